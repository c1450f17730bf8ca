"""The Engine facade on a tiny GGUF written here, and greedy decoding on the real models.

``write_tiny_llama`` writes a 1-layer llama-architecture GGUF (F32 random
weights, the byte-level BPE vocabulary of test_tokenizer) with ``gguf.GGUFWriter``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.worker.test_tokenizer import MODELS, bpe_metadata, load_fixture
from worker.engine import Engine, EngineError, GenerationResult, SamplingParams, TokenEvent
from worker.engine.text.builtin_templates import CHATML_TEMPLATE
from worker.engine.loading.gguf_loader import read_gguf


def write_tiny_llama(path: Path, chat_template: str | None = None, n_ctx_train: int = 128, seed: int = 0,
                     tokenizer_model: str = "gpt2") -> Path:
    import gguf

    md = bpe_metadata()
    tokens: list[str] = md["tokenizer.ggml.tokens"]
    n_vocab, n_embd, n_ff, n_head, n_kv = len(tokens), 16, 32, 2, 1
    head_dim = n_embd // n_head
    rng = np.random.default_rng(seed)

    def w(*shape: int, scale: float = 0.5) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    wr = gguf.GGUFWriter(str(path), "llama")
    wr.add_name("tiny-test-llama")
    wr.add_block_count(1)
    wr.add_context_length(n_ctx_train)
    wr.add_embedding_length(n_embd)
    wr.add_feed_forward_length(n_ff)
    wr.add_head_count(n_head)
    wr.add_head_count_kv(n_kv)
    wr.add_rope_freq_base(10000.0)
    wr.add_layer_norm_rms_eps(1e-5)
    wr.add_rope_dimension_count(head_dim)
    wr.add_vocab_size(n_vocab)
    wr.add_tokenizer_model(tokenizer_model)
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(tokens)
    wr.add_token_types(md["tokenizer.ggml.token_type"])
    wr.add_token_merges(md["tokenizer.ggml.merges"])
    wr.add_bos_token_id(1)
    wr.add_eos_token_id(2)
    wr.add_add_bos_token(False)
    if chat_template is not None:
        wr.add_chat_template(chat_template)
    wr.add_tensor("token_embd.weight", w(n_vocab, n_embd, scale=1.0))
    wr.add_tensor("blk.0.attn_norm.weight", np.ones(n_embd, np.float32))
    wr.add_tensor("blk.0.attn_q.weight", w(n_embd, n_embd))
    wr.add_tensor("blk.0.attn_k.weight", w(n_kv * head_dim, n_embd))
    wr.add_tensor("blk.0.attn_v.weight", w(n_kv * head_dim, n_embd))
    wr.add_tensor("blk.0.attn_output.weight", w(n_embd, n_embd))
    wr.add_tensor("blk.0.ffn_norm.weight", np.ones(n_embd, np.float32))
    wr.add_tensor("blk.0.ffn_gate.weight", w(n_ff, n_embd))
    wr.add_tensor("blk.0.ffn_up.weight", w(n_ff, n_embd))
    wr.add_tensor("blk.0.ffn_down.weight", w(n_embd, n_ff))
    wr.add_tensor("output_norm.weight", np.ones(n_embd, np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("tiny") / "tiny.gguf", chat_template=CHATML_TEMPLATE)


@pytest.fixture(scope="module")
def engine(tiny_path: Path) -> Engine:
    return Engine.load(str(tiny_path))


def greedy(**kw: Any) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


PROMPT = "<|im_start|>hello world"


# ------------------------------------------------------------------ load and info


def test_load_and_info(engine: Engine, tiny_path: Path) -> None:
    info = engine.info
    assert info.architecture == "llama" and info.name == "tiny-test-llama"
    assert info.n_ctx == 128 and info.n_ctx_train == 128
    assert info.n_vocab == engine.tokenizer.n_vocab
    assert info.file_size == tiny_path.stat().st_size
    assert isinstance(info.fingerprint, str) and info.fingerprint
    assert info.has_chat_template
    assert (info.bos_token, info.eos_token) == ("<|im_start|>", "<|im_end|>")


@pytest.mark.parametrize("weights", ["f32", "quantized"])
def test_load_reports_progress_once_per_tensor(tiny_path: Path, weights: str) -> None:
    steps: list[tuple[str, int, int]] = []
    Engine.load(str(tiny_path), weights=weights, progress=lambda stage, done, total: steps.append((stage, done, total)))
    assert steps[:4] == [("reading_gguf", 0, 1), ("reading_gguf", 1, 1), ("building_tokenizer", 0, 1),
                         ("building_tokenizer", 1, 1)]
    tensors = steps[4:] if weights == "f32" else steps[4:-2]
    n = len(read_gguf(str(tiny_path)).tensors)
    assert tensors == [("preparing_tensors", i, n) for i in range(1, n + 1)]  # every tensor of the file, once
    if weights == "quantized":  # then the wait for the kernel warm-up (numba's cache, or compiling)
        assert steps[-2:] == [("loading_kernels", 0, 1), ("loading_kernels", 1, 1)]


def test_load_errors(tmp_path: Path, tiny_path: Path) -> None:
    with pytest.raises(EngineError) as ei:
        Engine.load(str(tmp_path / "missing.gguf"))
    assert ei.value.code == "file_not_found"
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(EngineError) as ei:
        Engine.load(str(junk))
    assert ei.value.code == "invalid_gguf"
    for bad in (0, -5, 1.5, "12"):
        with pytest.raises(EngineError) as ei:
            Engine.load(str(tiny_path), n_ctx=bad)  # type: ignore[arg-type]
        assert ei.value.code == "invalid_params"
    for key in ("n_batch", "n_ubatch", "parallel"):
        for bad in (0, -1, 2.0, True):
            with pytest.raises(EngineError) as ei:
                Engine.load(str(tiny_path), **{key: bad})  # type: ignore[arg-type]
            assert ei.value.code == "invalid_params" and key in ei.value.message
    with pytest.raises(EngineError) as ei:
        Engine.load(str(tiny_path), chat_template="{% if %}")
    assert ei.value.code == "template_error"
    with pytest.raises(EngineError) as ei:
        Engine.load(str(write_tiny_llama(tmp_path / "bert.gguf", tokenizer_model="bert")))
    assert ei.value.code == "unsupported_tokenizer"


def test_chat_template_absent_then_supplied(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "notmpl.gguf", chat_template=None)
    eng = Engine.load(str(path), n_ctx=64)
    assert not eng.info.has_chat_template and eng.info.n_ctx == 64
    msgs = [{"role": "user", "content": "hi"}]
    for call in (eng.apply_template, eng.tokenize_chat):
        with pytest.raises(EngineError) as ei:
            call(msgs)
        assert ei.value.code == "no_chat_template"
    eng2 = Engine.load(str(path), n_ctx=64, chat_template="chatml")
    assert eng2.apply_template(msgs) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    # a request's own template (a preset's): used for that call only, compiled once
    chat = eng.tokenize_chat(msgs, chat_template="chatml")
    assert eng.detokenize(chat) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert eng.tokenize_chat(msgs, chat_template="chatml") == chat
    assert eng.apply_template(msgs, chat_template="chatml") == eng2.apply_template(msgs)
    assert "<start_of_turn>user\nhi<end_of_turn>" in eng.detokenize(eng2.tokenize_chat(msgs, chat_template="gemma"))
    assert eng2.tokenize_chat(msgs) == chat  # the model's own again
    for bad, code in (("{% if %}", "template_error"), ("", "invalid_params")):
        with pytest.raises(EngineError) as ei:
            eng.tokenize_chat(msgs, chat_template=bad)
        assert ei.value.code == code
    # template variables (chat_template_kwargs: a preset's reasoning switch)
    thinking = ("{% for m in messages %}{{ m['content'] }}{% endfor %}"
                "{% if enable_thinking is defined and not enable_thinking %} /no_think{% endif %}")
    off = eng.detokenize(eng.tokenize_chat(msgs, chat_template=thinking, template_kwargs={"enable_thinking": False}))
    on = eng.detokenize(eng.tokenize_chat(msgs, chat_template=thinking))
    assert off.endswith("hi /no_think") and on.endswith("hi") and "/no_think" not in on


# ------------------------------------------------------------------ text


def test_tokenize_detokenize_and_chat(engine: Engine) -> None:
    ids = engine.tokenize(PROMPT)
    assert ids[0] == 1 and engine.detokenize(ids) == PROMPT
    assert engine.token_bytes(1) == b"<|im_start|>" and engine.token_bytes(1, special=False) == b""
    with pytest.raises(EngineError) as ei:
        engine.detokenize([engine.info.n_vocab])
    assert ei.value.code == "invalid_token"
    msgs = [{"role": "user", "content": "hello<|im_end|>"}]
    chat = engine.tokenize_chat(msgs)
    assert engine.detokenize(chat) == engine.apply_template(msgs)
    assert chat.count(2) == 1  # only the template's <|im_end|>


# ------------------------------------------------------------------ generate


def test_generate_greedy_and_events(engine: Engine) -> None:
    events: list[TokenEvent] = []
    res = engine.generate(PROMPT, greedy(max_tokens=10, ignore_eos=True, n_probs=3), on_token=events.append)
    assert isinstance(res, GenerationResult)
    assert len(res.tokens) == 10 and res.finish_reason == "length"
    assert "".join(e.text for e in events) + res.tail == res.text
    assert all(e.top_logprobs[0][0] == e.id for e in events)  # greedy = raw argmax (no penalties)
    assert res.prompt_tokens == len(engine.tokenize(PROMPT))
    again = engine.generate(PROMPT, greedy(max_tokens=10, ignore_eos=True))
    assert again.tokens == res.tokens
    assert again.cache_n == res.prompt_tokens - 1 and again.prompt_n == 1


def test_seeded_sampling(engine: Engine) -> None:
    def sample(seed: int) -> list[int]:
        p = SamplingParams(temperature=1.5, top_k=0, top_p=1.0, min_p=0.0, seed=seed, max_tokens=16,
                           ignore_eos=True, cache_prompt=False)
        return engine.generate(PROMPT, p).tokens

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_cache_reuse_after_cancel_matches_fresh(tiny_path: Path) -> None:
    fresh = Engine.load(str(tiny_path)).generate(PROMPT + " again", greedy(max_tokens=8, ignore_eos=True))
    eng = Engine.load(str(tiny_path))
    r = eng.generate(PROMPT, greedy(max_tokens=20, ignore_eos=True), on_token=lambda e: False)
    assert r.finish_reason == "cancelled" and len(r.tokens) == 1
    r = eng.generate(PROMPT, greedy(max_tokens=20), should_stop=lambda: True)
    assert r.finish_reason == "cancelled" and r.tokens == []
    res = eng.generate(PROMPT + " again", greedy(max_tokens=8, ignore_eos=True))
    assert res.cache_n > 0
    assert res.tokens == fresh.tokens and res.text == fresh.text
    eng.reset_cache()
    assert eng.cached_tokens == []
    assert eng.generate(PROMPT + " again", greedy(max_tokens=8, ignore_eos=True)).tokens == fresh.tokens


def test_generate_errors(engine: Engine) -> None:
    n_vocab = engine.info.n_vocab
    cases: list[tuple[Any, Any, str]] = [
        ([1, n_vocab], greedy(), "invalid_token"),
        ([1, -1], greedy(), "invalid_token"),
        ([1, "2"], greedy(), "invalid_token"),
        ([], greedy(), "empty_prompt"),
        ("", SamplingParams(add_special=False), "empty_prompt"),
        (PROMPT, SamplingParams(temperature=-1), "invalid_params"),
        (PROMPT, SamplingParams(top_p=-0.1), "invalid_params"),
        (PROMPT, SamplingParams(n_probs=21), "invalid_params"),
        (PROMPT, SamplingParams(max_tokens=-1), "invalid_params"),
        (PROMPT, SamplingParams(logit_bias={n_vocab: 1.0}), "invalid_params"),
        (PROMPT, {"temperature": 0}, "invalid_params"),
        (12345, greedy(), "invalid_params"),
        ([5] * 128, greedy(max_tokens=4), "context_length_exceeded"),
        ([5] * 128, greedy(), "context_length_exceeded"),
    ]
    before = engine.cached_tokens
    for prompt, params, code in cases:
        with pytest.raises(EngineError) as ei:
            engine.generate(prompt, params)
        assert ei.value.code == code, (prompt, params)
        assert ei.value.message
    assert engine.cached_tokens == before  # bad requests never touch the cache
    with pytest.raises(EngineError) as ei:
        engine.generate([5] * 130, greedy(max_tokens=2))
    assert "maximum context length is 128 tokens" in ei.value.message


def test_max_tokens_beyond_the_room_left_is_clamped(engine: Engine) -> None:
    """llama.cpp's behaviour: a max_tokens the context cannot hold after the prompt
    generates until the context is full and ends with "length"."""
    ids, p = engine.prepare([5] * 120, greedy(max_tokens=200, ignore_eos=True))
    assert p.max_tokens == 8
    r = engine.generate([5] * 120, greedy(max_tokens=200, ignore_eos=True))
    assert r.finish_reason == "length" and len(r.tokens) == 8


def test_stop_string_through_engine(engine: Engine) -> None:
    full = engine.generate(PROMPT, greedy(max_tokens=12, ignore_eos=True))
    assert len(full.text) >= 4, "the tiny model's seeded weights must produce enough text for a stop string"
    stop = full.text[2:4]
    res = engine.generate(PROMPT, greedy(max_tokens=12, ignore_eos=True, stop=[stop]))
    assert res.stop_type == "word" and res.text == full.text[: full.text.index(stop)]


# ------------------------------------------------------------------ real models vs llama.cpp

NEAR_TIE = 0.6  # fixtures/README.md: top-2 logprob gap below which either token is acceptable


def first_near_tie(entry: dict[str, Any]) -> int:
    """Index of llama.cpp's first step whose top-2 logprobs are closer than NEAR_TIE (else len)."""
    for i, step in enumerate(entry["steps"]):
        if step["top"][0][1] - step["top"][1][1] < NEAR_TIE:
            return i
    return len(entry["steps"])


def matching_prefix(got: list[int], entry: dict[str, Any]) -> int:
    """Number of leading tokens equal to llama.cpp's; a divergence is only allowed at a near
    tie, and then only to llama.cpp's second choice (afterwards the contexts differ)."""
    for i, (a, b) in enumerate(zip(got, entry["ids"])):
        if a != b:
            top = entry["steps"][i]["top"]
            assert top[0][1] - top[1][1] < NEAR_TIE, f"step {i}: {a} != {b} at a clear margin"
            assert a == top[1][0], f"step {i}: {a} is not llama.cpp's second choice"
            return i
    return min(len(got), len(entry["ids"]))


@pytest.fixture(scope="module")
def smollm2() -> Engine:
    if not MODELS["smollm2"].is_file():
        pytest.fail("SmolLM2 not fetched (scripts/fetch_models.py)")
    return Engine.load(str(MODELS["smollm2"]), n_ctx=1024)


@pytest.mark.slow
@pytest.mark.parametrize("index, n_tokens", [(3, 8), (5, 6)])
def test_smollm2_greedy_chat_matches_llama_cpp(smollm2: Engine, index: int, n_tokens: int) -> None:
    """Chat entries whose first llama.cpp near tie comes late (at steps 8 and 4)."""
    entry = load_fixture("smollm2")["greedy"][index]
    ids = smollm2.tokenize_chat(entry["messages"])
    assert ids == entry["prompt_ids"]
    res = smollm2.generate(ids, greedy(max_tokens=n_tokens))
    assert matching_prefix(res.tokens, entry) >= min(first_near_tie(entry), n_tokens)
    assert res.text == smollm2.detokenize(res.tokens)  # no control token among them


@pytest.mark.slow
def test_gemma3_greedy_completion_matches_llama_cpp() -> None:
    if not MODELS["gemma3"].is_file():
        pytest.fail("Gemma 3 not fetched (scripts/fetch_models.py)")
    fx = load_fixture("gemma3")
    eng = Engine.load(str(MODELS["gemma3"]), n_ctx=256)
    assert not eng.info.has_chat_template
    for index, n_tokens in ((3, 6), (1, 4)):
        entry = fx["greedy"][index]
        res = eng.generate(entry["prompt"], greedy(max_tokens=n_tokens))
        assert res.prompt_tokens == len(entry["prompt_ids"])
        assert matching_prefix(res.tokens, entry) >= min(first_near_tie(entry), n_tokens)


def test_the_default_n_ctx_is_the_training_context_capped_at_8192(tmp_path: Path) -> None:
    """README: ``n_ctx`` defaults to ``min(n_ctx_train, 8192)``."""
    from tests.worker.tiny_gguf import write_tiny_llama as write_tiny

    long = write_tiny(tmp_path / "long.gguf", n_ctx_train=32768)
    short = write_tiny(tmp_path / "short.gguf", n_ctx_train=300)
    info = Engine.load(str(long), kv_budget_mib=64).info
    assert (info.n_ctx, info.n_ctx_train) == (8192, 32768)
    assert Engine.load(str(short)).info.n_ctx == 300
    assert Engine.load(str(long), n_ctx=512, kv_budget_mib=64).info.n_ctx == 512  # an explicit n_ctx is kept


def test_first_token_does_not_wait_for_the_fingerprint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file never seen before is hashed in the background: load and generation go on while the
    hash is held; the fingerprint, the callback and the KV identity come once it is done."""
    import hashlib

    from tests.worker.test_gguf_loader import GatedHashlib
    from worker.engine.loading import gguf_loader

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "SHA256_MEMO_MIN_BYTES", 0)
    gate = GatedHashlib()
    monkeypatch.setattr(gguf_loader, "hashlib", gate)
    path = write_tiny_llama(tmp_path / "t.gguf", chat_template=CHATML_TEMPLATE, seed=7)
    e = Engine.load(str(path))
    assert e.info.fingerprint == ""
    import threading

    got: list[str] = []
    called = threading.Event()
    e.on_fingerprint(lambda fp: (got.append(fp), called.set()))
    res = e.generate(e.tokenize(PROMPT), greedy(max_tokens=3))
    assert len(res.tokens) == 3 and got == [] and gate.updates == 0   # generated while the hash was held
    gate.go.set()
    want = hashlib.sha256(path.read_bytes()).hexdigest()
    assert e.fingerprint == want and e.kv_identity.model_fingerprint == want
    assert e.info.fingerprint == want
    assert called.wait(60) and got == [want]
    later: list[str] = []
    e.on_fingerprint(later.append)                        # known: called at once
    assert later == [want]


_WARM_PROBE = r"""
import json, sys
from worker.engine import Engine, SamplingParams, preload_kernels
from worker.engine.loading import resident
from worker.engine.kernels import attn_kernels, quant_kernels
from worker.engine import warmup as warmup_module

def llvm_kib():
    with open("/proc/self/smaps") as f:
        return sum(m[4] for m in resident._mappings(f.read()) if "libllvmlite" in m[3])

def loaded():
    ks = [getattr(quant_kernels, n) for n in ("quant_q8_0", "quant_q8_K", "matmul_lanes", "matmul_lanes_vnni",
                                                "matmul_q4k", "matmul_q6k", "matmul_q4k_vnni", "matmul_q6k_vnni",
                                                "lane_levels", "cos_sin_f32", "matmul_lanes_x", "matmul_kq_x",
                                                "kq_levels")]
    ks += [attn_kernels.fa_vec, attn_kernels.fa_tiled, attn_kernels.silu_rows, attn_kernels.gelu_table_f16,
           attn_kernels.rms_norm_rows, attn_kernels.geglu_rows, attn_kernels.swiglu_rows, attn_kernels.rope_rows]
    return {k.py_func.__name__: sorted(map(str, k.overloads)) for k in ks}

if sys.argv[2] == "preload":   # as the worker does: started first, joined by the load
    preload_kernels()
    assert warmup_module._preload_thread is not None
e = Engine.load(sys.argv[1], n_ctx=1024, weights="quantized")
assert warmup_module._preload_thread is None
before, llvm_loaded = loaded(), llvm_kib()
ids = e.tokenize(" ".join(["the cat sat on the mat"] * 12))    # >= 64 rows: the tiled attention
e.generate(ids, SamplingParams(max_tokens=3, temperature=0))   # then one-row decode steps
e.generate(ids[:5], SamplingParams(max_tokens=2, temperature=0, cache_prompt=False))
print(json.dumps({"before": before, "after": loaded(), "llvm_kib": [llvm_loaded, llvm_kib()]}))
"""


@pytest.mark.parametrize("model,preload", [("smollm2", "preload"), ("gemma3", "")])
def test_quantized_load_warms_every_kernel_the_first_request_runs(model: str, preload: str, smollm2_path: Path,
                                                                  gemma3_path: Path) -> None:
    """In a fresh process, ``Engine.load(weights="quantized")`` has already loaded every numba
    kernel signature a request then runs (prefill through the tiled attention, decode through the
    one-row path): the first request pays no kernel loading (nor compiling). LLVM's pages, which
    the import and the loading touched (~90 MiB), are off the resident set after the load and
    stay off while requests run. With ``preload_kernels()`` first (the worker's way), the load takes
    its thread over."""
    import json
    import subprocess
    import sys

    from tests.paths import ROOT

    path = smollm2_path if model == "smollm2" else gemma3_path
    out = subprocess.run([sys.executable, "-c", _WARM_PROBE, str(path), preload], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from worker.engine.kernels import quant

    v = "_vnni" if quant.host_has_vnni() else ""                   # the VNNI kernels where the CPU has them
    assert got["before"]["matmul_lanes_x" if v else "matmul_lanes"]  # (the VNNI ones through their fused entry)
    assert got["before"]["fa_vec"] and got["before"]["fa_tiled"]
    assert got["before"]["cos_sin_f32"] and got["before"]["rms_norm_rows"] and got["before"]["rope_rows"]
    # only its architecture's FFN activation (Gemma: GELU's table and the fused GEGLU; SmolLM2: SwiGLU),
    # not the standalone SiLU, nor the K-quants' activation quantization without K-quant matrices
    glu, other = ("geglu_rows", "swiglu_rows") if model == "gemma3" else ("swiglu_rows", "geglu_rows")
    assert got["before"][glu] and not got["before"][other] and not got["before"]["silu_rows"]
    assert bool(got["before"]["gelu_table_f16"]) == (model == "gemma3")
    assert bool(got["before"]["quant_q8_K"]) == (model == "gemma3")
    if model == "gemma3":                                           # its Q4_K and Q6_K matrices
        assert len(got["before"]["matmul_kq_x" if v else "matmul_q4k"]) >= 1 + bool(v)  # (VNNI: both, fused)
        assert v or got["before"]["matmul_q6k"]
    assert got["after"] == got["before"]
    assert max(got["llvm_kib"]) < 16 * 1024, got["llvm_kib"]


_COMPILE_PROBE = r"""
import json, runpy, sys
from worker.engine import Engine, SamplingParams
from worker.engine.kernels import attn_kernels, quant_kernels

def loaded():
    ks = [v for m in (quant_kernels, attn_kernels) for v in vars(m).values() if hasattr(v, "overloads")]
    return {k.py_func.__name__: sorted(map(str, k.overloads)) for k in ks}

try:
    runpy.run_path("scripts/compile_kernels.py", run_name="__main__")   # as scripts/_bootstrap.sh runs it
except SystemExit as e:
    assert e.code == 0, e.code
before = loaded()
for path in sys.argv[1:]:
    e = Engine.load(path, n_ctx=256, weights="quantized")
    e.generate(list(range(3, 83)), SamplingParams(max_tokens=3, temperature=0))  # 80 rows, then decode
print(json.dumps({"before": before, "after": loaded()}))
"""


def test_compile_kernels_covers_every_kernel_a_quantized_load_and_request_run(tmp_path: Path) -> None:
    """``scripts/compile_kernels.py`` (``worker.engine.compile_kernels``: every weight type with a
    kernel) leaves nothing for a later quantized load or request to compile or load: after it, loads
    of every type (the 32-block types with and without an offset, Q4_K and Q6_K in a Q4_K_M-like
    qwen3; llama's SiLU and Gemma 3's GELU) and a prefill through the tiled attention plus decode steps add no signature.
    The kernels come from numba's cache here (scripts/test's set-up compiled them), so this costs
    their loading, not their compiling."""
    import json
    import subprocess
    import sys

    from tests.paths import ROOT
    from tests.worker.tiny_gguf import write_tiny_gemma3, write_tiny_llama, write_tiny_qwen

    paths = [write_tiny_llama(tmp_path / "q41.gguf", qtype="Q4_1"),
             write_tiny_llama(tmp_path / "q40.gguf", qtype="Q4_0"),
             write_tiny_qwen(tmp_path / "q4km.gguf", "qwen3", qtype="Q4_K", n_embd=256, n_ff=256, n_head=8,
                             head_dim=64, qtype_overrides={"token_embd": "Q6_K", "attn_v": "Q6_K", "ffn_down": "Q6_K"}),
             write_tiny_gemma3(tmp_path / "g.gguf", qtype="Q5_0")]
    out = subprocess.run([sys.executable, "-c", _COMPILE_PROBE, *map(str, paths)], cwd=ROOT, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    assert "[setup] quantized kernels ready in" in out.stdout
    got = json.loads(out.stdout.strip().splitlines()[-1])
    from worker.engine.kernels import quant

    v = "_vnni" if quant.host_has_vnni() else ""                   # the VNNI kernels where the CPU has them
    for name in (f"matmul_lanes{v}", f"matmul_q4k{v}", f"matmul_q6k{v}", "fa_vec", "fa_tiled",
                 "gelu_table_f16", "cos_sin_f32", "quant_q8_0", "quant_q8_K", "rms_norm_rows", "geglu_rows",
                 "swiglu_rows", "rope_rows") + (("lane_levels",) if v else ()):
        assert got["before"][name], name
    assert got["after"] == got["before"]


@pytest.mark.slow
def test_the_prompt_size_bound_holds_every_piece(smollm2: Engine) -> None:
    """``_check_fits`` refuses a text only when no tokenization could fit n_ctx: its bound
    (the longest token text in bytes) is at least every decoded piece's characters."""
    tok = smollm2.tokenizer
    longest = max(len(tok.token_bytes(i).decode("utf-8", "replace")) for i in range(tok.n_vocab))
    with pytest.raises(EngineError):
        smollm2._check_fits(10**9)
    assert smollm2._max_piece_chars is not None and smollm2._max_piece_chars >= longest
    smollm2._check_fits(1024 * longest)  # the longest pieces, n_ctx of them: not refused by the bound

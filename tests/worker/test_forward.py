"""Forward passes, KV cache and model loading on tiny GGUF files (and a few real-model checks).

* an independent float64 reference written here (per token, per head, adjacent-pair
  RoPE on the *unpermuted* llama weights, explicit sliding-window test) agrees with
  the engine on tiny llama / gemma3 models in several quant types;
* float64 and float32 runs of the engine agree (tiny models, and real SmolLM2 / Gemma 3);
* chunked prefill = one-shot = token by token; truncate + re-feed = fresh;
* errors: context overflow, invalid tokens, unknown architecture, missing / misshaped
  tensors, bad hyperparameters, bad n_ctx; the cache is untouched by a failed call;
* the .npy weight cache: written once, read back memory-mapped, identical logits,
  ignored when incomplete.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.paths import GEMMA3_FIXTURES
from tests.worker.tiny_gguf import TINY_VOCAB_SIZE, write_tiny_gemma3, write_tiny_llama, write_tiny_qwen
from worker.engine.errors import EngineError
from worker.engine.loading.gguf_loader import read_gguf
from worker.engine.arch import weights as weights_mod
from worker.engine.kernels import quant
from worker.engine.kernels.quant import QWeight
from worker.engine.arch.llama import LlamaModel
from worker.engine.arch.model import Model
from worker.engine.arch.registry import ARCHITECTURES, load_model


@pytest.fixture(autouse=True)
def _private_cache(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Tiny-model tests get their own XDG cache (nothing leaks into ~/.cache or between
    tests); real-model (slow) tests use the user's cache so warm loads stay fast."""
    if request.node.get_closest_marker("slow") is None:
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
        monkeypatch.setattr(weights_mod, "WEIGHT_CACHE_MIN_BYTES", 0)  # cache even tiny files here


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def tiny(tmp_path: Path, arch: str, **kw) -> Path:
    name = f"{arch}-{'-'.join(f'{k}{v}' for k, v in sorted(kw.items()))}.gguf"
    if arch in ("qwen2", "qwen3"):
        return write_tiny_qwen(tmp_path / name, arch, **kw)
    writer = write_tiny_llama if arch == "llama" else write_tiny_gemma3
    return writer(tmp_path / name, **kw)


PROMPT = [1, 300, 301, 17, 42, 5, 260, 261, 262, 99, 100, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 400, 401, 2]


# ------------------------------------------------------------------ independent reference


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope_adjacent(x: np.ndarray, pos: int, base: float, n_rot: int) -> np.ndarray:
    """llama.cpp LLAMA_ROPE_TYPE_NORM on one head vector [hd]: pairs (2i, 2i+1)."""
    y = x.copy()
    for i in range(n_rot // 2):
        th = pos * base ** (-2.0 * i / n_rot)
        a, b = x[2 * i], x[2 * i + 1]
        y[2 * i] = a * math.cos(th) - b * math.sin(th)
        y[2 * i + 1] = a * math.sin(th) + b * math.cos(th)
    return y


def _rope_neox(x: np.ndarray, pos: int, base: float, n_rot: int) -> np.ndarray:
    """LLAMA_ROPE_TYPE_NEOX on one head vector [hd]: pairs (i, i + n_rot/2)."""
    y = x.copy()
    h = n_rot // 2
    for i in range(h):
        th = pos * base ** (-2.0 * i / n_rot)
        a, b = x[i], x[i + h]
        y[i] = a * math.cos(th) - b * math.sin(th)
        y[i + h] = a * math.sin(th) + b * math.cos(th)
    return y


def reference_logits(path: Path, tokens: list[int]) -> np.ndarray:
    """Float64 logits [T, n_vocab] of a llama, gemma3, qwen2 or qwen3 GGUF, computed token by
    token from the raw GGUF tensors (no fusing, no permutation), for checking the engine."""
    g = read_gguf(path)
    md, arch = g.metadata, g.architecture
    a = arch
    W = lambda n: g.tensor(n).astype(np.float64)  # noqa: E731
    n_embd = md[f"{a}.embedding_length"]
    n_head = md[f"{a}.attention.head_count"]
    n_kv = md[f"{a}.attention.head_count_kv"]
    hd = md.get(f"{a}.attention.key_length", n_embd // n_head)
    n_layer = md[f"{a}.block_count"]
    eps = md[f"{a}.attention.layer_norm_rms_epsilon"]
    base = md[f"{a}.rope.freq_base"]
    n_rot = md.get(f"{a}.rope.dimension_count", hd)
    emb = W("token_embd.weight")
    out_w = W("output.weight") if "output.weight" in g.tensors else emb
    gemma = arch == "gemma3"
    qwen = arch in ("qwen2", "qwen3")  # NEOX RoPE, optional q/k/v (and output) biases
    B = lambda n: W(n) if n in g.tensors else 0.0  # noqa: E731
    window = md.get(f"{a}.attention.sliding_window") if gemma else None
    pattern = md.get(f"{a}.attention.sliding_window_pattern", 6)
    base_swa = md.get(f"{a}.rope.freq_base_swa", 10000.0)
    Ks: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
    Vs: list[list[np.ndarray]] = [[] for _ in range(n_layer)]
    rows = []
    for pos, tok in enumerate(tokens):
        x = emb[tok].copy()
        if gemma:
            x *= math.sqrt(n_embd)
        for il in range(n_layer):
            p = f"blk.{il}."
            is_swa = gemma and window and (pattern[il] if isinstance(pattern, list) else il % pattern < pattern - 1)
            b = base_swa if is_swa else base
            h = _rms(x, W(p + "attn_norm.weight"), eps)
            q = (W(p + "attn_q.weight") @ h + B(p + "attn_q.bias")).reshape(n_head, hd)
            k = (W(p + "attn_k.weight") @ h + B(p + "attn_k.bias")).reshape(n_kv, hd)
            v = (W(p + "attn_v.weight") @ h + B(p + "attn_v.bias")).reshape(n_kv, hd)
            if qwen:
                if arch == "qwen3":
                    q = _rms(q, W(p + "attn_q_norm.weight"), eps)
                    k = _rms(k, W(p + "attn_k_norm.weight"), eps)
                q = np.stack([_rope_neox(qh, pos, b, n_rot) for qh in q])
                k = np.stack([_rope_neox(kh, pos, b, n_rot) for kh in k])
                scale = 1.0 / math.sqrt(hd)
            elif gemma:
                q = _rms(q, W(p + "attn_q_norm.weight"), eps)
                k = _rms(k, W(p + "attn_k_norm.weight"), eps)
                q = np.stack([_rope_neox(qh, pos, b, n_rot) for qh in q]) / math.sqrt(hd)
                k = np.stack([_rope_neox(kh, pos, b, n_rot) for kh in k])
                scale = 1.0
            else:
                q = np.stack([_rope_adjacent(qh, pos, b, n_rot) for qh in q])
                k = np.stack([_rope_adjacent(kh, pos, b, n_rot) for kh in k])
                scale = 1.0 / math.sqrt(hd)
            Ks[il].append(k)
            Vs[il].append(v)
            heads = []
            for hh in range(n_head):
                kv = hh // (n_head // n_kv)
                vis = [j for j in range(pos + 1) if not (is_swa and pos - j >= window)]
                s = np.array([q[hh] @ Ks[il][j][kv] for j in vis]) * scale
                pr = np.exp(s - s.max())
                pr /= pr.sum()
                heads.append(sum(pj * Vs[il][j][kv] for pj, j in zip(pr, vis)))
            att = W(p + "attn_output.weight") @ np.concatenate(heads)
            if gemma:
                sa = x + _rms(att, W(p + "post_attention_norm.weight"), eps)
                h = _rms(sa, W(p + "ffn_norm.weight"), eps)
                gt = W(p + "ffn_gate.weight") @ h
                gl = 0.5 * gt * (1 + np.tanh(math.sqrt(2 / math.pi) * (gt + 0.044715 * gt**3)))
                f = W(p + "ffn_down.weight") @ (gl * (W(p + "ffn_up.weight") @ h))
                x = sa + _rms(f, W(p + "post_ffw_norm.weight"), eps)
            else:
                x = x + att
                h = _rms(x, W(p + "ffn_norm.weight"), eps)
                gt = W(p + "ffn_gate.weight") @ h
                f = W(p + "ffn_down.weight") @ (gt / (1 + np.exp(-gt)) * (W(p + "ffn_up.weight") @ h))
                x = x + f
        rows.append(out_w @ _rms(x, W("output_norm.weight"), eps) + (B("output.bias") if arch == "qwen2" else 0.0))
    return np.stack(rows)


@pytest.mark.parametrize("arch,qtype", [("llama", "F32"), ("llama", "Q8_0"), ("llama", "Q4_1"), ("llama", "F16"),
                                        ("gemma3", "F32"), ("gemma3", "Q5_0"), ("gemma3", "F16"),
                                        ("qwen2", "F32"), ("qwen2", "Q8_0"), ("qwen3", "F32"), ("qwen3", "Q4_0")])
def test_matches_independent_reference(tmp_path: Path, arch: str, qtype: str) -> None:
    path = tiny(tmp_path, arch, qtype=qtype)
    ref = log_softmax(reference_logits(path, PROMPT))
    m64 = load_model(read_gguf(path), dtype=np.float64)
    got64 = log_softmax(m64.forward(PROMPT, all_logits=True))
    assert np.abs(got64 - ref).max() < 1e-9
    m32 = load_model(read_gguf(path), weights="f32")
    got32 = log_softmax(m32.forward(PROMPT, all_logits=True))
    assert np.abs(got32 - ref).max() < 1e-4
    # the quantized path (ggml's 8-bit activations, f16 attention inputs) stays within ~1 % of
    # the exact answer's range (random tiny weights: log-probs down to about -80)
    mq = load_model(read_gguf(path), weights="quantized")
    gotq = log_softmax(mq.forward(PROMPT, all_logits=True))
    assert np.abs(gotq - ref).max() < 0.02 * np.abs(ref).max()


def test_reference_llama_variants(tmp_path: Path) -> None:
    """Untied output, partial rotary (n_rot < head_dim), MHA (n_kv == n_head), other rope base."""
    path = write_tiny_llama(tmp_path / "v.gguf", tied=False, n_head_kv=4, rope_base=10000.0,
                            extra_metadata={"{arch}.rope.dimension_count": 8})
    m = load_model(read_gguf(path), dtype=np.float64)
    assert "output" in m.w
    np.testing.assert_allclose(m.forward(PROMPT, all_logits=True), reference_logits(path, PROMPT), atol=1e-9)


def test_reference_qwen_variants(tmp_path: Path) -> None:
    """qwen2: untied output + output.bias, MHA; qwen3: biases present (llama.cpp accepts them),
    head_dim 16 with 8 heads (n_head * head_dim = 128 != n_embd)."""
    p2 = write_tiny_qwen(tmp_path / "q2.gguf", "qwen2", tied=False, output_bias=True, n_head_kv=4)
    p3 = write_tiny_qwen(tmp_path / "q3.gguf", "qwen3", biases=True, n_head=8, head_dim=16, n_head_kv=2)
    for path in (p2, p3):
        m = load_model(read_gguf(path), dtype=np.float64)
        np.testing.assert_allclose(m.forward(PROMPT, all_logits=True), reference_logits(path, PROMPT), atol=1e-9)
    m2 = load_model(read_gguf(p2))
    assert "output" in m2.w and "output_b" in m2.w and "blk.0.bqkv" in m2.w


@pytest.mark.parametrize("bias", ["fused", "separate"])
def test_qwen2_fused_qkv_equals_separate(tmp_path: Path, bias: str) -> None:
    """A file with one ``attn_qkv.weight`` (and ``attn_qkv.bias`` or the three separate biases,
    both accepted by llama.cpp's ``create_tensor_qkv``) gives the same logits as separate Q/K/V."""
    from tests.worker.tiny_gguf import write_gguf

    src = write_tiny_qwen(tmp_path / "sep.gguf", "qwen2")
    g = read_gguf(src)
    md = {k: v for k, v in g.metadata.items() if k.startswith("qwen2.")}
    tensors = {}
    for name in g.tensors:
        kind = name.split(".")[-2] if name.startswith("blk.") else ""
        if kind in ("attn_q", "attn_k", "attn_v") and (name.endswith(".weight") or bias == "fused"):
            continue
        tensors[name] = (g.tensor(name), "F32")
    for i in range(md["qwen2.block_count"]):
        p = f"blk.{i}."
        tensors[p + "attn_qkv.weight"] = (np.concatenate([g.tensor(p + f"attn_{x}.weight") for x in "qkv"]), "F32")
        if bias == "fused":
            tensors[p + "attn_qkv.bias"] = (np.concatenate([g.tensor(p + f"attn_{x}.bias") for x in "qkv"]), "F32")
    fused = write_gguf(tmp_path / "fused.gguf", "qwen2", md, tensors)
    assert "blk.0.attn_qkv.weight" in read_gguf(fused).tensors and "blk.0.attn_q.weight" not in read_gguf(fused).tensors
    a = load_model(read_gguf(src), dtype=np.float64).forward(PROMPT, all_logits=True)
    b = load_model(read_gguf(fused), dtype=np.float64).forward(PROMPT, all_logits=True)
    np.testing.assert_allclose(a, b, atol=1e-9)


def test_reference_gemma3_pattern_and_swa_base(tmp_path: Path) -> None:
    """A per-layer sliding_window_pattern array and a freq_base_swa key are honoured."""
    pattern = [True, False, True, True, False, True]
    path = write_tiny_gemma3(tmp_path / "p.gguf", sliding_window=5,
                             extra_metadata={"{arch}.attention.sliding_window_pattern": pattern,
                                             "{arch}.rope.freq_base_swa": 500.0})
    m = load_model(read_gguf(path), dtype=np.float64)
    assert m.swa_layers == pattern and m.rope_base_swa == 500.0
    np.testing.assert_allclose(m.forward(PROMPT, all_logits=True), reference_logits(path, PROMPT), atol=1e-9)


def test_gemma3_default_layer_pattern(tmp_path: Path) -> None:
    m = load_model(read_gguf(write_tiny_gemma3(tmp_path / "g.gguf", n_layer=12)))
    assert m.swa_layers == [True] * 5 + [False] + [True] * 5 + [False]
    assert m.rope_base_swa == 10000.0 and m.rope_base == 1e6
    assert m.q_scale == pytest.approx(1 / math.sqrt(32))


def test_gemma3_without_window_is_global_with_softcap(tmp_path: Path) -> None:
    """No sliding window: every layer global, and llama.cpp's non-iswa graph softcaps the logits."""
    path = write_tiny_gemma3(tmp_path / "nc.gguf", sliding_window=0,
                             extra_metadata={"{arch}.final_logit_softcapping": 3.0})
    m = load_model(read_gguf(path), dtype=np.float64)
    assert m.window is None and not any(m.swa_layers) and m.softcap == 3.0
    got = m.forward(PROMPT, all_logits=True)
    np.testing.assert_allclose(got, np.tanh(reference_logits(path, PROMPT) / 3.0) * 3.0, atol=1e-9)
    assert np.abs(got).max() <= 3.0


def test_gemma3_window_changes_logits(tmp_path: Path) -> None:
    """The sliding window is real: a wide window gives other logits once the prompt exceeds it."""
    narrow = load_model(read_gguf(write_tiny_gemma3(tmp_path / "a.gguf", sliding_window=4)))
    wide = load_model(read_gguf(write_tiny_gemma3(tmp_path / "b.gguf", sliding_window=1000)))
    la, lb = narrow.forward(PROMPT, all_logits=True), wide.forward(PROMPT, all_logits=True)
    np.testing.assert_allclose(la[:4], lb[:4], atol=1e-5)  # first 4 positions see <= 4 keys
    assert np.abs(la[-1] - lb[-1]).max() > 1e-3


# ------------------------------------------------------------------ float64 vs float32


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_float64_agrees_with_float32_tiny(tmp_path: Path, arch: str) -> None:
    path = tiny(tmp_path, arch, qtype="Q8_0")
    g = read_gguf(path)
    a = log_softmax(load_model(g, weights="f32").forward(PROMPT, all_logits=True))
    b = log_softmax(load_model(g, dtype=np.float64).forward(PROMPT, all_logits=True))
    assert np.abs(a - b).max() < 1e-4


@pytest.mark.slow
def test_float64_agrees_with_float32_smollm2(smollm2_gguf) -> None:
    ids = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
           19712, 8182, 2, 198, 1, 4093, 198, 504, 2]
    m32 = load_model(smollm2_gguf, n_ctx=64, weights="f32")
    m64 = load_model(smollm2_gguf, n_ctx=64, dtype=np.float64)
    a = log_softmax(m32.forward(ids, all_logits=True))
    b = log_softmax(m64.forward(ids, all_logits=True))
    diff = np.abs(a - b)
    # over the plausible tokens (logprob > -20) the float32 error stays ~1e-4
    sel = b > -20
    print(f"\nSmolLM2 float32 vs float64 log-softmax: max |diff| {diff[sel].max():.2e} "
          f"(all tokens {diff.max():.2e})")
    assert diff[sel].max() < 2e-4


@pytest.mark.slow
def test_float64_agrees_with_float32_gemma3(gemma3_gguf) -> None:
    ids = [2, 818, 5279, 529, 7001, 563, 496, 1607, 236764, 625, 506, 3401, 1169, 236761, 107, 818]
    m32 = load_model(gemma3_gguf, n_ctx=32, weights="f32")
    m64 = load_model(gemma3_gguf, n_ctx=32, dtype=np.float64)
    a = log_softmax(m32.forward(ids, all_logits=True))
    b = log_softmax(m64.forward(ids, all_logits=True))
    sel = b > -20
    diff = np.abs(a - b)[sel]
    print(f"\nGemma 3 float32 vs float64 log-softmax: max |diff| {diff.max():.2e}")
    assert diff.max() < 5e-4


# ------------------------------------------------------------------ invariants


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_chunked_equals_oneshot_equals_tokenwise(tmp_path: Path, arch: str) -> None:
    # the f32 path (sgemm, float32 weights) is chunk-invariant to 1e-4; the quantized path, like
    # llama.cpp, picks kernels by a micro-batch's row count (tests/worker/test_batching.py holds its rule)
    m = load_model(read_gguf(tiny(tmp_path, arch, qtype="F16")), weights="f32")
    full = m.forward(PROMPT, all_logits=True)
    assert full.shape == (len(PROMPT), TINY_VOCAB_SIZE) and full.dtype == np.float32
    assert m.n_past == len(PROMPT)
    for chunk in (1, 3, 7, 10):
        m.reset()
        parts = [m.forward(PROMPT[i:i + chunk], all_logits=True) for i in range(0, len(PROMPT), chunk)]
        np.testing.assert_allclose(np.concatenate(parts), full, atol=1e-4, rtol=0)
    m.reset()
    last = m.forward(np.array(PROMPT, dtype=np.int32))
    assert last.shape == (TINY_VOCAB_SIZE,)
    np.testing.assert_allclose(last, full[-1], atol=1e-4)


@pytest.mark.parametrize("weights", ["f32", "quantized"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_batched_segments_equal_alone(tmp_path: Path, arch: str, weights: str) -> None:
    """One forward_batch over three sequences (a prefill chunk next to two decodes at other
    positions, each in its own KV entry) gives each the logits it gets alone."""
    from worker.engine.attention import AttnBatch, Segment
    from worker.engine.kv.cache import KVEntry

    m = load_model(read_gguf(tiny(tmp_path, arch, qtype="Q8_0")), n_ctx=64, weights=weights)
    prompts = [PROMPT[:5], PROMPT[3:14], PROMPT[10:12]]
    alone = []
    for p in prompts:
        m.reset()
        alone.append(m.forward(p, all_logits=True))
    entries = [KVEntry(m.kv_shape, m.n_ctx, m.n_ctx) for _ in prompts]
    # step 1: sequences 0 and 2 prefill all but their last token, sequence 1 its first 6
    firsts = [len(prompts[0]) - 1, 6, len(prompts[2]) - 1]
    segs, start, toks = [], 0, []
    for e, p, n in zip(entries, prompts, firsts):
        segs.append(Segment(e, start, n, 0))
        toks += p[:n]
        start += n
    m.forward_batch(np.array(toks), AttnBatch(segs, m.dtype), [])
    for e, p, n in zip(entries, prompts, firsts):
        e.tokens.extend(p[:n])
    # step 2: the rest of every sequence in one pass, logits of every row
    segs, start, toks, rows_of = [], 0, [], []
    for e, p, n in zip(entries, prompts, firsts):
        k = len(p) - n
        segs.append(Segment(e, start, k, n))
        toks += p[n:]
        rows_of.append(range(start, start + k))
        start += k
    got = m.forward_batch(np.array(toks), AttnBatch(segs, m.dtype), list(range(start)))
    # the quantized path is not batch-invariant (model.py DEFAULT_WEIGHTS: another kernel for other row
    # counts, then other 8-bit roundings): measured up to 0.09 on logits of ~7 (qwen3), 1e-5 elsewhere
    tol = 1e-4 if weights == "f32" else 2e-2
    for p, n, rows, ref in zip(prompts, firsts, rows_of, alone):
        np.testing.assert_allclose(got[list(rows)], ref[n:], atol=tol * max(1.0, float(np.abs(ref).max())))


@pytest.mark.parametrize("arch", ["llama", "gemma3", "qwen2", "qwen3"])
def test_truncate_and_refeed_equals_fresh(tmp_path: Path, arch: str) -> None:
    m = load_model(read_gguf(tiny(tmp_path, arch)), weights="f32")
    fresh = m.forward(PROMPT, all_logits=True)
    m.reset()
    m.forward(PROMPT[:15] + [5, 6, 7, 8, 9, 10, 11, 12, 13, 14])  # diverge after 15 tokens
    m.truncate(15)
    assert m.n_past == 15
    tail = m.forward(PROMPT[15:], all_logits=True)
    np.testing.assert_allclose(tail, fresh[15:], atol=1e-4)
    m.truncate(0)
    assert m.n_past == 0
    np.testing.assert_allclose(m.forward(PROMPT[:3], all_logits=True), fresh[:3], atol=1e-4)
    m.truncate(3)  # no-op is allowed
    with pytest.raises(EngineError) as e:
        m.truncate(4)
    assert e.value.code == "invalid_params"
    for bad in (-1, 1.5, True, "2"):
        with pytest.raises(EngineError):
            m.truncate(bad)  # type: ignore[arg-type]
    assert m.n_past == 3


@pytest.mark.slow
def test_real_models_chunked_equals_oneshot(smollm2_gguf, gemma3_gguf) -> None:
    """Gemma 3 over ~700 tokens (past the 512 sliding window): one pass vs 256-token chunks
    then single tokens; SmolLM2: one pass vs token by token."""
    fx = json.loads(GEMMA3_FIXTURES.read_text())
    ids = max(fx["greedy"], key=lambda e: len(e["prompt_ids"]))["prompt_ids"]
    assert len(ids) > 600
    m = load_model(gemma3_gguf, n_ctx=1024, weights="f32")
    one = m.forward(ids)
    m.reset()
    n = len(ids) - 3
    for i in range(0, n, 256):  # 256, 256, then a partial chunk; the window boundary falls inside
        m.forward(ids[i:min(i + 256, n)])
    for t in ids[n:]:
        last = m.forward([t])
    d = np.abs(log_softmax(last) - log_softmax(one))
    print(f"\nGemma 3 chunked vs one-shot ({len(ids)} tokens): max |dlogprob| {d.max():.2e}")
    assert d.max() < 1e-3
    s = load_model(smollm2_gguf, n_ctx=128, weights="f32")
    sid = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411]
    full = s.forward(sid, all_logits=True)
    s.reset()
    tok = np.concatenate([s.forward([t], all_logits=True) for t in sid])
    d = np.abs(log_softmax(tok) - log_softmax(full))
    print(f"SmolLM2 token-by-token vs one-shot: max |dlogprob| {d.max():.2e}")
    assert d.max() < 1e-3


# ------------------------------------------------------------------ errors


def test_context_overflow(tmp_path: Path) -> None:
    m = load_model(read_gguf(tiny(tmp_path, "llama")), n_ctx=10)
    assert m.n_ctx == 10
    m.forward(PROMPT[:8])
    with pytest.raises(EngineError) as e:
        m.forward(PROMPT[:3])
    assert e.value.code == "context_length_exceeded"
    assert m.n_past == 8
    m.forward(PROMPT[:2])
    assert m.n_past == 10
    with pytest.raises(EngineError) as e:
        m.forward([5])
    assert e.value.code == "context_length_exceeded"
    m.reset()
    with pytest.raises(EngineError):
        m.forward(list(range(11)))
    assert m.n_past == 0


@pytest.mark.parametrize("bad", [[-1], [TINY_VOCAB_SIZE], [3, 2**40], [1.0], [True], ["a"], [None],
                                 np.array([1.0, 2.0]), np.array([TINY_VOCAB_SIZE + 5]), np.array([-3])])
def test_invalid_token(tmp_path: Path, bad) -> None:
    m = load_model(read_gguf(tiny(tmp_path, "llama")))
    m.forward([5, 6])
    with pytest.raises(EngineError) as e:
        m.forward(bad)
    assert e.value.code == "invalid_token"
    assert m.n_past == 2
    m.forward([7])  # still usable
    assert m.n_past == 3


@pytest.mark.parametrize("bad", [[], np.zeros((0,), dtype=np.int64), np.zeros((2, 2), dtype=np.int64), "abc", 5])
def test_invalid_token_sequence(tmp_path: Path, bad) -> None:
    m = load_model(read_gguf(tiny(tmp_path, "llama")))
    with pytest.raises(EngineError) as e:
        m.forward(bad)
    assert e.value.code == "invalid_params"
    assert m.n_past == 0


def test_unknown_architecture(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "x.gguf", arch="mamba9")
    with pytest.raises(EngineError) as e:
        load_model(read_gguf(path))
    assert e.value.code == "unsupported_architecture" and "mamba9" in e.value.message
    assert {"llama", "gemma3", "qwen2", "qwen3"} <= set(ARCHITECTURES)


@pytest.mark.parametrize("arch,missing", [("llama", "blk.1.ffn_up.weight"), ("llama", "token_embd.weight"),
                                          ("llama", "output_norm.weight"), ("gemma3", "blk.3.attn_k_norm.weight"),
                                          ("gemma3", "blk.0.post_ffw_norm.weight"), ("qwen2", "blk.0.attn_v.weight"),
                                          ("qwen3", "blk.1.attn_q_norm.weight")])
def test_missing_tensor(tmp_path: Path, arch: str, missing: str) -> None:
    path = tiny(tmp_path, arch, omit=(missing,))
    with pytest.raises(EngineError) as e:
        load_model(read_gguf(path))
    assert e.value.code == "invalid_gguf" and missing in e.value.message


@pytest.mark.parametrize("arch,extra,what", [
    ("qwen2", {"{arch}.rope.dimension_count": 8}, "rope.dimension_count"),  # partial rotary: llama.cpp asserts
    ("qwen3", {"{arch}.rope.dimension_count": 16}, "rope.dimension_count"),
    ("qwen2", {"{arch}.attention.key_length": 8, "{arch}.attention.value_length": 8}, "embedding_length"),
])
def test_qwen_hparam_checks(tmp_path: Path, arch: str, extra: dict, what: str) -> None:
    path = write_tiny_qwen(tmp_path / "h.gguf", arch, extra_metadata=extra)
    with pytest.raises(EngineError) as e:
        load_model(read_gguf(path))
    assert e.value.code == "invalid_gguf" and what in e.value.message


def test_misshaped_tensor(tmp_path: Path) -> None:
    # head_count 8 with the 4-head weights: attn_q is [64, 64] but attn_k expects [8*8*2/... ] rows
    path = write_tiny_llama(tmp_path / "s.gguf", extra_metadata={"{arch}.attention.head_count_kv": 4})
    with pytest.raises(EngineError) as e:
        load_model(read_gguf(path))
    assert e.value.code == "invalid_gguf" and "attn_k.weight" in e.value.message and "shape" in e.value.message


@pytest.mark.parametrize("key,value", [("{arch}.block_count", 0), ("{arch}.attention.head_count_kv", 3),
                                       ("{arch}.attention.layer_norm_rms_epsilon", -1.0),
                                       ("{arch}.embedding_length", "wide"), ("{arch}.rope.dimension_count", 7),
                                       ("{arch}.rope.scaling.type", "yarn")])
def test_bad_hparams(tmp_path: Path, key: str, value) -> None:
    extra = {key: value}
    if key.endswith("scaling.type"):
        extra["{arch}.rope.scaling.factor"] = 4.0
    path = write_tiny_llama(tmp_path / "h.gguf", extra_metadata=extra)
    with pytest.raises(EngineError) as e:
        load_model(read_gguf(path))
    assert e.value.code in ("invalid_gguf", "unsupported_architecture")
    assert key.replace("{arch}.", "") in e.value.message or "RoPE scaling" in e.value.message


def test_missing_hparam(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "m.gguf")
    g = read_gguf(path)
    del g.metadata["llama.feed_forward_length"]
    with pytest.raises(EngineError) as e:
        load_model(g)
    assert e.value.code == "invalid_gguf" and "feed_forward_length" in e.value.message


def test_n_ctx(tmp_path: Path) -> None:
    g = read_gguf(write_tiny_llama(tmp_path / "c.gguf", n_ctx_train=300))
    assert load_model(g).n_ctx == 300
    assert load_model(g, n_ctx=1000).n_ctx == 1000
    for bad in (0, -5, 2.5, True, "64"):
        with pytest.raises(EngineError) as e:
            load_model(g, n_ctx=bad)  # type: ignore[arg-type]
        assert e.value.code == "invalid_params"
    with pytest.raises(EngineError) as e:
        load_model(g, dtype=np.int32)
    assert e.value.code == "invalid_params"


def test_model_api_surface(tmp_path: Path) -> None:
    m = load_model(read_gguf(tiny(tmp_path, "gemma3", qtype="Q8_0")), n_ctx=40)
    assert isinstance(m, Model) and m.n_vocab == TINY_VOCAB_SIZE and m.n_ctx == 40 and m.n_past == 0
    out = m.forward([3, 4, 5])
    assert out.shape == (TINY_VOCAB_SIZE,) and out.dtype == np.float32 and np.isfinite(out).all()
    assert m.n_past == 3
    m.reset()
    assert m.n_past == 0
    assert "n_past=0" in repr(m)


# ------------------------------------------------------------------ weight cache


@pytest.mark.parametrize("weights", ["f32", "quantized"])
def test_weight_cache_roundtrip(tmp_path: Path, weights: str) -> None:
    path = tiny(tmp_path, "llama", qtype="Q8_0")
    m1 = load_model(read_gguf(path), weights=weights)  # background write
    assert m1.weights_from_cache is False
    assert m1.wait_weight_cache(timeout=60)
    g = read_gguf(path)
    tag = f"-{quant.format_tag()}" if weights == "quantized" else ""
    d = tmp_path / "xdg-cache" / "modelyard" / "npy" / g.fingerprint / f"llama-v{LlamaModel.layout_version}-{weights}{tag}"
    assert (d / "manifest.json").is_file()
    assert not list(d.glob("*.tmp")) and not list(d.glob(".*"))
    m2 = load_model(g, weights=weights)
    assert m2.weights_from_cache is True
    w = m2.w["blk.0.wqkv"]
    if weights == "quantized":
        assert isinstance(w, QWeight) and w.types == ("Q8_0",) * 3
        w = w.q
    assert not w.flags.writeable  # memory-mapped, read-only
    for name, mat in m2.w.items():  # views of the one pack, each as a kernel sees a built array
        arrays = mat.arrays().values() if isinstance(mat, QWeight) else [mat] if isinstance(mat, np.ndarray) else []
        for a in arrays:
            assert a.flags.aligned and a.flags.c_contiguous and not a.flags.writeable, name
            assert a.ctypes.data % weights_mod.WeightCache.PACK_ALIGN == 0 or a.nbytes == 0, name
    np.testing.assert_array_equal(m1.forward(PROMPT, all_logits=True), m2.forward(PROMPT, all_logits=True))


def test_weight_cache_incomplete_is_rebuilt(tmp_path: Path) -> None:
    path = tiny(tmp_path, "gemma3")
    g = read_gguf(path)
    ref = load_model(g, weights="f32", cache_write="sync").forward(PROMPT)
    d = tmp_path / "xdg-cache" / "modelyard" / "npy" / g.fingerprint / "gemma3-v1-f32"
    pack = d / "weights.bin"
    data = pack.read_bytes()
    pack.write_bytes(data[: len(data) // 2])                 # a truncated pack (a killed copy, a full disk)
    m = load_model(g, weights="f32", cache_write="sync")
    assert m.weights_from_cache is False
    np.testing.assert_array_equal(m.forward(PROMPT), ref)
    assert pack.stat().st_size == len(data)                  # rewritten whole
    manifest = json.loads((d / "manifest.json").read_text())
    name, (shape, dtype, offset) = next(iter(manifest["arrays"].items()))
    manifest["arrays"][name] = [shape, dtype, len(data)]     # an array past the pack's end
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert load_model(g, weights="f32", cache_write="sync").weights_from_cache is False
    np.save(d / "stale.npy", np.zeros(3))                    # the layout before the pack
    manifest["pack"] = None
    (d / "manifest.json").write_text(json.dumps(manifest))
    assert load_model(g, weights="f32", cache_write="sync").weights_from_cache is False
    assert not list(d.glob("*.npy"))                          # the old layout's files are removed
    (d / "manifest.json").unlink()
    assert load_model(g, weights="f32", cache_write="sync").weights_from_cache is False
    assert load_model(g, weights="f32").weights_from_cache is True
    with pytest.raises(EngineError) as e:
        load_model(g, weights="f32", cache_write="later")
    assert e.value.code == "invalid_params"


def test_weight_cache_disabled(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tiny(tmp_path, "llama")
    load_model(read_gguf(path), weight_cache=False)
    monkeypatch.setenv("MODELYARD_WEIGHT_CACHE", "0")
    load_model(read_gguf(path))
    load_model(read_gguf(path), dtype=np.float64)
    assert not (tmp_path / "xdg-cache" / "modelyard" / "npy").exists()


def test_tiny_files_not_cached_by_default(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(weights_mod, "WEIGHT_CACHE_MIN_BYTES", 16 << 20)
    path = tiny(tmp_path, "llama")
    assert load_model(read_gguf(path)).weights_from_cache is False
    assert load_model(read_gguf(path)).weights_from_cache is False
    assert not (tmp_path / "xdg-cache" / "modelyard").exists()  # neither .npy nor sha256 memo


def test_weight_cache_unwritable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocker = tmp_path / "file-not-dir"
    blocker.write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # mkdir under a file fails
    path = tiny(tmp_path, "llama")
    g = read_gguf(path)
    g.__dict__["fingerprint"] = "0" * 64  # the sha256 memo cannot be written either; skip hashing
    m = load_model(g)
    assert m.weights_from_cache is False and m.forward([1, 2]).shape == (TINY_VOCAB_SIZE,)


# ------------------------------------------------------------------ KV cache unit


def test_kv_cache_unit() -> None:
    from worker.engine.kv.cache import KVEntry, KVPool, KVShape

    shape = KVShape(2, 3, 4, 5)
    assert shape.token_bytes == 2 * 3 * (4 + 5) * 4
    c = KVEntry(shape, 10, max_positions=10)
    assert c.n_past == 0 and c.k.shape == (2, 3, 10, 4) and c.v.shape == (2, 3, 10, 5)
    assert KVEntry(shape, 300).allocated == 512  # address space: a power of two >= 1.25x (no copy when growing)
    assert KVEntry(shape, 450).allocated == 1024
    k = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4)  # [T, n_kv, hd_k]
    v = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    c.store(1, 0, k, v)
    assert c.n_past == 0  # nothing is trusted until the caller appends the tokens
    c.tokens.extend([7, 8])
    np.testing.assert_array_equal(c.keys(1, 0, 2), k.transpose(1, 0, 2))
    np.testing.assert_array_equal(c.values(1, 1, 2), v.transpose(1, 0, 2)[:, 1:2])
    assert not c.keys(0, 0, 2).any()  # other layer untouched
    with pytest.raises(EngineError) as e:
        c.store(0, 9, k, v)  # beyond the capacity
    assert e.value.code == "context_length_exceeded" and c.n_past == 2
    assert c.common_prefix([7, 9], 5) == 1 and c.common_prefix([7, 8, 1], 1) == 1
    c.resize(40)  # grows, keeping the valid positions
    np.testing.assert_array_equal(c.keys(1, 0, 2), k.transpose(1, 0, 2))
    c.truncate(1)
    assert c.n_past == 1 and c.tokens == [7]
    for bad in ((0, 1, 1, 1), (1, 1, -3, 1), (1, 1, 1, 2.0)):
        with pytest.raises(EngineError) as e:
            KVShape(*bad)  # type: ignore[arg-type]
        assert e.value.code == "invalid_params"
    pool = KVPool(shape, 100)
    a = pool.new(60)
    with pytest.raises(EngineError) as e:
        pool.new(41)
    assert e.value.code == "kv_budget_exceeded"
    a.tokens.extend(range(5))
    pool.shrink(a)  # idle: only what it holds (rounded up) stays reserved
    assert a.capacity == 16 and pool.reserved_tokens == 16 and pool.held_tokens == 5
    b = pool.new(84)
    with pytest.raises(EngineError):
        pool.resize(a, 17)
    pool.drop(b)
    pool.resize(a, 50)
    assert pool.reserved_tokens == 50 and a.tokens == [0, 1, 2, 3, 4]


def test_kv_cache_memory_is_lazy() -> None:
    """A 1 GiB reservation costs (almost) nothing until positions are written."""
    import psutil

    from worker.engine.kv.cache import KVEntry, KVShape

    proc = psutil.Process()
    before = proc.memory_info().rss
    c = KVEntry(KVShape(16, 4, 64, 64), 65536, max_positions=65536)  # 2 x 1 GiB of address space
    one = np.ones((1, 4, 64), dtype=np.float32)
    for layer in range(16):
        c.store(layer, 0, one, one)
    c.tokens.append(1)
    grown = (proc.memory_info().rss - before) / 2**20
    assert c.nbytes == 2 * 2**30
    assert grown < 256, f"KV cache made {grown:.0f} MiB resident for one position"
    # 2048 positions written (2 x 32 MiB), then given back: the pages return to the OS
    many = np.ones((2048, 4, 64), dtype=np.float32)
    for layer in range(16):
        c.store(layer, 0, many, many)
    c.tokens[:] = [1] * 2048
    full = proc.memory_info().rss
    assert (full - before) / 2**20 > 50
    c.truncate(16)
    freed = (full - proc.memory_info().rss) / 2**20
    assert freed > 50, f"truncate gave back only {freed:.0f} MiB"

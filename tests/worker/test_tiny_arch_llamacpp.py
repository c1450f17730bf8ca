"""qwen2 / qwen3 against llama.cpp on tiny random-weight GGUFs (recorded fixture).

``tests/fixtures/tiny-arch.llamacpp.json`` (scripts/record_tiny_arch_llamacpp.py) holds,
per file, the ``write_tiny_qwen`` arguments, the file's sha256 and llama-server's
next-token log-softmax after every prefix of ``prompt`` under two settings: ``exact``
(f32 KV cache, no flash attention) and ``ggml`` (f16 KV cache, flash attention).
Each file is regenerated here (its sha256 must equal the recorded one: the writer and
gguf-py's quantizer are deterministic) and run by the engine:

* the issue's bound, every file: log-probabilities within 1e-3 of ``exact``, one pass
  and token by token (KV cache) — F32 files on the float32 path (``weights="f32"``),
  quantized files on the quantized path (``weights="quantized"``: ggml's 8-bit
  activations and vec_dot) with its f16 q/k/v rounding off (``ggml_numerics = False``,
  as ``exact`` has an f32 KV cache). Measured: max 2e-6 .. 6e-6 (Q4_K_M: 2e-5);
* the quantized path against ``ggml`` (f16 KV cache, flash attention), which it follows:
  its attention is ggml-cpu's flash attention reproduced bit for bit
  (``worker/engine/kernels/attn_kernels.py``, tests/worker/test_attn_kernels.py). On the quantized
  files, token by token (every matmul on the int8 vec_dot kernel): max 1.6e-6 .. 1.1e-5,
  asserted <= 1e-4 — the issue's 1e-3 under llama.cpp's default numerics. In one pass the
  matmuls of 8 or more rows take the dequantize-and-sgemm kernel instead (quant.py, equal
  only up to float32 rounding), and on these tiny random models a float32 rounding that
  moves an activation across an 8-bit level is amplified: qwen3-q8_0 max 0.099 from the
  8-token prefix on (2e-6 with that kernel off); bounds (mean, max) as below. On the F32
  files the float32 matmuls (BLAS) differ from ggml's in the last bit, which moves f16
  roundings of q/k/v: max 6e-4 / 2.6e-3 (was 6e-3 / 8.5e-3 before the flash-attention
  kernels), asserted <= 5e-3;
* the float32 path against ``ggml`` on the quantized files, looser (no 8-bit
  activations, no f16 KV): Q8_0 mean |dlogprob| <= 0.06, max <= 0.6
  (tests/fixtures/README.md's bounds; measured mean 0.011 / 0.028, max 0.05 / 0.17);
  Q4_K_M (activations in blocks of 256) mean <= 0.15, max <= 1.0 (measured mean 0.108,
  max 0.52). A wrong architecture detail costs far more (``test_wrong_detail_is_visible``).

The measured numbers are printed (run with ``-s`` to see them).
"""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from tests.worker.tiny_gguf import write_tiny_qwen
from worker.engine.loading.gguf_loader import read_gguf
from worker.engine.arch.registry import load_model

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "tiny-arch.llamacpp.json"
DATA = json.loads(FIXTURE.read_text())
PROMPT: list[int] = DATA["prompt"]
N_VOCAB: int = DATA["n_vocab"]

F32_BOUND = 1e-3
F16_KV_BOUND = 5e-3
#: quantized files, quantized path token by token, against llama.cpp's default numerics
GGML_BOUND = 1e-4
#: ggml type of the file's weights -> (mean, max) bound on |dlogprob| for the quantized files
QUANT_BOUNDS = {"Q8_0": (0.06, 0.6), "Q4_K": (0.15, 1.0)}


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    m = x.max(axis=-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(axis=-1, keepdims=True))


def recorded(name: str, setting: str) -> np.ndarray:
    """llama.cpp's log-softmax ``[len(PROMPT), n_vocab]`` after each prefix."""
    raw = base64.b64decode(DATA["files"][name]["logprobs"][setting])
    return np.frombuffer(raw, dtype="<f4").reshape(len(PROMPT), N_VOCAB).astype(np.float64)


F32_FILES = [n for n, r in DATA["files"].items() if r["kwargs"].get("qtype", "F32") == "F32"]
QUANT_FILES = [n for n in DATA["files"] if n not in F32_FILES]


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every fixture GGUF, regenerated; the sha256 must equal the recorded one."""
    d = tmp_path_factory.mktemp("tiny-arch")
    out = {}
    for name, rec in DATA["files"].items():
        assert rec["writer"] == "write_tiny_qwen"
        path = write_tiny_qwen(d / f"{name}.gguf", **rec["kwargs"])
        assert hashlib.sha256(path.read_bytes()).hexdigest() == rec["sha256"], \
            (f"{name}: the regenerated GGUF differs from the one llama.cpp was run on (recorded with "
             f"{DATA['writer_versions']}; re-record with scripts/record_tiny_arch_llamacpp.py if gguf-py changed)")
        out[name] = path
    return out


def ours(path: Path, weights: str, tokenwise: bool = False, f16_attention: bool = True) -> np.ndarray:
    """The engine's log-softmax ``[len(PROMPT), n_vocab]``; ``f16_attention=False`` turns the
    quantized path's f16 rounding of q/k/v off (to compare with llama.cpp's f32 KV cache)."""
    model = load_model(read_gguf(path), n_ctx=len(PROMPT), weights=weights, weight_cache=False)
    if not f16_attention:
        model.ggml_numerics = False
    if tokenwise:
        return log_softmax(np.stack([model.forward([t]) for t in PROMPT]))
    return log_softmax(model.forward(PROMPT, all_logits=True))


def test_fixture_covers_both_architectures_and_types() -> None:
    kw = [r["kwargs"] for r in DATA["files"].values()]
    assert {k["arch"] for k in kw} == {"qwen2", "qwen3"}
    for arch in ("qwen2", "qwen3"):
        assert any(k["arch"] == arch and k.get("qtype", "F32") == "F32" for k in kw)
        assert any(k["arch"] == arch and k.get("qtype", "F32") != "F32" for k in kw)


@pytest.mark.parametrize("name", list(DATA["files"]))
def test_within_1e3_of_llamacpp(files: dict[str, Path], name: str) -> None:
    """F32 files on the float32 path, quantized files on the quantized path (f32 attention)."""
    want = recorded(name, "exact")
    weights = "f32" if name in F32_FILES else "quantized"
    for tokenwise in (False, True):
        got = ours(files[name], weights, tokenwise, f16_attention=False)
        d = np.abs(got - want)
        print(f"{name} {weights} {'tokenwise' if tokenwise else 'one pass'} vs llama.cpp exact: "
              f"max {d.max():.2e} mean {d.mean():.2e}")
        assert d.max() <= F32_BOUND
        assert (got.argmax(-1) == want.argmax(-1)).all()


@pytest.mark.parametrize("name", F32_FILES)
def test_quantized_path_on_f32_file_follows_f16_kv(files: dict[str, Path], name: str) -> None:
    d = np.abs(ours(files[name], "quantized") - recorded(name, "ggml"))
    print(f"{name} quantized vs llama.cpp ggml: max {d.max():.2e} mean {d.mean():.2e} (one key: {d[0].max():.2e})")
    assert d.max() <= F16_KV_BOUND
    assert d[0].max() <= 1e-4  # one key: the f16 rounding of q/k/v is llama.cpp's (measured 3e-6)


@pytest.mark.parametrize("name", QUANT_FILES)
def test_quantized_path_within_1e4_of_llamacpp_defaults(files: dict[str, Path], name: str) -> None:
    """Token by token (int8 vec_dot matmuls, ggml's flash attention): llama.cpp's default run."""
    d = np.abs(ours(files[name], "quantized", tokenwise=True) - recorded(name, "ggml"))
    print(f"{name} quantized token by token vs llama.cpp ggml: max {d.max():.2e} mean {d.mean():.2e}")
    assert d.max() <= GGML_BOUND


@pytest.mark.parametrize("weights", ["f32", "quantized"])
@pytest.mark.parametrize("name", QUANT_FILES)
def test_quantized_files_agree_with_llamacpp(files: dict[str, Path], name: str, weights: str) -> None:
    d = np.abs(ours(files[name], weights) - recorded(name, "ggml"))
    print(f"{name} {weights} vs llama.cpp ggml: max {d.max():.2e} mean {d.mean():.2e}")
    mean_bound, max_bound = QUANT_BOUNDS[DATA["files"][name]["kwargs"]["qtype"]]
    assert d.mean() <= mean_bound and d.max() <= max_bound


@pytest.mark.parametrize("arch, detail", [("qwen2", "no_bias"), ("qwen3", "no_qk_norm"), ("qwen3", "norm_rope")])
def test_wrong_detail_is_visible(files: dict[str, Path], arch: str, detail: str, monkeypatch) -> None:
    """The bounds above separate a faithful engine from one with a detail wrong."""
    from worker.engine.arch import layers as layers_mod

    name = f"{arch}-f32"
    model = load_model(read_gguf(files[name]), n_ctx=len(PROMPT), weight_cache=False)
    if detail == "no_bias":
        model.layers = [(a, w, None, *rest) for a, w, _b, *rest in model.layers]
    elif detail == "no_qk_norm":
        model.layers = [(a, w, b, None, None, *rest) for a, w, b, _qn, _kn, *rest in model.layers]
    else:  # adjacent-pair rotation, as if Q/K had been permuted
        rope = model.rope

        def apply_norm(x: np.ndarray, positions: np.ndarray) -> np.ndarray:
            perm = np.concatenate([np.arange(0, rope.n_rot, 2), np.arange(1, rope.n_rot, 2)])
            y = x[..., perm].copy()
            layers_mod.RopeTable.apply_neox(rope, y, positions)
            x[..., perm] = y
            return x

        monkeypatch.setattr(rope, "apply_neox", apply_norm)
    d = np.abs(log_softmax(model.forward(PROMPT, all_logits=True)) - recorded(name, "exact"))
    print(f"{name} with {detail}: max {d.max():.2e} mean {d.mean():.2e}")
    assert d.max() > 1.0 and d.mean() > 0.15  # far outside every bound above

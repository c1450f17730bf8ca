"""The compiled one-token decode step of llama models (``LlamaModel._decode_one``,
``kernels/decode_kernels.py``) gives the same bits as the NumPy path it replaces, on a tiny llama
file with Q4_K_M's mix (Q4_K, with Q6_K attn_v / ffn_down in some layers), at short contexts (the
one-row attention path) and long ones (split-KV); and it is taken only where it applies (other
forms fall back to the NumPy path, which the fixture tests cover)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests.worker.tiny_gguf import random_kquant, tiny_llama_tensors, write_gguf
from worker.engine.arch import weights as weights_mod
from worker.engine.arch.registry import load_model
from worker.engine.kernels import quant
from worker.engine.loading.gguf_loader import read_gguf


@pytest.fixture(autouse=True)
def _private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg-cache"))
    monkeypatch.setattr(weights_mod, "WEIGHT_CACHE_MIN_BYTES", 0)


def _q4_k_m_llama(path: Path) -> Path:
    """A tiny llama (n_embd 256, 4 heads of 64, 2 KV heads, n_ff 512, 3 layers) of Q4_K with
    Q6_K attn_v and ffn_down in layers 0 and 2 (as llama-quantize's Q4_K_M mixes them) and a
    Q6_K token_embd / output."""
    md = {"{arch}.context_length": 1024, "{arch}.embedding_length": 256, "{arch}.block_count": 3,
          "{arch}.feed_forward_length": 512, "{arch}.attention.head_count": 4, "{arch}.attention.head_count_kv": 2,
          "{arch}.rope.freq_base": 10000.0, "{arch}.rope.dimension_count": 64,
          "{arch}.attention.layer_norm_rms_epsilon": 1e-5}
    t = tiny_llama_tensors(n_vocab=512, n_embd=256, n_head=4, n_head_kv=2, n_layer=3, n_ff=512, qtype="Q4_K",
                           tied=True, seed=11)
    rng = np.random.default_rng(11)
    for name, (a, qt) in list(t.items()):
        if qt == "Q4_K":                               # gguf-py cannot quantize to K-quants: random blocks
            kind = name.split(".")[-2]
            if name == "token_embd.weight" or (kind in ("attn_v", "ffn_down") and name.split(".")[1] in ("0", "2")):
                qt = "Q6_K"
            t[name] = (random_kquant(rng, a.shape[0], a.shape[1], qt, float(a.std())), qt)
    return write_gguf(path, "llama", md, t)


def _decode(m, prompt: list[int], steps: list[int], compiled: bool) -> np.ndarray:
    blocks = m.decode_blocks
    m.reset()
    m.forward(prompt)
    m.decode_blocks = blocks if compiled else None
    try:
        return np.stack([m.forward([t]) for t in steps])     # [steps, n_vocab]
    finally:
        m.decode_blocks = blocks


@pytest.mark.skipif(not quant.host_has_vnni(), reason="the compiled step reads the vector forms (AVX2 or AVX512-VNNI)")
@pytest.mark.parametrize("n_prompt", [5, 530])      # one-row attention; split-KV from 512 cells on
def test_compiled_decode_step_is_the_numpy_path_bit_for_bit(tmp_path: Path, n_prompt: int) -> None:
    m = load_model(read_gguf(str(_q4_k_m_llama(tmp_path / "q4km.gguf"))), n_ctx=1024, weights="quantized")
    assert m.decode_blocks is not None
    rows = [[(w[5], w[9]) for w in layer[2:]] for layer in m.decode_blocks]    # (Q4_K rows, Q6_K rows)
    assert rows[0] == [(384, 128), (256, 0), (1024, 0), (0, 256)]              # wqkv: q, k Q4_K + v Q6_K
    assert rows[1] == [(512, 0), (256, 0), (1024, 0), (256, 0)]
    rng = np.random.default_rng(n_prompt)
    prompt = rng.integers(3, 500, n_prompt).tolist()
    steps = rng.integers(3, 500, 4).tolist()
    fast = _decode(m, prompt, steps, compiled=True)
    ref = _decode(m, prompt, steps, compiled=False)
    assert np.array_equal(fast, ref)
    assert m.n_past == n_prompt + len(steps)


@pytest.mark.skipif(not quant.host_has_vnni(), reason="the vector forms need AVX2 or AVX512-VNNI")
def test_embedding_rows_of_the_vector_forms(tmp_path: Path) -> None:
    from worker.engine.kernels import decode_kernels

    m = load_model(read_gguf(str(_q4_k_m_llama(tmp_path / "q4km.gguf"))), n_ctx=64, weights="quantized")
    for w in (m.w["tok_embd"], m.layers[1][1], m.layers[0][1]):        # Q6_K; Q4_K; Q4_K + Q6_K rows
        parts = quant.kquant_matvec_parts(w)
        ref = w.dequantize() if isinstance(w, quant.QWeight) else np.concatenate([p.dequantize() for p in w.parts])
        got = np.empty_like(ref)
        for r in range(ref.shape[0]):
            decode_kernels.kq_row(parts, r, got[r])
        assert np.array_equal(got, ref)


def test_other_forms_take_the_numpy_path(tmp_path: Path) -> None:
    from tests.worker.tiny_gguf import write_tiny_llama

    m = load_model(read_gguf(str(write_tiny_llama(tmp_path / "q8.gguf", qtype="Q8_0"))), n_ctx=64, weights="quantized")
    assert m.decode_blocks is None
    f32 = load_model(read_gguf(str(_q4_k_m_llama(tmp_path / "q4km.gguf"))), n_ctx=64, weights="f32")
    assert f32.decode_blocks is None

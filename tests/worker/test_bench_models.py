"""scripts/make_bench_models.py's type mix and tests/worker/tiny_gguf.py's random blocks (the
bench models themselves are hundreds of MB: written by the script, not here)."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from tests.worker.tiny_gguf import random_blocks

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import make_bench_models as mbm  # noqa: E402


@pytest.mark.parametrize("qtype", ["Q4_0", "Q8_0", "Q4_K", "Q6_K"])
def test_random_blocks_are_valid_with_the_asked_scale(qtype: str) -> None:
    rng = np.random.default_rng(0)
    raw = random_blocks(rng, 64, 512, qtype, 0.05)
    w = dequantize(raw, GGMLQuantizationType[qtype]).reshape(64, 512)
    assert np.isfinite(w).all()
    assert abs(float(w.std()) / 0.05 - 1) < 0.25
    assert abs(float(w.mean())) < 0.2 * 0.05 + 0.01


def test_random_blocks_refuse_other_types() -> None:
    with pytest.raises(ValueError):
        random_blocks(np.random.default_rng(0), 4, 64, "Q5_1", 1.0)


def test_q4_k_m_mix_follows_llama_quantize() -> None:
    n = 16
    more = [i for i in range(n) if mbm.tensor_type("Q4_K_M", "ffn_down", i, n) == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]
    assert [i for i in range(n) if mbm.tensor_type("Q4_K_M", "attn_v", i, n) == "Q6_K"] == more
    assert {mbm.tensor_type("Q4_K_M", k, 3, n) for k in ("attn_q", "attn_k", "attn_output", "ffn_gate",
                                                          "ffn_up")} == {"Q4_K"}
    assert mbm.tensor_type("Q4_K_M", "token_embd", 0, n) == "Q6_K"
    assert mbm.tensor_type("Q4_0", "token_embd", 0, n) == "Q6_K"
    assert mbm.tensor_type("Q4_0", "ffn_down", 0, n) == "Q4_0"
    assert mbm.tensor_type("Q8_0", "token_embd", 0, n) == "Q8_0"


def test_shapes_tensor_plan() -> None:
    plan = list(mbm.tensors(mbm.SHAPES["llama-1b"], "Q4_K_M", 49152))
    names = [p[0] for p in plan]
    assert names[0] == "token_embd.weight" and len(names) == 2 + 16 * 9
    shapes = dict((p[0], p[1]) for p in plan)
    assert shapes["blk.0.attn_k.weight"] == (512, 2048) and shapes["blk.15.ffn_down.weight"] == (2048, 8192)
    params = sum(int(np.prod(s)) for s in shapes.values())
    assert 1.0e9 < params < 1.3e9
    qwen = [p[0] for p in mbm.tensors(mbm.SHAPES["qwen2-1.5b"], "Q8_0", 49152)]
    assert "blk.0.attn_q.bias" in qwen


@pytest.mark.parametrize("ftype", ["Q4_K_M", "Q4_0", "Q8_0"])
def test_a_small_shape_loads_and_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, ftype: str) -> None:
    tok = mbm.default_tokenizer()
    if not tok.exists():
        pytest.skip("SmolLM2's GGUF (the tokenizer source) is not fetched")
    from worker.engine import Engine

    monkeypatch.setitem(mbm.SHAPES, "tiny", mbm.Shape("llama", 256, 512, 2, 4, 2, 500000.0, 1e-5))
    path = mbm.ensure("tiny", ftype, out=tmp_path)
    assert mbm.ensure("tiny", ftype, out=tmp_path) == path          # cached: not rewritten
    e = Engine.load(str(path), n_ctx=64, weights="quantized")
    ids = e.tokenize("Hello world", add_special=True)
    assert ids and e.detokenize(ids) == "Hello world"
    from worker.engine import SamplingParams
    r = e.generate(ids, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(r.tokens) == 4

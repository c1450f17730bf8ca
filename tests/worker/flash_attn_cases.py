"""Seeded attention inputs for the flash-attention fixture (scripts/record_flash_attn_llamacpp.py,
tests/worker/test_attn_kernels.py): the same arrays on both sides, checked by sha256.

A case is one sequence's attention for one layer as llama.cpp's CPU flash attention sees it:
``n_q`` query rows at positions ``qpos0 ..``, a KV view of ``n_cells`` cells (cell = position;
cells at or beyond ``qpos0 + n_q`` are unwritten: zeros, masked), causal, optionally a sliding
window, ``scale`` and ``softcap`` as ``ggml_flash_attn_ext`` takes them (softcap 0: none).
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Case:
    name: str
    dk: int
    dv: int
    n_head: int
    n_kv: int
    n_q: int
    qpos0: int
    n_cells: int
    window: int = 0
    softcap: float = 0.0
    seed: int = 0

    @property
    def scale(self) -> float:
        return float(np.float32(1.0) / np.sqrt(np.float32(self.dk)))

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


#: ggml-cpu's three paths (one-row "vec", split-KV decode, tiled prefill) over the head sizes the
#: architectures use (16/32: tiny qwen; 64: SmolLM2, tiny qwen3 Q4_K_M; 256: Gemma 3; 96: leftovers
#: of the 64-wide f16 vectors), GQA, sliding windows and softcap.
CASES: list[Case] = [
    Case("vec-smollm2-chunk", 64, 64, 9, 3, 5, 40, 256, seed=1),
    Case("vec-smollm2-decode", 64, 64, 9, 3, 1, 200, 256, seed=2),
    Case("vec-tiny-qwen2", 16, 16, 4, 2, 12, 0, 256, seed=3),
    Case("vec-tiny-qwen3", 32, 32, 4, 2, 12, 0, 256, seed=4),
    Case("vec-gemma-window", 256, 256, 4, 1, 3, 600, 768, window=512, seed=5),
    Case("vec-d96-softcap", 96, 96, 4, 4, 6, 30, 256, softcap=30.0, seed=6),
    Case("split-smollm2", 64, 64, 9, 3, 1, 700, 768, seed=7),
    Case("split-smollm2-300", 64, 64, 9, 3, 1, 300, 512, seed=8),
    Case("split-gemma-window", 256, 256, 4, 1, 1, 730, 768, window=512, seed=9),
    Case("split-gemma-global", 256, 256, 4, 1, 1, 730, 768, seed=10),
    Case("tiled-smollm2", 64, 64, 9, 3, 100, 0, 256, seed=11),
    Case("tiled-smollm2-chunk", 64, 64, 9, 3, 70, 150, 256, seed=12),
    Case("tiled-gemma-window", 256, 256, 4, 1, 80, 480, 768, window=512, seed=13),
    Case("tiled-d32-softcap", 32, 48, 4, 2, 64, 10, 256, softcap=30.0, seed=14),
]


def make_inputs(c: Case) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``q`` float32 ``[n_q, n_head, dk]``; ``k`` float16 ``[n_kv, n_cells, dk]``, ``v`` float16
    ``[n_kv, n_cells, dv]`` (cells beyond the last query's position zero)."""
    rng = np.random.default_rng(c.seed)
    q = (rng.standard_normal((c.n_q, c.n_head, c.dk)) * 1.5).astype(np.float32)
    end = c.qpos0 + c.n_q
    k = np.zeros((c.n_kv, c.n_cells, c.dk), np.float16)
    v = np.zeros((c.n_kv, c.n_cells, c.dv), np.float16)
    k[:, :end] = rng.standard_normal((c.n_kv, end, c.dk)).astype(np.float16)
    v[:, :end] = (rng.standard_normal((c.n_kv, end, c.dv)) * 0.5).astype(np.float16)
    return q, k, v


def inputs_sha256(c: Case) -> str:
    h = hashlib.sha256()
    for a in make_inputs(c):
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()


def visible(c: Case) -> np.ndarray:
    """bool ``[n_q, n_cells]``: cell visible to query row (causal, window)."""
    qp = np.arange(c.qpos0, c.qpos0 + c.n_q)[:, None]
    cp = np.arange(c.n_cells)[None, :]
    vis = cp <= qp
    if c.window:
        vis &= (qp - cp) < c.window
    return vis

#!/usr/bin/env python3
"""Random-weight GGUFs of real model shapes, for benchmarks at 1B-8B parameters.

    .venv/bin/python scripts/make_bench_models.py [--shape llama-1b] [--qtype Q4_K_M] [--out DIR] [--force]
    .venv/bin/python scripts/make_bench_models.py --list

Writes ``<out>/<shape>-<qtype>.gguf`` (default out: ``$XDG_CACHE_HOME/modelyard/bench-models``,
i.e. ``~/.cache/modelyard/bench-models``) unless a file written by this script's current version
for the same shape and type is there already (the key is the GGUF's ``general.name``), and prints
its path (last line) and size. Shapes (:data:`SHAPES`) are the public configurations of the named
models: llama-1b = Llama 3.2 1B (n_embd 2048, n_ff 8192, 16 layers, 32 query / 8 KV heads),
llama-3b = Llama 3.2 3B, qwen2-1.5b / qwen2-7b = Qwen2.5 1.5B / 7B (with q/k/v biases). Every model
has tied embeddings and carries SmolLM2's byte-level BPE tokenizer (49,152 tokens, ``smollm``
pre-tokenizer, ChatML template, copied from ``--tokenizer-from``), so llama-server and modelyard
both load it and the output projection is 49,152 x n_embd (Llama 3's real vocabulary is 128,256:
``--vocab 128256`` pads the token list with unused tokens to that size).

Types, as ``llama-quantize`` assigns them (``src/llama-quant.cpp``, ``llama_tensor_get_type``):

* ``Q4_K_M``: Q4_K everywhere, but ``attn_v`` and ``ffn_down`` Q6_K in the layers where
  ``use_more_bits(i, n)`` (i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2), and the tied
  ``token_embd`` (the output projection) Q6_K;
* ``Q4_0``: Q4_0 everywhere, the tied ``token_embd`` Q6_K;
* ``Q8_0``: Q8_0 everywhere, ``token_embd`` too.

Norms and biases are F32. Weights are random blocks (:func:`tests.worker.tiny_gguf.random_blocks`,
written straight as bytes, tensor by tensor, so memory stays at one tensor): the numbers mean
nothing, but every byte is read as in a trained model, which is all a speed benchmark needs.
A 1B Q4_K_M file takes ~10 s to write.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.worker.tiny_gguf import random_blocks  # noqa: E402

#: bumped when the files this script writes change (a cached file of another version is rewritten)
VERSION = 1


@dataclass(frozen=True)
class Shape:
    arch: str
    n_embd: int
    n_ff: int
    n_layer: int
    n_head: int
    n_head_kv: int
    rope_base: float
    eps: float
    biases: bool = False


SHAPES: dict[str, Shape] = {
    "llama-1b": Shape("llama", 2048, 8192, 16, 32, 8, 500000.0, 1e-5),
    "llama-3b": Shape("llama", 3072, 8192, 28, 24, 8, 500000.0, 1e-5),
    "qwen2-1.5b": Shape("qwen2", 1536, 8960, 28, 12, 2, 1000000.0, 1e-6, biases=True),
    "qwen2-7b": Shape("qwen2", 3584, 18944, 28, 28, 4, 1000000.0, 1e-6, biases=True),
}
#: ggml file types (``general.file_type``, ``llama_ftype``)
FILE_TYPES = {"Q4_0": 2, "Q8_0": 7, "Q4_K_M": 15}
N_CTX_TRAIN = 8192


def default_out() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modelyard" / "bench-models"


def default_tokenizer() -> Path:
    return Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models") / "SmolLM2-135M-Instruct.Q4_1.gguf"


def use_more_bits(i: int, n: int) -> bool:
    """llama-quant.cpp's ``use_more_bits``: the layers Q4_K_M gives Q6_K for attn_v / ffn_down."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def tensor_type(ftype: str, kind: str, il: int, n_layer: int) -> str:
    """The ggml type ``llama-quantize`` gives a 2-D tensor of ``kind`` in layer ``il`` (see the docstring)."""
    if ftype == "Q8_0":
        return "Q8_0"
    if kind == "token_embd":                      # tied: it is the output projection
        return "Q6_K"
    if ftype == "Q4_0":
        return "Q4_0"
    if kind in ("attn_v", "ffn_down") and use_more_bits(il, n_layer):
        return "Q6_K"
    return "Q4_K"


def tensors(sh: Shape, ftype: str, n_vocab: int) -> Iterator[tuple[str, tuple[int, ...], str, float]]:
    """``(name, numpy shape [out, in] or [n], ggml type, value scale)`` of every tensor, in file order."""
    hd = sh.n_embd // sh.n_head
    nq, nk = sh.n_head * hd, sh.n_head_kv * hd
    yield "token_embd.weight", (n_vocab, sh.n_embd), tensor_type(ftype, "token_embd", 0, sh.n_layer), 0.25
    yield "output_norm.weight", (sh.n_embd,), "F32", 0.1
    for il in range(sh.n_layer):
        p = f"blk.{il}."

        def mat(kind: str, n_out: int, n_in: int) -> tuple[str, tuple[int, ...], str, float]:
            return p + kind + ".weight", (n_out, n_in), tensor_type(ftype, kind, il, sh.n_layer), n_in ** -0.5

        yield p + "attn_norm.weight", (sh.n_embd,), "F32", 0.1
        yield mat("attn_q", nq, sh.n_embd)
        yield mat("attn_k", nk, sh.n_embd)
        yield mat("attn_v", nk, sh.n_embd)
        if sh.biases:
            for kind, n in (("attn_q", nq), ("attn_k", nk), ("attn_v", nk)):
                yield p + kind + ".bias", (n,), "F32", 0.5
        yield mat("attn_output", sh.n_embd, nq)
        yield p + "ffn_norm.weight", (sh.n_embd,), "F32", 0.1
        yield mat("ffn_gate", sh.n_ff, sh.n_embd)
        yield mat("ffn_up", sh.n_ff, sh.n_embd)
        yield mat("ffn_down", sh.n_embd, sh.n_ff)


def tokenizer_keys(path: Path, n_vocab: int) -> list[tuple[str, Any, str]]:
    """``(key, value, kind)`` of the ``tokenizer.*`` keys of the GGUF at ``path``, the token list
    padded to ``n_vocab`` with unused tokens (type 5) when larger."""
    from worker.engine.loading.gguf_loader import read_gguf
    md = read_gguf(str(path)).metadata
    out: list[tuple[str, Any, str]] = []
    for k, v in md.items():
        if not k.startswith("tokenizer."):
            continue
        if k == "tokenizer.ggml.tokens":
            toks = list(v)
            toks += [f"<unused_{i}>" for i in range(len(toks), n_vocab)]
            out.append((k, toks, "array"))
        elif k == "tokenizer.ggml.token_type":
            tt = [int(x) for x in v]
            tt += [5] * (n_vocab - len(tt))
            out.append((k, tt, "array"))
        elif k == "tokenizer.ggml.merges":
            out.append((k, list(v), "array"))
        elif isinstance(v, bool):
            out.append((k, v, "bool"))
        elif isinstance(v, int):
            out.append((k, v, "uint32"))
        elif isinstance(v, str):
            out.append((k, v, "string"))
        elif isinstance(v, float):
            out.append((k, v, "float32"))
        else:
            out.append((k, list(v), "array"))
    return out


def model_name(shape: str, ftype: str, n_vocab: int) -> str:
    return f"modelyard-bench {shape} {ftype} vocab{n_vocab} v{VERSION}"


def cached_name(path: Path) -> str | None:
    """``general.name`` of an existing GGUF (None when unreadable)."""
    try:
        from worker.engine.loading.gguf_loader import read_gguf
        return str(read_gguf(str(path)).metadata.get("general.name"))
    except Exception:
        return None


def write_model(path: Path, shape: str, ftype: str, tokenizer_from: Path, n_vocab: int, seed: int = 0,
                progress: Callable[[str], None] | None = None) -> Path:
    """Write the ``shape`` model in ``ftype`` to ``path`` (through a temporary file, renamed at the end)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFWriter

    sh = SHAPES[shape]
    tmp = path.with_suffix(".gguf.tmp")
    wr = GGUFWriter(str(tmp), sh.arch)
    wr.add_name(model_name(shape, ftype, n_vocab))
    a = sh.arch
    wr.add_uint32(f"{a}.context_length", N_CTX_TRAIN)
    wr.add_uint32(f"{a}.embedding_length", sh.n_embd)
    wr.add_uint32(f"{a}.block_count", sh.n_layer)
    wr.add_uint32(f"{a}.feed_forward_length", sh.n_ff)
    wr.add_uint32(f"{a}.attention.head_count", sh.n_head)
    wr.add_uint32(f"{a}.attention.head_count_kv", sh.n_head_kv)
    wr.add_float32(f"{a}.rope.freq_base", sh.rope_base)
    wr.add_uint32(f"{a}.rope.dimension_count", sh.n_embd // sh.n_head)
    wr.add_float32(f"{a}.attention.layer_norm_rms_epsilon", sh.eps)
    wr.add_uint32(f"{a}.vocab_size", n_vocab)
    wr.add_file_type(FILE_TYPES[ftype])
    wr.add_quantization_version(2)
    for k, v, kind in tokenizer_keys(tokenizer_from, n_vocab):
        {"array": wr.add_array, "bool": wr.add_bool, "uint32": wr.add_uint32, "string": wr.add_string,
         "float32": wr.add_float32}[kind](k, v)
    plan = list(tensors(sh, ftype, n_vocab))
    for name, shp, qt, _ in plan:
        if qt == "F32":
            wr.add_tensor_info(name, shp, np.dtype(np.float32), 4 * int(np.prod(shp)))
        else:
            block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qt]]
            byte_shape = (shp[0], shp[1] // block * size)
            wr.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1],
                               raw_dtype=GGMLQuantizationType[qt])
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for i, (name, shp, qt, scale) in enumerate(plan):
        if qt == "F32":
            arr = (rng.standard_normal(shp) * scale).astype(np.float32)
            if name.endswith("norm.weight"):
                arr += 1.0
        else:
            arr = random_blocks(rng, shp[0], shp[1], qt, scale)
        wr.write_tensor_data(arr)
        if progress and i % 20 == 0:
            progress(f"{i + 1}/{len(plan)} tensors")
    wr.close()
    os.replace(tmp, path)
    return path


def ensure(shape: str, ftype: str, out: Path | None = None, tokenizer_from: Path | None = None,
           n_vocab: int = 49152, force: bool = False, progress: Callable[[str], None] | None = None) -> Path:
    """The path of the ``shape`` / ``ftype`` bench model, written first unless cached."""
    out = out or default_out()
    out.mkdir(parents=True, exist_ok=True)
    suffix = "" if n_vocab == 49152 else f"-v{n_vocab}"
    path = out / f"{shape}-{ftype}{suffix}.gguf"
    if not force and path.exists() and cached_name(path) == model_name(shape, ftype, n_vocab):
        return path
    tok = tokenizer_from or default_tokenizer()
    if not tok.exists():
        raise SystemExit(f"tokenizer source {tok} not found: run scripts/fetch_models.py or pass --tokenizer-from")
    return write_model(path, shape, ftype, tok, n_vocab, progress=progress)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="llama-1b", choices=sorted(SHAPES))
    ap.add_argument("--qtype", default="Q4_K_M", choices=sorted(FILE_TYPES))
    ap.add_argument("--out", type=Path, default=None, help="directory (default ~/.cache/modelyard/bench-models)")
    ap.add_argument("--tokenizer-from", type=Path, default=None, help="GGUF whose tokenizer.* keys are copied")
    ap.add_argument("--vocab", type=int, default=49152, help="pad the token list to this size (>= 49152)")
    ap.add_argument("--force", action="store_true", help="rewrite even when cached")
    ap.add_argument("--list", action="store_true", help="print the shapes and exit")
    a = ap.parse_args()
    if a.list:
        for k, s in SHAPES.items():
            n = s.n_layer * (s.n_embd * s.n_embd * 2 + 2 * s.n_embd * s.n_embd * s.n_head_kv // s.n_head
                             + 3 * s.n_embd * s.n_ff) + a.vocab * s.n_embd
            print(f"{k}: {s} ~{n / 1e9:.2f} B parameters")
        return 0
    t0 = time.monotonic()
    path = ensure(a.shape, a.qtype, a.out, a.tokenizer_from, a.vocab, a.force,
                  progress=lambda m: print(f"[bench-models] {m}", file=sys.stderr, flush=True))
    print(f"[bench-models] {path.stat().st_size / 2**20:.0f} MiB in {time.monotonic() - t0:.1f} s", file=sys.stderr)
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

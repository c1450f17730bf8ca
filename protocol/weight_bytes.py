"""The memory a worker's weights take, per weights mode and GGUF tensor type: one table.

A worker holds a model's weights in one of the modes of :data:`~protocol.limits.WEIGHT_MODES`
(config ``weights``):

* ``"f32"``: every tensor dequantized to float32 (4 bytes per weight);
* ``"quantized"``: each 2-D tensor of a type in :data:`QUANTIZED_FORMS` in the compact form the
  engine's kernels read (``worker/engine/kernels/quant.py``, ``QWeight``), every other tensor (1-D
  norms, F32/F16/BF16 and the types without a kernel: Q2_K, Q3_K, Q5_K, IQ*) as float32.

The router's placement turns a GGUF's tensor infos (``router.gguf_meta.tensor_infos``) into the
bytes the worker will hold with :func:`held_bytes`, without loading anything.
``tests/protocol/test_weight_bytes.py`` holds this table to the forms ``quant.py`` builds (type
by type) and the sum to the arrays of both shipped models as loaded, in both modes.

Imports neither the router nor the worker; both may import it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from protocol.limits import WEIGHT_MODES

#: GGUF tensor type code (``ggml_type``, the tensor info's type field) -> its name
#: (``gguf.GGMLQuantizationType``), for the types whose held size is not plain float32.
GGML_TYPE_NAMES = {2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 12: "Q4_K", 14: "Q6_K"}

#: Bytes per weight held as float32.
FLOAT32_BYTES = 4

#: Rows of a ``lanes`` matrix are interleaved in groups of this many, the last group padded
#: with zero rows (``quant.LANE_ROWS``).
LANE_ROWS = 16

#: ggml type name -> ``(form, elements, bytes)``: the quantized path's in-memory form of a
#: matrix of that type holds ``bytes`` per ``elements`` weights, on a CPU without AVX512-VNNI or AVX2
#: (the reference kernels' forms):
#:
#: * ``lanes`` (the 32-block types): an int8 level per weight and a float32 scale ``d`` per 32
#:   (Q4_1 / Q5_1: and a float32 offset ``m`` per 32); rows padded to :data:`LANE_ROWS`;
#: * ``q4k``: per 256-weight super-block the GGUF's 128 bytes of nibbles, the 8 six-bit
#:   sub-block scales and 8 mins unpacked to a byte each, float32 ``d`` and ``dmin``;
#: * ``q6k``: per super-block the 256 six-bit levels a byte each, 16 int8 scales, float32 ``d``.
QUANTIZED_FORMS: dict[str, tuple[str, int, int]] = {
    "Q4_0": ("lanes", 32, 32 + 4),
    "Q5_0": ("lanes", 32, 32 + 4),
    "Q8_0": ("lanes", 32, 32 + 4),
    "Q4_1": ("lanes", 32, 32 + 4 + 4),
    "Q5_1": ("lanes", 32, 32 + 4 + 4),
    "Q4_K": ("q4k", 256, 128 + 8 + 8 + 4 + 4),
    "Q6_K": ("q6k", 256, 256 + 16 + 4),
}

#: The same on a CPU with AVX512-VNNI or AVX2 (the VNNI kernels' forms, ``quant.QWeight``): every form
#: has its rows interleaved by :data:`LANE_ROWS` (padded); ``vlanes4`` holds Q4_0 / Q4_1 as
#: packed nibbles (16 bytes per 32 weights), ``vlanes`` the other 32-block types as a byte per
#: weight, ``vq4k`` the K-quant form's bytes, ``vq6k`` the 6-bit levels packed as the GGUF packs them
#: (4 + 2 bits: ``quant.pack_q6``); every scale (``d``, ``m``, ``dmin``) as the
#: GGUF's own fp16 (2 bytes). A fused matrix whose parts are not all
#: Q4_0 / Q4_1 is held as ``vlanes`` (a byte per weight) whole.
VNNI_FORMS: dict[str, tuple[str, int, int]] = {
    "Q4_0": ("vlanes4", 32, 16 + 2),
    "Q4_1": ("vlanes4", 32, 16 + 2 + 2),
    "Q5_0": ("vlanes", 32, 32 + 2),
    "Q8_0": ("vlanes", 32, 32 + 2),
    "Q5_1": ("vlanes", 32, 32 + 2 + 2),
    "Q4_K": ("vq4k", 256, 128 + 8 + 8 + 2 + 2),
    "Q6_K": ("vq6k", 256, 192 + 16 + 2),
}

#: Environment switch of the worker's VNNI kernels (``worker.engine.kernels.quant.VNNI_ENV``).
VNNI_ENV = "MODELYARD_QUANT_VNNI"
#: Environment switch of their AVX2 lowering (``worker.engine.kernels.quant.AVX2_ENV``).
AVX2_ENV = "MODELYARD_VECTOR_AVX2"


def _env_on(name: str) -> bool:
    return os.environ.get(name, "1").strip().lower() not in ("0", "false", "no", "off")


def host_has_vnni() -> bool:
    """Whether a worker on this host holds the VNNI forms: the CPU flags ``avx512f``,
    ``avx512bw`` and ``avx512_vnni``, or ``avx2``, ``fma`` and ``f16c`` (:data:`AVX2_ENV` not
    off), in ``/proc/cpuinfo`` (Linux), :data:`VNNI_ENV` not off,
    ``NUMBA_CPU_NAME`` unset or ``host`` — the rule of ``worker.engine.kernels.quant.host_has_vnni``
    (which asks llvmlite; a test holds the two equal). False where ``/proc/cpuinfo`` is missing."""
    if not _env_on(VNNI_ENV) or os.environ.get("NUMBA_CPU_NAME", "host") not in ("", "host"):
        return False
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return {"avx512f", "avx512bw", "avx512_vnni"} <= flags or (
                        {"avx2", "fma", "f16c"} <= flags and _env_on(AVX2_ENV))
    except OSError:
        pass
    return False


def held_bytes(type_code: int, dims: Sequence[int], weights: str, vnni: bool | None = None) -> int:
    """Bytes a worker in mode ``weights`` holds for one GGUF tensor.

    Args:
        type_code: the tensor's ``ggml_type`` code as stored in the GGUF tensor info.
        dims: its dimensions in GGUF order (``ne[0]`` first: the row length, then the rows).
        weights: a mode of :data:`~protocol.limits.WEIGHT_MODES`.
        vnni: the VNNI forms (:data:`VNNI_FORMS`) or the reference ones; None: :func:`host_has_vnni`.
    Returns: bytes, int >= 0 (the worker's arrays' ``nbytes``; a fused matrix's rows are padded
        once, so the sum over its parts may exceed it by under :data:`LANE_ROWS` rows per part).
    Raises: ValueError for an unknown mode.
    """
    if weights not in WEIGHT_MODES:
        raise ValueError(f"weights must be one of {', '.join(WEIGHT_MODES)}, got {weights!r}")
    n = 1
    for d in dims:
        n *= int(d)
    if weights == "quantized" and vnni is None:
        vnni = host_has_vnni()
    form = (VNNI_FORMS if vnni else QUANTIZED_FORMS).get(GGML_TYPE_NAMES.get(type_code, ""))
    if weights == "f32" or form is None or len(dims) != 2:
        return n * FLOAT32_BYTES
    kind, elements, nbytes = form
    cols, rows = int(dims[0]), int(dims[1])
    if kind != "q4k" and kind != "q6k":  # every form but the reference K-quant ones pads rows
        rows = -(-rows // LANE_ROWS) * LANE_ROWS
    return rows * cols * nbytes // elements

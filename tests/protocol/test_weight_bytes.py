"""protocol.weight_bytes — the one table of what a worker holds per weights mode and GGUF
tensor type — against both sides: the router's reading of a GGUF's tensor infos
(router.gguf_meta) and the in-memory forms the engine builds (worker.engine.kernels.quant), type by
type and summed over both shipped models as loaded, in both modes."""

from __future__ import annotations

import numpy as np
import pytest
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from protocol.limits import DEFAULT_WEIGHTS, WEIGHT_MODES
from protocol.weight_bytes import (FLOAT32_BYTES, GGML_TYPE_NAMES, LANE_ROWS, QUANTIZED_FORMS, VNNI_ENV, VNNI_FORMS,
                                   held_bytes, host_has_vnni)
from router.gguf_meta import tensor_infos
from router.workers.placement import held_weight_bytes
from tests.paths import GEMMA3_PATH, SMOLLM2_PATH
from worker.engine.kernels import quant
from worker.engine.arch.registry import DEFAULT_WEIGHTS as ENGINE_DEFAULT

#: The estimate may exceed the loaded arrays by the row padding of fused lanes matrices (each
#: part padded to 16 rows in the estimate, the fused matrix once in the worker); never below.
#: Both shipped models have row counts that are multiples of 16: there it is exact.
TOLERANCE = 0.005


def test_the_table_names_the_engines_types_and_forms() -> None:
    for code, name in GGML_TYPE_NAMES.items():
        assert GGMLQuantizationType(code).name == name
    assert set(QUANTIZED_FORMS) == {t for t in GGML_TYPE_NAMES.values() if quant.supports(t)} == set(quant.ACT_TYPE)
    assert {t for t, f in QUANTIZED_FORMS.items() if f[0] == "lanes"} == set(quant.LANE_TYPES)
    assert set(VNNI_FORMS) == set(QUANTIZED_FORMS)
    assert {t for t, f in VNNI_FORMS.items() if f[0] == "vlanes4"} == set(quant.PACKED_TYPES)
    assert VNNI_ENV == quant.VNNI_ENV
    assert host_has_vnni() == quant.host_has_vnni()  # the router's rule (cpuinfo) = the worker's (llvmlite)
    assert LANE_ROWS == quant.LANE_ROWS
    assert ENGINE_DEFAULT == DEFAULT_WEIGHTS and DEFAULT_WEIGHTS in WEIGHT_MODES


#: the form sets a QWeight can be built in on this host: the reference one always, the VNNI one
#: where the CPU has it
FORM_SETS = [False] + ([True] if quant.host_has_vnni() else [])


@pytest.mark.parametrize("vnni", FORM_SETS, ids=lambda v: "vnni" if v else "reference")
@pytest.mark.parametrize("type_name", sorted(QUANTIZED_FORMS))
@pytest.mark.parametrize("rows", [1, 16, 17, 40])
def test_held_bytes_is_the_nbytes_of_the_quantized_form(type_name: str, rows: int, vnni: bool,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quant, "_vnni", vnni)
    t = GGMLQuantizationType[type_name]
    block, tsize = GGML_QUANT_SIZES[t]
    cols = 512
    raw = np.random.default_rng(rows).integers(0, 256, (rows, cols // block * tsize), dtype=np.uint8)
    w = quant.QWeight.from_raw(type_name, raw, rows, cols)
    assert w.kind == (VNNI_FORMS if vnni else QUANTIZED_FORMS)[type_name][0]
    assert held_bytes(int(t), (cols, rows), "quantized", vnni) == w.nbytes
    assert held_bytes(int(t), (cols, rows), "f32") == rows * cols * FLOAT32_BYTES


def test_float32_tensors_and_types_without_a_kernel() -> None:
    for t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16,
              GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q3_K, GGMLQuantizationType.IQ4_NL):
        assert not quant.supports(t.name)
        assert held_bytes(int(t), (256, 3), "quantized") == 256 * 3 * 4
    assert held_bytes(int(GGMLQuantizationType.Q8_0), (576,), "quantized") == 576 * 4  # a vector: float32
    with pytest.raises(ValueError, match="weights must be one of"):
        held_bytes(0, (4,), "int8")


@pytest.mark.parametrize("path", [SMOLLM2_PATH, GEMMA3_PATH], ids=["smollm2", "gemma3"])
def test_the_routers_tensor_infos_are_the_files(path) -> None:
    from worker.engine.loading.gguf_loader import read_gguf

    infos = tensor_infos(path)
    gguf = read_gguf(str(path))  # the worker's reader (the gguf package's): numpy shapes, ne reversed
    try:
        assert infos is not None and len(infos) == len(gguf.tensors)
        assert {i.name: (i.dims[::-1], i.type_code) for i in infos} == {
            n: (tuple(int(d) for d in t.np_shape), int(t.type)) for n, t in gguf.tensors.items()}
    finally:
        gguf.close()


def _held(w) -> int:
    """The bytes of a loaded weight's arrays, counted here (QWeight / QConcat / ndarray)."""
    if isinstance(w, quant.QConcat):
        return sum(_held(p) for p in w.parts)
    if isinstance(w, quant.QWeight):
        return sum(a.nbytes for a in w.arrays().values())
    assert isinstance(w, np.ndarray)
    return w.nbytes


@pytest.mark.parametrize("weights", WEIGHT_MODES)
@pytest.mark.parametrize("path", [SMOLLM2_PATH, GEMMA3_PATH], ids=["smollm2", "gemma3"])
def test_the_estimate_is_what_the_loaded_model_holds(path, weights: str) -> None:
    from worker.engine.loading.gguf_loader import read_gguf
    from worker.engine.arch.registry import load_model

    gguf = read_gguf(str(path))
    try:
        model = load_model(gguf, 64, weights=weights)
        actual = sum(_held(w) for w in model.w.values())
        assert actual == model.weight_bytes
        est = held_weight_bytes(path, weights)
        print(f"\n{path.name} [{weights}]: loaded {actual / 2**20:.2f} MiB, estimated {est / 2**20:.2f} MiB")
        assert est is not None and actual <= est <= actual * (1 + TOLERANCE)
    finally:
        gguf.close()

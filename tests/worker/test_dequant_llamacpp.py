"""Dequantization checked against llama.cpp itself, not only against the gguf package.

``tests/fixtures/dequant.llamacpp.json`` holds random valid blocks of every tensor type
the engine reads, with the float32 values llama.cpp's ggml made of them
(``dequantize_row_*``; recorded by ``scripts/record_dequant_llamacpp.py``). Each is
written into a tiny GGUF and read back through the engine's loader
(``GGUFFile.tensor``), which must give llama.cpp's values bit for bit.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from worker.engine.loading.gguf_loader import SUPPORTED_TENSOR_TYPES, read_gguf

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "dequant.llamacpp.json"
RECORD: dict[str, Any] = json.loads(FIXTURE.read_text())


def test_every_type_the_engine_reads_is_recorded() -> None:
    assert {t.name for t in SUPPORTED_TENSOR_TYPES} - {"F32"} == set(RECORD["types"])


@pytest.mark.parametrize("name", sorted(RECORD["types"]))
def test_the_engine_dequantizes_like_llama_cpp(tmp_path: Path, name: str) -> None:
    rec = RECORD["types"][name]
    rows, cols = rec["shape"]
    qt = GGMLQuantizationType[name]
    raw = np.frombuffer(base64.b64decode(rec["raw"]), dtype=np.uint8).reshape(rows, -1)
    want = np.frombuffer(base64.b64decode(rec["f32"]), dtype="<f4").reshape(rows, cols)
    path = tmp_path / f"{name}.gguf"
    wr = GGUFWriter(str(path), "llama")
    wr.add_tensor("w", raw, raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    g = read_gguf(path)
    assert g.tensors["w"].type == qt
    got = g.tensor("w")
    assert got.shape == (rows, cols) and got.dtype == np.float32
    np.testing.assert_array_equal(got, want)

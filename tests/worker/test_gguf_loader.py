"""GGUF header parser: agreement with gguf.GGUFReader, dequantization, and every load error."""

from __future__ import annotations

import hashlib
import os
import struct
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter

from tests.worker.tiny_gguf import TINY_VOCAB_SIZE, tiny_bpe_vocab, write_gguf, write_tiny_llama
from worker.engine.loading import dequant, gguf_loader
from worker.engine.errors import EngineError
from worker.engine.loading.gguf_loader import SUPPORTED_TENSOR_TYPES, atomic_write_bytes, cache_root, read_gguf


def _reader_value(field: gguf.ReaderField):
    """A GGUFReader field as a plain Python value (the slow reference)."""
    vt = field.types[0]
    if vt == gguf.GGUFValueType.ARRAY:
        it = field.types[-1]
        if it == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8") for i in field.data]
        return [field.parts[i].tolist()[0] for i in field.data]
    if vt == gguf.GGUFValueType.STRING:
        return bytes(field.parts[-1]).decode("utf-8")
    v = field.parts[-1].tolist()[0]
    return bool(v) if vt == gguf.GGUFValueType.BOOL else v


@pytest.mark.slow
def test_smollm2_header_matches_gguf_reader(smollm2_path: Path, smollm2_gguf) -> None:
    ref = gguf.GGUFReader(str(smollm2_path))
    g = smollm2_gguf
    ref_md = {k: _reader_value(f) for k, f in ref.fields.items() if not k.startswith("GGUF.")}
    assert g.metadata.keys() == ref_md.keys()
    for k, v in ref_md.items():
        if isinstance(v, float):
            assert g.metadata[k] == pytest.approx(v, rel=0, abs=0), k
        else:
            assert g.metadata[k] == v, k
    assert g.architecture == "llama"
    assert list(g.tensors) == [t.name for t in ref.tensors]
    for t in ref.tensors:
        info = g.tensors[t.name]
        assert info.shape == tuple(int(x) for x in t.shape), t.name
        assert info.type == t.tensor_type
        assert info.data_offset == t.data_offset
        assert info.n_bytes == t.n_bytes
    # dequantized data of one tensor per type, numpy-shaped [ne1, ne0]
    seen: set[GGMLQuantizationType] = set()
    for t in ref.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        ours = g.tensor(t.name)
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(reversed([int(x) for x in t.shape])))
        assert ours.dtype == np.float32 and ours.flags.c_contiguous
        np.testing.assert_array_equal(ours, want)
    assert g.tensor("token_embd.weight").shape == (49152, 576)
    assert g.file_size == smollm2_path.stat().st_size


@pytest.mark.slow
def test_gemma3_header(gemma3_gguf) -> None:
    g = gemma3_gguf
    md = g.metadata
    assert g.architecture == "gemma3"
    assert len(md["tokenizer.ggml.tokens"]) == 262144
    assert len(md["tokenizer.ggml.scores"]) == 262144 and isinstance(md["tokenizer.ggml.scores"][0], float)
    assert md["gemma3.attention.key_length"] == 256
    assert md["gemma3.attention.sliding_window"] == 512
    types = {t.type for t in g.tensors.values()}
    assert types <= SUPPORTED_TENSOR_TYPES and GGMLQuantizationType.Q4_K in types and GGMLQuantizationType.Q6_K in types
    assert g.tensor("blk.0.ffn_down.weight").shape == (640, 2048)  # Q6_K


@pytest.mark.slow
def test_fingerprint_is_file_sha256(smollm2_path: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    want = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"  # fixtures/README.md
    assert read_gguf(smollm2_path).fingerprint == want
    memo = list((tmp_path / "cache" / "modelyard" / "sha256").glob("*.json"))
    assert len(memo) == 1
    assert read_gguf(smollm2_path).fingerprint == want  # from the memo


def test_fingerprint_changes_with_content(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "SHA256_MEMO_MIN_BYTES", 0)  # memoise even tiny files here
    a = write_tiny_llama(tmp_path / "a.gguf", seed=1)
    b = write_tiny_llama(tmp_path / "b.gguf", seed=2)
    fa, fb = read_gguf(a).fingerprint, read_gguf(b).fingerprint
    assert fa == hashlib.sha256(a.read_bytes()).hexdigest()
    assert fa != fb
    # rewrite a with other content: new mtime/size key -> new hash, never the stale memo
    old_mtime = a.stat().st_mtime_ns
    a.write_bytes(b.read_bytes())
    os.utime(a, ns=(old_mtime + 10**9, old_mtime + 10**9))  # coarse fs clocks: force a new mtime
    assert read_gguf(a).fingerprint == fb
    assert len(list((tmp_path / "cache" / "modelyard" / "sha256").glob("*.json"))) == 3


def test_small_files_hashed_without_memo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    a = write_tiny_llama(tmp_path / "a.gguf")
    assert read_gguf(a).fingerprint == hashlib.sha256(a.read_bytes()).hexdigest()
    assert not (tmp_path / "cache").exists()


def test_cache_root_respects_xdg(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "modelyard"
    monkeypatch.delenv("XDG_CACHE_HOME")
    assert cache_root() == Path.home() / ".cache" / "modelyard"


def test_atomic_write(tmp_path: Path) -> None:
    p = tmp_path / "d" / "x.bin"
    atomic_write_bytes(p, b"abc")
    atomic_write_bytes(p, b"defg")
    assert p.read_bytes() == b"defg"
    assert [q.name for q in p.parent.iterdir()] == ["x.bin"]


@pytest.mark.parametrize("qtype", ["F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_tiny_roundtrip_every_type(tmp_path: Path, qtype: str) -> None:
    path = write_tiny_llama(tmp_path / "t.gguf", qtype=qtype)
    g = read_gguf(path)
    ref = gguf.GGUFReader(str(path))
    for t in ref.tensors:
        want = gguf.quants.dequantize(t.data, t.tensor_type).reshape(g.tensors[t.name].np_shape)
        np.testing.assert_array_equal(g.tensor(t.name), want)
    assert g.tensors["blk.0.attn_q.weight"].type.name == qtype
    assert g.tensor("blk.0.attn_k.weight").shape == (32, 64)  # [n_kv*head_dim, n_embd]
    toks, types, merges = tiny_bpe_vocab()
    assert g.metadata["tokenizer.ggml.tokens"] == list(toks)
    assert g.metadata["tokenizer.ggml.token_type"] == list(types)
    assert g.metadata["tokenizer.ggml.merges"] == list(merges)
    assert g.metadata["llama.vocab_size"] == TINY_VOCAB_SIZE


@pytest.mark.parametrize("qtype", ["BF16", "Q4_K", "Q5_K", "Q6_K"])
def test_other_types_dequantize_like_reference(tmp_path: Path, qtype: str) -> None:
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 512)).astype(np.float32)
    qt = GGMLQuantizationType[qtype]
    if qt == GGMLQuantizationType.BF16:
        raw = gguf.quants.quantize(w, qt)
    else:  # no numpy quantizer for K-quants: random but valid blocks (finite f16 scales)
        block, tsize = gguf.GGML_QUANT_SIZES[qt]
        raw = rng.integers(0, 256, size=(4, 512 // block * tsize), dtype=np.uint8)
        blocks = raw.reshape(-1, tsize)
        # K-quant super-block scales d/dmin are f16 at fixed places; keep them small & finite
        d = np.full((blocks.shape[0],), 0.01, dtype=np.float16).view(np.uint8).reshape(-1, 2)
        if qt == GGMLQuantizationType.Q6_K:
            blocks[:, -2:] = d
        else:
            blocks[:, 0:2] = d
            blocks[:, 2:4] = d
    path = tmp_path / "k.gguf"
    wr = GGUFWriter(str(path), "llama")
    wr.add_tensor("w", raw, raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    ours = read_gguf(path).tensor("w")
    want = gguf.quants.dequantize(raw, qt)
    assert ours.shape == (4, 512) and np.isfinite(ours).all()
    np.testing.assert_array_equal(ours, want)


# ----------------------------------------------------------------- errors


def test_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(EngineError) as e:
        read_gguf(tmp_path / "nope.gguf")
    assert e.value.code == "file_not_found"
    with pytest.raises(EngineError) as e:
        read_gguf(tmp_path)  # a directory
    assert e.value.code == "file_not_found"


def test_bad_magic(tmp_path: Path) -> None:
    p = tmp_path / "bad.gguf"
    data = bytearray(write_tiny_llama(tmp_path / "t.gguf").read_bytes())
    data[:4] = b"GGML"
    p.write_bytes(bytes(data))
    with pytest.raises(EngineError) as e:
        read_gguf(p)
    assert e.value.code == "invalid_gguf" and "magic" in e.value.message
    p.write_bytes(b"hello")
    with pytest.raises(EngineError) as e:
        read_gguf(p)
    assert e.value.code == "invalid_gguf"
    p.write_bytes(b"")
    with pytest.raises(EngineError) as e:
        read_gguf(p)
    assert e.value.code == "invalid_gguf"


def test_bad_version(tmp_path: Path) -> None:
    data = bytearray(write_tiny_llama(tmp_path / "t.gguf").read_bytes())
    for version, word in ((1, "version 1"), (7, "version 7")):
        data[4:8] = struct.pack("<I", version)
        (tmp_path / "v.gguf").write_bytes(bytes(data))
        with pytest.raises(EngineError) as e:
            read_gguf(tmp_path / "v.gguf")
        assert e.value.code == "invalid_gguf" and word in e.value.message
    data[4:8] = struct.pack(">I", 3)
    (tmp_path / "v.gguf").write_bytes(bytes(data))
    with pytest.raises(EngineError) as e:
        read_gguf(tmp_path / "v.gguf")
    assert e.value.code == "invalid_gguf" and "big-endian" in e.value.message


def test_truncated_everywhere(tmp_path: Path) -> None:
    src = write_tiny_llama(tmp_path / "t.gguf")
    data = src.read_bytes()
    g = read_gguf(src)
    cuts = sorted({5, 12, 20, 30, 100, 1000, 5000, g.data_start - 3, g.data_start + 10, len(data) - 1,
                   *range(24, g.data_start, max(1, g.data_start // 40))})
    p = tmp_path / "cut.gguf"
    for n in cuts:
        p.write_bytes(data[:n])
        with pytest.raises(EngineError) as e:
            read_gguf(p)
        assert e.value.code == "invalid_gguf", n
        assert "truncated" in e.value.message or "magic" in e.value.message or "implausible" in e.value.message, \
            (n, e.value.message)


def test_garbage_counts_and_types(tmp_path: Path) -> None:
    src = write_tiny_llama(tmp_path / "t.gguf")
    data = bytearray(src.read_bytes())
    bad = bytearray(data)
    bad[8:16] = struct.pack("<Q", 2**62)  # tensor count
    (tmp_path / "b.gguf").write_bytes(bytes(bad))
    with pytest.raises(EngineError) as e:
        read_gguf(tmp_path / "b.gguf")
    assert e.value.code == "invalid_gguf"
    # first kv: key string then value type; corrupt the value type
    klen = struct.unpack_from("<Q", data, 24)[0]
    bad = bytearray(data)
    bad[32 + klen:36 + klen] = struct.pack("<I", 99)
    (tmp_path / "b.gguf").write_bytes(bytes(bad))
    with pytest.raises(EngineError) as e:
        read_gguf(tmp_path / "b.gguf")
    assert e.value.code == "invalid_gguf" and "value type 99" in e.value.message


def test_random_corruption_never_crashes(tmp_path: Path) -> None:
    """Flipping header bytes gives a GGUFFile or an EngineError, never another exception."""
    src = write_tiny_llama(tmp_path / "t.gguf")
    data = src.read_bytes()
    hdr = read_gguf(src).data_start
    rng = np.random.default_rng(0)
    p = tmp_path / "c.gguf"
    for _ in range(150):
        b = bytearray(data)
        for pos in rng.integers(4, hdr, size=3):
            b[pos] = int(rng.integers(0, 256))
        p.write_bytes(bytes(b))
        try:
            read_gguf(p)
        except EngineError as e:
            assert e.code in ("invalid_gguf", "unsupported_tensor_type")


def _one_tensor_file(path: Path, qt: GGMLQuantizationType, raw: np.ndarray) -> Path:
    wr = GGUFWriter(str(path), "llama")
    wr.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=qt)
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


@pytest.mark.parametrize("qt", [GGMLQuantizationType.Q2_K, GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.I32])
def test_unsupported_tensor_type(tmp_path: Path, qt: GGMLQuantizationType) -> None:
    block, tsize = gguf.GGML_QUANT_SIZES[qt]
    raw = np.zeros((2, 256 // block * tsize), dtype=np.uint8)
    path = _one_tensor_file(tmp_path / "u.gguf", qt, raw)
    with pytest.raises(EngineError) as e:
        read_gguf(path)
    assert e.value.code == "unsupported_tensor_type"
    assert qt.name in e.value.message and "blk.0.attn_q.weight" in e.value.message


def test_unknown_type_id(tmp_path: Path) -> None:
    path = _one_tensor_file(tmp_path / "u.gguf", GGMLQuantizationType.F32, np.zeros((2, 8), dtype=np.uint8))
    data = bytearray(path.read_bytes())
    g = read_gguf(path)
    # the type u32 sits right after name + n_dims + dims; find it from the known layout
    name = b"blk.0.attn_q.weight"
    pos = data.index(name) + len(name) + 4 + 8 * 2
    assert struct.unpack_from("<I", data, pos)[0] == 0
    data[pos:pos + 4] = struct.pack("<I", 250)
    path.write_bytes(bytes(data))
    with pytest.raises(EngineError) as e:
        read_gguf(path)
    assert e.value.code == "unsupported_tensor_type" and "250" in e.value.message
    assert g.tensors[name.decode()].shape == (2, 2)


def test_missing_tensor_lookup(tmp_path: Path) -> None:
    g = read_gguf(write_tiny_llama(tmp_path / "t.gguf"))
    with pytest.raises(EngineError) as e:
        g.tensor("blk.9.attn_q.weight")
    assert e.value.code == "invalid_gguf" and "blk.9.attn_q.weight" in e.value.message


def test_missing_architecture(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "x.gguf", "llama", {}, {"w": (np.ones((2, 32)), "F32")}, tokenizer=False)
    g = read_gguf(path)
    assert g.architecture == "llama"
    g.metadata.pop("general.architecture")
    with pytest.raises(EngineError) as e:
        _ = g.architecture
    assert e.value.code == "invalid_gguf"


def test_metadata_value_types(tmp_path: Path) -> None:
    path = tmp_path / "m.gguf"
    wr = GGUFWriter(str(path), "llama")
    wr.add_uint8("a.u8", 255)
    wr.add_int8("a.i8", -5)
    wr.add_uint16("a.u16", 65535)
    wr.add_int16("a.i16", -300)
    wr.add_int32("a.i32", -70000)
    wr.add_uint64("a.u64", 2**40)
    wr.add_int64("a.i64", -(2**40))
    wr.add_float32("a.f32", 0.5)
    wr.add_float64("a.f64", 1e-300)
    wr.add_bool("a.b", True)
    wr.add_string("a.s", "héllo ▁")
    wr.add_array("a.ai", [1, 2, 3])
    wr.add_array("a.af", [0.25, 1.5])
    wr.add_array("a.ab", [True, False])
    wr.add_array("a.as", ["x", "", "ü"])
    wr.add_tensor("w", np.ones((2, 32), dtype=np.float32))
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    md = read_gguf(path).metadata
    assert md["a.u8"] == 255 and md["a.i8"] == -5 and md["a.u16"] == 65535 and md["a.i16"] == -300
    assert md["a.i32"] == -70000 and md["a.u64"] == 2**40 and md["a.i64"] == -(2**40)
    assert md["a.f32"] == 0.5 and md["a.f64"] == 1e-300 and md["a.b"] is True
    assert md["a.s"] == "héllo ▁"
    assert md["a.ai"] == [1, 2, 3] and md["a.af"] == [0.25, 1.5] and md["a.ab"] == [True, False]
    assert md["a.as"] == ["x", "", "ü"]


@pytest.mark.parametrize("qtype", ["F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_chunked_dequant_bit_identical(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, qtype: str) -> None:
    """Chunk boundaries (7 blocks, a ragged last chunk) change nothing, bit for bit."""
    monkeypatch.setattr(dequant, "_DEQUANT_CHUNK_BLOCKS", 7)
    rng = np.random.default_rng(5)
    qt = GGMLQuantizationType[qtype]
    w = (rng.standard_normal((13, 96)) * 3).astype(np.float32)
    w[0, :32] = 0.0  # an all-zero block
    raw = gguf.quants.quantize(w, qt).view(np.uint8).reshape(13, -1)
    got = dequant.dequantize_raw(raw, qt)
    want = gguf.quants.dequantize(raw, qt).reshape(13, 96)
    assert got.dtype == np.float32 and got.shape == (13, 96) and got.flags.c_contiguous
    assert np.array_equal(got.view(np.uint32), want.astype(np.float32).view(np.uint32))


class GatedHashlib:
    """Stands in for ``gguf_loader.hashlib``: the background hasher (``sha256()`` without data)
    waits in each ``update`` until ``go`` is set, so a test holds the hash where it wants it."""

    def __init__(self) -> None:
        import threading

        self.go = threading.Event()
        self.updates = 0

    def sha256(self, data: bytes | None = None):
        if data is not None:
            return hashlib.sha256(data)
        gate, real = self, hashlib.sha256()

        class Hasher:
            def update(self, chunk) -> None:
                gate.go.wait()
                gate.updates += 1
                real.update(chunk)

            def hexdigest(self) -> str:
                return real.hexdigest()

        return Hasher()


def test_fingerprint_is_hashed_in_the_background(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A file never seen before: reading it does not hash it; the hash runs on a thread, whoever
    needs the fingerprint waits for it; the memo makes the next open know it at once."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "SHA256_MEMO_MIN_BYTES", 0)
    gate = GatedHashlib()
    monkeypatch.setattr(gguf_loader, "hashlib", gate)
    a = write_tiny_llama(tmp_path / "a.gguf", seed=3)
    g = read_gguf(a)
    fut = g.start_fingerprint()
    assert g.start_fingerprint() is fut                    # one hash per file
    assert not fut.done() and g.fingerprint_nowait() is None
    gate.go.set()
    want = hashlib.sha256(a.read_bytes()).hexdigest()
    assert g.fingerprint == want and fut.result() == want
    again = read_gguf(a)
    assert again.start_fingerprint().done() and again.fingerprint_nowait() == want   # from the memo
    assert gate.updates == 1                               # the memo was not re-hashed


def test_close_stops_a_background_hash(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "SHA256_MEMO_MIN_BYTES", 0)
    monkeypatch.setattr(gguf_loader, "HASH_CHUNK_BYTES", 1024)
    gate = GatedHashlib()
    monkeypatch.setattr(gguf_loader, "hashlib", gate)
    g = read_gguf(write_tiny_llama(tmp_path / "a.gguf", seed=4))
    fut = g.start_fingerprint()
    closer = threading.Thread(target=g.close)
    closer.start()
    while not g._closing:  # close() has begun (it waits for the hashing thread)
        closer.join(0.01)
    gate.go.set()
    closer.join()
    with pytest.raises(EngineError) as ei:
        fut.result()
    assert ei.value.code == "invalid_gguf" and "closed" in ei.value.message
    assert not (tmp_path / "cache" / "modelyard" / "sha256").exists()   # no memo of a partial hash


def test_the_background_hash_reads_the_file_it_mapped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fingerprint is the sha256 of the opened file; a file replaced at its path after it
    was opened is not hashed in its place (an error, never another file's digest)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf_loader, "SHA256_MEMO_MIN_BYTES", 0)
    a = tmp_path / "a.gguf"
    write_tiny_llama(a)
    g = read_gguf(a)
    want = hashlib.sha256(a.read_bytes()).hexdigest()
    assert g.fingerprint == want
    g.release_pages()  # the mapping stays readable after its pages are dropped
    assert g.raw(next(iter(g.tensors))).size > 0
    b = tmp_path / "b.gguf"
    write_tiny_llama(b)
    g2 = read_gguf(b)
    os.replace(a, b)  # b's path now names another file (another inode)
    with pytest.raises(EngineError, match="replaced"):
        _ = g2.fingerprint

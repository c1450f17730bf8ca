"""The compact vocabulary: GGUF metadata arrays as StringArray / NumericArray, the tokenizer's
str -> id index, and the tokenizer fingerprint they must leave unchanged."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.paths import GEMMA3_PATH, SMOLLM2_PATH
from worker.engine.errors import EngineError
from worker.engine.loading.gguf_loader import COMPACT_MIN_ITEMS, NumericArray, StringArray, read_gguf
from worker.engine.text.tokenizer import Tokenizer
from worker.engine.text.vocab import VocabIndex

TEXTS = ["a", "", "héllo", "▁the", "日本語", "😀x", "e'", "\u2765", "<0x0A>", "\ud800", "", "z" * 300]

#: Tokenizer.fingerprint of the shipped models, as computed before the vocabulary was compact
#: (commit e9d2009: lists of str, a dict, lists of float/int); KV states saved with it must load.
PINNED = {
    "gemma3": (GEMMA3_PATH, "531919738ca0567c97fe32eae0ea18408fb59473aaef490b2764cd9c16d39080"),
    "smollm2": (SMOLLM2_PATH, "95d17129e075ca670dde7881891b9477d1b437b1801be9ec40c1f8cf63cdf4c3"),
}


# ------------------------------------------------------------------ StringArray

def test_string_array_behaves_like_the_list() -> None:
    a = StringArray.from_strs(TEXTS)
    assert len(a) == len(TEXTS) and list(a) == TEXTS and a == TEXTS and TEXTS == a
    assert [a[i] for i in range(len(TEXTS))] == TEXTS
    assert [a[-i] for i in range(1, len(TEXTS) + 1)] == [TEXTS[-i] for i in range(1, len(TEXTS) + 1)]
    assert a[2:5] == TEXTS[2:5] and a[::-3] == TEXTS[::-3] and a[100:] == []
    assert all(type(x) is str for x in a) and a[1] == "" and a[9] == "\ud800"
    assert a.item_bytes(4) == "日本語".encode() and a.item_bytes(-1) == b"z" * 300
    assert a.byte_lengths().tolist() == [len(t.encode("utf-8", "surrogatepass")) for t in TEXTS]
    assert list(a.iter_bytes()) == [t.encode("utf-8", "surrogatepass") for t in TEXTS]
    assert a.hashes().tolist() == [hash(t) for t in TEXTS]
    assert "日本語" in a and "日本" not in a and a.index("e'") == 6 and a.count("") == 2
    assert a != TEXTS[:-1] and a != [*TEXTS[:-1], "y"] and a != "a" and (a == 3) is False
    assert StringArray.from_strs(TEXTS) == a and StringArray.from_strs([]) == []


@pytest.mark.parametrize("i", [len(TEXTS), -len(TEXTS) - 1, 10**12])
def test_string_array_out_of_range(i: int) -> None:
    a = StringArray.from_strs(TEXTS)
    with pytest.raises(IndexError):
        a[i]
    with pytest.raises(IndexError):
        a.item_bytes(i)


def test_string_array_is_read_only_and_validated() -> None:
    a = StringArray.from_strs(TEXTS)
    with pytest.raises(TypeError):
        a[0] = "b"  # type: ignore[index]
    with pytest.raises(ValueError):
        a.offsets[1] = 0
    with pytest.raises(ValueError):
        StringArray(b"abc", np.array([0, 2]))  # does not end at len(blob)
    with pytest.raises(ValueError):
        StringArray(b"abc", np.array([0, 2, 1, 3]))  # falls
    with pytest.raises(TypeError):
        StringArray.from_strs(["a", 1])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        hash(a)


# ------------------------------------------------------------------ NumericArray

def test_numeric_array_behaves_like_the_list() -> None:
    vals = np.array([0.1, -2.5, 3e38, 0.0, -0.0], dtype=np.float32)
    a = NumericArray(vals)
    want = vals.tolist()
    assert len(a) == 5 and list(a) == want and a == want and want == a and a.tolist() == want
    assert all(type(x) is float for x in a) and a[0] == float(np.float32(0.1)) and a[-1] == 0.0
    assert a[1:3] == want[1:3] and a[::-1] == want[::-1]
    for i in (5, -6):
        with pytest.raises(IndexError):
            a[i]
    b = NumericArray(np.array([True, False, True]))
    assert list(b) == [True, False, True] and all(type(x) is bool for x in b)
    c = NumericArray(np.array([1, -7, 2**31 - 1], dtype="<i4"))
    assert list(c) == [1, -7, 2**31 - 1] and all(type(x) is int for x in c) and c != [1, -7, 0]
    assert NumericArray(np.array([1, 2], dtype=">i4")) == [1, 2]  # byte-swapped input: native copy
    src = np.arange(3)
    d = NumericArray(src)
    src[0] = 9  # a writable input is copied: the array does not change under it
    assert d[0] == 0 and not d.array.flags.writeable
    with pytest.raises(TypeError):
        d[0] = 1  # type: ignore[index]


# ------------------------------------------------------------------ read_gguf

def _gguf_with_arrays(path: Path, arrays: dict[str, list[bytes] | np.ndarray]) -> Path:
    """A tensor-less GGUF v3 whose metadata is ``arrays`` (string items given as raw bytes)."""
    out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, len(arrays)))
    for key, items in arrays.items():
        out += struct.pack("<Q", len(key)) + key.encode() + struct.pack("<I", 9)
        if isinstance(items, np.ndarray):
            out += struct.pack("<IQ", {np.dtype("<f4"): 6, np.dtype("<i4"): 5}[items.dtype], len(items))
            out += items.tobytes()
        else:
            out += struct.pack("<IQ", 8, len(items))
            for b in items:
                out += struct.pack("<Q", len(b)) + b
    path.write_bytes(bytes(out) + b"\0" * 32)
    return path


def test_read_gguf_compact_arrays_as_the_lists_were(tmp_path: Path) -> None:
    n = COMPACT_MIN_ITEMS
    raw = [f"t{i}".encode() for i in range(n - 4)] + [b"", "日本".encode(), b"bad\xff\xfe", b"\xe2\x96"]
    small = [b"x", b"\xc3"]
    scores = np.linspace(-1, 1, n, dtype="<f4")
    md = read_gguf(_gguf_with_arrays(tmp_path / "a.gguf", {
        "tokenizer.ggml.tokens": raw, "other.strings": raw, "small": small, "scores": scores,
        "types": np.arange(n, dtype="<i4"), "few": np.arange(3, dtype="<i4")})).metadata
    want = [b.decode("utf-8", errors="replace") for b in raw]  # what the lists held
    toks = md["tokenizer.ggml.tokens"]
    assert isinstance(toks, StringArray) and toks == want and list(toks) == want
    assert toks[-2] == "bad\ufffd\ufffd" and toks[-1] == "\ufffd" and toks[-5] == f"t{n - 5}"
    assert toks.hashes().tolist() == [hash(t) for t in want]  # computed while reading
    assert isinstance(md["other.strings"], StringArray) and md["other.strings"] == want
    assert md["small"] == ["x", "\ufffd"] and type(md["small"]) is list
    assert isinstance(md["scores"], NumericArray) and md["scores"] == scores.tolist()
    assert md["types"] == list(range(n)) and md["few"] == [0, 1, 2] and type(md["few"]) is list


# ------------------------------------------------------------------ the str -> id index

def test_vocab_index_is_exact_like_a_dict() -> None:
    texts = [t for t in dict.fromkeys(TEXTS) if t] + [chr(0x4E00 + i) for i in range(300)] + [
        "ab", "\u6261", "abcd", "\u6261\u6463", "\U00016261"]  # raw-buffer twins of ASCII pairs
    a = StringArray.from_strs(texts)
    idx = VocabIndex(a)
    for i, t in enumerate(texts):
        assert idx.get(t) == i
    for q in ["", "b", "héllo!", "日本", "ba", "\u6162", "abc", "\ud801", "zz", "z" * 299]:
        assert idx.get(q) is None, q
    assert "ab" in idx and "ba" not in idx and 3 not in idx


def test_vocab_index_with_every_hash_equal_still_exact(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every text hashing alike: a lookup walks one long probe run and tells texts of one length
    apart by their bytes alone."""
    import worker.engine.text.vocab as vocab_module

    texts = [f"w{i:03d}" for i in range(200)] + ["é", "日", "ab", "ba", "\u6261"]
    packed = StringArray.from_strs(texts)
    monkeypatch.setattr(vocab_module, "hash", lambda s: 0, raising=False)
    idx = VocabIndex(StringArray(packed.blob, packed.offsets, hashes=np.zeros(len(texts), dtype=np.int64)))
    assert [idx.get(t) for t in texts] == list(range(len(texts)))
    for q in ["w200", "w19", "w0999", "è", "a", "bb", "\u6262"]:
        assert idx.get(q) is None, q


def test_vocab_index_names_duplicates() -> None:
    texts = ["a", "b", "c", "b", "a", "d"]
    with pytest.raises(EngineError) as ei:
        VocabIndex(StringArray.from_strs(texts))
    assert ei.value.code == "invalid_gguf" and "'b' has ids 1 and 3" in ei.value.message


def test_token_id_of_non_strings_is_none() -> None:
    from tests.worker.test_tokenizer import spm_metadata

    tok = Tokenizer.from_metadata(spm_metadata())
    assert tok.token_id(3) is None and tok.token_id(b"a") is None  # type: ignore[arg-type]
    assert tok.token_id(tok.tokens[5]) == 5


# ------------------------------------------------------------------ the shipped models

@pytest.mark.slow
@pytest.mark.parametrize("model", sorted(PINNED))
def test_fingerprint_pinned_and_vocabulary_compact(model: str) -> None:
    path, fp = PINNED[model]
    md = read_gguf(str(path)).metadata
    tok = Tokenizer.from_metadata(md)
    assert tok.fingerprint == fp
    # the same vocabulary given as plain lists (the old metadata) gives the same tokenizer
    lists = {k: (list(v) if isinstance(v, (StringArray, NumericArray)) else v) for k, v in md.items()}
    again = Tokenizer.from_metadata(lists)
    assert again.fingerprint == fp and again.attrs == tok.attrs
    # no Python container of one object per token is left in the metadata or the tokenizer
    n = tok.n_vocab
    for where, values in (("metadata", md), ("tokenizer", vars(tok))):
        for k, v in values.items():
            assert not (isinstance(v, (list, tuple, dict, set, frozenset)) and len(v) >= n // 2), (where, k)
    assert isinstance(md["tokenizer.ggml.tokens"], StringArray) and tok.tokens is md["tokenizer.ggml.tokens"]
    assert sys.getsizeof(tok.attrs) < 2 * n


@pytest.mark.slow
def test_gemma_lookups_agree_with_a_dict() -> None:
    path, _ = PINNED["gemma3"]
    tok = Tokenizer.from_metadata(read_gguf(str(path)).metadata)
    ref = dict(zip(tok.tokens, range(tok.n_vocab)))
    get = tok._vocab.get  # type: ignore[union-attr]
    assert all(get(t) == i for t, i in ref.items())
    text = Path(__file__).read_text() + "日本語のテキスト ❥ e' 😀 " * 3
    qs = {text[i:i + k] for i in range(len(text)) for k in (1, 2, 3, 5)}
    assert all(get(q) == ref.get(q) for q in qs)

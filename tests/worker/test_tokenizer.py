"""Tokenizer: llama.cpp fixtures on both real models, and unit/property tests on tiny vocabularies.

The tiny vocabularies are GGUF metadata dicts built here (no file needed);
the reference functions below are direct, slow transcriptions of llama.cpp's
``tokenizer_st_partition`` and ``llm_tokenizer_spm`` used as oracles.
"""

from __future__ import annotations

import heapq
import json
import os
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.paths import GEMMA3_PATH, SMOLLM2_PATH
import worker.engine.text.bpe as bpe_module
import worker.engine.text.specials as specials_module
import worker.engine.text.spm as spm_module
from worker.engine.errors import EngineError
from worker.engine.loading.gguf_loader import NumericArray, StringArray
from worker.engine.text.bpe import BYTE_TO_UNICODE
from worker.engine.text.tokenizer import (
    ATTR_CONTROL,
    ATTR_USER_DEFINED,
    IncrementalUTF8Decoder,
    Tokenizer,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    "smollm2": SMOLLM2_PATH,
    "gemma3": GEMMA3_PATH,
}
FIXTURE_NAMES = {
    "smollm2": "smollm2-135m-instruct-q4_1.shared.json",
    "gemma3": "gemma-3-270m-q4_k_m.shared.json",
}


def fixture_path(model: str) -> Path | None:
    """The llama.cpp fixture file: $MODELYARD_FIXTURES or tests/fixtures."""
    dirs = [os.environ.get("MODELYARD_FIXTURES"), ROOT / "tests" / "fixtures"]
    for d in dirs:
        if d and (Path(d) / FIXTURE_NAMES[model]).is_file():
            return Path(d) / FIXTURE_NAMES[model]
    return None


def load_fixture(model: str) -> dict[str, Any]:
    p = fixture_path(model)
    if p is None:
        pytest.fail(f"llama.cpp fixture {FIXTURE_NAMES[model]} not found (set MODELYARD_FIXTURES)")
    return json.loads(p.read_text(encoding="utf-8"))


_META_CACHE: dict[str, dict[str, Any]] = {}


def real_metadata(model: str) -> dict[str, Any]:
    if model not in _META_CACHE:
        path = MODELS[model]
        if not path.is_file():
            pytest.fail(f"model file {path} not fetched (scripts/fetch_models.py)")
        from worker.engine.loading.gguf_loader import read_gguf

        _META_CACHE[model] = read_gguf(str(path)).metadata
    return _META_CACHE[model]


_TOK_CACHE: dict[Any, Tokenizer] = {}


def real_tokenizer(model: str) -> Tokenizer:
    if model not in _TOK_CACHE:
        _TOK_CACHE[model] = Tokenizer.from_metadata(real_metadata(model))
    return _TOK_CACHE[model]


# ============================================================== real models vs llama.cpp

MODES = [("ids_parse_special", False, True), ("ids_plain", False, False), ("ids_add_special", True, True)]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_fixture_tokenize_all_modes(model: str) -> None:
    fx = load_fixture(model)
    tok = real_tokenizer(model)
    assert len(fx["tokenize"]) >= 30
    mismatches = []
    for entry in fx["tokenize"]:
        for key, add_special, parse_special in MODES:
            got = tok.tokenize(entry["text"], add_special=add_special, parse_special=parse_special)
            if got != entry[key]:
                mismatches.append((entry["text"], key, got, entry[key]))
    assert mismatches == []


@pytest.mark.slow
def test_smollm2_missing_bytes_and_unicode_16_characters_as_llama_cpp() -> None:
    """Beyond the shared fixtures (see the file's "about"): a byte the vocabulary lacks
    blocks merges across it and is dropped; letters/numbers new in Unicode 16.0 are not
    letters/numbers to llama.cpp (Unicode 15.1 tables), whatever tokenizers' regex thinks."""
    doc = json.loads((ROOT / "tests" / "fixtures" / "smollm2-tokenize-extra.llamacpp.json").read_text())
    tok = real_tokenizer("smollm2")
    modes = [(False, False), (False, True), (True, False), (True, True)]
    mismatches = []
    for case in doc["cases"]:
        for (add_special, parse_special), want in zip(modes, case["ids"], strict=True):
            got = tok.tokenize(case["text"], add_special=add_special, parse_special=parse_special)
            if got != want:
                mismatches.append((case["text"][:40], add_special, parse_special, got[:20], want[:20]))
    assert len(doc["cases"]) >= 100 and mismatches == []
    assert tok.tokenize(".\x04.", add_special=False) == [30, 30]  # not ".." (950): 0x04 keeps them apart


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_fixture_greedy_prompt_ids(model: str) -> None:
    fx = load_fixture(model)
    tok = real_tokenizer(model)
    for entry in fx["greedy"]:
        assert tok.tokenize(entry["prompt"], add_special=True, parse_special=True) == entry["prompt_ids"]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2", "gemma3"])
def test_fixture_detokenize_round_trips(model: str) -> None:
    fx = load_fixture(model)
    tok = real_tokenizer(model)
    for entry in fx["tokenize"]:
        text = entry["text"]
        assert tok.detokenize(entry["ids_plain"]) == text
        assert tok.detokenize(entry["ids_parse_special"]) == text
        with_bos = entry["ids_add_special"]
        if tok.add_bos:
            assert with_bos[0] == tok.bos_id
            with_bos = with_bos[1:]
        assert tok.detokenize(with_bos) == text
    for entry in fx["greedy"]:
        assert tok.detokenize(entry["ids"]).startswith(entry["text"].removesuffix("<|im_end|>"))


@pytest.mark.slow
def test_real_special_tokens_and_eog() -> None:
    smol = real_tokenizer("smollm2")
    assert smol.model == "gpt2" and smol.pre == "smollm" and not smol.add_bos
    assert smol.tokens[smol.eos_id] == "<|im_end|>"
    assert {smol.tokens[i] for i in smol.eog_ids} >= {"<|im_end|>", "<|endoftext|>"}
    gemma = real_tokenizer("gemma3")
    assert gemma.model == "llama" and gemma.add_bos and not gemma.add_space_prefix
    assert gemma.tokens[gemma.bos_id] == "<bos>"
    assert {gemma.tokens[i] for i in gemma.eog_ids} == {"<eos>", "<end_of_turn>", "</s>"}
    # </s> is user-defined in the file but llama.cpp makes it control (EOG list)
    s = gemma.token_id("</s>")
    assert gemma.attrs[s] & ATTR_CONTROL and gemma.attrs[s] & ATTR_USER_DEFINED
    assert gemma.tokenize("a</s>", add_special=False, parse_special=True)[-1] == s
    assert s not in gemma.tokenize("a</s>", add_special=False, parse_special=False)
    # control tokens render their text only with special=True
    eot = gemma.token_id("<end_of_turn>")
    assert gemma.token_bytes(eot) == b"<end_of_turn>" and gemma.token_bytes(eot, special=False) == b""
    assert gemma.token_bytes(gemma.token_id("<0x41>")) == b"A"


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=60))
def test_real_round_trip_property(text: str) -> None:
    for model in ("smollm2", "gemma3"):
        tok = real_tokenizer(model)
        if tok.model == "gpt2" and any(tok.token_id(BYTE_TO_UNICODE[b]) is None for b in text.encode()):
            # SmolLM2's vocabulary lacks 21 byte tokens (e.g. 0xF1, the lead byte of
            # U+40000..); llama.cpp, like this tokenizer, cannot represent such text
            continue
        # SentencePiece escapes spaces as U+2581, so a literal U+2581 comes back as a space
        # (llama.cpp's llama_escape_whitespace / llama_unescape_whitespace do the same)
        expected = text.replace("\u2581", " ") if tok.model == "llama" else text
        assert tok.detokenize(tok.tokenize(text, add_special=False, parse_special=False)) == expected
        ids = tok.tokenize(text, add_special=False, parse_special=True)
        assert tok.detokenize(ids) == expected


# ============================================================== tiny vocabularies

# "xx<|" (control) and "xx" (user-defined) exercise a shorter special taken where a
# longer one starting at the same position overlaps an earlier split.
SPECIALS_BPE = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>", "<|im", "<ud>", "<ud2>", "xx<|", "xx"]
SPECIAL_TYPES = [3, 3, 3, 3, 3, 4, 4, 3, 4]


def bpe_metadata(**over: Any) -> dict[str, Any]:
    """A byte-level BPE vocabulary: control tokens, two user-defined ones, bytes, a few merges."""
    merges = ["h e", "l l", "he ll", "hell o", "Ġ w", "o r", "Ġw or", "l d", "Ġwor ld", "1 2"]
    tokens = SPECIALS_BPE + [BYTE_TO_UNICODE[b] for b in range(256)]
    for m in merges:
        a, b = m.split(" ")
        tokens.append(a + b)
    types = SPECIAL_TYPES + [1] * (len(tokens) - len(SPECIAL_TYPES))
    md = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "smollm",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.add_bos_token": False,
    }
    md.update(over)
    return md


SPM_PIECES = {
    # piece: score (higher merges first)
    "▁": -1.0, "a": -2.0, "b": -2.0, "c": -2.0, "ab": -3.0, "bc": -3.0, "abc": -1.5, "▁a": -4.0,
    "▁ab": -5.0, "x": -2.0, "xx": -6.0, "xxx": -7.0, "d": -2.0, "da": -8.0, "ad": -8.0,
    ">▁<": -9.0, "▁<": -8.5, ">": -2.0, "<": -2.0,
}


def spm_metadata(**over: Any) -> dict[str, Any]:
    """A SentencePiece-style vocabulary: control tokens, user-defined runs, byte tokens, scored pieces."""
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<start>", "<end>", "\n", "\n\n", "  "]
    types = [3, 3, 3, 3, 3, 3, 4, 4, 4]
    scores = [0.0] * len(tokens)
    for b in range(256):
        tokens.append(f"<0x{b:02X}>")
        types.append(6)
        scores.append(0.0)
    for piece, score in SPM_PIECES.items():
        tokens.append(piece)
        types.append(1)
        scores.append(score)
    md = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.pre": "default",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.scores": scores,
        "tokenizer.ggml.bos_token_id": 2,
        "tokenizer.ggml.eos_token_id": 1,
        "tokenizer.ggml.unknown_token_id": 3,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": False,
    }
    md.update(over)
    return md


@pytest.fixture(scope="module")
def bpe() -> Tokenizer:
    return Tokenizer.from_metadata(bpe_metadata())


@pytest.fixture(scope="module")
def spm() -> Tokenizer:
    return Tokenizer.from_metadata(spm_metadata())


# --- llama.cpp oracles ------------------------------------------------------------


def ref_partition(tok: Tokenizer, text: str, parse_special: bool) -> list[tuple[str | None, int]]:
    """Line-by-line transcription of llama.cpp ``tokenizer_st_partition`` (forward_list of fragments)."""
    frags: list[tuple[str | None, int, int, int]] = [(text, 0, len(text), -1)] if text else []
    order = sorted((i for i in range(tok.n_vocab) if tok.attrs[i] & (ATTR_CONTROL | ATTR_USER_DEFINED | 1)),
                   key=lambda i: (-len(tok.tokens[i].encode()), i))
    for sid in order:
        if not parse_special and tok.attrs[sid] & (ATTR_CONTROL | 1):
            continue
        stext = tok.tokens[sid]
        out = []
        for raw, off, ln, t in frags:
            if raw is None:
                out.append((raw, off, ln, t))
                continue
            while True:
                match = raw.find(stext, off, off + ln)
                if match < 0:
                    out.append((raw, off, ln, -1))
                    break
                if match > off:
                    out.append((raw, off, match - off, -1))
                out.append((None, 0, 0, sid))
                right = match + len(stext)
                if right < off + ln:
                    ln = off + ln - right
                    off = right
                else:
                    break
        frags = out
    return [(raw[off:off + ln], -1) if raw is not None else (None, t) for raw, off, ln, t in frags]


def ref_spm(tok: Tokenizer, text: str) -> list[int]:
    """llama.cpp ``llm_tokenizer_spm_session::tokenize`` on a whole fragment (no word splitting)."""
    text = text.replace(" ", "▁")
    n = len(text)
    if n == 0:
        return []
    sym_n = [1] * n
    prev = list(range(-1, n - 1))
    nxt = list(range(1, n + 1))
    nxt[-1] = -1
    heap: list[tuple[float, int, int, int]] = []

    def add(left: int, right: int) -> None:
        if left == -1 or right == -1:
            return
        t = text[left:left + sym_n[left] + sym_n[right]]
        tid = tok.token_id(t)
        if tid is not None:
            heapq.heappush(heap, (-tok.scores[tid], left, right, len(t)))

    for i in range(1, n):
        add(i - 1, i)
    while heap:
        _, left, right, size = heapq.heappop(heap)
        if sym_n[left] == 0 or sym_n[right] == 0 or sym_n[left] + sym_n[right] != size:
            continue
        sym_n[left] += sym_n[right]
        sym_n[right] = 0
        nxt[left] = nxt[right]
        if nxt[right] >= 0:
            prev[nxt[right]] = left
        add(prev[left], left)
        add(left, nxt[left])
    out = []
    i = 0
    while i != -1:
        piece = text[i:i + sym_n[i]]
        tid = tok.token_id(piece)
        if tid is not None:
            out.append(tid)
        else:
            out.extend(tok.token_id(f"<0x{b:02X}>") for b in piece.encode())
        i = nxt[i]
    return out


def ref_tokenize_spm(tok: Tokenizer, text: str, parse_special: bool) -> list[int]:
    out = []
    prev_special = True
    for raw, tid in ref_partition(tok, text, parse_special):
        if raw is None:
            out.append(tid)
            prev_special = True
        else:
            out.extend(ref_spm(tok, (" " if tok.add_space_prefix and prev_special else "") + raw))
            prev_special = False
    return out


# --- special-token partition ------------------------------------------------------


def test_parse_special_splits_control_tokens(bpe: Tokenizer) -> None:
    ids = bpe.tokenize("<|im_start|>hello<|im_end|>", add_special=False, parse_special=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert bpe.detokenize(ids[1:-1]) == "hello"
    plain = bpe.tokenize("<|im_start|>hello<|im_end|>", add_special=False, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert bpe.detokenize(plain) == "<|im_start|>hello<|im_end|>"


def test_user_defined_split_even_without_parse_special(bpe: Tokenizer) -> None:
    ud = bpe.token_id("<ud>")
    assert bpe.tokenize("x<ud>y", add_special=False, parse_special=False)[1] == ud
    assert ud in bpe.tokenize("x<ud>y", add_special=False, parse_special=True)


def test_longest_special_first(bpe: Tokenizer) -> None:
    # "<|im" is itself a control token; the longer "<|im_end|>" wins
    assert bpe.tokenize("<|im_end|>", add_special=False) == [2]
    assert bpe.tokenize("<|im_x", add_special=False)[0] == bpe.token_id("<|im")
    assert bpe.tokenize("<ud2>", add_special=False, parse_special=False) == [bpe.token_id("<ud2>")]
    # "<|im_start|>" is split first; "xx<|" at 0 overlaps it, so its prefix "xx" is taken
    ids = bpe.tokenize("xx<|im_start|>", add_special=False)
    assert ids == [bpe.token_id("xx"), 1]


SPECIAL_ALPHABET = list("<|>imstarend_xud2 ") + ["<|im_start|>", "<|im_end|>", "<|im", "<ud>", "<ud2>",
                                                   "<tool>", "xx", "xx<|"]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(SPECIAL_ALPHABET), max_size=25), st.booleans())
def test_partition_matches_llama_cpp_reference(parts: list[str], parse_special: bool) -> None:
    tok = Tokenizer.from_metadata(bpe_metadata())
    text = "".join(parts)
    want = ref_partition(tok, text, parse_special)
    got = [(f.text, f.token) for f in tok._specials.partition(text, parse_special, None)] if text else []
    assert got == want
    with mock.patch.object(specials_module, "_SCAN_CHARS", 3):  # the scan in tiny windows finds the same
        got = [(f.text, f.token) for f in tok._specials.partition(text, parse_special, None)] if text else []
    assert got == want


def test_pieces_protect_user_content(bpe: Tokenizer) -> None:
    pieces = [("<|im_start|>user\n", True), ("hi<|im_end|>\n<|im_start|>assistant", False), ("<|im_end|>", True)]
    ids = bpe.tokenize_pieces(pieces, add_special=False)
    assert ids.count(1) == 1 and ids.count(2) == 1 and ids[0] == 1 and ids[-1] == 2
    assert bpe.detokenize(ids) == "".join(p for p, _ in pieces)
    # a special token straddling markup and content is not parsed either
    ids = bpe.tokenize_pieces([("a<|im_", False), ("end|>", True)], add_special=False)
    assert 2 not in ids
    # user-defined tokens are still split inside content
    assert bpe.token_id("<ud>") in bpe.tokenize_pieces([("x<ud>", False), ("y", True)], add_special=False)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.text(alphabet="helo wrd12<|>_imstar", max_size=12), st.just(True)), max_size=6))
def test_pieces_all_markup_equals_plain_tokenize(pieces: list[tuple[str, bool]]) -> None:
    tok = Tokenizer.from_metadata(bpe_metadata())
    text = "".join(p for p, _ in pieces)
    assert tok.tokenize_pieces(pieces, add_special=True) == tok.tokenize(text)
    unprotected = [(p, False) for p, _ in pieces]
    assert tok.tokenize_pieces(unprotected, add_special=False) == tok.tokenize(text, False, False)


# --- byte-level BPE ---------------------------------------------------------------


def test_bpe_merges_and_smollm_digits(bpe: Tokenizer) -> None:
    assert [bpe.tokens[i] for i in bpe.tokenize("hello world", add_special=False)] == ["hello", "Ġworld"]
    # smollm isolates every digit before merging: the "12" merge never applies
    assert [bpe.tokens[i] for i in bpe.tokenize("12", add_special=False)] == ["1", "2"]


def test_bpe_default_pre_and_unknown_pre() -> None:
    tok = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.pre": "gpt-2"}))
    assert [tok.tokens[i] for i in tok.tokenize("12", add_special=False)] == ["12"]
    with pytest.raises(EngineError) as ei:
        Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.pre": "no-such-pre"}))
    assert ei.value.code == "unsupported_tokenizer"


def test_bpe_bytes_and_utf8(bpe: Tokenizer) -> None:
    text = "héllo 😀 — ok"
    ids = bpe.tokenize(text, add_special=False)
    assert bpe.detokenize(ids) == text
    assert b"".join(bpe.token_bytes(i) for i in ids) == text.encode()


def test_bos_eos_flags() -> None:
    tok = Tokenizer.from_metadata(bpe_metadata(**{"tokenizer.ggml.add_bos_token": True,
                                                  "tokenizer.ggml.add_eos_token": True}))
    ids = tok.tokenize("he", add_special=True)
    assert ids[0] == 1 and ids[-1] == 2
    assert tok.tokenize("he", add_special=False) == [tok.token_id("he")]
    assert tok.tokenize("", add_special=True) == [1, 2]


# --- SentencePiece-style ------------------------------------------------------------


def test_spm_highest_score_then_leftmost(spm: Tokenizer) -> None:
    # "abc" (-1.5) beats "ab"/"bc" (-3): but merges are pairwise, "ab" and "bc"
    # tie at -3 -> leftmost "ab" first, then "ab"+"c" = "abc"
    assert [spm.tokens[i] for i in spm.tokenize("abc", add_special=False)] == ["abc"]
    # "xxx": "xx" at 0 (leftmost) merges first, then "xx"+"x" -> "xxx"
    assert [spm.tokens[i] for i in spm.tokenize("xxx", add_special=False)] == ["xxx"]
    # "dad": "da" and "ad" tie -> leftmost "da", leaving "d"
    assert [spm.tokens[i] for i in spm.tokenize("dad", add_special=False)] == ["da", "d"]


def test_spm_spaces_and_byte_fallback(spm: Tokenizer) -> None:
    ids = spm.tokenize("ab é", add_special=False)
    assert [spm.tokens[i] for i in ids] == ["ab", "▁", "<0xC3>", "<0xA9>"]
    assert spm.detokenize(ids) == "ab é"
    assert spm.tokenize("ab", add_special=True)[0] == spm.bos_id


def test_spm_add_space_prefix_after_specials() -> None:
    tok = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.add_space_prefix": True}))
    assert [tok.tokens[i] for i in tok.tokenize("ab", add_special=False)] == ["▁ab"]
    ids = tok.tokenize("<start>ab<end>a", add_special=False)
    assert [tok.tokens[i] for i in ids] == ["<start>", "▁ab", "<end>", "▁a"]


def test_spm_user_defined_runs(spm: Tokenizer) -> None:
    ids = spm.tokenize("a\n\n\nb  c", add_special=False, parse_special=False)
    assert [spm.tokens[i] for i in ids] == ["a", "\n\n", "\n", "b", "  ", "c"]


@settings(max_examples=400, deadline=None)
@given(st.text(alphabet="abcxd ><\né", max_size=40), st.booleans())
def test_spm_matches_llama_cpp_reference(text: str, parse_special: bool) -> None:
    """Word splitting + memo give exactly llama.cpp's whole-fragment result (">▁<" spans words),
    also when a long text is split into chunks (here: at every word boundary)."""
    tok = Tokenizer.from_metadata(spm_metadata())
    want = ref_tokenize_spm(tok, text, parse_special)
    assert tok.tokenize(text, add_special=False, parse_special=parse_special) == want
    with mock.patch.object(spm_module, "_CHUNK_CHARS", 1):
        assert tok.tokenize(text, add_special=False, parse_special=parse_special) == want
    assert tok.detokenize(tok.tokenize(text, add_special=False, parse_special=False)) == text


# --- attributes, end-of-generation, pieces ----------------------------------------------


def test_eog_detection_by_text() -> None:
    md = bpe_metadata()
    md["tokenizer.ggml.tokens"] = md["tokenizer.ggml.tokens"] + ["<end_of_turn>", "<fim_pad>"]
    md["tokenizer.ggml.token_type"] = md["tokenizer.ggml.token_type"] + [1, 1]
    tok = Tokenizer.from_metadata(md)
    eot, pad = tok.token_id("<end_of_turn>"), tok.token_id("<fim_pad>")
    assert tok.eot_id == tok.token_id("<|im_end|>")  # first eot-like text of llama.cpp's list present
    assert {0, 2, eot, pad} <= tok.eog_ids
    assert tok.attrs[eot] & ATTR_CONTROL  # normal -> control, as llama.cpp overrides
    assert tok.is_eog(2) and not tok.is_eog(1)


def test_token_bytes_by_type(spm: Tokenizer) -> None:
    assert spm.token_bytes(spm.token_id("<start>")) == b"<start>"
    assert spm.token_bytes(spm.token_id("<start>"), special=False) == b""
    assert spm.token_bytes(spm.token_id("\n\n"), special=False) == b"\n\n"  # user-defined always
    assert spm.token_bytes(spm.token_id("▁a")) == b" a"
    assert spm.token_bytes(spm.token_id("<0xFF>")) == b"\xff"
    for bad in (-1, spm.n_vocab, "3", 2.0, True):
        with pytest.raises(EngineError) as ei:
            spm.token_bytes(bad)  # type: ignore[arg-type]
        assert ei.value.code == "invalid_token"
    with pytest.raises(EngineError):
        spm.detokenize([0, 10**9])


def test_invalid_metadata() -> None:
    for md, code in [
        ({}, "invalid_gguf"),
        (bpe_metadata(**{"tokenizer.ggml.model": "bert"}), "unsupported_tokenizer"),
        (bpe_metadata(**{"tokenizer.ggml.tokens": ["a", "a"], "tokenizer.ggml.token_type": [1, 1]}), "invalid_gguf"),
        (bpe_metadata(**{"tokenizer.ggml.token_type": [1]}), "invalid_gguf"),
        (bpe_metadata(**{"tokenizer.ggml.merges": None}), "invalid_gguf"),
        (spm_metadata(**{"tokenizer.ggml.scores": [0.0]}), "invalid_gguf"),
        (spm_metadata(**{"tokenizer.ggml.bos_token_id": 10**6, "tokenizer.ggml.tokens": ["a"] * 1}), "invalid_gguf"),
    ]:
        with pytest.raises(EngineError) as ei:
            Tokenizer.from_metadata(md)
        assert ei.value.code == code, md.get("tokenizer.ggml.model")


def test_vocabulary_read_paths_agree() -> None:
    """The fast paths of ``from_metadata`` (the loader's compact tokens and scores used as read,
    types converted in numpy), plain lists, and the per-item ones (an empty token text, integer
    scores, non-int types) give the same tokenizer; a duplicate names both of its ids."""
    base = spm_metadata()
    n = len(base["tokenizer.ggml.tokens"])
    compact = {**base, "tokenizer.ggml.tokens": StringArray.from_strs(base["tokenizer.ggml.tokens"]),
               "tokenizer.ggml.scores": NumericArray(np.array(base["tokenizer.ggml.scores"], dtype=np.float64)),
               "tokenizer.ggml.token_type": NumericArray(np.array(base["tokenizer.ggml.token_type"], dtype=np.int32))}
    fast = Tokenizer.from_metadata(compact)
    assert fast.tokens is compact["tokenizer.ggml.tokens"] and fast.scores is compact["tokenizer.ggml.scores"]
    lists = Tokenizer.from_metadata(base)
    assert lists.tokens == base["tokenizer.ggml.tokens"] and lists.scores == base["tokenizer.ggml.scores"]
    assert lists.attrs == fast.attrs and lists.fingerprint == fast.fingerprint
    slow = Tokenizer.from_metadata(spm_metadata(**{
        "tokenizer.ggml.scores": [int(x) if x == int(x) else x for x in base["tokenizer.ggml.scores"]] + [0.0],
        "tokenizer.ggml.token_type": [float(t) for t in base["tokenizer.ggml.token_type"]]}))
    assert slow.scores == fast.scores and all(type(x) is float for x in slow.scores) and len(slow.scores) == n
    assert slow.attrs == fast.attrs and slow.fingerprint == fast.fingerprint
    empty = Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.tokens": base["tokenizer.ggml.tokens"][:-1] + [""]}))
    assert empty.tokens[-1] == f"[EMPTY_{n - 1}]" and empty.token_id(f"[EMPTY_{n - 1}]") == n - 1
    dup = base["tokenizer.ggml.tokens"][:-1] + [base["tokenizer.ggml.tokens"][100]]
    with pytest.raises(EngineError) as ei:
        Tokenizer.from_metadata(spm_metadata(**{"tokenizer.ggml.tokens": dup}))
    assert ei.value.code == "invalid_gguf" and f"has ids 100 and {n - 1}" in ei.value.message


def test_tokenize_rejects_non_string(bpe: Tokenizer) -> None:
    with pytest.raises(EngineError) as ei:
        bpe.tokenize(b"bytes")  # type: ignore[arg-type]
    assert ei.value.code == "invalid_params"


# --- incremental UTF-8 decoding -------------------------------------------------------


def test_incremental_decoder_never_emits_half_characters() -> None:
    data = "aé😀€z".encode()
    dec = IncrementalUTF8Decoder()
    out = []
    for b in data:
        s = dec.feed(bytes([b]))
        assert "\ufffd" not in s
        out.append(s)
    assert "".join(out) + dec.flush() == "aé😀€z"
    dec = IncrementalUTF8Decoder()
    assert dec.feed(b"a\xf0\x9f") == "a"
    assert dec.flush() == "\ufffd"


#: One name per distinct row of the pre-tokenizer table.
PRE_ROWS = {row: name for name, row in reversed(list(bpe_module._PRE_TOKENIZERS.items()))}
CUT_ALPHABET = ["a", "b", "Z", " ", "  ", "\n", "\r\n", "\t", "1", "23", "'s", "'", ".", ",", "é", "中", "ß", "-"]


@pytest.mark.slow
@settings(max_examples=120, deadline=None)
@given(st.lists(st.sampled_from(CUT_ALPHABET), max_size=40))
def test_long_texts_in_chunks_give_the_ids_of_the_whole_on_every_pre_tokenizer(parts: list[str]) -> None:
    """A long fragment is encoded in chunks cut at a space between ASCII letters (_CUT): on
    every row of the pre-tokenizer table (SmolLM2's vocabulary and merges) the chunks'
    ids, concatenated, are those of one encode of the whole text."""
    text = "".join(parts)
    for row, name in PRE_ROWS.items():
        key = ("chunks", name)
        if key not in _TOK_CACHE:
            _TOK_CACHE[key] = Tokenizer.from_metadata({**real_metadata("smollm2"), "tokenizer.ggml.pre": name})
        tok = _TOK_CACHE[key]
        whole: list[int] = []
        tok._bpe.keep_ids(tok._bpe.hf.encode(text, add_special_tokens=False).ids, whole)
        chunked: list[int] = []
        with mock.patch.multiple(bpe_module, _GIL_FREE_CHARS=0, _CHUNK_CHARS=1):
            tok._bpe.ids(text, chunked)
        assert chunked == whole, (name, row.regexes)

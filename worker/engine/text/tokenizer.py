"""Tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata alone.

Reproduces llama.cpp's ``src/llama-vocab.cpp`` (``llama_vocab::impl::load``,
``tokenize``, ``tokenizer_st_partition``, ``token_to_piece``) for the two
vocabulary types this project serves:

* ``tokenizer.ggml.model == "gpt2"`` -- byte-level BPE (SmolLM2, Qwen2, Llama 3,
  ...). The BPE core is Hugging Face ``tokenizers`` (a ``BPE`` model assembled
  from the GGUF vocab and merges), fed by the pre-tokenizer regexes that
  llama.cpp uses for the ``tokenizer.ggml.pre`` name (``_PRE_TOKENIZERS``),
  then the GPT-2 byte -> unicode map.
* ``tokenizer.ggml.model == "llama"`` -- SentencePiece-style merges by token
  score with ``<0xXX>`` byte fallback (Gemma). Implemented here (see
  ``Tokenizer._spm_word``), not with ``tokenizers``: the GGUF has no merge
  list, only per-token scores, and llama.cpp's ``llm_tokenizer_spm`` merges the
  adjacent pair whose *concatenation* has the highest score (leftmost on ties).
  A ``tokenizers`` BPE model ranks merges per (left, right) *pair*, so a
  derived merge list orders two overlapping splits of one token differently
  from llama.cpp, and deriving ~all splits of 262,144 tokens costs seconds at
  load. The own implementation is exact and, with a per-word memo (words are
  split only where no vocabulary token can span the boundary), fast enough:
  see ``scripts/bench_tokenizer.py``.

Two llama.cpp details the ``tokenizers`` BPE would otherwise miss (found by fuzzing
against llama.cpp's ``llama_tokenize``, 1.1 M code points and ~8,000 texts): a byte
the vocabulary lacks is a symbol that blocks merges across it and is then dropped
(``_init_bpe``), and the split regexes use llama.cpp's Unicode 15.1 categories, not
the regex engine's newer tables (``_as_llama_unicode``).

Special tokens (control, user-defined and unknown token types) are split out
of the text before the model runs, longest text first, exactly like llama.cpp's
``tokenizer_st_partition``; with ``parse_special=False`` only user-defined
tokens are split out (Gemma has 165: runs of newlines, spaces, tabs, HTML tags).

Token attributes follow llama.cpp's ``llama_token_attr`` bit flags, including
its load-time fix-ups: tokens whose text is on llama.cpp's end-of-turn /
end-of-generation / fill-in-the-middle lists become control tokens (that is why
Gemma's user-defined ``</s>`` behaves as control), control tokens whose text
contains ``unused`` also get the unused flag.

Not reproduced: the per-model LSTRIP/RSTRIP attributes llama.cpp sets by model
name (phi-3, jina, modern-bert), and the other vocabulary types (WPM, UGM,
RWKV, PLaMo-2) -- loading such a file raises ``EngineError("unsupported_tokenizer")``.
"""

from __future__ import annotations

import codecs
import hashlib
import heapq
import struct
import numbers
import os
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import EngineError
from ..loading.gguf_loader import NumericArray, StringArray

# tokenizers' rayon pool off (one text at a time; no oversubscription, no fork warnings);
# encode_batch is used for its GIL release alone (Tokenizer._hf_ids)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Fragments at least this long (chars) are tokenized with the GIL released.
_GIL_FREE_CHARS = 4096

#: Special-token texts are searched for in windows of this many chars (``Tokenizer._partition``).
_SCAN_CHARS = 1 << 18

#: Longer fragments are encoded in chunks of about this many chars (``Tokenizer._hf_ids``).
_CHUNK_CHARS = 1 << 16

#: Where a long fragment may be cut: at a space between two ASCII letters. No regex of the
#: pre-tokenizer table can match a letter followed by a space (letters are matched as
#: ``[^\r\n\p{L}\p{N}]?\p{L}+`` / `` ?\p{L}+`` or contractions, spaces only in all-space or
#: space-prefixed matches), so every row splits there, and neither side of the cut is seen
#: by a lookahead (``\s+(?!\S)`` needs whitespace before the cut): the ids of the whole
#: fragment are the ids of its chunks, concatenated. tests/worker/test_tokenizer.py checks
#: this on every row of the table. A new row must keep it.
_CUT = re.compile(r"[A-Za-z] [A-Za-z]")

__all__ = [
    "ATTR_UNDEFINED",
    "ATTR_UNKNOWN",
    "ATTR_UNUSED",
    "ATTR_NORMAL",
    "ATTR_CONTROL",
    "ATTR_USER_DEFINED",
    "ATTR_BYTE",
    "IncrementalUTF8Decoder",
    "Tokenizer",
]

# llama.h: enum llama_token_attr (bit flags)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

# llama.h: enum llama_token_type (the values stored in tokenizer.ggml.token_type)
_TYPE_TO_ATTR = {
    0: ATTR_UNDEFINED,  # LLAMA_TOKEN_TYPE_UNDEFINED
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

_SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
_PARSE_ONLY_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # split out only with parse_special

_SPM_SPACE = "\u2581"  # LOWER ONE EIGHTH BLOCK, SentencePiece's escaped space

# --- pre-tokenizer regexes (llama-vocab.cpp, llm_tokenizer_bpe constructor) ---------------

_RE_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
_RE_LLAMA3 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_RE_QWEN2 = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Letters, numbers and punctuation that Unicode 16.0 added (computed from unicodedata2
# 15.1.0 vs 16.0.0 by category L*/N*/P*). llama.cpp's unicode-data.cpp is generated from
# Unicode 15.1, so to it these code points are none of \p{L}, \p{N}, \p{P}; tokenizers'
# regex engine (Oniguruma, Unicode 16 tables in tokenizers 0.23) would split them as
# letters/numbers. ``_as_llama_unicode`` takes them out of those classes.
_UNICODE_16_ADDED = {
    "L": r"\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D4A}-\x{10D65}"
         r"\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}"
         r"\x{113B7}\x{113D1}\x{113D3}\x{11BC0}-\x{11BE0}\x{13460}-\x{143FA}\x{16100}-\x{1611D}"
         r"\x{16D40}-\x{16D6C}\x{18CFF}\x{1E5D0}-\x{1E5ED}\x{1E5F0}",
    "N": r"\x{10D40}-\x{10D49}\x{116D0}-\x{116E3}\x{11BF0}-\x{11BF9}\x{16130}-\x{16139}\x{16D70}-\x{16D79}"
         r"\x{1CCF0}-\x{1CCF9}\x{1E5F1}-\x{1E5FA}",
    "P": r"\x{1B4E}-\x{1B4F}\x{1B7F}\x{10D6E}\x{113D4}-\x{113D5}\x{113D7}-\x{113D8}\x{11BE1}"
         r"\x{16D6D}-\x{16D6F}\x{1E5FF}",
}


def _as_llama_unicode(regex: str) -> str:
    r"""``regex`` with ``\p{L}``, ``\p{N}``, ``\p{P}`` narrowed to llama.cpp's Unicode 15.1
    (Oniguruma class intersection; valid inside and outside brackets)."""
    return re.sub(r"\\p\{([LNP])\}", lambda m: rf"[\p{{{m[1]}}}&&[^{_UNICODE_16_ADDED[m[1]]}]]", regex)


@dataclass(frozen=True)
class _PreTokenizer:
    """One row of llama.cpp's pre-tokenizer table.

    ``regexes`` are applied in order, each splitting the pieces of the previous
    one (llama.cpp ``unicode_regex_split``); unmatched text stays a piece.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is already a token is emitted whole (llama3)
    add_bos: bool = False  # default of add_bos_token when the GGUF lacks the key


_PRE_DEFAULT = _PreTokenizer(
    (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
)
_PRE_GPT2 = _PreTokenizer((_RE_GPT2,))
_PRE_SMOLLM = _PreTokenizer((r"\p{N}", _RE_GPT2))  # every digit isolated, then GPT-2
_PRE_LLAMA3 = _PreTokenizer((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_QWEN2 = _PreTokenizer((_RE_QWEN2,))

# tokenizer.ggml.pre -> pre-tokenizer (llama-vocab.cpp, llama_vocab::impl::load)
_PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PRE_DEFAULT,
    **dict.fromkeys(
        ["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de",
         "a.x-4.0", "mellum", "modern-bert", "exaone4", "mpt", "olmo", "jais", "trillion",
         "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe"],
        _PRE_GPT2,
    ),
    **dict.fromkeys(
        ["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b",
         "mellum2"],
        _PRE_SMOLLM,
    ),
    **dict.fromkeys(
        ["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0",
         "lfm2", "jina-v5-nano", "dbrx", "smaug-bpe"],
        _PRE_LLAMA3,
    ),
    **dict.fromkeys(
        ["qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez", "stablelm2", "hunyuan",
         "solar-open"],
        _PRE_QWEN2,
    ),
}
# dbrx/smaug use the llama3 regex but not ignore_merges/add_bos in llama.cpp
_PRE_TOKENIZERS["dbrx"] = _PRE_TOKENIZERS["smaug-bpe"] = _PreTokenizer((_RE_LLAMA3,))

# --- llama.cpp's text-based special-token detection (llama_vocab::impl::load) -------------

_EOT_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|end_of_text|>",
    "<EOT>", "_<EOT>", "[EOT]", "<｜end▁of▁sentence｜>", "<end_of_utterance>",
)
_EOM_TEXTS = ("<|eom_id|>",)
_FIM_PRE_TEXTS = ("<|fim_prefix|>", "<fim-prefix>", "<fim_prefix>", "<｜fim▁begin｜>", "<PRE>",
                  "▁<PRE>", "<|code_prefix|>", "<|prefix|>")
_FIM_SUF_TEXTS = ("<|fim_suffix|>", "<fim-suffix>", "<fim_suffix>", "<｜fim▁hole｜>", "<SUF>",
                  "▁<SUF>", "<|code_suffix|>", "<|suffix|>")
_FIM_MID_TEXTS = ("<|fim_middle|>", "<fim-middle>", "<fim_middle>", "<｜fim▁end｜>", "<MID>",
                  "▁<MID>", "<|code_middle|>", "<|middle|>")
_FIM_PAD_TEXTS = ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")
_FIM_REP_TEXTS = ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")
_FIM_SEP_TEXTS = ("<|file_sep|>",)
# Texts that end generation (special_eog_ids), besides eos/eot/eom and fim pad/rep/sep.
EOG_TEXTS = (
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>",
    "<end_of_turn>", "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]",
    "<|end_of_text|>", "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
    "<｜end▁of▁sentence｜>", "[e~[",
)


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (``unicode.cpp``)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1)
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_BYTE_TO_UNICODE = _bytes_to_unicode()
_UNICODE_TO_BYTE = {c: b for b, c in _BYTE_TO_UNICODE.items()}


def _trie_regex(strings: Iterable[str]) -> str:
    """A regex matching the longest of ``strings`` that starts at the current position.

    The alternation is built as a character trie with the "stop here" branch
    last, so backtracking returns the longest string (two branches of one node
    cannot both match: they start with different characters).
    """
    trie: dict[str, Any] = {}
    for s in strings:
        node = trie
        for ch in s:
            node = node.setdefault(ch, {})
        node[""] = True

    def build(node: dict[str, Any]) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch != ""]
        terminal = "" in node
        if not alts:
            return ""
        if len(alts) == 1 and not terminal:
            return alts[0]
        return "(?:" + "|".join(alts) + ("|" if terminal else "") + ")"

    return build(trie)


#: A text's key in :class:`_VocabIndex`: ``hash(text) ^ (len(text) << _LEN_SHIFT)`` (int64).
_LEN_SHIFT = 40


class _VocabIndex:
    """Token text -> id over a :class:`StringArray`, without a ``str`` object per token.

    An open-addressing table (linear probing, at most a quarter full: ~1.2 probes a hit, ~1.4
    a miss; half full made cold SentencePiece tokenizing of base64 text ~25% slower) of int32
    ids, keyed by the text's Python ``hash()`` (``StringArray.hashes``: salted per process, so
    built at load) mixed with its length in characters. A lookup computes the query's key, walks its probe
    sequence and, where a stored key is equal, compares the UTF-8 bytes, so the answer is
    exactly a dict's. (The length is mixed in because CPython hashes a str's internal buffer:
    the 2-character ``"e'"`` and the 1-character ``"\u2765"`` hash alike, and ASCII pairs
    against single CJK characters are frequent in SentencePiece lookups.) Memory: 4 bytes per
    slot (16-32 per token) and an 8-byte key per token (the StringArray's cached hashes are
    dropped once the keys exist), where a ``dict`` of ``str`` keys and ``int`` values costs ~60
    bytes per token besides the ``str`` objects. A lookup costs ~3x a ``dict.get``.
    """

    __slots__ = ("get", "_table", "_keys")

    def __init__(self, texts: StringArray) -> None:
        """Raises: EngineError("invalid_gguf") if two texts are equal (names both ids)."""
        n = len(texts)
        # characters = bytes that are not UTF-8 continuation bytes (10xxxxxx), summed per text
        # (reduceat over a sentinel-padded array; an empty text's sum is forced to 0). No
        # temporary is much larger than the blob: the engine loads on a thread, and glibc keeps
        # the top of a thread's heap resident after a free (malloc_trim does not trim it)
        lead = (np.frombuffer(texts.blob, dtype=np.uint8) & 0xC0) != 0x80
        lead = np.append(lead, False).view(np.uint8)
        n_chars = np.add.reduceat(lead, texts.offsets[:-1].astype(np.intp), dtype=np.int64) if n else np.zeros(0, np.int64)
        n_chars[texts.byte_lengths() == 0] = 0
        del lead
        keys = texts.hashes() ^ (n_chars << _LEN_SHIFT)
        keys.flags.writeable = False
        texts.drop_hashes()  # the keys replace them
        size = 8
        while size < 4 * n:
            size *= 2
        mask = size - 1
        table = np.full(size, -1, dtype=np.int32)
        # linear probing in rounds: a key goes to the first free slot of home, home+1, ...;
        # a slot once taken stays taken, so every slot a key skipped is occupied at lookup
        # (int32 throughout: ids < n and slots < size fit, and the temporaries stay small)
        pending = np.arange(n, dtype=np.int32)
        slot = (keys & mask).astype(np.int32)
        while len(pending):
            free = table[slot] < 0
            cand, cand_slot = pending[free], slot[free]
            table[cand_slot] = cand  # several keys for one slot: one of them lands, read back below
            lost = np.ones(len(pending), dtype=bool)
            lost[np.flatnonzero(free)[table[cand_slot] == cand]] = False
            del free, cand, cand_slot
            pending, slot = pending[lost], (slot[lost] + 1) & mask
            del lost
        del pending, slot
        # equal texts have equal keys: compare the bytes within each (rare) equal-key run;
        # like a scan in id order, name the duplicate whose second id is smallest
        order = np.argsort(keys, kind="stable")  # ids ascending within a run
        sk = keys[order]
        same = np.flatnonzero(sk[1:] == sk[:-1])
        del sk
        dup: tuple[int, int] | None = None
        runs: list[list[int]] = []
        last = -2
        for k in same.tolist():
            if k != last + 1:
                runs.append([int(order[k])])
            runs[-1].append(int(order[k + 1]))
            last = k
        for ids in runs:
            for k, b in enumerate(ids[1:], 1):
                a = next((a for a in ids[:k] if texts.item_bytes(a) == texts.item_bytes(b)), None)
                if a is not None and (dup is None or b < dup[1]):
                    dup = (a, b)
        if dup is not None:
            raise EngineError("invalid_gguf", f"duplicate token in vocabulary: {texts[dup[0]]!r} has ids "
                              f"{dup[0]} and {dup[1]}")
        self._table, self._keys = table, keys
        # the ignores: numpy types ndarray's buffer protocol for Python >= 3.12 only
        self.get = self._getter(memoryview(table), memoryview(keys),  # type: ignore[arg-type]
                                mask, texts.blob, memoryview(texts.offsets))  # type: ignore[arg-type]

    @staticmethod
    def _getter(slots: memoryview, keys: memoryview, mask: int, blob: bytes, off: memoryview) -> Any:
        startswith = blob.startswith

        def get(text: str) -> int | None:
            """The id of the token whose text is exactly ``text``, else None."""
            h = hash(text) ^ (len(text) << _LEN_SHIFT)
            i = h & mask
            t = slots[i]
            while t >= 0:
                if keys[t] == h:
                    b = text.encode("utf-8", "surrogatepass")
                    a = off[t]
                    if off[t + 1] - a == len(b) and startswith(b, a):
                        return t
                i = (i + 1) & mask
                t = slots[i]
            return None

        return get

    def __contains__(self, text: object) -> bool:
        return isinstance(text, str) and self.get(text) is not None

    @property
    def nbytes(self) -> int:
        """Bytes of the table and the keys."""
        return int(self._table.nbytes + self._keys.nbytes)


class _Fragment:
    __slots__ = ("text", "token")

    def __init__(self, text: str | None, token: int) -> None:
        self.text = text
        self.token = token


class Tokenizer:
    """Text <-> token ids for one GGUF vocabulary (see the module docstring).

    Build with :meth:`from_metadata`. Token ids are ``int`` in ``[0, n_vocab)``.

    The per-token tables hold no Python object per token (Gemma 3's 262,144 tokens: ~9 MiB
    where lists, a dict and their ``str``/``float``/``int`` objects took ~50 MiB):

    Attributes:
        tokens: the token texts, a read-only :class:`StringArray` (``tokens[i]`` is a ``str``);
            the metadata's own array when it had no empty text.
        scores: ``NumericArray`` ``[n_vocab]`` of Python floats (float32 as read, float64 when
            given as a list); zeros when the GGUF has none.
        attrs: ``bytearray`` ``[n_vocab]`` of ``ATTR_*`` bit flags.
        The str -> id lookup (:meth:`token_id`) is a ``_VocabIndex`` over ``tokens``.
    """

    _MEMO_LIMIT = 200_000  # SPM word memo entries before the memo is cleared

    def __init__(self) -> None:  # use from_metadata
        self.model: str = ""
        self.pre: str = ""
        self.tokens: StringArray = StringArray.from_strs([])
        self.scores: NumericArray = NumericArray(np.zeros(0))
        self.attrs: bytearray = bytearray()
        self.n_vocab: int = 0
        self.bos_id: int | None = None
        self.eos_id: int | None = None
        self.eot_id: int | None = None
        self.eom_id: int | None = None
        self.unk_id: int | None = None
        self.pad_id: int | None = None
        self.eog_ids: frozenset[int] = frozenset()
        self.add_bos: bool = False
        self.add_eos: bool = False
        self.add_space_prefix: bool = False
        self._vocab: _VocabIndex | None = None
        self._scores_mv: memoryview = memoryview(b"")  # self.scores's items (Python floats), fast indexing
        self._special_rank: dict[int, int] = {}
        self._special_len: dict[int, int] = {}
        self._special_ids: dict[str, int] = {}  # special texts only (a partition match's id, as a dict lookup)
        self._re_all: re.Pattern[str] | None = None
        self._re_ud: re.Pattern[str] | None = None
        self._prefix_cache: dict[tuple[int, bool], tuple[int, ...]] = {}
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
        # gpt2
        self._hf: Any = None
        self._bpe_placeholders = False  # placeholder ids for bytes missing from the vocab (see _init_bpe)
        # llama (SPM)
        self._byte_ids: list[int] = []
        self._cross_re: re.Pattern[str] | None = None
        self._cross_unbounded = False
        self._cross_reach = 0  # the longest cross-space token, chars
        self._memo: dict[str, tuple[int, ...]] = {}
        self._merges: Sequence[Any] = []  # tokenizer.ggml.merges as read (the fingerprint covers them)
        self._fim: dict[str, int | None] = {}
        self._fingerprint: str | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        """Build the tokenizer from GGUF metadata: ``read_gguf``'s (large arrays as
        ``StringArray`` / ``NumericArray``, used without a copy) or plain Python lists.

        Reads ``tokenizer.ggml.{model, pre, tokens, scores, token_type, merges,
        bos_token_id, eos_token_id, eot_token_id, eom_token_id, unknown_token_id,
        padding_token_id, add_bos_token, add_eos_token, add_space_prefix}``.

        Raises:
            EngineError("invalid_gguf"): missing/ill-typed vocabulary keys,
                duplicate token texts.
            EngineError("unsupported_tokenizer"): a tokenizer model other than
                ``gpt2``/``llama``, or an unknown ``gpt2`` pre-tokenizer name.
        """
        self = cls()
        model = metadata.get("tokenizer.ggml.model")
        if not isinstance(model, str):
            raise EngineError("invalid_gguf", "GGUF has no tokenizer.ggml.model")
        if model not in ("gpt2", "llama"):
            raise EngineError("unsupported_tokenizer", f"tokenizer model {model!r} is not supported "
                              "(supported: 'gpt2' byte-level BPE, 'llama' SentencePiece)")
        self.model = model
        tokens = metadata.get("tokenizer.ggml.tokens")
        if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
            tokens = StringArray.from_strs(tokens)
        if not isinstance(tokens, StringArray) or not len(tokens):
            raise EngineError("invalid_gguf", "tokenizer.ggml.tokens must be a non-empty list of strings")
        n = len(tokens)
        blen = tokens.byte_lengths()  # int64 [n]
        if not blen.all():  # else the metadata's own array (read-only, shared)
            tokens = StringArray.from_strs(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
            blen = tokens.byte_lengths()
        vocab = _VocabIndex(tokens)  # raises on a duplicate text
        self.tokens, self._vocab, self.n_vocab = tokens, vocab, n

        scores = metadata.get("tokenizer.ggml.scores")
        if scores is None:
            self.scores = NumericArray(np.zeros(n, dtype=np.float32))
        elif isinstance(scores, NumericArray) and len(scores) == n and scores.array.dtype.kind == "f":
            self.scores = scores  # the metadata's own array (read-only, shared)
        elif isinstance(scores, (list, NumericArray)) and len(scores) >= n:
            self.scores = NumericArray(np.array([float(x) for x in scores[:n]], dtype=np.float64))
        else:
            raise EngineError("invalid_gguf", "tokenizer.ggml.scores is shorter than the vocabulary")
        self._scores_mv = self.scores._mv
        types = metadata.get("tokenizer.ggml.token_type")
        if types is None:
            attrs = bytearray([ATTR_NORMAL]) * n
        elif isinstance(types, (list, NumericArray)) and len(types) >= n:
            if isinstance(types, NumericArray) and types.array.dtype.kind in "iu":
                tv = types.array[:n]
            else:
                tv = np.array([int(t) for t in types[:n]], dtype=np.int64)
            lut = np.array([_TYPE_TO_ATTR[k] for k in range(len(_TYPE_TO_ATTR))], dtype=np.uint8)
            known = (tv >= 0) & (tv < len(lut))
            attrs = bytearray(lut[np.where(known, tv, 0)] * known)  # unknown types: ATTR_UNDEFINED (0)
            del tv, known
        else:
            raise EngineError("invalid_gguf", "tokenizer.ggml.token_type is shorter than the vocabulary")
        tok2id = vocab.get

        # defaults per vocabulary type, then the GGUF's keys (llama_vocab::impl::load)
        if model == "llama":
            bos, eos, unk, pad = 1, 2, 0, None
            add_bos, add_space_prefix = True, True
            pre = _PRE_DEFAULT
            self.pre = "default"
        else:
            bos, eos, unk, pad = 11, 11, None, None
            add_space_prefix = False
            pre_name = metadata.get("tokenizer.ggml.pre") or "default"
            if not isinstance(pre_name, str) or pre_name not in _PRE_TOKENIZERS:
                raise EngineError("unsupported_tokenizer",
                                  f"unknown pre-tokenizer type {pre_name!r} (known: "
                                  f"{', '.join(sorted(_PRE_TOKENIZERS))})")
            self.pre = pre_name
            pre = _PRE_TOKENIZERS[pre_name]
            add_bos = pre.add_bos
        add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))

        def special(key: str, default: int | None) -> int | None:
            if default is not None and default >= n:
                default = None
            v = metadata.get(key)
            if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
                return v
            return default

        self.bos_id = special("tokenizer.ggml.bos_token_id", bos)
        self.eos_id = special("tokenizer.ggml.eos_token_id", eos)
        self.eot_id = special("tokenizer.ggml.eot_token_id", None)
        self.eom_id = special("tokenizer.ggml.eom_token_id", None)
        self.unk_id = special("tokenizer.ggml.unknown_token_id", unk)
        self.pad_id = special("tokenizer.ggml.padding_token_id", pad)
        fim = {k: special(f"tokenizer.ggml.fim_{k}_token_id", None)
               for k in ("pre", "suf", "mid", "pad", "rep", "sep")}
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        self.add_space_prefix = add_space_prefix
        if self.add_bos and self.bos_id is None:
            raise EngineError("invalid_gguf", "add_bos_token is true but the BOS token is not set")
        if self.add_eos and self.eos_id is None:
            raise EngineError("invalid_gguf", "add_eos_token is true but the EOS token is not set")

        # text-based detection of eot/eom/fim tokens; each found one becomes control
        def detect(current: int | None, texts: tuple[str, ...]) -> int | None:
            if current is not None:
                return current
            for t in texts:
                tid = tok2id(t)
                if tid is not None:
                    attrs[tid] |= ATTR_CONTROL
                    return tid
            return None

        self.eot_id = detect(self.eot_id, _EOT_TEXTS)
        self.eom_id = detect(self.eom_id, _EOM_TEXTS)
        fim["pre"] = detect(fim["pre"], _FIM_PRE_TEXTS)
        fim["suf"] = detect(fim["suf"], _FIM_SUF_TEXTS)
        fim["mid"] = detect(fim["mid"], _FIM_MID_TEXTS)
        fim["pad"] = detect(fim["pad"], _FIM_PAD_TEXTS)
        fim["rep"] = detect(fim["rep"], _FIM_REP_TEXTS)
        fim["sep"] = detect(fim["sep"], _FIM_SEP_TEXTS)
        attr_np = np.frombuffer(attrs, dtype=np.uint8)
        for i in np.flatnonzero(attr_np & ATTR_CONTROL).tolist():
            if b"unused" in tokens.item_bytes(i):  # an ASCII text is in a str iff in its UTF-8
                attrs[i] |= ATTR_UNUSED

        eog: set[int] = {x for x in (fim["pad"], fim["rep"], fim["sep"]) if x is not None}
        for t in EOG_TEXTS:
            tid = tok2id(t)
            if tid is not None:
                eog.add(tid)
                attrs[tid] |= ATTR_CONTROL
        for tid in (self.eos_id, self.eot_id, self.eom_id):
            if tid is not None:
                eog.add(tid)
        texts = {tokens[i]: i for i in eog}
        # o200k_harmony / solar-open: "<|end|>" is not end-of-generation there
        if "<|end|>" in texts and (("<|return|>" in texts and ("<|call|>" in texts or "<|calls|>" in texts))
                                   or (("<|call|>" in texts or "<|calls|>" in texts) and "<|flush|>" in texts)):
            eog.discard(texts["<|end|>"])
            attrs[texts["<|end|>"]] = ATTR_USER_DEFINED
        # gemma4 / paddleocr: "</s>" is not end-of-generation there
        if "<|tool_response>" in texts and "</s>" in texts:
            eog.discard(texts["</s>"])
            attrs[texts["</s>"]] = ATTR_NORMAL
        self.eog_ids = frozenset(eog)
        self.attrs = attrs
        self._fim = fim
        merges_md = metadata.get("tokenizer.ggml.merges")
        self._merges = merges_md if isinstance(merges_md, (list, StringArray)) else []

        # special-token partition: longest text first (llama.cpp sorts by byte length)
        sp = np.flatnonzero(np.frombuffer(attrs, dtype=np.uint8) & _SPECIAL_ATTRS)
        specials: list[int] = sp[np.lexsort((sp, -blen[sp]))].tolist()
        self._special_rank = {tid: r for r, tid in enumerate(specials)}
        self._special_ids = {tokens[tid]: tid for tid in specials}
        self._special_len = {tid: len(t) for t, tid in self._special_ids.items()}
        if specials:
            self._re_all = re.compile("(?=(" + _trie_regex(tokens[i] for i in specials) + "))")
        ud = [i for i in specials if not attrs[i] & _PARSE_ONLY_ATTRS]
        if ud:
            self._re_ud = re.compile("(?=(" + _trie_regex(tokens[i] for i in ud) + "))")

        if model == "gpt2":
            self._init_bpe(metadata, pre)
        else:
            self._init_spm()
        return self

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of everything that decides which text a token id stands for:
        the tokenizer model and pre-tokenizer, every token text, score and attribute, the
        BPE merges, the special ids (bos, eos, eot, eom, unk, pad, fim, the end-of-generation
        set) and the add_bos / add_eos / add_space_prefix flags. Two GGUFs with the same
        vocabulary give the same digest; one changed token, merge or special id changes it.
        Computed once, on first use (~0.1 s for a 262k vocabulary)."""
        if self._fingerprint is None:
            h = hashlib.sha256(b"modelyard-tokenizer-v1\0")

            def text(t: str) -> None:
                b = t.encode("utf-8", "surrogatepass")
                h.update(struct.pack("<I", len(b)))
                h.update(b)

            def texts(a: StringArray) -> None:  # text(t) of each item: its stored bytes are t's UTF-8
                pack = struct.Struct("<I").pack
                for b in a.iter_bytes():
                    h.update(pack(len(b)))
                    h.update(b)

            text(self.model)
            text(self.pre)
            h.update(struct.pack("<I", self.n_vocab))
            texts(self.tokens)
            h.update(self.scores.array.astype("<f8").tobytes())  # == struct.pack("<{n}d", *scores)
            h.update(np.frombuffer(self.attrs, dtype=np.uint8).astype("<i4").tobytes())  # == pack("<{n}i")
            h.update(struct.pack("<I", len(self._merges)))
            if isinstance(self._merges, StringArray):
                texts(self._merges)
            else:
                for m in self._merges:
                    text(str(m))
            ids = [self.bos_id, self.eos_id, self.eot_id, self.eom_id, self.unk_id, self.pad_id,
                   *(self._fim.get(k) for k in ("pre", "suf", "mid", "pad", "rep", "sep")), *sorted(self.eog_ids)]
            h.update(struct.pack(f"<{len(ids)}q", *(-1 if i is None else i for i in ids)))
            h.update(bytes([self.add_bos, self.add_eos, self.add_space_prefix]))
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def _init_bpe(self, metadata: Mapping[str, Any], pre: _PreTokenizer) -> None:
        from tokenizers import Regex
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import models, pre_tokenizers

        merges_raw = metadata.get("tokenizer.ggml.merges")
        if not isinstance(merges_raw, (list, StringArray)):
            raise EngineError("invalid_gguf", "gpt2 tokenizer without tokenizer.ggml.merges")
        merges: list[tuple[str, str]] = []
        for m in merges_raw:
            if not isinstance(m, str):
                raise EngineError("invalid_gguf", "tokenizer.ggml.merges must hold strings")
            pos = m.find(" ", 1)  # llama.cpp: word.find(' ', 1)
            if pos < 0:
                continue
            merges.append((m[:pos], m[pos + 1:]))
        # A byte the vocabulary lacks (SmolLM2 has no token for 21 bytes, e.g. 0x04, 0xF1)
        # still is a symbol in llama.cpp: it blocks merges across it and is then dropped.
        # tokenizers would delete it *before* merging (its neighbours could merge), so it
        # gets a placeholder id >= n_vocab here, removed after encoding.
        vocab = dict(zip(self.tokens, range(self.n_vocab)))  # for tokenizers only (it keeps its own)
        missing = [c for c in _BYTE_TO_UNICODE.values() if c not in vocab]
        vocab.update({c: self.n_vocab + k for k, c in enumerate(missing)})
        self._bpe_placeholders = bool(missing)
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
            hf = HFTokenizer(bpe)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_as_llama_unicode(r)), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
            )
        except Exception as e:  # tokenizers raises plain Exception on bad merges
            raise EngineError("invalid_gguf", f"cannot build the BPE tokenizer: {e}") from e
        self._hf = hf

    def _init_spm(self) -> None:
        assert self._vocab is not None
        get = self._vocab.get
        byte_ids = []
        for b in range(256):
            tid = get(f"<0x{b:02X}>")
            if tid is None:
                tid = get(chr(b)) if b < 128 else None
            if tid is None:
                tid = self.unk_id if self.unk_id is not None else -1
            byte_ids.append(tid)
        self._byte_ids = byte_ids
        # Tokens that contain an escaped space after their first character can
        # join two words; only boundaries they can span are kept together.
        # (found in the blob: U+2581's UTF-8 at a byte past the token's first)
        blob = np.frombuffer(self.tokens.blob, dtype=np.uint8)
        sp = _SPM_SPACE.encode("utf-8")
        pos = np.flatnonzero(blob[:-2] == sp[0])  # (candidates first: one blob-sized temporary)
        pos = pos[(blob[pos + 1] == sp[1]) & (blob[pos + 2] == sp[2])]
        starts = self.tokens.offsets.astype(np.int64)
        owner = np.searchsorted(starts, pos, side="right") - 1
        cross = [self.tokens[i] for i in np.unique(owner[pos > starts[owner]]).tolist()]
        if len(cross) > 512:
            self._cross_unbounded = True
        elif cross:
            self._cross_re = re.compile("(?=(" + _trie_regex(cross) + "))")
            self._cross_reach = max(map(len, cross))

    # ------------------------------------------------------------------ properties

    @property
    def bos_token(self) -> str | None:
        """Text of the BOS token (as a chat template's ``bos_token``), or None."""
        return None if self.bos_id is None else self.tokens[self.bos_id]

    @property
    def eos_token(self) -> str | None:
        """Text of the EOS token (as a chat template's ``eos_token``), or None."""
        return None if self.eos_id is None else self.tokens[self.eos_id]

    def is_eog(self, token_id: int) -> bool:
        """True if ``token_id`` ends generation (llama.cpp ``llama_vocab_is_eog``)."""
        return token_id in self.eog_ids

    def token_id(self, text: str) -> int | None:
        """Id of the token whose text is exactly ``text``, else None."""
        if not isinstance(text, str) or self._vocab is None:
            return None
        return self._vocab.get(text)

    # ------------------------------------------------------------------ tokenize

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` as llama.cpp's ``llama_tokenize`` gives them.

        Args:
            text: any ``str``.
            add_special: prepend BOS (and append EOS) when the GGUF's
                ``add_bos_token`` / ``add_eos_token`` say so.
            parse_special: split out control/unknown token texts (e.g.
                ``<|im_start|>``); user-defined token texts are split out always.

        Returns:
            list of ids, each in ``[0, n_vocab)``.

        Raises:
            EngineError("invalid_params"): ``text`` is not a ``str``.
        """
        if not isinstance(text, str):
            raise EngineError("invalid_params", f"text to tokenize must be a string, not {type(text).__name__}")
        return self.tokenize_pieces([(text, parse_special)], add_special=add_special)

    def tokenize_pieces(self, pieces: Sequence[tuple[str, bool]], add_special: bool = True) -> list[int]:
        """Tokenize the concatenation of ``pieces`` as one text.

        Each piece is ``(text, parse_special)``: control/unknown token texts are
        split out only where they lie entirely inside pieces with
        ``parse_special=True`` (template markup), never inside or across pieces
        with ``parse_special=False`` (user content). Everything else is
        identical to ``tokenize("".join(texts), add_special, ...)``: piece
        boundaries do not split words, so ordinary text tokenizes the same.
        """
        text = "".join(p[0] for p in pieces)
        flags = {bool(p[1]) for p in pieces if p[0]}
        protected: bytearray | None = None
        if flags == {False}:
            parse_special = False
        else:
            parse_special = True
            if False in flags:
                protected = bytearray(len(text))
                pos = 0
                for t, ps in pieces:
                    if not ps:
                        protected[pos:pos + len(t)] = b"\x01" * len(t)
                    pos += len(t)
        fragments = self._partition(text, parse_special, protected) if text else []

        out: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_id is not None
            out.append(self.bos_id)
        if self.model == "gpt2":
            for f in fragments:
                if f.text is None:
                    out.append(f.token)
                    continue
                self._hf_ids(f.text, out)
        else:
            is_prev_special = True
            for f in fragments:
                if f.text is None:
                    out.append(f.token)
                    is_prev_special = True
                else:
                    t = f.text
                    if self.add_space_prefix and is_prev_special:
                        t = " " + t
                    out.extend(self._spm_fragment(t))
                    is_prev_special = False
        if add_special and self.add_eos:
            assert self.eos_id is not None
            out.append(self.eos_id)
        return out

    def _hf_ids(self, text: str, out: list[int]) -> None:
        """Append the BPE ids of one fragment (no specials) to ``out``. ``Tokenizer.encode``
        holds the GIL for the whole call (a 7 MB text: ~15 s in which no other thread of the
        process runs — the worker's socket thread could not answer a Ping); ``encode_batch``
        gives the same ids and releases the GIL, so long texts go through it, one at a time
        (its thread pool stays off: TOKENIZERS_PARALLELISM, set at import unless the
        environment says otherwise), and texts over ``_CHUNK_CHARS`` in chunks cut at
        ``_CUT``: freeing the Encoding of a 7 MB text (2.5M ids, each with its token string
        and offsets) holds the GIL for ~1 s, building its id list ~0.15 s; per 64K-char
        chunk, ~10 ms."""
        if len(text) < _GIL_FREE_CHARS:
            self._keep_ids(self._hf.encode(text, add_special_tokens=False).ids, out)
            return
        start, n = 0, len(text)
        while start < n:
            m = _CUT.search(text, start + _CHUNK_CHARS) if n - start > _CHUNK_CHARS else None
            end = m.start() + 1 if m is not None else n
            self._keep_ids(self._hf.encode_batch([text[start:end]], add_special_tokens=False)[0].ids, out)
            start = end

    def _keep_ids(self, ids: list[int], out: list[int]) -> None:
        """``out += ids`` without the placeholder ids of bytes the vocabulary lacks (``_init_bpe``)."""
        if self._bpe_placeholders and ids and max(ids) >= self.n_vocab:  # max(): no per-token Python loop
            n_vocab = self.n_vocab
            ids = [i for i in ids if i < n_vocab]
        out.extend(ids)

    def _prefix_chain(self, tid: int, parse_special: bool) -> tuple[int, ...]:
        """Special tokens (usable in this mode) whose text is a proper prefix of ``tid``'s, longest first."""
        key = (tid, parse_special)
        chain = self._prefix_cache.get(key)
        if chain is None:
            t = self.tokens[tid]
            found = []
            get = self._vocab.get  # type: ignore[union-attr]
            for k in range(len(t) - 1, 0, -1):
                p = get(t[:k])
                if p is not None and p in self._special_rank and (
                    parse_special or not self.attrs[p] & _PARSE_ONLY_ATTRS
                ):
                    found.append(p)
            chain = tuple(found)
            self._prefix_cache[key] = chain
        return chain

    def _partition(self, text: str, parse_special: bool, protected: bytearray | None) -> list[_Fragment]:
        """Split special-token texts out of ``text`` (llama.cpp ``tokenizer_st_partition``).

        llama.cpp walks the special tokens longest first and, for each, splits
        every non-overlapping occurrence (left to right) that lies inside a
        still-raw fragment. Equivalently: candidate (token, position) pairs are
        taken in (token order, position) order when they overlap nothing taken
        before. Candidates come from one regex scan giving the longest special
        text at each position; a shorter special prefix at that position is
        queued only when the longer one is refused.
        """
        regex = self._re_all if parse_special else self._re_ud
        if regex is None:
            return [_Fragment(text, -1)]
        rank, attrs, lens = self._special_rank, self.attrs, self._special_len
        tok2id = self._special_ids.__getitem__  # every match is a special token's text
        # The scan in windows (the pattern is a lookahead, so a window that reaches the longest
        # special text past its end finds exactly the whole text's candidates in it): one
        # finditer step over 7 MB with no special token in it would hold the GIL for ~0.1 s.
        reach = max(lens.values())
        heap = [(rank[tid], m.start(), tid)
                for a in range(0, len(text), _SCAN_CHARS)
                for m in regex.finditer(text, a, a + _SCAN_CHARS + reach) if m.start() < a + _SCAN_CHARS
                for tid in (tok2id(m.group(1)),)]
        if not heap:
            return [_Fragment(text, -1)]
        heapq.heapify(heap)
        claimed = bytearray(len(text))
        taken: list[tuple[int, int, int]] = []
        while heap:
            _, s, tid = heapq.heappop(heap)
            e = s + lens[tid]
            q = claimed.find(1, s, e)
            if q == -1:
                if protected is not None and attrs[tid] & _PARSE_ONLY_ATTRS and protected.find(1, s, e) != -1:
                    q = e  # refused inside user content: a shorter special prefix may still fit
                else:
                    claimed[s:e] = b"\x01" * (e - s)
                    taken.append((s, e, tid))
                    continue
            if q == s:
                continue
            for p in self._prefix_chain(tid, parse_special):
                if s + lens[p] <= q:
                    heapq.heappush(heap, (rank[p], s, p))
                    break
        taken.sort()
        out: list[_Fragment] = []
        pos = 0
        for s, e, tid in taken:
            if s > pos:
                out.append(_Fragment(text[pos:s], -1))
            out.append(_Fragment(None, tid))
            pos = e
        if pos < len(text):
            out.append(_Fragment(text[pos:], -1))
        return out

    # --- SentencePiece-style (llama.cpp llm_tokenizer_spm) ---

    def _spm_fragment(self, text: str) -> list[int]:
        text = text.replace(" ", _SPM_SPACE)
        out: list[int] = []
        memo = self._memo
        for chunk in self._spm_chunks(text):
            for word in self._spm_words(chunk):
                ids = memo.get(word)
                if ids is None:
                    ids = self._spm_word(word)
                    if len(memo) >= self._MEMO_LIMIT:
                        memo.clear()
                    memo[word] = ids
                out.extend(ids)
        return out

    def _spm_chunks(self, text: str) -> Iterator[str]:
        """``text`` (spaces escaped) in pieces of about ``_CHUNK_CHARS``, each cut at a word
        boundary of :meth:`_spm_words` (an escaped space no cross-space token spans), so the
        words of the pieces are the words of the whole: splitting a 7 MB text into its
        ~1.3M words in one ``str.split`` (or scanning it for cross-space tokens in one
        regex step) would hold the GIL for ~0.2 s."""
        n = len(text)
        if n <= _CHUNK_CHARS or self._cross_unbounded:
            yield text
            return
        start = 0
        while start < n:
            cut = n
            p = start + _CHUNK_CHARS
            while p < n:
                p = text.find(_SPM_SPACE, p)
                if p == -1:
                    break
                if self._spm_boundary(text, p):
                    cut = p
                    break
                p += 1
            yield text[start:cut]
            start = cut

    def _spm_boundary(self, text: str, p: int) -> bool:
        """True if ``_spm_words(text)`` starts a word at ``p`` (``text[p]`` is U+2581): no
        cross-space token occurrence starts before ``p`` and ends after it."""
        if self._cross_re is None:
            return True
        reach = self._cross_reach
        for m in self._cross_re.finditer(text, max(0, p - reach), p + reach):
            if m.start() >= p:
                break
            if m.start() + len(m.group(1)) > p:
                return False
        return True

    def _spm_words(self, text: str) -> list[str]:
        """Split at escaped spaces where no vocabulary token can span the boundary.

        A merge joining the characters at ``p-1`` and ``p`` (text[p] == U+2581)
        yields a token with U+2581 after its first character, occurring in the
        text across ``p``; where no such occurrence exists the merge process on
        either side is independent, so words can be tokenized (and memoized)
        separately with identical results.
        """
        if self._cross_unbounded:
            return [text]
        if _SPM_SPACE not in text[1:]:
            return [text]
        parts = text.split(_SPM_SPACE)
        words = [parts[0]] if parts[0] else []
        words.extend(_SPM_SPACE + p for p in parts[1:])
        if self._cross_re is None:
            return words
        spans = [(m.start(), m.start() + len(m.group(1))) for m in self._cross_re.finditer(text)]
        if not spans:
            return words
        unsafe = bytearray(len(text) + 1)
        for s, e in spans:
            unsafe[s + 1:e] = b"\x01" * (e - s - 1)
        merged: list[str] = []
        pos = 0
        for w in words:
            if merged and unsafe[pos]:
                merged[-1] += w
            else:
                merged.append(w)
            pos += len(w)
        return merged

    def _spm_word(self, word: str) -> tuple[int, ...]:
        """llama.cpp ``llm_tokenizer_spm_session::tokenize`` on one word.

        Symbols start as single characters; the adjacent pair whose
        concatenation is a vocabulary token with the highest score is merged
        first, leftmost on equal scores; left-over symbols that are not tokens
        become ``<0xXX>`` byte tokens of their UTF-8 bytes.
        """
        tok2id, scores = self._vocab.get, self._scores_mv  # type: ignore[union-attr]
        n = len(word)
        if n == 1:
            tid = tok2id(word)
            return (tid,) if tid is not None else self._byte_fallback(word)
        length = [1] * n
        ids: list[int | None] = [None] * n  # a merged symbol's token id (known from its merge)
        prev = list(range(-1, n - 1))
        nxt = list(range(1, n + 1))
        nxt[-1] = -1
        heap = []
        for i in range(n - 1):
            tid = tok2id(word[i:i + 2])
            if tid is not None:
                heap.append((-scores[tid], i, i + 1, 2, tid))
        heapq.heapify(heap)
        pop, push = heapq.heappop, heapq.heappush
        while heap:
            # (entries equal up to size are the same piece: the trailing id never decides the order)
            _, left, right, size, tid = pop(heap)
            ll, rl = length[left], length[right]
            if ll == 0 or rl == 0 or ll + rl != size:
                continue
            length[left] = size
            length[right] = 0
            ids[left] = tid
            r2 = nxt[right]
            nxt[left] = r2
            if r2 >= 0:
                prev[r2] = left
            p = prev[left]
            if p >= 0:
                sz = length[p] + size
                t2 = tok2id(word[p:p + sz])
                if t2 is not None:
                    push(heap, (-scores[t2], p, left, sz, t2))
            if r2 >= 0:
                sz = size + length[r2]
                t2 = tok2id(word[left:left + sz])
                if t2 is not None:
                    push(heap, (-scores[t2], left, r2, sz, t2))
        out: list[int] = []
        i = 0
        while i != -1:
            tid = ids[i] if length[i] > 1 else tok2id(word[i])
            if tid is not None:
                out.append(tid)
            else:
                out.extend(self._byte_fallback(word[i:i + length[i]]))
            i = nxt[i]
        return tuple(out)

    def _byte_fallback(self, piece: str) -> tuple[int, ...]:
        return tuple(t for t in (self._byte_ids[b] for b in piece.encode("utf-8")) if t >= 0)

    # ------------------------------------------------------------------ detokenize

    def check_ids(self, ids: Iterable[Any]) -> list[int]:
        """Validate token ids; returns them as a list of ``int``.

        Raises:
            EngineError("invalid_token"): an id that is not an int in ``[0, n_vocab)``.
        """
        out = []
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= int(t) < self.n_vocab:
                raise EngineError("invalid_token", f"token id {t!r} is out of the vocabulary "
                                  f"[0, {self.n_vocab})")
            out.append(int(t))
        return out

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token's piece (llama.cpp ``token_to_piece``, lstrip 0).

        Control and unknown tokens render their text when ``special`` is True
        and nothing when False (llama-server emits generated tokens with
        special=False); user-defined tokens always render their text. Byte-level
        BPE text goes back through the GPT-2 unicode -> byte map (a character
        outside the map is kept as its UTF-8 bytes, where llama.cpp writes an
        ``[UNK_BYTE_...]`` marker); SentencePiece U+2581 becomes a space and
        ``<0xXX>`` tokens become that byte.

        Raises:
            EngineError("invalid_token"): id out of ``[0, n_vocab)``.
        """
        key = (token_id, special)
        b = self._piece_cache.get(key)
        if b is not None:
            return b
        (token_id,) = self.check_ids([token_id])
        attr = self.attrs[token_id]
        text = self.tokens[token_id]
        if not special and attr & (ATTR_UNKNOWN | ATTR_CONTROL):
            b = b""
        elif attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED):
            b = text.encode("utf-8")
        elif attr & ATTR_NORMAL:
            if self.model == "llama":
                b = text.replace(_SPM_SPACE, " ").encode("utf-8")
            else:
                u2b = _UNICODE_TO_BYTE
                b = b"".join(bytes((u2b[c],)) if c in u2b else c.encode("utf-8") for c in text)
        elif attr & ATTR_BYTE:
            try:
                b = bytes((int(text[3:5], 16),))
            except ValueError:
                b = b""
        else:
            b = b""  # unused / undefined types render nothing in llama.cpp
        self._piece_cache[key] = b
        return b

    def detokenize(self, ids: Sequence[int], special: bool = True) -> str:
        """Concatenated pieces of ``ids`` decoded as UTF-8 (invalid bytes -> U+FFFD).

        Like llama-server's ``/detokenize`` (pieces joined, nothing stripped).

        Raises:
            EngineError("invalid_token"): an id out of ``[0, n_vocab)``.
        """
        ids = self.check_ids(ids)
        return b"".join(self.token_bytes(t, special) for t in ids).decode("utf-8", errors="replace")


class IncrementalUTF8Decoder:
    """Bytes -> text, never emitting half of a multi-byte character.

    ``feed`` returns the text completed so far; an incomplete trailing UTF-8
    sequence is held until the next call. Invalid bytes become U+FFFD.
    """

    def __init__(self) -> None:
        self._dec = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, data: bytes) -> str:
        return self._dec.decode(data, final=False)

    def flush(self) -> str:
        """Text of any held incomplete sequence (as U+FFFD) at end of stream."""
        return self._dec.decode(b"", final=True)

"""A GGUF vocabulary's tables: token attributes, the token text -> id index and the reading of
``tokenizer.ggml.{tokens, scores, token_type}`` (llama.cpp ``llama_vocab::impl::load``).

The per-token tables hold no Python object per token (Gemma 3's 262,144 tokens: ~9 MiB where
lists, a dict and their ``str``/``float``/``int`` objects took ~50 MiB): the texts are a
:class:`StringArray`, the scores a :class:`NumericArray`, the attributes a ``bytearray`` and
the lookup a :class:`VocabIndex`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from ..errors import EngineError
from ..loading.arrays import NumericArray, StringArray

# llama.h: enum llama_token_attr (bit flags)
ATTR_UNDEFINED = 0
ATTR_UNKNOWN = 1 << 0
ATTR_UNUSED = 1 << 1
ATTR_NORMAL = 1 << 2
ATTR_CONTROL = 1 << 3
ATTR_USER_DEFINED = 1 << 4
ATTR_BYTE = 1 << 5

# llama.h: enum llama_token_type (the values stored in tokenizer.ggml.token_type)
TYPE_TO_ATTR = {
    0: ATTR_UNDEFINED,  # LLAMA_TOKEN_TYPE_UNDEFINED
    1: ATTR_NORMAL,
    2: ATTR_UNKNOWN,
    3: ATTR_CONTROL,
    4: ATTR_USER_DEFINED,
    5: ATTR_UNUSED,
    6: ATTR_BYTE,
}

SPECIAL_ATTRS = ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN
PARSE_ONLY_ATTRS = ATTR_CONTROL | ATTR_UNKNOWN  # split out only with parse_special


def trie_regex(strings: Iterable[str]) -> str:
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


#: A text's key in :class:`VocabIndex`: ``hash(text) ^ (len(text) << _LEN_SHIFT)`` (int64).
_LEN_SHIFT = 40


class VocabIndex:
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


def read_tokens(metadata: Mapping[str, Any]) -> StringArray:
    """``tokenizer.ggml.tokens`` as a :class:`StringArray`: the metadata's own array (read-only,
    shared) when it has no empty text, else a copy with each empty text ``i`` named
    ``[EMPTY_i]``; a list of ``str`` is packed.

    Raises: EngineError("invalid_gguf") if missing, empty or not strings."""
    tokens = metadata.get("tokenizer.ggml.tokens")
    if isinstance(tokens, list) and all(isinstance(t, str) for t in tokens):
        tokens = StringArray.from_strs(tokens)
    if not isinstance(tokens, StringArray) or not len(tokens):
        raise EngineError("invalid_gguf", "tokenizer.ggml.tokens must be a non-empty list of strings")
    if not tokens.byte_lengths().all():  # else the metadata's own array (read-only, shared)
        tokens = StringArray.from_strs(t if t else f"[EMPTY_{i}]" for i, t in enumerate(tokens))
    return tokens


def read_scores(metadata: Mapping[str, Any], n: int) -> NumericArray:
    """``tokenizer.ggml.scores``, ``[n]`` Python floats: the metadata's own float array when it
    has exactly ``n``, float64 of its first ``n`` items otherwise; float32 zeros when absent.

    Raises: EngineError("invalid_gguf") if shorter than ``n``."""
    scores = metadata.get("tokenizer.ggml.scores")
    if scores is None:
        return NumericArray(np.zeros(n, dtype=np.float32))
    if isinstance(scores, NumericArray) and len(scores) == n and scores.array.dtype.kind == "f":
        return scores  # the metadata's own array (read-only, shared)
    if isinstance(scores, (list, NumericArray)) and len(scores) >= n:
        return NumericArray(np.array([float(x) for x in scores[:n]], dtype=np.float64))
    raise EngineError("invalid_gguf", "tokenizer.ggml.scores is shorter than the vocabulary")


def read_attrs(metadata: Mapping[str, Any], n: int) -> bytearray:
    """``ATTR_*`` flags ``[n]`` from ``tokenizer.ggml.token_type`` (:data:`TYPE_TO_ATTR`; an
    unknown type is ATTR_UNDEFINED); all ATTR_NORMAL when absent.

    Raises: EngineError("invalid_gguf") if shorter than ``n``."""
    types = metadata.get("tokenizer.ggml.token_type")
    if types is None:
        return bytearray([ATTR_NORMAL]) * n
    if not isinstance(types, (list, NumericArray)) or len(types) < n:
        raise EngineError("invalid_gguf", "tokenizer.ggml.token_type is shorter than the vocabulary")
    if isinstance(types, NumericArray) and types.array.dtype.kind in "iu":
        tv = types.array[:n]
    else:
        tv = np.array([int(t) for t in types[:n]], dtype=np.int64)
    lut = np.array([TYPE_TO_ATTR[k] for k in range(len(TYPE_TO_ATTR))], dtype=np.uint8)
    known = (tv >= 0) & (tv < len(lut))
    return bytearray(lut[np.where(known, tv, 0)] * known)  # unknown types: ATTR_UNDEFINED (0)

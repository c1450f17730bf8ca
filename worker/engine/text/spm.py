"""SentencePiece-style tokenizing (``tokenizer.ggml.model == "llama"``: Gemma) as llama.cpp's
``llm_tokenizer_spm`` does it: merges by token score with ``<0xXX>`` byte fallback.

Implemented here (see :meth:`SpmModel.word`), not with ``tokenizers``: the GGUF has no merge
list, only per-token scores, and llama.cpp's ``llm_tokenizer_spm`` merges the adjacent pair whose
*concatenation* has the highest score (leftmost on ties). A ``tokenizers`` BPE model ranks merges
per (left, right) *pair*, so a derived merge list orders two overlapping splits of one token
differently from llama.cpp, and deriving ~all splits of 262,144 tokens costs seconds at load. The
own implementation is exact and, with a per-word memo (words are split only where no vocabulary
token can span the boundary), fast enough: see ``scripts/bench_tokenizer.py``.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Iterator

import numpy as np

from ..loading.arrays import NumericArray, StringArray
from .vocab import trie_regex

SPM_SPACE = "\u2581"  # LOWER ONE EIGHTH BLOCK, SentencePiece's escaped space

#: Longer texts are split into words in pieces of about this many chars (``SpmModel.chunks``).
_CHUNK_CHARS = 1 << 16


class SpmModel:
    """Text (no special tokens) -> ids of one SentencePiece vocabulary.

    Attributes:
        memo: word -> ids, cleared when it reaches :attr:`MEMO_LIMIT` entries.
    """

    MEMO_LIMIT = 200_000  # word memo entries before the memo is cleared

    def __init__(self, tokens: StringArray, tok2id: Callable[[str], int | None], scores: NumericArray,
                 unk_id: int | None) -> None:
        """``tok2id``: the vocabulary's text -> id lookup; ``scores`` ``[n_vocab]``; ``unk_id``
        stands for a byte with neither a ``<0xXX>`` nor (ASCII) a character token."""
        self._tok2id = get = tok2id
        self._scores_mv = scores._mv  # the scores' items (Python floats), fast indexing
        self.memo: dict[str, tuple[int, ...]] = {}
        self._cross_re: re.Pattern[str] | None = None
        self._cross_unbounded = False
        self._cross_reach = 0  # the longest cross-space token, chars
        byte_ids = []
        for b in range(256):
            tid = get(f"<0x{b:02X}>")
            if tid is None:
                tid = get(chr(b)) if b < 128 else None
            if tid is None:
                tid = unk_id if unk_id is not None else -1
            byte_ids.append(tid)
        self._byte_ids = byte_ids
        # Tokens that contain an escaped space after their first character can
        # join two words; only boundaries they can span are kept together.
        # (found in the blob: U+2581's UTF-8 at a byte past the token's first)
        blob = np.frombuffer(tokens.blob, dtype=np.uint8)
        sp = SPM_SPACE.encode("utf-8")
        pos = np.flatnonzero(blob[:-2] == sp[0])  # (candidates first: one blob-sized temporary)
        pos = pos[(blob[pos + 1] == sp[1]) & (blob[pos + 2] == sp[2])]
        starts = tokens.offsets.astype(np.int64)
        owner = np.searchsorted(starts, pos, side="right") - 1
        cross = [tokens[i] for i in np.unique(owner[pos > starts[owner]]).tolist()]
        if len(cross) > 512:
            self._cross_unbounded = True
        elif cross:
            self._cross_re = re.compile("(?=(" + trie_regex(cross) + "))")
            self._cross_reach = max(map(len, cross))

    def fragment(self, text: str) -> list[int]:
        """The ids of one fragment (no special tokens; spaces not yet escaped)."""
        text = text.replace(" ", SPM_SPACE)
        out: list[int] = []
        memo = self.memo
        for chunk in self.chunks(text):
            for word in self.words(chunk):
                ids = memo.get(word)
                if ids is None:
                    ids = self.word(word)
                    if len(memo) >= self.MEMO_LIMIT:
                        memo.clear()
                    memo[word] = ids
                out.extend(ids)
        return out

    def chunks(self, text: str) -> Iterator[str]:
        """``text`` (spaces escaped) in pieces of about ``_CHUNK_CHARS``, each cut at a word
        boundary of :meth:`words` (an escaped space no cross-space token spans), so the
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
                p = text.find(SPM_SPACE, p)
                if p == -1:
                    break
                if self._boundary(text, p):
                    cut = p
                    break
                p += 1
            yield text[start:cut]
            start = cut

    def _boundary(self, text: str, p: int) -> bool:
        """True if ``words(text)`` starts a word at ``p`` (``text[p]`` is U+2581): no
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

    def words(self, text: str) -> list[str]:
        """Split at escaped spaces where no vocabulary token can span the boundary.

        A merge joining the characters at ``p-1`` and ``p`` (text[p] == U+2581)
        yields a token with U+2581 after its first character, occurring in the
        text across ``p``; where no such occurrence exists the merge process on
        either side is independent, so words can be tokenized (and memoized)
        separately with identical results.
        """
        if self._cross_unbounded:
            return [text]
        if SPM_SPACE not in text[1:]:
            return [text]
        parts = text.split(SPM_SPACE)
        words = [parts[0]] if parts[0] else []
        words.extend(SPM_SPACE + p for p in parts[1:])
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

    def word(self, word: str) -> tuple[int, ...]:
        """llama.cpp ``llm_tokenizer_spm_session::tokenize`` on one word.

        Symbols start as single characters; the adjacent pair whose
        concatenation is a vocabulary token with the highest score is merged
        first, leftmost on equal scores; left-over symbols that are not tokens
        become ``<0xXX>`` byte tokens of their UTF-8 bytes.
        """
        tok2id, scores = self._tok2id, self._scores_mv
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


"""Special tokens: which ids a vocabulary's specials are (read from the GGUF, else found by their
text, llama.cpp ``llama_vocab::impl::load``) and their split-out of a text before the tokenizer
model runs (llama.cpp ``tokenizer_st_partition``).

Token attributes follow llama.cpp's load-time fix-ups: tokens whose text is on llama.cpp's
end-of-turn / end-of-generation / fill-in-the-middle lists become control tokens (that is why
Gemma's user-defined ``</s>`` behaves as control), control tokens whose text contains
``unused`` also get the unused flag.
"""

from __future__ import annotations

import heapq
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..loading.arrays import StringArray
from .vocab import (ATTR_CONTROL, ATTR_NORMAL, ATTR_UNUSED, ATTR_USER_DEFINED, PARSE_ONLY_ATTRS,
                    SPECIAL_ATTRS, trie_regex)

#: Special-token texts are searched for in windows of this many chars (``SpecialTokens.partition``).
_SCAN_CHARS = 1 << 18

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


#: The fill-in-the-middle roles (``tokenizer.ggml.fim_<role>_token_id``), in fingerprint order.
FIM_ROLES = ("pre", "suf", "mid", "pad", "rep", "sep")
_FIM_TEXTS = {"pre": _FIM_PRE_TEXTS, "suf": _FIM_SUF_TEXTS, "mid": _FIM_MID_TEXTS,
              "pad": _FIM_PAD_TEXTS, "rep": _FIM_REP_TEXTS, "sep": _FIM_SEP_TEXTS}


@dataclass
class SpecialIds:
    """A vocabulary's special token ids (each in ``[0, n_vocab)`` or None).

    Attributes:
        bos, eos, eot, eom, unk, pad: ``tokenizer.ggml.<name>_token_id`` or the vocabulary
            type's default (eot, eom: found by text when absent).
        fim: ``{role: id}`` for every role of :data:`FIM_ROLES` (found by text when absent).
        eog: the end-of-generation ids (llama.cpp ``special_eog_ids``).
    """

    bos: int | None
    eos: int | None
    eot: int | None
    eom: int | None
    unk: int | None
    pad: int | None
    fim: dict[str, int | None]
    eog: frozenset[int] = frozenset()


def read_special_ids(metadata: Mapping[str, Any], n: int, bos: int | None, eos: int | None,
                     unk: int | None, pad: int | None) -> SpecialIds:
    """The GGUF's special ids, each a default (``bos`` ... ``pad``, None for the others) when
    absent or outside ``[0, n)`` (a default outside it is None); ``eog`` empty."""
    def special(key: str, default: int | None) -> int | None:
        if default is not None and default >= n:
            default = None
        v = metadata.get(key)
        if isinstance(v, int) and not isinstance(v, bool) and 0 <= v < n:
            return v
        return default

    return SpecialIds(
        bos=special("tokenizer.ggml.bos_token_id", bos),
        eos=special("tokenizer.ggml.eos_token_id", eos),
        eot=special("tokenizer.ggml.eot_token_id", None),
        eom=special("tokenizer.ggml.eom_token_id", None),
        unk=special("tokenizer.ggml.unknown_token_id", unk),
        pad=special("tokenizer.ggml.padding_token_id", pad),
        fim={k: special(f"tokenizer.ggml.fim_{k}_token_id", None) for k in FIM_ROLES},
    )


def detect_by_text(ids: SpecialIds, tokens: StringArray, tok2id: Callable[[str], int | None],
                   attrs: bytearray) -> None:
    """llama.cpp's text-based detection: eot / eom / fim ids still unset are found by their
    texts (each found one becomes control), control tokens naming ``unused`` get ATTR_UNUSED,
    and ``ids.eog`` is set. Updates ``ids`` and ``attrs`` in place."""
    def detect(current: int | None, texts: tuple[str, ...]) -> int | None:
        if current is not None:
            return current
        for t in texts:
            tid = tok2id(t)
            if tid is not None:
                attrs[tid] |= ATTR_CONTROL
                return tid
        return None

    ids.eot = detect(ids.eot, _EOT_TEXTS)
    ids.eom = detect(ids.eom, _EOM_TEXTS)
    for role in FIM_ROLES:
        ids.fim[role] = detect(ids.fim[role], _FIM_TEXTS[role])
    attr_np = np.frombuffer(attrs, dtype=np.uint8)
    for i in np.flatnonzero(attr_np & ATTR_CONTROL).tolist():
        if b"unused" in tokens.item_bytes(i):  # an ASCII text is in a str iff in its UTF-8
            attrs[i] |= ATTR_UNUSED
    ids.eog = _eog_ids(ids, tokens, tok2id, attrs)


def _eog_ids(ids: SpecialIds, tokens: StringArray, tok2id: Callable[[str], int | None],
             attrs: bytearray) -> frozenset[int]:
    fim = ids.fim
    eog: set[int] = {x for x in (fim["pad"], fim["rep"], fim["sep"]) if x is not None}
    for t in EOG_TEXTS:
        tid = tok2id(t)
        if tid is not None:
            eog.add(tid)
            attrs[tid] |= ATTR_CONTROL
    for tid in (ids.eos, ids.eot, ids.eom):
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
    return frozenset(eog)


class Fragment:
    """A piece of a partitioned text: raw ``text`` (``token`` -1), or one special ``token``
    (``text`` None)."""

    __slots__ = ("text", "token")

    def __init__(self, text: str | None, token: int) -> None:
        self.text = text
        self.token = token


class SpecialTokens:
    """The split-out of special-token texts (control, user-defined and unknown token types),
    longest text first, exactly like llama.cpp's ``tokenizer_st_partition``; with
    ``parse_special=False`` only user-defined tokens are split out (Gemma has 165: runs of
    newlines, spaces, tabs, HTML tags)."""

    def __init__(self, tokens: StringArray, attrs: bytearray, tok2id: Callable[[str], int | None]) -> None:
        """``attrs`` as final (read, not kept as a copy)."""
        self._tokens, self._attrs, self._tok2id = tokens, attrs, tok2id
        blen = tokens.byte_lengths()
        # longest text first (llama.cpp sorts by byte length)
        sp = np.flatnonzero(np.frombuffer(attrs, dtype=np.uint8) & SPECIAL_ATTRS)
        specials: list[int] = sp[np.lexsort((sp, -blen[sp]))].tolist()
        self._rank = {tid: r for r, tid in enumerate(specials)}
        self._ids = {tokens[tid]: tid for tid in specials}  # special texts only (a match's id, as a dict lookup)
        self._len = {tid: len(t) for t, tid in self._ids.items()}
        self._re_all: re.Pattern[str] | None = None
        self._re_ud: re.Pattern[str] | None = None
        if specials:
            self._re_all = re.compile("(?=(" + trie_regex(tokens[i] for i in specials) + "))")
        ud = [i for i in specials if not attrs[i] & PARSE_ONLY_ATTRS]
        if ud:
            self._re_ud = re.compile("(?=(" + trie_regex(tokens[i] for i in ud) + "))")
        self._prefix_cache: dict[tuple[int, bool], tuple[int, ...]] = {}

    def prefix_chain(self, tid: int, parse_special: bool) -> tuple[int, ...]:
        """Special tokens (usable in this mode) whose text is a proper prefix of ``tid``'s, longest first."""
        key = (tid, parse_special)
        chain = self._prefix_cache.get(key)
        if chain is None:
            t = self._tokens[tid]
            found = []
            get = self._tok2id
            for k in range(len(t) - 1, 0, -1):
                p = get(t[:k])
                if p is not None and p in self._rank and (
                    parse_special or not self._attrs[p] & PARSE_ONLY_ATTRS
                ):
                    found.append(p)
            chain = tuple(found)
            self._prefix_cache[key] = chain
        return chain

    def partition(self, text: str, parse_special: bool, protected: bytearray | None) -> list[Fragment]:
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
            return [Fragment(text, -1)]
        rank, attrs, lens = self._rank, self._attrs, self._len
        tok2id = self._ids.__getitem__  # every match is a special token's text
        # The scan in windows (the pattern is a lookahead, so a window that reaches the longest
        # special text past its end finds exactly the whole text's candidates in it): one
        # finditer step over 7 MB with no special token in it would hold the GIL for ~0.1 s.
        reach = max(lens.values())
        heap = [(rank[tid], m.start(), tid)
                for a in range(0, len(text), _SCAN_CHARS)
                for m in regex.finditer(text, a, a + _SCAN_CHARS + reach) if m.start() < a + _SCAN_CHARS
                for tid in (tok2id(m.group(1)),)]
        if not heap:
            return [Fragment(text, -1)]
        heapq.heapify(heap)
        claimed = bytearray(len(text))
        taken: list[tuple[int, int, int]] = []
        while heap:
            _, s, tid = heapq.heappop(heap)
            e = s + lens[tid]
            q = claimed.find(1, s, e)
            if q == -1:
                if protected is not None and attrs[tid] & PARSE_ONLY_ATTRS and protected.find(1, s, e) != -1:
                    q = e  # refused inside user content: a shorter special prefix may still fit
                else:
                    claimed[s:e] = b"\x01" * (e - s)
                    taken.append((s, e, tid))
                    continue
            if q == s:
                continue
            for p in self.prefix_chain(tid, parse_special):
                if s + lens[p] <= q:
                    heapq.heappush(heap, (rank[p], s, p))
                    break
        taken.sort()
        out: list[Fragment] = []
        pos = 0
        for s, e, tid in taken:
            if s > pos:
                out.append(Fragment(text[pos:s], -1))
            out.append(Fragment(None, tid))
            pos = e
        if pos < len(text):
            out.append(Fragment(text[pos:], -1))
        return out


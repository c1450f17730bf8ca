"""Byte-level BPE (``tokenizer.ggml.model == "gpt2"``: SmolLM2, Qwen2, Llama 3, ...) as llama.cpp's
``llm_tokenizer_bpe`` does it.

The BPE core is Hugging Face ``tokenizers`` (a ``BPE`` model assembled from the GGUF vocab and
merges), fed by the pre-tokenizer regexes that llama.cpp uses for the ``tokenizer.ggml.pre`` name
(``_PRE_TOKENIZERS``), then the GPT-2 byte -> unicode map.

Two llama.cpp details the ``tokenizers`` BPE would otherwise miss (found by fuzzing against
llama.cpp's ``llama_tokenize``, 1.1 M code points and ~8,000 texts): a byte the vocabulary lacks
is a symbol that blocks merges across it and is then dropped (:class:`BpeModel`), and the split
regexes use llama.cpp's Unicode 15.1 categories, not the regex engine's newer tables
(``_as_llama_unicode``).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import EngineError
from ..loading.arrays import StringArray

# tokenizers' rayon pool off (one text at a time; no oversubscription, no fork warnings);
# encode_batch is used for its GIL release alone (BpeModel.ids)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

#: Fragments at least this long (chars) are tokenized with the GIL released.
_GIL_FREE_CHARS = 4096

#: Longer fragments are encoded in chunks of about this many chars (``BpeModel.ids``).
_CHUNK_CHARS = 1 << 16

#: Where a long fragment may be cut: at a space between two ASCII letters. No regex of the
#: pre-tokenizer table can match a letter followed by a space (letters are matched as
#: ``[^\r\n\p{L}\p{N}]?\p{L}+`` / `` ?\p{L}+`` or contractions, spaces only in all-space or
#: space-prefixed matches), so every row splits there, and neither side of the cut is seen
#: by a lookahead (``\s+(?!\S)`` needs whitespace before the cut): the ids of the whole
#: fragment are the ids of its chunks, concatenated. tests/worker/test_tokenizer.py checks
#: this on every row of the table. A new row must keep it.
_CUT = re.compile(r"[A-Za-z] [A-Za-z]")

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
class PreTokenizer:
    """One row of llama.cpp's pre-tokenizer table.

    ``regexes`` are applied in order, each splitting the pieces of the previous
    one (llama.cpp ``unicode_regex_split``); unmatched text stays a piece.
    """

    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is already a token is emitted whole (llama3)
    add_bos: bool = False  # default of add_bos_token when the GGUF lacks the key


_PRE_DEFAULT = PreTokenizer(
    (r"[\p{P}\$\+<=>\^~\|]+", _RE_GPT2, r"\p{N}+", r"[0-9][0-9][0-9]"),
)
_PRE_GPT2 = PreTokenizer((_RE_GPT2,))
_PRE_SMOLLM = PreTokenizer((r"\p{N}", _RE_GPT2))  # every digit isolated, then GPT-2
_PRE_LLAMA3 = PreTokenizer((_RE_LLAMA3,), ignore_merges=True, add_bos=True)
_PRE_QWEN2 = PreTokenizer((_RE_QWEN2,))

# tokenizer.ggml.pre -> pre-tokenizer (llama-vocab.cpp, llama_vocab::impl::load)
_PRE_TOKENIZERS: dict[str, PreTokenizer] = {
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
_PRE_TOKENIZERS["dbrx"] = _PRE_TOKENIZERS["smaug-bpe"] = PreTokenizer((_RE_LLAMA3,))


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


BYTE_TO_UNICODE = _bytes_to_unicode()
UNICODE_TO_BYTE = {c: b for b, c in BYTE_TO_UNICODE.items()}


def pre_tokenizer(metadata: Mapping[str, Any]) -> tuple[str, PreTokenizer]:
    """``tokenizer.ggml.pre`` (``"default"`` when absent) and its row of the table.

    Raises: EngineError("unsupported_tokenizer") for a name llama.cpp does not know."""
    pre_name = metadata.get("tokenizer.ggml.pre") or "default"
    if not isinstance(pre_name, str) or pre_name not in _PRE_TOKENIZERS:
        raise EngineError("unsupported_tokenizer",
                          f"unknown pre-tokenizer type {pre_name!r} (known: "
                          f"{', '.join(sorted(_PRE_TOKENIZERS))})")
    return pre_name, _PRE_TOKENIZERS[pre_name]


class BpeModel:
    """Text (no special tokens) -> ids of one byte-level BPE vocabulary.

    Attributes:
        hf: the ``tokenizers.Tokenizer`` (its ids may include placeholders ``>= n_vocab``).
    """

    def __init__(self, metadata: Mapping[str, Any], tokens: StringArray, pre: PreTokenizer) -> None:
        """Build it from ``tokenizer.ggml.merges`` and the vocabulary's ``tokens``.

        Raises: EngineError("invalid_gguf") for missing or malformed merges."""
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
        self.n_vocab = n_vocab = len(tokens)
        vocab = dict(zip(tokens, range(n_vocab)))  # for tokenizers only (it keeps its own)
        missing = [c for c in BYTE_TO_UNICODE.values() if c not in vocab]
        vocab.update({c: n_vocab + k for k, c in enumerate(missing)})
        self._placeholders = bool(missing)
        try:
            bpe = models.BPE(vocab=vocab, merges=merges, ignore_merges=pre.ignore_merges)
            hf = HFTokenizer(bpe)
            hf.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(_as_llama_unicode(r)), behavior="isolated") for r in pre.regexes]
                + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False, trim_offsets=False)]
            )
        except Exception as e:  # tokenizers raises plain Exception on bad merges
            raise EngineError("invalid_gguf", f"cannot build the BPE tokenizer: {e}") from e
        self.hf: Any = hf

    def ids(self, text: str, out: list[int]) -> None:
        """Append the BPE ids of one fragment (no specials) to ``out``. ``tokenizers.Tokenizer.encode``
        holds the GIL for the whole call (a 7 MB text: ~15 s in which no other thread of the
        process runs — the worker's socket thread could not answer a Ping); ``encode_batch``
        gives the same ids and releases the GIL, so long texts go through it, one at a time
        (its thread pool stays off: TOKENIZERS_PARALLELISM, set at import unless the
        environment says otherwise), and texts over ``_CHUNK_CHARS`` in chunks cut at
        ``_CUT``: freeing the Encoding of a 7 MB text (2.5M ids, each with its token string
        and offsets) holds the GIL for ~1 s, building its id list ~0.15 s; per 64K-char
        chunk, ~10 ms."""
        if len(text) < _GIL_FREE_CHARS:
            self.keep_ids(self.hf.encode(text, add_special_tokens=False).ids, out)
            return
        start, n = 0, len(text)
        while start < n:
            m = _CUT.search(text, start + _CHUNK_CHARS) if n - start > _CHUNK_CHARS else None
            end = m.start() + 1 if m is not None else n
            self.keep_ids(self.hf.encode_batch([text[start:end]], add_special_tokens=False)[0].ids, out)
            start = end

    def keep_ids(self, ids: list[int], out: list[int]) -> None:
        """``out += ids`` without the placeholder ids of bytes the vocabulary lacks (see ``__init__``)."""
        if self._placeholders and ids and max(ids) >= self.n_vocab:  # max(): no per-token Python loop
            n_vocab = self.n_vocab
            ids = [i for i in ids if i < n_vocab]
        out.extend(ids)


"""Tokenizer built from a GGUF file's ``tokenizer.ggml.*`` metadata alone.

Reproduces llama.cpp's ``src/llama-vocab.cpp`` (``llama_vocab::impl::load``,
``tokenize``, ``tokenizer_st_partition``, ``token_to_piece``) for the two
vocabulary types this project serves, one module per concept beside this one:

* ``tokenizer.ggml.model == "gpt2"`` -- byte-level BPE (SmolLM2, Qwen2, Llama 3,
  ...): ``bpe.py`` (Hugging Face ``tokenizers`` behind llama.cpp's pre-tokenizer table).
* ``tokenizer.ggml.model == "llama"`` -- SentencePiece-style merges by token
  score with ``<0xXX>`` byte fallback (Gemma): ``spm.py`` (an own, exact implementation).

The vocabulary's tables and the reading of its metadata are in ``vocab.py``; the special
tokens -- their ids, found by text where the GGUF lacks them, and their split-out of a text
before the model runs -- in ``specials.py``. This module holds the :class:`Tokenizer` that
puts them together, and the way back: token ids -> bytes -> text.

Not reproduced: the per-model LSTRIP/RSTRIP attributes llama.cpp sets by model
name (phi-3, jina, modern-bert), and the other vocabulary types (WPM, UGM,
RWKV, PLaMo-2) -- loading such a file raises ``EngineError("unsupported_tokenizer")``.
"""

from __future__ import annotations

import codecs
import hashlib
import numbers
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from ..errors import EngineError
from ..loading.arrays import NumericArray, StringArray
from .bpe import UNICODE_TO_BYTE, BpeModel, pre_tokenizer
from .specials import FIM_ROLES, SpecialIds, SpecialTokens, detect_by_text, read_special_ids
from .spm import SPM_SPACE, SpmModel
from .vocab import (ATTR_BYTE, ATTR_CONTROL, ATTR_NORMAL, ATTR_UNDEFINED, ATTR_UNKNOWN, ATTR_UNUSED,
                    ATTR_USER_DEFINED, VocabIndex, read_attrs, read_scores, read_tokens)

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
        The str -> id lookup (:meth:`token_id`) is a :class:`~.vocab.VocabIndex` over ``tokens``.
    """

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
        self._vocab: VocabIndex | None = None
        self._specials: SpecialTokens | None = None
        self._bpe: BpeModel | None = None  # gpt2
        self._spm: SpmModel | None = None  # llama
        self._piece_cache: dict[tuple[int, bool], bytes] = {}
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
        self.tokens = tokens = read_tokens(metadata)
        self.n_vocab = n = len(tokens)
        self._vocab = vocab = VocabIndex(tokens)  # raises on a duplicate text
        self.scores = read_scores(metadata, n)
        attrs = read_attrs(metadata, n)
        ids = self._read_specials(metadata)
        detect_by_text(ids, tokens, vocab.get, attrs)  # eot/eom/fim by text, eog; attrs fixed up
        self.eot_id, self.eom_id, self._fim, self.eog_ids = ids.eot, ids.eom, ids.fim, ids.eog
        self.attrs = attrs
        merges_md = metadata.get("tokenizer.ggml.merges")
        self._merges = merges_md if isinstance(merges_md, (list, StringArray)) else []
        self._specials = SpecialTokens(tokens, attrs, vocab.get)
        if model == "gpt2":
            self._bpe = BpeModel(metadata, tokens, pre_tokenizer(metadata)[1])
        else:
            self._spm = SpmModel(tokens, vocab.get, self.scores, self.unk_id)
        return self

    def _read_specials(self, metadata: Mapping[str, Any]) -> SpecialIds:
        """Set ``pre``, the special ids and the add_* flags: the vocabulary type's defaults,
        then the GGUF's keys (llama_vocab::impl::load). The ids before detection by text."""
        if self.model == "llama":
            bos, eos, unk = 1, 2, 0
            add_bos, add_space_prefix = True, True
            self.pre = "default"
        else:
            bos, eos, unk = 11, 11, None
            add_space_prefix = False
            self.pre, pre = pre_tokenizer(metadata)
            add_bos = pre.add_bos
        self.add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", add_space_prefix))
        ids = read_special_ids(metadata, self.n_vocab, bos=bos, eos=eos, unk=unk, pad=None)
        self.bos_id, self.eos_id, self.unk_id, self.pad_id = ids.bos, ids.eos, ids.unk, ids.pad
        self.eot_id, self.eom_id = ids.eot, ids.eom
        self.add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", add_bos))
        self.add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", False))
        if self.add_bos and self.bos_id is None:
            raise EngineError("invalid_gguf", "add_bos_token is true but the BOS token is not set")
        if self.add_eos and self.eos_id is None:
            raise EngineError("invalid_gguf", "add_eos_token is true but the EOS token is not set")
        return ids

    @property
    def fingerprint(self) -> str:
        """SHA-256 hex digest of everything that decides which text a token id stands for:
        the tokenizer model and pre-tokenizer, every token text, score and attribute, the
        BPE merges, the special ids (bos, eos, eot, eom, unk, pad, fim, the end-of-generation
        set) and the add_bos / add_eos / add_space_prefix flags. Two GGUFs with the same
        vocabulary give the same digest; one changed token, merge or special id changes it.
        Computed once, on first use (~0.1 s for a 262k vocabulary)."""
        if self._fingerprint is None:
            self._fingerprint = _digest(self)
        return self._fingerprint

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
        assert self._specials is not None
        fragments = self._specials.partition(text, parse_special, protected) if text else []

        out: list[int] = []
        if add_special and self.add_bos:
            assert self.bos_id is not None
            out.append(self.bos_id)
        if self._bpe is not None:
            for f in fragments:
                if f.text is None:
                    out.append(f.token)
                    continue
                self._bpe.ids(f.text, out)
        else:
            assert self._spm is not None
            is_prev_special = True
            for f in fragments:
                if f.text is None:
                    out.append(f.token)
                    is_prev_special = True
                else:
                    t = f.text
                    if self.add_space_prefix and is_prev_special:
                        t = " " + t
                    out.extend(self._spm.fragment(t))
                    is_prev_special = False
        if add_special and self.add_eos:
            assert self.eos_id is not None
            out.append(self.eos_id)
        return out


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
                b = text.replace(SPM_SPACE, " ").encode("utf-8")
            else:
                u2b = UNICODE_TO_BYTE
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


def _digest(tok: Tokenizer) -> str:
    """:attr:`Tokenizer.fingerprint`, computed."""
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

    text(tok.model)
    text(tok.pre)
    h.update(struct.pack("<I", tok.n_vocab))
    texts(tok.tokens)
    h.update(tok.scores.array.astype("<f8").tobytes())  # == struct.pack("<{n}d", *scores)
    h.update(np.frombuffer(tok.attrs, dtype=np.uint8).astype("<i4").tobytes())  # == pack("<{n}i")
    h.update(struct.pack("<I", len(tok._merges)))
    if isinstance(tok._merges, StringArray):
        texts(tok._merges)
    else:
        for m in tok._merges:
            text(str(m))
    ids = [tok.bos_id, tok.eos_id, tok.eot_id, tok.eom_id, tok.unk_id, tok.pad_id,
           *(tok._fim.get(k) for k in FIM_ROLES), *sorted(tok.eog_ids)]
    h.update(struct.pack(f"<{len(ids)}q", *(-1 if i is None else i for i in ids)))
    h.update(bytes([tok.add_bos, tok.add_eos, tok.add_space_prefix]))
    return h.hexdigest()


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

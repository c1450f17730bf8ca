"""One-shot text calls of the model's tokenizer and chat template: Tokenize, Detokenize,
ApplyTemplate and their answers."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, ClassVar

from protocol.frame import Message
from protocol.token_ids import TokenIds


@dataclass(frozen=True, kw_only=True)
class Tokenize(Message):
    TYPE: ClassVar[str] = "tokenize"
    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


@dataclass(frozen=True, kw_only=True)
class TokenizeResult(Message):
    TYPE: ClassVar[str] = "tokenize_result"
    tokens: TokenIds
    # with_pieces: every token's bytes, concatenated; piece_ends[i] is where token i's ends
    # (so token i is pieces[piece_ends[i-1]:piece_ends[i]]). Empty without with_pieces.
    pieces: bytes = b""
    piece_ends: TokenIds = TokenIds()

    @classmethod
    def of(cls, id: str, ids: Sequence[int], pieces: Sequence[bytes] | None = None) -> TokenizeResult:
        """The answer for ``ids`` (and, when given, each id's bytes, ``len(pieces) == len(ids)``)."""
        if pieces is None:
            return cls(id=id, tokens=TokenIds.of(ids))
        return cls(id=id, tokens=TokenIds.of(ids), pieces=b"".join(pieces),
                   piece_ends=TokenIds.of(accumulate(map(len, pieces))))

    def piece_slice(self, lo: int, hi: int) -> list[bytes]:
        """The bytes of tokens ``lo..hi-1`` (with_pieces answers)."""
        ends = self.piece_ends.view()[lo:hi]
        start = self.piece_ends.view()[lo - 1] if lo > 0 else 0
        blob, out = self.pieces, []
        for e in ends:
            out.append(blob[start:e])
            start = e
        return out

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        ends = fields.get("piece_ends", TokenIds())
        if not ends:
            return "pieces without piece_ends" if fields.get("pieces") else None
        if ends.count != fields["tokens"].count:
            return f"piece_ends has {ends.count} entries for {fields['tokens'].count} tokens"
        v = ends.view()
        if v[-1] != len(fields.get("pieces", b"")):
            return f"piece_ends ends at {v[-1]}, pieces has {len(fields.get('pieces', b''))} bytes"
        return None


@dataclass(frozen=True, kw_only=True)
class Detokenize(Message):
    TYPE: ClassVar[str] = "detokenize"
    tokens: TokenIds


@dataclass(frozen=True, kw_only=True)
class DetokenizeResult(Message):
    TYPE: ClassVar[str] = "detokenize_result"
    content: str


@dataclass(frozen=True, kw_only=True)
class ApplyTemplate(Message):
    TYPE: ClassVar[str] = "apply_template"
    messages: list[dict[str, Any]]
    add_generation_prompt: bool = True
    # the template's ``tools`` (as Generate.tools), for templates with their own tool syntax
    tools: list[dict[str, Any]] | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # as Generate.template_kwargs
    chat_template: str | None = None  # as Generate.chat_template (a preset's own template)


@dataclass(frozen=True, kw_only=True)
class ApplyTemplateResult(Message):
    TYPE: ClassVar[str] = "apply_template_result"
    prompt: str

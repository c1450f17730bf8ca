"""Per-sequence decode logic: sampling, logprobs, UTF-8-safe text, stop strings, limits.

:class:`Sequence` turns one next-token logit vector into "feed this token
next" or "finished"; it knows nothing of the KV cache or of other sequences.
The batch scheduler (``scheduler.py``) owns the model calls and steps every
live sequence together; :func:`scheduler.run_one` is the single-sequence
``generate`` built on it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .constraints import Constraint
from .errors import EngineError
from .sampling import Sampler, SamplingParams, raw_logprobs
from .text.tokenizer import IncrementalUTF8Decoder, Tokenizer

__all__ = ["GenerationResult", "Sequence", "TokenEvent", "check_context"]


@dataclass
class TokenEvent:
    """One generated token, as handed to ``on_token``.

    ``text`` is the safe text delta: it may be "" while a multi-byte UTF-8
    character is incomplete or while the text could be the start of a stop
    string; text once delivered is never retracted.
    """

    id: int
    text: str
    piece: bytes  # this token's bytes as emitted (control tokens: b"", like llama-server)
    logprob: float | None  # natural log, raw distribution; None when n_probs == 0
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class GenerationResult:
    """Outcome of one generation (field meanings in docs/ENGINE-API.md)."""

    text: str
    tail: str
    tokens: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    stop_type: str  # "eos" | "word" | "limit" | "cancelled"
    stopping_word: str
    prompt_n: int
    prompt_ms: float
    predicted_n: int
    predicted_ms: float
    cache_n: int
    prompt_tokens: int
    #: the end-of-generation token that ended it: ``(token_id, logprob, [(id, logprob), ...])``,
    #: the probabilities only when n_probs > 0 (else None, []); llama.cpp reports that token too
    eog: tuple[int, float | None, list[tuple[int, float]]] | None = None


def check_context(n_ctx: int, n_prompt: int, max_tokens: int | None) -> None:
    """Raise ``EngineError("context_length_exceeded")`` unless the request fits.

    ``n_prompt + max_tokens`` must be ``<= n_ctx``; with ``max_tokens`` None
    at least one completion token must fit.
    """
    n_completion = 1 if max_tokens is None else max_tokens
    if n_prompt + n_completion > n_ctx:
        raise EngineError(
            "context_length_exceeded",
            f"This model's maximum context length is {n_ctx} tokens. However, you requested "
            f"{n_prompt + n_completion} tokens ({n_prompt} in the prompt, {n_completion} for the completion).",
            n_prompt_tokens=n_prompt, n_ctx=n_ctx,
        )


def _partial_stop_len(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class Sequence:
    """Decode-side state of one sequence: sampler, text, stop strings, limits.

    Args:
        tokenizer: for pieces and the end-of-generation set.
        params: validated sampling parameters.
        prompt: prompt token ids (penalty history).
        n_max: most tokens to generate.
        on_token: called per emitted token; returning ``False`` cancels (the scheduler's
            ``abort`` is the other way to cancel).
        n_vocab: ids the sampler may produce.
        constraint: masks every token (None: built from ``params.json_schema`` /
            ``params.grammar``, if any). When it allows nothing more the sequence
            finishes with "stop" (stop_type "eos").
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt: list[int], n_max: int,
                 on_token: Callable[[TokenEvent], Any] | None, n_vocab: int, constraint: Constraint | None = None) -> None:
        self.tok = tokenizer
        self.params = params
        self.n_max = n_max
        self.on_token = on_token
        self.sampler = Sampler(params, n_vocab, tokenizer.eog_ids, prompt)
        self.constraint = constraint if constraint is not None else Constraint.create(
            tokenizer, n_vocab, params.json_schema, params.grammar)
        self.decoder = IncrementalUTF8Decoder()
        self.stops = params.stop
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.stop_type = ""
        self.stopping_word = ""
        self.eog: tuple[int, float | None, list[tuple[int, float]]] | None = None

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def finish(self, reason: str, stop_type: str) -> None:
        self.finish_reason, self.stop_type = reason, stop_type

    def check_limits(self) -> bool:
        """Before sampling: True (and finished) if the token budget is spent."""
        if len(self.tokens) >= self.n_max:
            self.finish("length", "limit")
        return self.done

    def _probs(self, logits: np.ndarray, tid: int) -> tuple[float | None, list[tuple[int, float]]]:
        """``(logprob of tid, top n_probs)``: of the model's distribution, or with
        ``post_sampling_probs`` of the sampler chain's (``Sampler.post_sampling``)."""
        if self.params.n_probs <= 0:
            return None, []
        if self.params.post_sampling_probs:
            return self.sampler.post_sampling(tid, self.params.n_probs)
        return raw_logprobs(logits[: self.sampler.n_vocab], tid, self.params.n_probs)

    def step(self, logits: np.ndarray) -> int | None:
        """Sample from ``logits`` (float32 ``[n_vocab]``), emit, and return the token to feed next,
        or None when the sequence has finished."""
        if self.check_limits():
            return None
        allowed = self.constraint.allowed() if self.constraint is not None else None
        tid = self.sampler.sample(logits, allowed)
        if self.constraint is not None:
            self.constraint.advance(tid)
        self.sampler.accept(tid)
        self.tokens.append(tid)
        if tid in self.tok.eog_ids and not self.params.ignore_eos:
            lp, top = self._probs(logits, tid)
            self.eog = (tid, lp, top)
            self.finish("stop", "eos")  # the end-of-generation token is not text
            return None
        lp, top = self._probs(logits, tid)
        piece = self.tok.token_bytes(tid, special=False)
        old_len = len(self.text)
        self.text += self.decoder.feed(piece)
        safe_end = len(self.text)
        if self.stops:
            hit, word = -1, ""
            if len(self.text) > old_len:
                start = max(0, old_len - self.max_stop + 1)
                for s in self.stops:
                    at = self.text.find(s, start)
                    if at >= 0 and (hit < 0 or at < hit):
                        hit, word = at, s
            if hit >= 0:
                self.text = self.text[:hit]
                safe_end = hit
                self.stopping_word = word
                self.finish("stop", "word")
            else:
                safe_end = len(self.text) - _partial_stop_len(self.text, self.stops)
        safe_end = max(safe_end, self.sent)
        delta = self.text[self.sent:safe_end]
        self.sent = safe_end
        if self.on_token is not None:
            keep_going = self.on_token(TokenEvent(tid, delta, piece, lp, top))
            if keep_going is False and not self.done:
                self.finish("cancelled", "cancelled")
        if self.constraint is not None and self.constraint.done and not self.done:
            self.finish("stop", "eos")  # the constraint allows nothing more: the answer is complete
        if self.done:
            return None
        if len(self.tokens) >= self.n_max:  # no need to feed a token nobody will follow
            self.finish("length", "limit")
            return None
        return tid

    def final_text(self) -> tuple[str, str]:
        """(full text, undelivered tail) once finished."""
        if self.stop_type != "word":
            self.text += self.decoder.flush()
        return self.text, self.text[self.sent:]

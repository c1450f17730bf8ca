"""The generate loop: prefill in chunks, decode one token per forward pass.

One sequence at a time. The per-sequence decode logic (sampling, logprobs,
UTF-8-safe text, stop strings, limits, callbacks) lives in :class:`Sequence`,
whose :meth:`Sequence.step` turns one next-token logit vector into "feed this
token next" or "finished"; :func:`generate` only owns the model calls. Batching
several sequences later replaces the loop in :func:`generate` (step each live
sequence, one batched forward) without touching ``Sequence`` or the facade.

KV-cache hygiene: ``CacheState.tokens`` lists the token ids whose K/V are in
the model's cache and valid (positions ``0 .. len-1``). It grows only after a
forward pass returned; on any exception the model is truncated back to it (or
reset when that fails), so a cancelled or failed request never leaves a cache
the next one trusts without checking. A request reuses only the common prefix
of its prompt with that list, and always re-evaluates at least its last prompt
token (its logits are needed).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from .errors import EngineError
from .sampling import Sampler, SamplingParams, raw_logprobs
from .tokenizer import IncrementalUTF8Decoder, Tokenizer

__all__ = ["PREFILL_CHUNK", "CacheState", "GenerationResult", "ModelLike", "Sequence", "TokenEvent",
           "check_context", "generate"]

PREFILL_CHUNK = 256  # prompt tokens per forward pass during prefill


class ModelLike(Protocol):
    """What the loop needs from ``worker.engine.model.Model``."""

    n_ctx: int
    n_vocab: int
    n_past: int

    def forward(self, tokens: Any, all_logits: bool = False) -> np.ndarray: ...
    def truncate(self, n: int) -> None: ...
    def reset(self) -> None: ...


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


@dataclass
class CacheState:
    """Token ids whose K/V are valid in the model's cache, in position order."""

    tokens: list[int] = field(default_factory=list)


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
        on_token: called per emitted token; returning ``False`` cancels.
        should_stop: polled before each token; True cancels.
        n_vocab: ids the sampler may produce.
    """

    def __init__(self, tokenizer: Tokenizer, params: SamplingParams, prompt: list[int], n_max: int,
                 on_token: Callable[[TokenEvent], Any] | None, should_stop: Callable[[], Any] | None,
                 n_vocab: int) -> None:
        self.tok = tokenizer
        self.params = params
        self.n_max = n_max
        self.on_token = on_token
        self.should_stop = should_stop
        self.sampler = Sampler(params, n_vocab, tokenizer.eog_ids, prompt)
        self.decoder = IncrementalUTF8Decoder()
        self.stops = params.stop
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""
        self.sent = 0
        self.tokens: list[int] = []
        self.finish_reason = ""
        self.stop_type = ""
        self.stopping_word = ""

    @property
    def done(self) -> bool:
        return bool(self.finish_reason)

    def finish(self, reason: str, stop_type: str) -> None:
        self.finish_reason, self.stop_type = reason, stop_type

    def check_limits(self) -> bool:
        """Before sampling: True (and finished) if the token budget is spent or a cancel is due."""
        if len(self.tokens) >= self.n_max:
            self.finish("length", "limit")
        elif self.should_stop is not None and self.should_stop():
            self.finish("cancelled", "cancelled")
        return self.done

    def step(self, logits: np.ndarray) -> int | None:
        """Sample from ``logits`` (float32 ``[n_vocab]``), emit, and return the token to feed next,
        or None when the sequence has finished."""
        if self.check_limits():
            return None
        tid = self.sampler.sample(logits)
        self.sampler.accept(tid)
        self.tokens.append(tid)
        if tid in self.tok.eog_ids and not self.params.ignore_eos:
            self.finish("stop", "eos")  # the end-of-generation token is not text
            return None
        lp, top = (None, [])
        if self.params.n_probs > 0:
            lp, top = raw_logprobs(logits[: self.sampler.n_vocab], tid, self.params.n_probs)
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


def _restore(model: ModelLike, cache: CacheState) -> None:
    """Bring the model's cache back to the verified ``cache.tokens`` after a failure."""
    try:
        if cache.tokens:
            model.truncate(len(cache.tokens))
        else:
            model.reset()
        if model.n_past != len(cache.tokens):
            raise RuntimeError("model cache length disagrees after truncate")
    except Exception:
        cache.tokens.clear()
        model.reset()


def generate(model: ModelLike, tokenizer: Tokenizer, cache: CacheState, prompt: list[int],
             params: SamplingParams, on_token: Callable[[TokenEvent], Any] | None = None,
             should_stop: Callable[[], Any] | None = None, prefill_chunk: int = PREFILL_CHUNK) -> GenerationResult:
    """Run one generation on ``model`` for ``prompt`` (validated ids, non-empty).

    ``params`` must be validated and the context already checked
    (:func:`check_context`). Exceptions from the model or the callbacks
    propagate after the cache has been made consistent.
    """
    n_prompt = len(prompt)
    n_vocab = min(model.n_vocab, tokenizer.n_vocab)
    n_max = params.max_tokens if params.max_tokens is not None else model.n_ctx - n_prompt
    seq = Sequence(tokenizer, params, prompt, n_max, on_token, should_stop, n_vocab)

    # --- reuse the verified common prefix of the cache
    if model.n_past != len(cache.tokens):
        cache.tokens.clear()
        model.reset()
    n_keep = 0
    if params.cache_prompt:
        limit = min(len(cache.tokens), n_prompt - 1)
        while n_keep < limit and cache.tokens[n_keep] == prompt[n_keep]:
            n_keep += 1
    if n_keep < len(cache.tokens):
        del cache.tokens[n_keep:]
        try:
            if n_keep:
                model.truncate(n_keep)
            else:
                model.reset()
        except Exception:
            _restore(model, cache)
            raise

    # --- prefill
    t0 = time.perf_counter()
    logits: np.ndarray | None = None
    evaluated = 0
    try:
        for start in range(n_keep, n_prompt, prefill_chunk):
            if should_stop is not None and should_stop():
                seq.finish("cancelled", "cancelled")
                break
            chunk = prompt[start:start + prefill_chunk]
            logits = model.forward(chunk)
            cache.tokens.extend(chunk)
            evaluated += len(chunk)
    except BaseException:
        _restore(model, cache)
        raise
    t1 = time.perf_counter()

    # --- decode
    try:
        while logits is not None and not seq.done:
            tid = seq.step(logits)
            if tid is None:
                break
            logits = model.forward([tid])
            cache.tokens.append(tid)
    except BaseException:
        _restore(model, cache)
        raise
    t2 = time.perf_counter()

    text, tail = seq.final_text()
    return GenerationResult(
        text=text, tail=tail, tokens=seq.tokens, finish_reason=seq.finish_reason, stop_type=seq.stop_type,
        stopping_word=seq.stopping_word, prompt_n=evaluated, prompt_ms=(t1 - t0) * 1e3,
        predicted_n=len(seq.tokens), predicted_ms=(t2 - t1) * 1e3, cache_n=n_keep, prompt_tokens=n_prompt,
    )

"""What llama-server answers to ``/completion``: the result object of a prompt (``content``,
``tokens``, ``stop_type``, ``timings``, ``generation_settings``, ``completion_probabilities`` —
exactly one entry per generated token, also for a token ending inside a UTF-8 character: its
``bytes`` are exact), and a stream's chunks (a token's, the ``prompt_progress`` ones, the final)."""

from __future__ import annotations

import math
from collections.abc import Awaitable, Callable
from typing import Any

from protocol import Done, Generate, PromptProgress, Token
from router.dialects.llamacpp_request import Completion
from router.dialects.shared import RANDOM_SEED
from router.http.sse import sse_event
from router.serving.generation import TokenProb, prompt_progress_of, timings_of, token_probs
from router.serving.server import Generation


def token_text(piece: bytes) -> str:
    """A piece's ``token`` text as llama.cpp's server gives it (``validate_utf8`` in
    tools/server/utils.hpp): a multi-byte character cut off at the end is dropped, so a
    token that ends mid-character shows only its complete part (``bytes`` has it all)."""
    n = len(piece)
    for i in range(1, min(4, n) + 1):
        c = piece[n - i]
        if (c & 0xE0 == 0xC0 and i < 2) or (c & 0xF0 == 0xE0 and i < 3) or (c & 0xF8 == 0xF0 and i < 4):
            n -= i
            break
    return piece[:n].decode("utf-8", errors="replace")


def _prob_entry(p: TokenProb, n: int, post_sampling: bool = False) -> dict[str, Any]:
    """One ``completion_probabilities`` entry: ``logprob`` / ``top_logprobs`` (the model's), or with
    ``post_sampling_probs`` llama.cpp's ``prob`` / ``top_probs`` (the sampler chain's probabilities)."""
    if post_sampling:
        return {
            "id": p.id, "token": token_text(p.piece), "bytes": list(p.piece), "prob": _prob(p.logprob),
            "top_probs": [{"id": tid, "token": token_text(pc), "bytes": list(pc), "prob": _prob(lp)}
                          for tid, pc, lp in p.top[:n]],
        }
    return {
        "id": p.id, "token": token_text(p.piece), "bytes": list(p.piece), "logprob": p.logprob,
        "top_logprobs": [{"id": tid, "token": token_text(pc), "bytes": list(pc),
                          "logprob": lp} for tid, pc, lp in p.top[:n]],
    }


def _prob(logprob: float | None) -> float:
    return 0.0 if logprob is None or logprob == -math.inf else math.exp(logprob)


def _settings(msg: Generate, n_predict: int | None, streaming: bool) -> dict[str, Any]:
    """llama-server's ``generation_settings`` of a /completion answer: the parameters this request
    ran with (its own values, the model's config and llama.cpp's defaults), in its names."""
    return {
        "n_predict": -1 if n_predict is None else n_predict,
        "seed": RANDOM_SEED if msg.seed is None else msg.seed,
        "temperature": msg.temperature, "top_k": msg.top_k, "top_p": msg.top_p, "min_p": msg.min_p,
        "repeat_last_n": msg.repeat_last_n, "repeat_penalty": msg.repeat_penalty,
        "presence_penalty": msg.presence_penalty, "frequency_penalty": msg.frequency_penalty,
        "stop": list(msg.stop), "max_tokens": -1 if n_predict is None else n_predict, "n_keep": 0,
        "ignore_eos": msg.ignore_eos, "stream": streaming,
        "logit_bias": [[t, b if b not in (math.inf, -math.inf) else False if b < 0 else b]
                       for t, b in msg.logit_bias],
        "n_probs": msg.n_probs, "grammar": msg.grammar or "", "json_schema": msg.json_schema or "",
        "cache_prompt": msg.cache_prompt,
        "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
    }


def _eog_token(done: Done) -> list[Token]:
    """llama.cpp reports the end-of-generation token like any other (in tokens, one stream
    chunk, completion_probabilities); its piece is "" as it is not rendered."""
    if done.eog_token < 0:
        return []
    return [Token(id=done.id, text="", token_id=done.eog_token, piece=b"", logprob=done.eog_logprob,
                  top_logprobs=done.eog_top_logprobs)]


class CompletionAnswers:
    """The answers of one /completion request ``req`` on model ``name``: each prompt's result
    (:meth:`result`) or stream chunks (:meth:`formatter`, :func:`progress_chunk`). ``access``: the
    request's access-log record; with several prompts its token figures are their sums."""

    def __init__(self, name: str, req: Completion, access: dict[str, Any]) -> None:
        self.name, self.req, self.access = name, req, access
        self.settings = _settings(req.msgs[0], req.max_tokens, req.streaming)
        self._totals = {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}

    def _account(self, done: Done) -> None:
        """Several prompts: the access log's figures are the request's, every prompt's summed (each
        generation's record writes its own, last one wins, as it finishes before this runs)."""
        if len(self.req.msgs) > 1:
            self._totals["prompt_tokens"] += done.prompt_tokens
            self._totals["cached_tokens"] += done.cache_n
            self._totals["completion_tokens"] += done.completion_tokens
            self.access.update(self._totals)

    def _probs(self, tokens: list[Token]) -> list[dict[str, Any]]:
        n = self.req.n_probs
        return [_prob_entry(p, n, self.req.post_sampling) for p in token_probs(tokens, n)]

    def _summary(self, index: int, run: Generation, done: Done, tokens: list[int], content: str) -> dict[str, Any]:
        ready = run.ready
        prompt = self.req.prompts[index]
        # as llama.cpp: truncated when generation stopped because the context was full
        truncated = (done.stop_type == "limit" and ready is not None
                     and done.prompt_tokens + done.completion_tokens >= ready.n_ctx)
        return {
            "index": index, "content": content, "tokens": tokens if self.req.return_tokens else [],
            "id_slot": done.id_slot, "stop": True, "model": self.name, "tokens_predicted": done.completion_tokens,
            "tokens_evaluated": done.prompt_tokens, "generation_settings": self.settings,
            **({"prompt": prompt} if isinstance(prompt, str) else {}),
            "has_new_line": "\n" in content, "truncated": truncated,
            "stop_type": done.stop_type if done.stop_type in ("eos", "word", "limit") else "none",
            "stopping_word": done.stopping_word,
            "tokens_cached": done.prompt_tokens + done.completion_tokens,
            "timings": timings_of(done),
        }

    def result(self, index: int, run: Generation, tokens: list[Token], done: Done) -> dict[str, Any]:
        """Prompt ``index``'s result object, from its run's Tokens and Done (not streaming)."""
        self._account(done)
        text = "".join(t.text for t in tokens) + done.text
        tokens = tokens + _eog_token(done)
        out = self._summary(index, run, done, [t.token_id for t in tokens], text)
        if self.req.n_probs > 0:
            out["completion_probabilities"] = self._probs(tokens)
        return out

    def formatter(self, index: int, run: Generation) -> Callable[[Token | Done], Awaitable[list[bytes]]]:
        """The stream chunks of prompt ``index``'s frames: one per token (``tokens`` always
        carries its id, as llama.cpp's stream does), then the end-of-generation token's and the
        final result (``stop`` true)."""
        count = 0

        def chunk(token: Token) -> bytes:
            nonlocal count
            count += 1
            out: dict[str, Any] = {"index": index, "content": token.text, "tokens": [token.token_id],
                                   "stop": False, "tokens_predicted": count}
            if self.req.n_probs > 0:
                out["completion_probabilities"] = self._probs([token])
            return sse_event(out)

        async def on_frame(item: Token | Done) -> list[bytes]:
            if isinstance(item, Token):
                return [chunk(item)]
            self._account(item)
            return ([chunk(eog) for eog in _eog_token(item)]
                    + [sse_event(self._summary(index, run, item, [], item.text))])

        return on_frame


def progress_chunk(index: int) -> Callable[[PromptProgress], list[bytes]]:
    """The stream chunk of a PromptProgress frame, as llama-server's ``return_progress`` sends it
    (a partial result with no token: ``id_slot`` -1, ``tokens_evaluated`` the prompt's tokens,
    ``prompt_progress`` ``{"total", "cache", "processed", "time_ms"}``)."""

    def chunk(p: PromptProgress) -> list[bytes]:
        return [sse_event({"index": index, "content": "", "tokens": [], "stop": False, "id_slot": -1,
                           "tokens_predicted": 0, "tokens_evaluated": p.total,
                           "prompt_progress": prompt_progress_of(p)})]

    return chunk

"""A generation's frames, translated: a Generate checked on arrival and turned into the engine's
:class:`~worker.engine.SamplingParams`, and the engine's results turned into Done / Error frames."""

from __future__ import annotations

import dataclasses
import logging
import math
from typing import Any

from protocol import Done, Error, Generate, slot_filename_error
from protocol.errors import ErrorCode
from protocol.limits import GENERATE_LIMITS
from protocol.sampling import SAMPLING_FIELDS
from worker.engine import EngineError, SamplingParams

__all__ = ["INTERNAL_ERROR", "cancelled_done", "check_generate", "done_frame", "error_frame", "internal_error",
           "job_problem", "merged_done", "sampling_params"]

log = logging.getLogger("modelyard.worker")

#: Error code for an unexpected exception (an engine or worker bug), never for bad input.
INTERNAL_ERROR = ErrorCode.INTERNAL_ERROR


def error_frame(request_id: str, e: EngineError) -> Error:
    """The Error frame of an engine failure: its code and message, and for a context overflow the
    prompt's tokens and the context size (``n_prompt_tokens`` / ``n_ctx``, as llama-server gives them)."""
    return Error(id=request_id, code=e.code, message=e.message, n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)


def internal_error(request_id: str, e: BaseException, doing: str = "") -> Error:
    """The Error frame of an unexpected exception (a bug, never bad input): :data:`INTERNAL_ERROR`,
    the exception's type and text after ``doing`` (e.g. ``"generation failed: "``), at most 1000 chars."""
    return Error(id=request_id, code=INTERNAL_ERROR, message=f"{doing}{type(e).__name__}: {e}"[:1000])


def check_generate(g: Generate, n_vocab: int | None = None, sampling_vocab: int | None = None) -> SamplingParams | Error:
    """The one check of a Generate in the worker, on arrival, so a bad request is refused at once
    rather than after the generations queued before it: the Error to answer, or its sampling
    parameters, checked once the model is loaded (``n_vocab`` known: ``SamplingParams.validated``
    against ``sampling_vocab``, the engine's ``Engine.sampling_vocab``, default ``n_vocab``; the
    engine trusts that checked copy as it is) and to be checked when its job is prepared
    otherwise (a spare or a loading worker).

    Exactly one of ``prompt`` and ``messages`` must be set ("invalid_request");
    ``logit_bias`` must be ``[token_id, bias]`` pairs and, once the model is loaded, the
    sampling values must pass ``SamplingParams.validated`` ("invalid_params") and a token-id
    prompt must be non-empty ("empty_prompt") with every id in ``[0, n_vocab)``
    ("invalid_token"). Whatever needs tokenizing (context length of text and chat prompts,
    templates) is checked by the engine when the job runs. (The codec checked every field's
    type when the frame arrived.)
    """
    if (g.prompt is None) == (g.messages is None):
        return Error(id=g.id, code=ErrorCode.INVALID_REQUEST,
                     message="exactly one of 'prompt' (text or token ids) and 'messages' must be given")
    if not GENERATE_LIMITS["n"].contains(g.n):
        return Error(id=g.id, code=ErrorCode.INVALID_PARAMS, message=f"n must be {GENERATE_LIMITS['n'].describe()}, got {g.n}")
    try:
        params = sampling_params(g)
        if n_vocab is not None:
            params = params.validated(n_vocab if sampling_vocab is None else sampling_vocab)
    except EngineError as e:
        return error_frame(g.id, e)
    if n_vocab is not None and isinstance(g.prompt, list):
        if not g.prompt:
            return Error(id=g.id, code=ErrorCode.EMPTY_PROMPT, message="the prompt is empty (no token ids)")
        bad = next((t for t in g.prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            return Error(id=g.id, code=ErrorCode.INVALID_TOKEN, message=f"token id {bad} is out of the vocabulary [0, {n_vocab})")
    return params


def _bias_pairs(pairs: list[Any]) -> dict[Any, float]:
    out: dict[Any, float] = {}
    for pair in pairs:
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise EngineError("invalid_params", f"logit_bias entries must be [token_id, bias] pairs, got {pair!r:.80}")
        tid, bias = pair
        if isinstance(tid, bool) or not isinstance(tid, (int, str)):
            raise EngineError("invalid_params", f"logit_bias token id must be an integer, got {tid!r:.80}")
        if bias is False:  # llama.cpp: false bans the token
            bias = -math.inf
        elif isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise EngineError("invalid_params", f"logit_bias value must be a number or false, got {bias!r:.80}")
        out[tid] = float(bias)
    return out


def sampling_params(g: Generate) -> SamplingParams:
    """The engine's SamplingParams for ``g``: every field of ``protocol.sampling.SAMPLING_FIELDS``
    (``logit_bias`` pairs to a map).

    Raises:
        EngineError("invalid_params"): a malformed ``logit_bias`` entry. Ranges are
            checked later by ``Engine.generate``.
    """
    values = {f.name: getattr(g, f.name) for f in SAMPLING_FIELDS}
    values["logit_bias"] = _bias_pairs(g.logit_bias)
    values["stop"] = list(g.stop)
    return SamplingParams(**values)


def cancelled_done(job_id: str, completion_tokens: int = 0) -> Done:
    """Done(finish_reason="cancelled") for a job that never ran (or whose engine never returned)."""
    return Done(id=job_id, finish_reason="cancelled", stop_type="cancelled", text="", prompt_tokens=0,
                completion_tokens=completion_tokens, prompt_n=0, prompt_ms=0.0, predicted_n=completion_tokens,
                predicted_ms=0.0, cache_n=0)


def done_frame(f: Any, job_id: str, token_bytes: Any) -> Done | Error:
    """The final frame of one engine sequence ``f`` (a ``Finished``) of job ``job_id``: its Error,
    or a Done with the result's counts and timings (and the end-of-generation token's logprobs,
    their pieces from ``token_bytes(id, special=False)``)."""
    if f.error is not None:
        e = f.error
        if isinstance(e, EngineError):
            return error_frame(job_id, e)
        log.error("generation %s failed: %s: %s", f.id, type(e).__name__, e)
        return internal_error(job_id, e, "generation failed: ")
    res = f.result
    eog: dict[str, Any] = {}
    if res.eog is not None:
        tid, lp, top = res.eog
        eog = {"eog_token": int(tid), "eog_logprob": None if lp is None else float(lp),
               "eog_top_logprobs": [[int(t), float(p), token_bytes(int(t), special=False)] for t, p in top]}
    return Done(id=job_id, finish_reason=res.finish_reason, stop_type=res.stop_type,
                stopping_word=res.stopping_word, text=res.tail, prompt_tokens=int(res.prompt_tokens),
                completion_tokens=len(res.tokens), prompt_n=int(res.prompt_n), prompt_ms=float(res.prompt_ms),
                predicted_n=int(res.predicted_n), predicted_ms=float(res.predicted_ms),
                cache_n=int(res.cache_n), id_slot=int(f.id_slot), **eog)


def merged_done(dones: list[Done | Error]) -> Done:
    """One Done over the ``n`` choices of a job (``dones[0]`` a Done): the first choice's fields,
    counts summed, and every choice's ending in ``choices``."""
    first = dones[0]
    assert isinstance(first, Done)
    total = sum(d.completion_tokens for d in dones if isinstance(d, Done))
    choices = [{"index": i, "finish_reason": d.finish_reason, "stop_type": d.stop_type,
                "stopping_word": d.stopping_word, "text": d.text, "completion_tokens": d.completion_tokens}
               for i, d in enumerate(dones) if isinstance(d, Done)]
    return dataclasses.replace(
        first, completion_tokens=total, predicted_n=sum(d.predicted_n for d in dones if isinstance(d, Done)),
        prompt_n=sum(d.prompt_n for d in dones if isinstance(d, Done)), choices=choices)


def job_problem(g: Generate, n_prompt: int, can_save: bool, info: Any) -> Error | None:
    """What refuses prepared Generate ``g`` (``n_prompt`` prompt tokens) before it joins the batch,
    or None: ``save_slot_to`` without a ``slot_save_path`` (``can_save`` False), with a bad file
    name or ``n`` > 1, ``stream_state`` with ``n`` > 1 or with ``save_slot_to`` ("invalid_request"),
    or ``n`` choices whose prompts and answers together exceed the KV budget of ``info`` (the
    engine's EngineInfo: ``kv_budget_tokens``, ``n_ctx``; "kv_budget_exceeded", issue 23)."""
    save_to = g.save_slot_to
    if save_to:
        why = ("no slot_save_path is configured" if not can_save
               else slot_filename_error(save_to) or ("n must be 1" if g.n != 1 else None))
        if why is not None:
            return Error(id=g.id, code=ErrorCode.INVALID_REQUEST, message=f"save_slot_to: {why}")
    if g.stream_state and (g.n != 1 or save_to):
        return Error(id=g.id, code=ErrorCode.INVALID_REQUEST, message="stream_state: n must be 1, and not with save_slot_to")
    n = max(1, int(g.n))
    budget = int(getattr(info, "kv_budget_tokens", 0) or 0)
    if n > 1 and budget > 0:  # every choice holds its prompt and its answer at once (issue 23)
        n_ctx = int(info.n_ctx)
        answer = g.max_tokens if g.max_tokens is not None else n_ctx - n_prompt
        need = n * (n_prompt + max(0, min(answer, n_ctx - n_prompt)))
        if need > budget:
            return Error(id=g.id, code=ErrorCode.KV_BUDGET_EXCEEDED, message=(
                f"n={n} choices of {n_prompt} prompt tokens and up to {answer} answer tokens each need {need} "
                f"tokens of KV; this model's KV budget holds {budget}"))
    return None

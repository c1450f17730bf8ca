"""The token path: run Generate jobs on the engine, off the socket thread.

This module is the narrow seam between the socket loop (``worker.server``) and
the engine. The server only ever:

* ``submit(job)``s a :class:`Job` while fewer than ``capacity`` jobs run,
* ``cancel(job_id)``s a running job (sets its cancel flag; the engine sees it
  between prefill chunks and before each decoded token),
* receives events (:class:`FrameOut` for Token frames, :class:`JobFinished`
  with the job's Done or Error, :class:`Loaded`, :class:`LoadFailed`) through
  the ``post`` callable it handed in.

:class:`SerialRunner` has ``capacity == 1``: one generation at a time, the
depth-one job queue. A batching runner (several sequences stepped together in
one forward pass) can replace it with ``capacity > 1`` without touching the
server's queue logic or the router: each job still yields its own Token frames
and exactly one Done or Error.

Threading: the runner's thread owns the engine's KV cache (loading and
generation run there). It never touches the ZeroMQ socket: every frame goes
through ``post`` to the socket thread. Read-only engine calls (tokenize,
detokenize, apply_template) are made by the socket thread directly; they do
not touch the KV cache.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol import Done, Error, Generate, Message, Token
from worker.engine import EngineError, SamplingParams

log = logging.getLogger("modelyard.worker")

__all__ = [
    "FrameOut", "Job", "JobFinished", "LoadFailed", "Loaded", "RunnerEvent", "SerialRunner",
    "cancelled_done", "check_generate", "sampling_params",
]

#: Error code for an unexpected exception (an engine or worker bug), never for bad input.
INTERNAL_ERROR = "internal_error"


# ----------------------------------------------------------------------------- jobs


@dataclass
class Job:
    """One Generate request, queued or running.

    ``cancel`` is set by the socket thread (Cancel, Shutdown, parent gone) and
    read by the engine thread. ``tokens_sent`` counts Token frames posted
    (engine thread writes, socket thread reads only after the job finished or
    gave up on it). ``received`` is ``time.monotonic()`` at arrival (s).
    """

    msg: Generate
    received: float = field(default_factory=time.monotonic)
    cancel: threading.Event = field(default_factory=threading.Event)
    tokens_sent: int = 0
    cancel_at: float | None = None  # monotonic time the socket thread asked to cancel (s), for its log

    @property
    def id(self) -> str:
        return self.msg.id


# ----------------------------------------------------------------------------- events


@dataclass(frozen=True)
class FrameOut:
    """A frame for the router (a Token of the running job)."""

    msg: Message


@dataclass(frozen=True)
class JobFinished:
    """The job ended: ``final`` is its last frame (Done or Error); the runner is free for another.

    One event, so the socket thread sends the last frame and marks the job
    finished in one step (a Ping right after the Done never sees it running).
    """

    job_id: str
    final: Done | Error


@dataclass(frozen=True)
class Loaded:
    """The engine is loaded. ``load_ms``: wall time of ``Engine.load`` (ms)."""

    engine: Any
    load_ms: float


@dataclass(frozen=True)
class LoadFailed:
    """``Engine.load`` raised; ``reason`` says why ("<code>: <message>")."""

    reason: str


RunnerEvent = FrameOut | JobFinished | Loaded | LoadFailed


# ----------------------------------------------------------------------------- Generate -> engine


def check_generate(g: Generate, n_vocab: int | None = None) -> Error | None:
    """Cheap checks on arrival, so a bad request is refused at once rather than after
    the generations queued before it: an Error to answer, or None.

    Exactly one of ``prompt`` and ``messages`` must be set ("invalid_request");
    ``logit_bias`` must be ``[token_id, bias]`` pairs and, once the model is loaded
    (``n_vocab`` known), the sampling values must pass ``SamplingParams.validated``
    ("invalid_params") and a token-id prompt must be non-empty ("empty_prompt") with
    every id in ``[0, n_vocab)`` ("invalid_token"). Whatever needs tokenizing
    (context length of text and chat prompts, templates) is checked by the engine
    when the job runs.
    """
    if (g.prompt is None) == (g.messages is None):
        return Error(id=g.id, code="invalid_request",
                     message="exactly one of 'prompt' (text or token ids) and 'messages' must be given")
    try:
        params = sampling_params(g)
        if n_vocab is not None:
            params.validated(n_vocab)
    except EngineError as e:
        return Error(id=g.id, code=e.code, message=e.message)
    if n_vocab is not None and isinstance(g.prompt, list):
        if not g.prompt:
            return Error(id=g.id, code="empty_prompt", message="the prompt is empty (no token ids)")
        bad = next((t for t in g.prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            return Error(id=g.id, code="invalid_token", message=f"token id {bad} is out of the vocabulary [0, {n_vocab})")
    return None


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
    """The engine's SamplingParams for ``g`` (field by field; ``logit_bias`` pairs to a map).

    Raises:
        EngineError("invalid_params"): a malformed ``logit_bias`` entry. Ranges are
            checked later by ``Engine.generate``.
    """
    return SamplingParams(
        max_tokens=g.max_tokens, temperature=g.temperature, top_k=g.top_k, top_p=g.top_p,
        min_p=g.min_p, repeat_penalty=g.repeat_penalty, repeat_last_n=g.repeat_last_n,
        presence_penalty=g.presence_penalty, frequency_penalty=g.frequency_penalty, seed=g.seed,
        logit_bias=_bias_pairs(g.logit_bias), stop=list(g.stop), n_probs=g.n_probs,
        ignore_eos=g.ignore_eos, add_special=g.add_special, parse_special=g.parse_special,
        cache_prompt=g.cache_prompt,
    )


def cancelled_done(job_id: str, completion_tokens: int = 0) -> Done:
    """Done(finish_reason="cancelled") for a job that never ran (or whose engine never returned)."""
    return Done(id=job_id, finish_reason="cancelled", stop_type="cancelled", text="", prompt_tokens=0,
                completion_tokens=completion_tokens, prompt_n=0, prompt_ms=0.0, predicted_n=completion_tokens,
                predicted_ms=0.0, cache_n=0)


# ----------------------------------------------------------------------------- the runner


class SerialRunner:
    """Loads the engine, then runs one Generate job at a time, in its own thread.

    Args:
        loader: ``Engine.load``-like callable ``(gguf_path, n_ctx, chat_template) -> engine``.
        gguf_path, n_ctx, chat_template: passed to ``loader``.
        post: called (from the runner thread) with each :class:`RunnerEvent`;
            must be thread-safe and must not block.

    Per job it posts zero or more FrameOut(Token), then exactly one
    JobFinished carrying the job's Done or Error. After a job that raised anything
    but EngineError the KV cache is reset (the engine already restores a
    verified cache; this is belt and braces).
    """

    capacity = 1

    def __init__(self, loader: Callable[..., Any], gguf_path: str, n_ctx: int | None,
                 chat_template: str | None, post: Callable[[RunnerEvent], None]) -> None:
        self._loader = loader
        self._gguf_path = gguf_path
        self._n_ctx = n_ctx
        self._chat_template = chat_template
        self._post = post
        self._inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._running: dict[str, Job] = {}
        self._lock = threading.Lock()
        self.engine: Any = None
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)

    # -- socket-thread side

    def start(self) -> None:
        """Start the thread; it loads the engine and posts Loaded or LoadFailed."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Run ``job`` next. Only call while ``len(running) < capacity`` and after Loaded."""
        with self._lock:
            if len(self._running) >= self.capacity:
                raise RuntimeError("runner is full")  # a server bug, never a request's fault
            self._running[job.id] = job
        self._inbox.put(job)

    def cancel(self, job_id: str) -> bool:
        """Ask running job ``job_id`` to stop; False if it is not running."""
        with self._lock:
            job = self._running.get(job_id)
        if job is None:
            return False
        job.cancel.set()
        return True

    def stop(self, timeout_s: float) -> bool:
        """Cancel everything, end the thread; True if it ended within ``timeout_s`` seconds."""
        with self._lock:
            jobs = list(self._running.values())
        for job in jobs:
            job.cancel.set()
        self._inbox.put(None)
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- runner-thread side

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._loader(self._gguf_path, self._n_ctx, self._chat_template)
        except EngineError as e:
            self._post(LoadFailed(f"{e.code}: {e.message}"))
            return
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, never a silent death
            log.error("model load crashed:\n%s", traceback.format_exc())
            self._post(LoadFailed(f"{type(e).__name__}: {e}"))
            return
        self.engine = engine
        self._post(Loaded(engine, (time.perf_counter() - t0) * 1e3))
        while True:
            job = self._inbox.get()
            if job is None:
                return
            try:
                last: Done | Error = self._run(job)
            except Exception as e:  # noqa: BLE001 - a bug here must still end the job with a frame
                log.error("job %s crashed:\n%s", job.id, traceback.format_exc())
                last = Error(id=job.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000])
            with self._lock:
                self._running.pop(job.id, None)
            self._post(JobFinished(job.id, last))

    def _run(self, job: Job) -> Done | Error:
        g = job.msg
        engine = self.engine
        if job.cancel.is_set():  # cancelled between submit and start
            return cancelled_done(g.id)

        def on_token(ev: Any) -> bool:
            # [id, logprob, piece]: the alternatives' exact bytes (a partial UTF-8 piece
            # cannot be recovered from a detokenized string), same convention as ev.piece.
            top = [[int(t), float(lp), engine.token_bytes(int(t), special=False)] for t, lp in ev.top_logprobs]
            self._post(FrameOut(Token(id=g.id, text=ev.text, token_id=int(ev.id), piece=bytes(ev.piece),
                                      logprob=None if ev.logprob is None else float(ev.logprob),
                                      top_logprobs=top)))
            job.tokens_sent += 1
            return not job.cancel.is_set()

        try:
            params = sampling_params(g)
            prompt: str | list[int]
            if g.messages is not None:
                prompt = engine.tokenize_chat(g.messages)
            else:
                assert g.prompt is not None
                prompt = g.prompt
            res = engine.generate(prompt, params, on_token=on_token, should_stop=job.cancel.is_set)
        except EngineError as e:
            return Error(id=g.id, code=e.code, message=e.message)
        except Exception as e:  # noqa: BLE001 - a request never kills the worker
            log.error("generation %s failed:\n%s", g.id, traceback.format_exc())
            try:
                engine.reset_cache()
            except Exception:  # noqa: BLE001
                log.error("reset_cache failed after an error:\n%s", traceback.format_exc())
            return Error(id=g.id, code=INTERNAL_ERROR, message=f"generation failed: {type(e).__name__}: {e}"[:1000])
        return Done(id=g.id, finish_reason=res.finish_reason, stop_type=res.stop_type,
                    stopping_word=res.stopping_word, text=res.tail, prompt_tokens=int(res.prompt_tokens),
                    completion_tokens=len(res.tokens), prompt_n=int(res.prompt_n), prompt_ms=float(res.prompt_ms),
                    predicted_n=int(res.predicted_n), predicted_ms=float(res.predicted_ms),
                    cache_n=int(res.cache_n))

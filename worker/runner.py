"""The token path: run Generate jobs on the engine's batch scheduler, off the socket thread.

This module is the narrow seam between the socket loop (``worker.server``) and
the engine. The server only ever:

* ``submit(job)``s a :class:`Job` while fewer than ``capacity`` jobs run
  (``capacity`` = the engine's KV slots, config ``parallel``),
* ``cancel(job_id)``s a running job (sets its cancel flag; the engine thread
  aborts it before the next step, so it leaves the batch within one step and
  the others go on unchanged),
* reads :attr:`BatchRunner.snapshot` (slots and KV use after the last step,
  published by the engine thread; reading it never waits for a step),
* receives events (:class:`FrameOut` for Token frames, :class:`JobFinished`
  with the job's Done or Error, :class:`Loaded`, :class:`LoadFailed`) through
  the ``post`` callable it handed in.

Threads: the *engine* thread loads the model, then loops: take prepared jobs,
``engine.add`` them, abort cancelled ones, ``engine.step()`` (one batched
forward over every live sequence), post the finished. The *prep* thread turns
each submitted Generate into prompt ids (chat template, tokenizer, checks),
so a large prompt being tokenized never stalls the running streams' steps.
Neither touches the ZeroMQ socket: every frame goes through ``post``.
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
    "BatchRunner", "FrameOut", "Job", "JobFinished", "LoadFailed", "Loaded", "RunnerEvent", "RunnerSnapshot",
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
        cache_prompt=g.cache_prompt, json_schema=g.json_schema, grammar=g.grammar,
    )


def cancelled_done(job_id: str, completion_tokens: int = 0) -> Done:
    """Done(finish_reason="cancelled") for a job that never ran (or whose engine never returned)."""
    return Done(id=job_id, finish_reason="cancelled", stop_type="cancelled", text="", prompt_tokens=0,
                completion_tokens=completion_tokens, prompt_n=0, prompt_ms=0.0, predicted_n=completion_tokens,
                predicted_ms=0.0, cache_n=0)


# ----------------------------------------------------------------------------- the runner


@dataclass(frozen=True)
class RunnerSnapshot:
    """Slots and KV use after the engine's last step (Pong, /slots)."""

    slots: list[dict[str, Any]] = field(default_factory=list)  # protocol Pong.slots maps
    kv_tokens: int = 0
    kv_budget_tokens: int = 0


class BatchRunner:
    """Loads the engine, then runs up to ``capacity`` Generate jobs at once, stepped together.

    Args:
        loader: ``Engine.load``-like callable ``(gguf_path, n_ctx, chat_template, parallel=,
            kv_budget_mib=) -> engine``.
        gguf_path, n_ctx, chat_template, parallel, kv_budget_mib: passed to ``loader``.
        post: called (from the runner threads) with each :class:`RunnerEvent`;
            must be thread-safe and must not block.

    Per job it posts zero or more FrameOut(Token), then exactly one
    JobFinished carrying the job's Done or Error.
    """

    def __init__(self, loader: Callable[..., Any], gguf_path: str, n_ctx: int | None,
                 chat_template: str | None, post: Callable[[RunnerEvent], None], *, parallel: int = 1,
                 kv_budget_mib: float | None = None) -> None:
        self._loader = loader
        self._gguf_path = gguf_path
        self._n_ctx = n_ctx
        self._chat_template = chat_template
        self._parallel = parallel
        self._kv_budget_mib = kv_budget_mib
        self._post = post
        self.capacity = parallel
        self._prep_inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[tuple[Job, list[int] | None, Any] | None] = queue.SimpleQueue()
        self._running: dict[str, Job] = {}
        self._in_engine: set[str] = set()  # ids added to the engine and not yet ended (engine thread only)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self.engine: Any = None
        self.snapshot = RunnerSnapshot()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._prep = threading.Thread(target=self._prep_main, name="prep", daemon=True)

    # -- socket-thread side

    def start(self) -> None:
        """Start the threads; the engine thread loads the engine and posts Loaded or LoadFailed."""
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Run ``job`` as soon as it is prepared. Only call while ``len(running) < capacity``
        and after Loaded."""
        with self._lock:
            if len(self._running) >= self.capacity:
                raise RuntimeError("runner is full")  # a server bug, never a request's fault
            self._running[job.id] = job
        self._prep_inbox.put(job)

    def cancel(self, job_id: str) -> bool:
        """Ask running job ``job_id`` to stop; False if it is not running."""
        with self._lock:
            job = self._running.get(job_id)
        if job is None:
            return False
        job.cancel.set()
        self._wake.set()
        return True

    def stop(self, timeout_s: float) -> bool:
        """Cancel everything, end the threads; True if the engine thread ended within ``timeout_s`` s."""
        with self._lock:
            jobs = list(self._running.values())
        for job in jobs:
            job.cancel.set()
        self._stop = True
        self._prep_inbox.put(None)
        self._ready.put(None)
        self._wake.set()
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- prep thread

    def _prep_main(self) -> None:
        while True:
            job = self._prep_inbox.get()
            if job is None:
                return
            try:
                item = self._prepare(job)
            except Exception as e:  # noqa: BLE001 - a bug here must still end the job with a frame
                log.error("preparing %s crashed:\n%s", job.id, traceback.format_exc())
                item = (job, None, Error(id=job.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000]))
            self._ready.put(item)
            self._wake.set()

    def _prepare(self, job: Job) -> tuple[Job, list[int] | None, Any]:
        """``(job, prompt ids, params)`` or ``(job, None, Error)``."""
        g = job.msg
        engine = self.engine
        try:
            params = sampling_params(g)
            prompt: str | list[int]
            if g.messages is not None:
                prompt = engine.tokenize_chat(g.messages)
            else:
                assert g.prompt is not None
                prompt = g.prompt
            ids, p = engine.prepare(prompt, params)
        except EngineError as e:
            return job, None, Error(id=g.id, code=e.code, message=e.message)
        return job, ids, p

    # -- engine thread

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._loader(self._gguf_path, self._n_ctx, self._chat_template, parallel=self._parallel,
                                  kv_budget_mib=self._kv_budget_mib)
        except EngineError as e:
            self._post(LoadFailed(f"{e.code}: {e.message}"))
            return
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, never a silent death
            log.error("model load crashed:\n%s", traceback.format_exc())
            self._post(LoadFailed(f"{type(e).__name__}: {e}"))
            return
        self.engine = engine
        self.capacity = max(1, int(getattr(engine.info, "n_parallel", self._parallel) or 1))
        self._publish()
        self._prep.start()
        self._post(Loaded(engine, (time.perf_counter() - t0) * 1e3))
        aborted: set[str] = set()
        while not self._stop:
            if not engine.has_work:
                self._wake.wait(0.5)
            self._wake.clear()
            while True:  # prepared jobs join the batch at this step
                try:
                    item = self._ready.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    return
                self._add(*item)
            with self._lock:
                cancelled = [j.id for j in self._running.values() if j.cancel.is_set() and j.id not in aborted]
            for jid in cancelled:
                if engine.abort(jid):
                    aborted.add(jid)
            if not engine.has_work:
                continue
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - the scheduler itself failed: end every live job
                log.error("engine step crashed:\n%s", traceback.format_exc())
                for jid in list(self._in_engine):
                    self._end(jid, Error(id=jid, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000]))
                self._reset(engine)
                continue
            for f in finished:
                aborted.discard(f.id)
                self._end(f.id, self._final(f))
            self._publish()

    def _add(self, job: Job, ids: list[int] | None, p: Any) -> None:
        if ids is None:
            self._end(job.id, p)
            return
        if job.cancel.is_set():  # cancelled while being prepared
            self._end(job.id, cancelled_done(job.id))
            return
        engine = self.engine

        def on_token(ev: Any) -> bool:
            # [id, logprob, piece]: the alternatives' exact bytes (a partial UTF-8 piece
            # cannot be recovered from a detokenized string), same convention as ev.piece.
            top = [[int(t), float(lp), engine.token_bytes(int(t), special=False)] for t, lp in ev.top_logprobs]
            self._post(FrameOut(Token(id=job.id, text=ev.text, token_id=int(ev.id), piece=bytes(ev.piece),
                                      logprob=None if ev.logprob is None else float(ev.logprob),
                                      top_logprobs=top)))
            job.tokens_sent += 1
            return not job.cancel.is_set()

        try:
            engine.add(job.id, ids, p, on_token)
            self._in_engine.add(job.id)
        except EngineError as e:
            self._end(job.id, Error(id=job.id, code=e.code, message=e.message))

    def _final(self, f: Any) -> Done | Error:
        if f.error is not None:
            e = f.error
            if isinstance(e, EngineError):
                return Error(id=f.id, code=e.code, message=e.message)
            log.error("generation %s failed: %s: %s", f.id, type(e).__name__, e)
            return Error(id=f.id, code=INTERNAL_ERROR, message=f"generation failed: {type(e).__name__}: {e}"[:1000])
        res = f.result
        return Done(id=f.id, finish_reason=res.finish_reason, stop_type=res.stop_type,
                    stopping_word=res.stopping_word, text=res.tail, prompt_tokens=int(res.prompt_tokens),
                    completion_tokens=len(res.tokens), prompt_n=int(res.prompt_n), prompt_ms=float(res.prompt_ms),
                    predicted_n=int(res.predicted_n), predicted_ms=float(res.predicted_ms),
                    cache_n=int(res.cache_n), id_slot=int(f.id_slot))

    def _end(self, job_id: str, final: Done | Error) -> None:
        self._in_engine.discard(job_id)
        with self._lock:
            self._running.pop(job_id, None)
        self._post(JobFinished(job_id, final))

    def _reset(self, engine: Any) -> None:
        try:
            engine.reset_cache()
        except Exception:  # noqa: BLE001
            log.error("reset_cache failed after an error:\n%s", traceback.format_exc())

    def _publish(self) -> None:
        eng = self.engine
        try:
            slots = [{"id": int(s.id), "id_task": s.id_task, "is_processing": bool(s.is_processing),
                      "n_past": int(s.n_past)} for s in eng.slots()]
            self.snapshot = RunnerSnapshot(slots, int(eng.kv_tokens), int(getattr(eng.info, "kv_budget_tokens", 0)))
        except Exception:  # noqa: BLE001 - a snapshot is informational
            log.debug("snapshot failed:\n%s", traceback.format_exc())

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
The *text* thread answers Tokenize / Detokenize / ApplyTemplate, so three 7 MB
``/tokenize`` calls never hold up a Generate's preparation (nor, the tokenizer
releasing the GIL on long texts, the socket thread's Pongs and Token relaying).
None touches the ZeroMQ socket: every frame goes through ``post``.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import math
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol.limits import GENERATE_LIMITS
from protocol import (
    ApplyTemplate,
    ApplyTemplateResult,
    Detokenize,
    DetokenizeResult,
    Done,
    Error,
    Generate,
    Message,
    Token,
    Tokenize,
    TokenizeResult,
)
from protocol.errors import ErrorCode
from worker.engine import EngineError, SamplingParams
from worker.threads import apply_blas_threads

log = logging.getLogger("modelyard.worker")

__all__ = [
    "BatchRunner", "FrameOut", "Job", "JobFinished", "LoadFailed", "Loaded", "RunnerEvent", "RunnerSnapshot",
    "cancelled_done", "check_generate", "sampling_params",
]

#: Error code for an unexpected exception (an engine or worker bug), never for bad input.
INTERNAL_ERROR = ErrorCode.INTERNAL_ERROR


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
        return Error(id=g.id, code=ErrorCode.INVALID_REQUEST,
                     message="exactly one of 'prompt' (text or token ids) and 'messages' must be given")
    if not GENERATE_LIMITS["n"].contains(g.n):
        return Error(id=g.id, code=ErrorCode.INVALID_PARAMS, message=f"n must be {GENERATE_LIMITS['n'].describe()}, got {g.n}")
    try:
        params = sampling_params(g)
        if n_vocab is not None:
            params.validated(n_vocab)
    except EngineError as e:
        return Error(id=g.id, code=e.code, message=e.message)
    if n_vocab is not None and isinstance(g.prompt, list):
        if not g.prompt:
            return Error(id=g.id, code=ErrorCode.EMPTY_PROMPT, message="the prompt is empty (no token ids)")
        bad = next((t for t in g.prompt if not 0 <= t < n_vocab), None)
        if bad is not None:
            return Error(id=g.id, code=ErrorCode.INVALID_TOKEN, message=f"token id {bad} is out of the vocabulary [0, {n_vocab})")
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


@dataclass(eq=False)
class _Run:
    """Engine-thread bookkeeping of one job: its ``n`` choices (engine sequences).

    Choice 0 is added first; the others join once its prompt is in the KV (its
    first token), so they copy that prefix instead of prefilling it again.
    ``finished[i]`` is the engine's Finished for choice i (None: cancelled before it was added).
    """

    job: Job
    ids: list[int]
    params: Any
    n: int
    added: int = 0
    first_token: bool = False
    aborted: bool = False
    finished: dict[int, Any] = field(default_factory=dict)

    def seq_id(self, i: int) -> str:
        return self.job.id if self.n == 1 else f"{self.job.id}#{i}"


def give_back_memory() -> None:
    """Return freed heap to the OS (glibc ``malloc_trim``): a 7 MB text leaves ~800 MB of
    freed tokenizer buffers in malloc's arenas, which RSS would otherwise keep showing."""
    try:
        _libc().malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None)
    return _LIBC


#: A Tokenize text at least this long (chars) gives its memory back once answered.
LARGE_TEXT_CHARS = 1 << 20


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
        self._text_inbox: queue.SimpleQueue[Tokenize | Detokenize | ApplyTemplate | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[tuple[Job, list[int] | None, Any] | None] = queue.SimpleQueue()
        self._running: dict[str, Job] = {}
        self._runs: dict[str, _Run] = {}  # job id -> its sequences in the engine (engine thread only)
        self._seq: dict[str, tuple[_Run, int]] = {}  # engine sequence id -> (run, choice index)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._threads_wanted = 0  # BLAS threads asked by the router (Ping.threads), applied between steps
        self._stop = False
        self.engine: Any = None
        self.snapshot = RunnerSnapshot()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        self._prep = threading.Thread(target=self._prep_main, name="prep", daemon=True)
        self._text = threading.Thread(target=self._text_main, name="text", daemon=True)

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

    def submit_text_op(self, msg: Tokenize | Detokenize | ApplyTemplate) -> None:
        """Answer ``msg`` from the text thread (a FrameOut with its result or Error), in
        submission order. After Loaded."""
        self._text_inbox.put(msg)

    def request_threads(self, n: int) -> None:
        """Use ``n`` BLAS threads (0: unchanged). Applied by the engine thread between two steps,
        never while a BLAS call of a forward pass is running."""
        if n > 0:
            self._threads_wanted = n
            self._wake.set()

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
        self._text_inbox.put(None)
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

    # -- text thread

    def _text_main(self) -> None:
        while True:
            msg = self._text_inbox.get()
            if msg is None:
                return
            answer = self._text_op(msg)
            large = isinstance(msg, Tokenize) and len(msg.content) >= LARGE_TEXT_CHARS
            self._post(FrameOut(answer))
            del answer
            if large:
                give_back_memory()

    def _text_op(self, msg: Tokenize | Detokenize | ApplyTemplate) -> Message:
        eng = self.engine
        try:
            if isinstance(msg, Tokenize):
                ids = eng.tokenize(msg.content, add_special=msg.add_special, parse_special=msg.parse_special)
                if type(ids) is not list or not all(type(t) is int for t in ids[:1]):
                    ids = [int(t) for t in ids]  # plain ints for msgpack (a list of ints is kept as is)
                pieces = [bytes(eng.token_bytes(t)) for t in ids] if msg.with_pieces else []
                return TokenizeResult(id=msg.id, tokens=ids, pieces=pieces)
            if isinstance(msg, Detokenize):
                return DetokenizeResult(id=msg.id, content=str(eng.detokenize(msg.tokens)))
            return ApplyTemplateResult(id=msg.id, prompt=str(eng.apply_template(
                msg.messages, add_generation_prompt=msg.add_generation_prompt)))
        except EngineError as e:
            return Error(id=msg.id, code=e.code, message=e.message)
        except Exception as e:  # noqa: BLE001 - a request never kills the worker
            log.error("%s %s failed:\n%s", msg.TYPE, msg.id, traceback.format_exc())
            return Error(id=msg.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000])

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
        self._text.start()
        self._post(Loaded(engine, (time.perf_counter() - t0) * 1e3))
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
            for run in list(self._runs.values()):
                if run.job.cancel.is_set() and not run.aborted:
                    self._abort(run)
                elif run.added < run.n and (run.first_token or 0 in run.finished):
                    self._add_choices(run)  # choice 0's prompt is in the KV: the others copy it
            if self._threads_wanted:
                apply_blas_threads(self._threads_wanted)
                self._threads_wanted = 0
            if not engine.has_work:
                continue
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - the scheduler itself failed: end every live job
                log.error("engine step crashed:\n%s", traceback.format_exc())
                for run in list(self._runs.values()):
                    self._end(run.job.id, Error(id=run.job.id, code=INTERNAL_ERROR,
                                                message=f"{type(e).__name__}: {e}"[:1000]))
                self._seq.clear()
                self._reset(engine)
                continue
            for f in finished:
                got = self._seq.pop(f.id, None)
                if got is None:
                    continue  # a choice of a job that already ended (an error in another choice)
                run, index = got
                run.finished[index] = f
                if f.error is not None or len(run.finished) == run.n:
                    self._finish_run(run, f if f.error is not None else None)
            self._publish()

    def _add(self, job: Job, ids: list[int] | None, p: Any) -> None:
        if ids is None:
            self._end(job.id, p)
            return
        if job.cancel.is_set():  # cancelled while being prepared
            self._end(job.id, cancelled_done(job.id))
            return
        run = _Run(job, ids, p, max(1, int(job.msg.n)))
        self._runs[job.id] = run
        self._add_choices(run, upto=1)

    def _add_choices(self, run: _Run, upto: int | None = None) -> None:
        """Add choices ``run.added .. upto-1`` (all when None) to the engine."""
        engine = self.engine
        job = run.job
        for i in range(run.added, run.n if upto is None else upto):
            params = run.params
            if i and params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + i)
            sid = run.seq_id(i)

            def on_token(ev: Any, i: int = i) -> bool:
                # [id, logprob, piece]: the alternatives' exact bytes (a partial UTF-8 piece
                # cannot be recovered from a detokenized string), same convention as ev.piece.
                top = [[int(t), float(lp), engine.token_bytes(int(t), special=False)] for t, lp in ev.top_logprobs]
                self._post(FrameOut(Token(id=job.id, text=ev.text, token_id=int(ev.id), piece=bytes(ev.piece),
                                          logprob=None if ev.logprob is None else float(ev.logprob),
                                          top_logprobs=top, index=i)))
                job.tokens_sent += 1
                if i == 0:
                    run.first_token = True
                return not job.cancel.is_set()

            try:
                engine.add(sid, run.ids, params, on_token)
            except EngineError as e:
                self._abort(run)
                self._end(job.id, Error(id=job.id, code=e.code, message=e.message))
                return
            self._seq[sid] = (run, i)
            run.added = i + 1

    def _abort(self, run: _Run) -> None:
        """Cancel every added choice of ``run``; the ones never added count as cancelled."""
        run.aborted = True
        for i in range(run.added):
            self.engine.abort(run.seq_id(i))
        for i in range(run.added, run.n):
            run.finished.setdefault(i, None)
        run.added = run.n
        if len(run.finished) == run.n and all(f is None for f in run.finished.values()):
            self._finish_run(run, None)

    def _finish_run(self, run: _Run, failed: Any) -> None:
        """The job's final frame: the failing choice's Error, or one Done over every choice."""
        job_id = run.job.id
        for i in range(run.n):  # choices still in the engine are dropped with the job
            got = self._seq.pop(run.seq_id(i), None)
            if got is not None:
                self.engine.abort(run.seq_id(i))
        if failed is not None:
            self._end(job_id, self._final(failed, job_id))
            return
        dones = [self._final(run.finished[i], job_id) if run.finished.get(i) is not None
                 else cancelled_done(job_id) for i in range(run.n)]
        first = dones[0]
        assert isinstance(first, Done)
        if run.n == 1:
            self._end(job_id, first)
            return
        total = sum(d.completion_tokens for d in dones if isinstance(d, Done))
        choices = [{"index": i, "finish_reason": d.finish_reason, "stop_type": d.stop_type,
                    "stopping_word": d.stopping_word, "text": d.text, "completion_tokens": d.completion_tokens}
                   for i, d in enumerate(dones) if isinstance(d, Done)]
        self._end(job_id, dataclasses.replace(
            first, completion_tokens=total, predicted_n=sum(d.predicted_n for d in dones if isinstance(d, Done)),
            prompt_n=sum(d.prompt_n for d in dones if isinstance(d, Done)), choices=choices))

    def _final(self, f: Any, job_id: str) -> Done | Error:
        if f.error is not None:
            e = f.error
            if isinstance(e, EngineError):
                return Error(id=job_id, code=e.code, message=e.message)
            log.error("generation %s failed: %s: %s", f.id, type(e).__name__, e)
            return Error(id=job_id, code=INTERNAL_ERROR, message=f"generation failed: {type(e).__name__}: {e}"[:1000])
        res = f.result
        return Done(id=job_id, finish_reason=res.finish_reason, stop_type=res.stop_type,
                    stopping_word=res.stopping_word, text=res.tail, prompt_tokens=int(res.prompt_tokens),
                    completion_tokens=len(res.tokens), prompt_n=int(res.prompt_n), prompt_ms=float(res.prompt_ms),
                    predicted_n=int(res.predicted_n), predicted_ms=float(res.predicted_ms),
                    cache_n=int(res.cache_n), id_slot=int(f.id_slot))

    def _end(self, job_id: str, final: Done | Error) -> None:
        self._runs.pop(job_id, None)
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

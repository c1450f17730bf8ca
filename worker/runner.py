"""The token path: run Generate jobs on the engine's batch scheduler, off the socket thread.

This module is the narrow seam between the socket loop (``worker.server``) and
the engine. The server only ever:

* ``submit(job)``s a :class:`Job` while fewer than ``capacity`` jobs run
  (``capacity`` = the engine's KV slots, config ``parallel``),
* ``cancel(job_id)``s a running job (sets its cancel flag, which the engine
  polls before each step and between the layers of a forward pass: it leaves the
  batch without waiting for the pass running now, and the others go on unchanged),
* reads :attr:`BatchRunner.snapshot` (slots and KV use after the last step,
  published by the engine thread; reading it never waits for a step),
* receives events (:class:`FrameOut` for Token frames, :class:`JobFinished`
  with the job's Done or Error, :class:`LoadStep`, :class:`Loaded`, :class:`LoadFailed`) through
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
from pathlib import Path
from typing import Any

from protocol.limits import GENERATE_LIMITS
from protocol import (
    Accepted,
    ApplyTemplate,
    ApplyTemplateResult,
    Detokenize,
    DetokenizeResult,
    Done,
    Error,
    Generate,
    Message,
    SlotAction,
    SlotActionResult,
    Token,
    Tokenize,
    TokenizeResult,
    slot_filename_error,
)
from protocol.errors import ErrorCode
from worker.engine import EngineError, SamplingParams
from worker.threads import apply_blas_threads

log = logging.getLogger("modelyard.worker")


def error_frame(request_id: str, e: EngineError) -> Error:
    """The Error frame of an engine failure: its code and message, and for a context overflow the
    prompt's tokens and the context size (``n_prompt_tokens`` / ``n_ctx``, as llama-server gives them)."""
    return Error(id=request_id, code=e.code, message=e.message, n_prompt_tokens=e.n_prompt_tokens, n_ctx=e.n_ctx)

__all__ = [
    "BatchRunner", "FrameOut", "Job", "JobFinished", "LoadFailed", "LoadStep", "Loaded", "Persisted", "RunnerEvent",
    "RunnerSnapshot", "StateOut", "cancelled_done", "check_generate", "sampling_params",
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
class LoadStep:
    """A step of ``Engine.load`` (its ``progress`` callback, thinned out: every stage's
    first and last step, at most one in LOAD_STEP_INTERVAL_S between them)."""

    stage: str
    done: int
    total: int


#: Least time between two LoadStep events of one stage (seconds).
LOAD_STEP_INTERVAL_S = 0.25


@dataclass(frozen=True)
class Loaded:
    """The engine is loaded. ``load_ms``: wall time of ``Engine.load`` (ms)."""

    engine: Any
    load_ms: float


@dataclass(frozen=True)
class LoadFailed:
    """``Engine.load`` raised; ``reason`` says why ("<code>: <message>")."""

    reason: str


@dataclass(frozen=True)
class Persisted:
    """The idle KV entries were saved to the KV cache directory (or there was nothing to do):
    ``files`` written, ``n_bytes`` written, ``ms`` wall time."""

    files: int = 0
    n_bytes: int = 0
    ms: float = 0.0


@dataclass(frozen=True)
class StateOut:
    """A ``stream_state`` generation ended: ``state`` is its KV entry (a copy, taken in the step
    it ended), ``final`` its Done; the socket thread streams the state, then sends ``final``.
    Like JobFinished, it frees the runner for another job."""

    job_id: str
    state: Any
    final: Done


RunnerEvent = FrameOut | JobFinished | LoadStep | Loaded | LoadFailed | Persisted | StateOut


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
        return error_frame(g.id, e)
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
        post_sampling_probs=g.post_sampling_probs,
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


@dataclass(eq=False)
class _SlotOp:
    """One slot action on its way: ``state`` is the slot's copy (save, after the engine thread
    took it) or the validated file's content (restore, after the kvio thread read it)."""

    msg: SlotAction
    t0: float  # perf_counter at arrival
    state: Any = None
    n_bytes: int = 0
    final: Any = None  # a Generate's Done (save_slot_to): posted once the file is written
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
    n_decode_total: int = 0  # the engine's forward passes (Pong.n_decode_total)
    n_busy_slots_total: int = 0  # slots busy at each, summed (Pong.n_busy_slots_total)


class BatchRunner:
    """Loads the engine, then runs up to ``capacity`` Generate jobs at once, stepped together.

    Args:
        loader: ``Engine.load``-like callable ``(gguf_path, n_ctx, chat_template, parallel=,
            kv_budget_mib=, weights=[, n_ubatch=]) -> engine``.
        gguf_path, n_ctx, chat_template, parallel, kv_budget_mib, weights: passed to ``loader``;
        n_ubatch too when it is not None.
        post: called (from the runner threads) with each :class:`RunnerEvent`;
            must be thread-safe and must not block.

    Per job it posts zero or more FrameOut(Token), then exactly one
    JobFinished carrying the job's Done or Error.
    """

    def __init__(self, loader: Callable[..., Any], gguf_path: str, n_ctx: int | None,
                 chat_template: str | None, post: Callable[[RunnerEvent], None], *, parallel: int = 1,
                 kv_budget_mib: float | None = None, weights: str | None = None, n_ubatch: int | None = None,
                 slot_save_path: str | None = None, kv_cache_dir: str | None = None, kv_cache_mib: float = 0.0) -> None:
        self._loader = loader
        self._weights = weights
        self._extra: dict[str, Any] = {} if n_ubatch is None else {"n_ubatch": n_ubatch}
        self._gguf_path = gguf_path
        self._n_ctx = n_ctx
        self._chat_template = chat_template
        self._parallel = parallel
        self._kv_budget_mib = kv_budget_mib
        self._post = post
        self.capacity = parallel
        self._prep_inbox: queue.SimpleQueue[Job | None] = queue.SimpleQueue()
        self._text_inbox: queue.SimpleQueue[Tokenize | Detokenize | ApplyTemplate | None] = queue.SimpleQueue()
        self._ready: queue.SimpleQueue[tuple[Job, list[int] | None, Any, Any] | None] = queue.SimpleQueue()
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
        # KV states (slot actions, the cache kept across restarts)
        self.slot_save_path = Path(slot_save_path) if slot_save_path else None
        self._kv_cache_dir = kv_cache_dir
        self._kv_cache_bytes = int(max(0.0, kv_cache_mib) * 2**20)
        self.disk: Any = None  # worker.engine.kv.disk.DiskCache once loaded (kv_cache_dir set)
        self._io_inbox: queue.SimpleQueue[Any] = queue.SimpleQueue()  # file work of slot actions
        self._io = threading.Thread(target=self._io_main, name="kvio", daemon=True)
        self._slot_ops: queue.SimpleQueue[_SlotOp] = queue.SimpleQueue()  # for the engine thread
        self._deferred: list[_SlotOp] = []  # slot ops waiting for their slot to be idle
        self._persist_wanted = threading.Event()
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

    def submit_slot_action(self, msg: SlotAction) -> None:
        """Run a slot action (after Loaded); its SlotActionResult or Error comes as a FrameOut.
        File work runs on the ``kvio`` thread, slot changes on the engine thread between steps
        (deferred while the slot is busy)."""
        t0 = time.perf_counter()
        if self.slot_save_path is None:
            self._post(FrameOut(Error(id=msg.id, code=ErrorCode.INVALID_REQUEST, message=(
                "This server does not support slots action: no slot_save_path is configured"))))
            return
        if msg.action not in ("save", "restore", "erase"):
            self._post(FrameOut(Error(id=msg.id, code=ErrorCode.INVALID_REQUEST,
                                      message=f"Invalid action {msg.action!r} (save, restore or erase)")))
            return
        if msg.action != "erase":
            why = slot_filename_error(msg.filename)
            if why is not None:
                self._post(FrameOut(Error(id=msg.id, code=ErrorCode.INVALID_REQUEST, message=f"Invalid filename: {why}")))
                return
        op = _SlotOp(msg, t0)
        if msg.action == "restore":
            self._io_inbox.put(op)  # read and validate the whole file first; the slot is touched after
        else:
            self._slot_ops.put(op)
            self._wake.set()

    def install_state(self, stream_id: str, state: Any, n_bytes: int, t0: float) -> None:
        """Put a fully validated KV state (a KVChunk stream's) into the prefix cache, on the
        engine thread between steps; answered (FrameOut) by a SlotActionResult (action "restore",
        id_slot -1, id ``stream_id``) or an Error ("kv_budget_exceeded", ...). After Loaded."""
        op = _SlotOp(SlotAction(id=stream_id, action="restore", id_slot=-1), t0, state, n_bytes)
        self._slot_ops.put(op)
        self._wake.set()

    def persist(self) -> bool:
        """Save the idle KV entries to the KV cache directory once nothing runs (the engine thread
        posts :class:`Persisted`). False when there is no cache directory or no engine."""
        if self.disk is None or self.engine is None:
            return False
        self._persist_wanted.set()
        self._wake.set()
        return True

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
        self._io_inbox.put(None)
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
                item = (job, None, Error(id=job.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000]),
                        None)
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
                pieces = [bytes(eng.token_bytes(t)) for t in ids] if msg.with_pieces else None
                return TokenizeResult.of(msg.id, ids, pieces)  # ids packed as int32: one C-level pass
            if isinstance(msg, Detokenize):
                return DetokenizeResult(id=msg.id, content=str(eng.detokenize(msg.tokens.tolist())))
            return ApplyTemplateResult(id=msg.id, prompt=str(eng.apply_template(
                msg.messages, add_generation_prompt=msg.add_generation_prompt, tools=msg.tools,
                template_kwargs=msg.template_kwargs, chat_template=msg.chat_template)))
        except EngineError as e:
            return error_frame(msg.id, e)
        except Exception as e:  # noqa: BLE001 - a request never kills the worker
            log.error("%s %s failed:\n%s", msg.TYPE, msg.id, traceback.format_exc())
            return Error(id=msg.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000])

    def _prepare(self, job: Job) -> tuple[Job, list[int] | None, Any, Any]:
        """``(job, prompt ids, params, KV state from disk or None)`` or ``(job, None, Error, None)``."""
        g = job.msg
        engine = self.engine
        try:
            params = sampling_params(g)
            prompt: str | list[int]
            if g.messages is not None:
                prompt = engine.tokenize_chat(g.messages, tools=g.tools, template_kwargs=g.template_kwargs,
                                              chat_template=g.chat_template)
            else:
                assert g.prompt is not None
                prompt = g.prompt
            ids, p = engine.prepare(prompt, params)
        except EngineError as e:
            return job, None, error_frame(g.id, e), None
        return job, ids, p, self._disk_state(ids, p)

    def _disk_state(self, ids: list[int], params: Any) -> Any:
        """A saved KV state holding a longer prefix of ``ids`` than the KV does (read and
        validated here, on the prep thread), or None."""
        disk = self.disk
        if disk is None or not disk.files or not getattr(params, "cache_prompt", True):
            return None
        path = disk.lookup(ids, self.engine.best_prefix(ids))
        if path is None:
            return None
        from worker.engine.kv.state import KVStateError

        try:
            state, n = disk.load(path)
        except KVStateError:
            return None
        log.info("KV cache: %s holds %d tokens of a %d-token prompt (%d bytes read)", path.name,
                 state.n_tokens, len(ids), n)
        return state

    # -- kvio thread (slot files)

    def _io_main(self) -> None:
        from worker.engine.kv.state import encode_state, read_state_file, write_state_file

        while True:
            op = self._io_inbox.get()
            if op is None:
                return
            msg = op.msg
            assert self.slot_save_path is not None
            path = self.slot_save_path / msg.filename
            try:
                if op.state is None:  # restore: read and validate, then the engine thread installs it
                    op.state, op.n_bytes = read_state_file(path, self.engine.kv_identity)
                    self._slot_ops.put(op)
                    self._wake.set()
                    continue
                st = op.state  # save: the engine thread's copy of the slot
                self.slot_save_path.mkdir(parents=True, exist_ok=True)
                n = write_state_file(path, encode_state(st.identity, st.tokens, st.k, st.v))
                if op.final is not None:  # a generation's save_slot_to: its Done comes now
                    self._post(JobFinished(msg.id, op.final))
                    continue
                self._post(FrameOut(SlotActionResult(id=msg.id, action="save", id_slot=msg.id_slot,
                                                     filename=msg.filename, n_tokens=st.n_tokens, n_bytes=n,
                                                     ms=(time.perf_counter() - op.t0) * 1e3)))
            except Exception as e:  # noqa: BLE001 - a request never kills the worker
                if isinstance(e, EngineError):
                    err = error_frame(msg.id, e)
                elif isinstance(e, OSError):
                    err = Error(id=msg.id, code=INTERNAL_ERROR,
                                message=f"cannot write {msg.filename!r}: {e.strerror or e}"[:1000])
                else:
                    log.error("slot action %s failed:\n%s", msg.id, traceback.format_exc())
                    err = Error(id=msg.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000])
                self._post(JobFinished(msg.id, err) if op.final is not None else FrameOut(err))

    # -- engine thread

    def _load_progress(self) -> Callable[[str, int, int], None]:
        """The ``progress`` callback handed to the loader: posts LoadStep events, thinned out."""
        last: list[Any] = ["", 0.0]  # stage, monotonic time of its last post

        def progress(stage: str, done: int, total: int) -> None:
            now = time.monotonic()
            if stage != last[0] or done >= total or done == 0 or now - last[1] >= LOAD_STEP_INTERVAL_S:
                last[0], last[1] = stage, now
                self._post(LoadStep(stage, int(done), int(total)))

        return progress

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._loader(self._gguf_path, self._n_ctx, self._chat_template, parallel=self._parallel,
                                  kv_budget_mib=self._kv_budget_mib, weights=self._weights,
                                  progress=self._load_progress(), **self._extra)
        except EngineError as e:
            self._post(LoadFailed(f"{e.code}: {e.message}"))
            return
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, never a silent death
            log.error("model load crashed:\n%s", traceback.format_exc())
            self._post(LoadFailed(f"{type(e).__name__}: {e}"))
            return
        self.engine = engine
        self.capacity = max(1, int(getattr(engine.info, "n_parallel", self._parallel) or 1))
        if self._kv_cache_dir:
            self._open_disk(engine)
        self._publish()
        self._prep.start()
        self._io.start()
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
            self._run_slot_ops()
            if self._persist_wanted.is_set() and not engine.has_work:
                self._persist_wanted.clear()
                self._persist(engine)
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

    def _add(self, job: Job, ids: list[int] | None, p: Any, state: Any = None) -> None:
        if ids is None:
            self._end(job.id, p)
            return
        if job.cancel.is_set():  # cancelled while being prepared
            self._end(job.id, cancelled_done(job.id))
            return
        if state is not None:  # a saved prefix of this prompt, validated on the prep thread
            try:
                self.engine.restore_slot(state, None)
            except EngineError as e:
                log.warning("KV cache: a saved state of %d tokens not restored: %s", state.n_tokens, e.message)
        save_to = getattr(job.msg, "save_slot_to", "")
        if save_to:
            why = ("no slot_save_path is configured" if self.slot_save_path is None
                   else slot_filename_error(save_to) or ("n must be 1" if job.msg.n != 1 else None))
            if why is not None:
                self._end(job.id, Error(id=job.id, code=ErrorCode.INVALID_REQUEST, message=f"save_slot_to: {why}"))
                return
        if getattr(job.msg, "stream_state", False) and (job.msg.n != 1 or save_to):
            self._end(job.id, Error(id=job.id, code=ErrorCode.INVALID_REQUEST,
                                    message="stream_state: n must be 1, and not with save_slot_to"))
            return
        n = max(1, int(job.msg.n))
        budget = int(getattr(self.engine.info, "kv_budget_tokens", 0) or 0)
        if n > 1 and budget > 0:  # every choice holds its prompt and its answer at once (issue 23)
            n_ctx = int(self.engine.info.n_ctx)
            answer = job.msg.max_tokens if job.msg.max_tokens is not None else n_ctx - len(ids)
            need = n * (len(ids) + max(0, min(answer, n_ctx - len(ids))))
            if need > budget:
                self._end(job.id, Error(id=job.id, code=ErrorCode.KV_BUDGET_EXCEEDED, message=(
                    f"n={n} choices of {len(ids)} prompt tokens and up to {answer} answer tokens each need {need} "
                    f"tokens of KV; this model's KV budget holds {budget}")))
                return
        run = _Run(job, ids, p, n)
        self._runs[job.id] = run
        self._add_choices(run, upto=1)
        if run.added:  # queued in the engine: the router may open its stream now (before the prefill)
            self._post(FrameOut(Accepted(id=job.id, prompt_tokens=len(ids), set_aside=list(p.set_aside))))

    def _add_choices(self, run: _Run, upto: int | None = None) -> None:
        """Add choices ``run.added .. upto-1`` (all when None) to the engine."""
        engine = self.engine
        job = run.job
        for i in range(run.added, run.n if upto is None else upto):
            params = run.params
            if i and params.seed is not None:
                params = dataclasses.replace(params, seed=params.seed + i)
            sid = run.seq_id(i)

            def on_token(ev: Any, i: int = i, sid: str = sid) -> bool:
                # [id, logprob, piece]: the alternatives' exact bytes (a partial UTF-8 piece
                # cannot be recovered from a detokenized string), same convention as ev.piece.
                top = [[int(t), float(lp), engine.token_bytes(int(t), special=False)] for t, lp in ev.top_logprobs]
                head = i == 0 and not run.first_token  # the first token carries the prompt's counts
                self._post(FrameOut(Token(id=job.id, text=ev.text, token_id=int(ev.id), piece=bytes(ev.piece),
                                          logprob=None if ev.logprob is None else float(ev.logprob),
                                          top_logprobs=top, index=i,
                                          prompt_tokens=len(run.ids) if head else 0,
                                          cache_n=engine.cache_n(sid) if head else 0)))
                job.tokens_sent += 1
                if i == 0:
                    run.first_token = True
                return not job.cancel.is_set()

            try:
                engine.add(sid, run.ids, params, on_token, job.cancel.is_set)
            except EngineError as e:
                self._abort(run)
                self._end(job.id, error_frame(job.id, e))
                return
            self._seq[sid] = (run, i)
            run.added = i + 1

    # -- KV states (engine thread)

    def _open_disk(self, engine: Any) -> None:
        from worker.engine.kv.disk import DiskCache

        assert self._kv_cache_dir is not None  # opened only when a directory is configured
        try:
            disk = DiskCache(self._kv_cache_dir, self._kv_cache_bytes, engine.kv_identity)
            n = disk.scan()
        except Exception as e:  # noqa: BLE001 - a bad cache directory disables the cache, not the worker
            log.error("KV cache %s disabled: %s: %s", self._kv_cache_dir, type(e).__name__, e)
            return
        self.disk = disk
        log.info("KV cache %s: %d saved states of this model", self._kv_cache_dir, n)

    def _run_slot_ops(self) -> None:
        while True:
            try:
                self._deferred.append(self._slot_ops.get_nowait())
            except queue.Empty:
                break
        if not self._deferred:
            return
        engine = self.engine
        waiting: list[_SlotOp] = []
        answers: list[Message] = []  # posted once the snapshot shows what they did
        for op in self._deferred:
            msg = op.msg
            try:
                to_cache = msg.action == "restore" and msg.id_slot == -1  # the prefix cache, no slot
                if not to_cache and engine.slot_busy(msg.id_slot):
                    waiting.append(op)  # llama.cpp defers a busy slot's action too
                    continue
                if msg.action == "save":
                    op.state = engine.save_slot(msg.id_slot)
                    self._io_inbox.put(op)
                    continue
                if msg.action == "restore":
                    n = engine.restore_slot(op.state, None if to_cache else msg.id_slot)
                    op.state = None
                    res = SlotActionResult(id=msg.id, action="restore", id_slot=msg.id_slot, filename=msg.filename,
                                           n_tokens=n, n_bytes=op.n_bytes, ms=(time.perf_counter() - op.t0) * 1e3)
                else:
                    n = engine.erase_slot(msg.id_slot)
                    res = SlotActionResult(id=msg.id, action="erase", id_slot=msg.id_slot, n_tokens=n,
                                           ms=(time.perf_counter() - op.t0) * 1e3)
                answers.append(res)
            except EngineError as e:
                answers.append(error_frame(msg.id, e))
            except Exception as e:  # noqa: BLE001 - a request never kills the worker
                log.error("slot action %s failed:\n%s", msg.id, traceback.format_exc())
                answers.append(Error(id=msg.id, code=INTERNAL_ERROR, message=f"{type(e).__name__}: {e}"[:1000]))
        self._deferred = waiting
        self._publish()
        for a in answers:
            self._post(FrameOut(a))

    def _persist(self, engine: Any) -> None:
        t0 = time.perf_counter()
        files = n_bytes = 0
        try:
            files, n_bytes = self.disk.save(engine.idle_states(copy=False))  # nothing runs meanwhile
        except Exception:  # noqa: BLE001 - saving is best effort; the worker still exits cleanly
            log.error("KV cache save failed:\n%s", traceback.format_exc())
        ms = (time.perf_counter() - t0) * 1e3
        log.info("KV cache %s: saved %d states (%d bytes) in %.0f ms", self._kv_cache_dir, files, n_bytes, ms)
        self._post(Persisted(files, n_bytes, ms))

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
        save_to = getattr(run.job.msg, "save_slot_to", "")
        if run.n == 1 and getattr(run.job.msg, "stream_state", False) and run.finished.get(0) is not None \
                and first.finish_reason != "cancelled":
            # this very step ended it: its slot still holds its entry; the socket thread streams it
            try:
                state = self.engine.save_slot(run.finished[0].id_slot)
            except EngineError as e:
                self._end(job_id, error_frame(job_id, e))
                return
            self._end(job_id, first, post=False)
            self._post(StateOut(job_id, state, first))
            return
        if run.n == 1 and save_to and run.finished.get(0) is not None and first.finish_reason != "cancelled":
            # this very step ended it: its slot still holds its entry, nobody took it over yet
            try:
                state = self.engine.save_slot(run.finished[0].id_slot)
            except EngineError as e:
                self._end(job_id, error_frame(job_id, e))
                return
            op = _SlotOp(SlotAction(id=job_id, action="save", id_slot=run.finished[0].id_slot, filename=save_to),
                         time.perf_counter(), state)
            op.final = first
            self._end(job_id, first, post=False)
            self._io_inbox.put(op)  # the kvio thread writes it, then posts the Done
            return
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
                return error_frame(job_id, e)
            log.error("generation %s failed: %s: %s", f.id, type(e).__name__, e)
            return Error(id=job_id, code=INTERNAL_ERROR, message=f"generation failed: {type(e).__name__}: {e}"[:1000])
        res = f.result
        eog: dict[str, Any] = {}
        if res.eog is not None:
            tid, lp, top = res.eog
            eog = {"eog_token": int(tid), "eog_logprob": None if lp is None else float(lp),
                   "eog_top_logprobs": [[int(t), float(p), self.engine.token_bytes(int(t), special=False)]
                                        for t, p in top]}
        return Done(id=job_id, finish_reason=res.finish_reason, stop_type=res.stop_type,
                    stopping_word=res.stopping_word, text=res.tail, prompt_tokens=int(res.prompt_tokens),
                    completion_tokens=len(res.tokens), prompt_n=int(res.prompt_n), prompt_ms=float(res.prompt_ms),
                    predicted_n=int(res.predicted_n), predicted_ms=float(res.predicted_ms),
                    cache_n=int(res.cache_n), id_slot=int(f.id_slot), **eog)

    def _end(self, job_id: str, final: Done | Error, post: bool = True) -> None:
        self._runs.pop(job_id, None)
        with self._lock:
            self._running.pop(job_id, None)
        if post:
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
            stats = getattr(eng, "step_stats", None) or {}
            self.snapshot = RunnerSnapshot(slots, int(eng.kv_tokens), int(getattr(eng.info, "kv_budget_tokens", 0)),
                                           int(stats.get("passes", 0)), int(stats.get("busy_slots", 0)))
        except Exception:  # noqa: BLE001 - a snapshot is informational
            log.debug("snapshot failed:\n%s", traceback.format_exc())

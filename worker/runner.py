"""The token path: run Generate jobs on the engine's batch scheduler, off the socket thread.

This module is the narrow seam between the socket loop (``worker.server``) and
the engine, and the one owner of the jobs (its :class:`~worker.jobs.JobTable`). The server only ever:

* ``submit(g)``s a Generate as it arrives (checked, queued: at most ``max_queue`` wait beyond
  the ``capacity`` that run; ``capacity`` = the engine's KV slots, config ``parallel``), or gets
  the Error refusing it; waiting jobs start, in arrival order, as slots free,
* ``cancel_waiting(job_id)``s a waiting job, or ``cancel(job_id)``s a running one (sets its
  cancel flag, which the engine polls before each step and between the layers of a forward
  pass: it leaves the batch without waiting for the pass running now, and the others go on unchanged),
* ``release(job_id)``s a job once it sent its last frame (the next waiting one starts),
* reads :attr:`BatchRunner.snapshot` (slots and KV use after the last step,
  published by the engine thread; reading it never waits for a step) and :attr:`BatchRunner.jobs`,
* receives events (:class:`FrameOut` for Token frames, :class:`JobFinished`
  with the job's Done or Error, :class:`LoadStep`, :class:`Loaded`, :class:`LoadFailed`) through
  the ``post`` callable it handed in.

Threads: the *engine* thread loads the model, then loops: take prepared jobs,
``engine.add`` them, abort cancelled ones, ``engine.step()`` (one batched
forward over every live sequence), post the finished. The *prep* thread turns
each started Generate into prompt ids (chat template, tokenizer, checks),
so a large prompt being tokenized never stalls the running streams' steps.
The *text* thread answers Tokenize / Detokenize / ApplyTemplate, so three 7 MB
``/tokenize`` calls never hold up a Generate's preparation (nor, the tokenizer
releasing the GIL on long texts, the socket thread's Pongs and Token relaying).
None touches the ZeroMQ socket: every frame goes through ``post``.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from protocol import Accepted, Done, Error, Generate, Token
from worker.engine import EngineError
from worker.events import FrameOut, JobFinished, LoadFailed, LoadStep, Loaded, RunnerEvent, StateOut
from worker.frames import cancelled_done, check_generate, done_frame, error_frame, internal_error, job_problem, merged_done
from worker.jobs import Job, JobTable
from worker.kvops import KVStates
from worker.prep import Prep
from worker.progress import PrefillProgress
from worker.textops import TextOps
from worker.threads import apply_blas_threads

log = logging.getLogger("modelyard.worker")


__all__ = ["BatchRunner", "RunnerSnapshot"]

#: Least time between two LoadStep events of one stage (seconds).
LOAD_STEP_INTERVAL_S = 0.25


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
    progress: PrefillProgress | None = None  # Generate.return_progress: its prompt's PromptProgress frames

    def seq_id(self, i: int) -> str:
        return self.job.id if self.n == 1 else f"{self.job.id}#{i}"

    @classmethod
    def of(cls, job: Job, ids: list[int], params: Any, engine: Any, post: Callable[[RunnerEvent], None]) -> _Run:
        """The run of ``job`` (prompt ``ids``), with its prefill's progress reports when it asks."""
        run = cls(job, ids, params, max(1, int(job.msg.n)))
        if getattr(job.msg, "return_progress", False):
            sid = run.seq_id(0)
            run.progress = PrefillProgress(job.id, sid, len(ids), functools.partial(engine.cache_n, sid),
                                           lambda m: post(FrameOut(m)))
        return run


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
        max_queue: jobs that may wait beyond the ``capacity`` running ones.
        kv_events_block_size: > 0: post each step's KV events (``KVStates.post_events``) in blocks of that size.

    Per job it posts FrameOut frames (Accepted, PromptProgress, Token), then one JobFinished (its Done or Error).
    """

    def __init__(self, loader: Callable[..., Any], gguf_path: str, n_ctx: int | None,
                 chat_template: str | None, post: Callable[[RunnerEvent], None], *, parallel: int = 1,
                 kv_budget_mib: float | None = None, weights: str | None = None, n_ubatch: int | None = None,
                 slot_save_path: str | None = None, kv_cache_dir: str | None = None, kv_cache_mib: float = 0.0,
                 max_queue: int, kv_events_block_size: int = 0) -> None:
        extra: dict[str, Any] = {} if n_ubatch is None else {"n_ubatch": n_ubatch}
        self._load = functools.partial(loader, gguf_path, n_ctx, chat_template, parallel=parallel,
                                       kv_budget_mib=kv_budget_mib, weights=weights, **extra)
        self._post = post
        #: the jobs, waiting and running: their one record (worker.jobs)
        self.jobs = JobTable(max_queue, parallel)
        self._serving = False  # jobs start once the server sent Ready (begin_serving)
        self._runs: dict[str, _Run] = {}  # job id -> its sequences in the engine (engine thread only)
        self._seq: dict[str, tuple[_Run, int]] = {}  # engine sequence id -> (run, choice index)
        self._wake = threading.Event()
        self._threads_wanted = 0  # BLAS threads asked by the router (Ping.threads), applied between steps
        self._stop = False
        self.engine: Any = None
        self.snapshot = RunnerSnapshot()
        self._thread = threading.Thread(target=self._main, name="engine", daemon=True)
        #: KV states in and out: slot actions, streamed states, the cache kept across restarts
        self.kv = KVStates(post, self._wake, self._publish, slot_save_path=slot_save_path, kv_cache_dir=kv_cache_dir,
                           kv_cache_mib=kv_cache_mib, kv_events_block_size=kv_events_block_size)
        self.text = TextOps(post)  # Tokenize / Detokenize / ApplyTemplate, on their own thread
        self.prep = Prep(self.kv, self._wake)  # started Generates -> prompt ids, on their own thread

    # -- socket-thread side

    def start(self) -> None:
        """Start the threads; the engine thread loads the engine and posts Loaded or LoadFailed."""
        self._thread.start()

    @property
    def capacity(self) -> int:
        """Jobs that run at once (the engine's KV slots once loaded; ``parallel`` before)."""
        return self.jobs.capacity

    def submit(self, g: Generate) -> Error | None:
        """Take Generate ``g``: the Error refusing it (its id in use, a bad value:
        :func:`check_generate`, the line full), or None: it waits, and starts as soon as a slot
        is free (in arrival order)."""
        err = self.jobs.id_in_use(g)
        if err is not None:
            return err
        e = self.engine
        checked = check_generate(g, None if e is None else int(e.info.n_vocab), None if e is None else e.sampling_vocab)
        if isinstance(checked, Error):
            return checked
        err = self.jobs.admit(g, checked, can_start=self._serving)
        if err is None:
            self._start_waiting()
        return err

    def begin_serving(self) -> None:
        """The server sent Ready: waiting jobs may start."""
        self._serving = True
        self._start_waiting()

    def cancel_waiting(self, job_id: str) -> bool:
        """Drop waiting job ``job_id`` (the server answers it cancelled); False if not waiting."""
        return self.jobs.drop_waiting(job_id)

    def release(self, job_id: str) -> Job | None:
        """Job ``job_id`` is over (its last frame is being sent): free its place, start the next
        waiting one. Returns the job, or None if it was not running (given up on at exit)."""
        job = self.jobs.release(job_id)
        self._start_waiting()
        return job

    def _start_waiting(self) -> None:
        while self._serving and not self._stop:
            job = self.jobs.start_next()
            if job is None:
                return
            self.prep.submit(job)

    def request_threads(self, n: int) -> None:
        """Use ``n`` BLAS threads (0: unchanged). Applied by the engine thread between two steps,
        never while a BLAS call of a forward pass is running."""
        if n > 0:
            self._threads_wanted = n
            self._wake.set()

    def cancel(self, job_id: str) -> bool:
        """Ask running job ``job_id`` to stop; False if it is not running."""
        job = self.jobs.running(job_id)
        if job is None:
            return False
        job.cancel.set()
        self._wake.set()
        return True

    def stop(self, timeout_s: float) -> bool:
        """Cancel everything, end the threads; True if the engine thread ended within ``timeout_s`` s."""
        for job in self.jobs.running_jobs():
            job.cancel.set()
        self._stop = True
        self.prep.stop()
        self.kv.stop()
        self.text.stop()
        self._wake.set()
        if not self._thread.is_alive():
            return True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()

    # -- engine thread

    def _main(self) -> None:
        t0 = time.perf_counter()
        try:
            engine = self._load(progress=load_progress(self._post))
        except EngineError as e:
            self._post(LoadFailed(f"{e.code}: {e.message}"))
            return
        except BaseException as e:  # noqa: BLE001 - any load failure is reported, never a silent death
            log.error("model load crashed:\n%s", traceback.format_exc())
            self._post(LoadFailed(f"{type(e).__name__}: {e}"))
            return
        self.engine = engine
        self.jobs.capacity = max(1, int(getattr(engine.info, "n_parallel", self.jobs.capacity) or 1))
        self.kv.start(engine)
        self._publish()
        self.prep.start(engine)
        self.text.start(engine)
        self._post(Loaded(engine, (time.perf_counter() - t0) * 1e3))
        while not self._stop:
            if not engine.has_work:
                self._wake.wait(0.5)
            self._wake.clear()
            for item in self.prep.take_ready():  # prepared jobs join the batch at this step
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
            self.kv.run_slot_ops()
            if self.kv.persist_due(engine):
                self.kv.persist_now(engine)
            if not engine.has_work:
                continue
            try:
                finished = engine.step()
            except Exception as e:  # noqa: BLE001 - the scheduler itself failed: end every live job
                log.error("engine step crashed:\n%s", traceback.format_exc())
                for run in list(self._runs.values()):
                    self._end(run.job.id, internal_error(run.job.id, e))
                self._seq.clear()
                reset_cache(engine)
                continue
            self._publish()  # before any JobFinished of this step: a Pong after its Done sees the step
            for progress in [r.progress for r in self._runs.values() if r.progress is not None]:
                progress.after_step(self.snapshot.slots)  # how far the prompts are, after this step
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
        err = job_problem(job.msg, len(ids), self.kv.slot_save_path is not None, self.engine.info)
        if err is not None:
            self._end(job.id, err)
            return
        run = _Run.of(job, ids, p, self.engine, self._post)
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
                if head and run.progress is not None:
                    run.progress.prompt_done()  # its last report goes before the token
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
            self._end(job_id, done_frame(failed, job_id, self.engine.token_bytes))
            return
        dones = [done_frame(run.finished[i], job_id, self.engine.token_bytes) if run.finished.get(i) is not None
                 else cancelled_done(job_id) for i in range(run.n)]
        first = dones[0]
        assert isinstance(first, Done)
        save_to = getattr(run.job.msg, "save_slot_to", "")
        stream_state = getattr(run.job.msg, "stream_state", False)
        if run.n == 1 and (stream_state or save_to) and run.finished.get(0) is not None \
                and first.finish_reason != "cancelled":
            # this very step ended it: its slot still holds its entry, nobody took it over yet
            try:
                state = self.engine.save_slot(run.finished[0].id_slot)
            except EngineError as e:
                self._end(job_id, error_frame(job_id, e))
                return
            self._end(job_id, first, post=False)
            if stream_state:  # the socket thread streams it
                self._post(StateOut(job_id, state, first))
            else:
                self.kv.save_then_finish(job_id, run.finished[0].id_slot, save_to, state, first)  # Done once written
            return
        if run.n == 1:
            self._end(job_id, first)
            return
        self._end(job_id, merged_done(dones))

    def _end(self, job_id: str, final: Done | Error, post: bool = True) -> None:
        """The engine is done with ``job_id`` (the server releases it once its last frame is out)."""
        self._runs.pop(job_id, None)
        if post:
            self._post(JobFinished(job_id, final))

    def _publish(self) -> None:  # after each step and slot action: also its KV events, at most one batch
        self.snapshot = snapshot_of(self.engine, self.snapshot)
        self.kv.post_events()


def load_progress(post: Callable[[RunnerEvent], None]) -> Callable[[str, int, int], None]:
    """The ``progress`` callback handed to the loader: posts LoadStep events, thinned out (every
    stage's first and last step, at most one in LOAD_STEP_INTERVAL_S between them)."""
    last: list[Any] = ["", 0.0]  # stage, monotonic time of its last post

    def progress(stage: str, done: int, total: int) -> None:
        now = time.monotonic()
        if stage != last[0] or done >= total or done == 0 or now - last[1] >= LOAD_STEP_INTERVAL_S:
            last[0], last[1] = stage, now
            post(LoadStep(stage, int(done), int(total)))

    return progress


def snapshot_of(engine: Any, last: RunnerSnapshot) -> RunnerSnapshot:
    """The engine's slots and KV use now (``last`` if they cannot be read: a snapshot is informational)."""
    try:
        slots = [{"id": int(s.id), "id_task": s.id_task, "is_processing": bool(s.is_processing),
                  "n_past": int(s.n_past)} for s in engine.slots()]
        stats = getattr(engine, "step_stats", None) or {}
        return RunnerSnapshot(slots, int(engine.kv_tokens), int(getattr(engine.info, "kv_budget_tokens", 0)),
                              int(stats.get("passes", 0)), int(stats.get("busy_slots", 0)))
    except Exception:  # noqa: BLE001 - a snapshot is informational
        log.debug("snapshot failed:\n%s", traceback.format_exc())
        return last


def reset_cache(engine: Any) -> None:
    """Empty the engine's KV after a failed step (logged if even that fails)."""
    try:
        engine.reset_cache()
    except Exception:  # noqa: BLE001
        log.error("reset_cache failed after an error:\n%s", traceback.format_exc())

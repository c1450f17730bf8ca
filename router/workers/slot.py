"""One configured model's owner: :class:`ModelSlot`, its worker's state machine and the decisions on it.

A slot and its parts are the only writers of its state (worker state machine
(``router.workers.lifecycle``, moved by :meth:`ModelSlot.move`), the admission
(``router.workers.admission``: waiting queue, running set), current worker). The parts are
made by the slot alone and hold one concept each: admission (the bounded queue: 503 +
Retry-After at once when full; decided here), liveness (``router.workers.liveness``: ping,
unresponsive, hung; its verdicts applied here), the idle unload (``router.workers.idle``),
placement (``router.workers.placing``: this model's side, the pool's one placer), the load and
the restart after a crash (``router.workers.loading``), the unload and a config reload
(``router.workers.unloading``), the CPU share (``Pool.share_cores``, sent here), the crash
backoff (``router.workers.backoff``), its views (``router.workers.views``, the slot's base).
All run on the event loop and never ``await`` between reading a fact and acting on it, so no
decision uses a stale snapshot.

Admission: one running request per worker job slot (``Ready.max_jobs``) plus at most
``max_queue`` waiting — requests waiting for the model to load count too: while it
loads, the first in line (the one that will run as soon as it is ready) counts as the
running one, so ``1 + max_queue`` requests are admitted whether the model is loaded or
not. Beyond that :meth:`ModelSlot.admit` raises QueueFull (503) at once, saying so.
Waiting is FIFO. A request's job slot is given back only when the worker has finished
with it (Done/Error, or the worker is gone), never when the client merely left, so the
worker is never handed two generations at once.

Placement: a model that must load asks the pool's placer for room; its requests wait in
its own queue meanwhile, so a burst asks once and loads once.

Liveness: a worker judged ``unresponsive`` gets no new job (requests wait in its queue),
/admin/models, /admin/events and ``/metrics`` say so; any frame makes it ``ready`` again.

Idle unload (``idle_ttl_s`` > 0, like Ollama's keep_alive; never for ``pinned`` models): a
request arriving while an idle unload stops the worker is not refused — it waits and
starts the model again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from protocol import Pong
from router.config import ModelConfig
from router.http.errors import ApiError, ModelUnloading, QueueFull, ServerShuttingDown
from router.workers.admission import Admission, Ticket
from router.workers.backoff import CrashHistory, crash_policy, restart_refusal
from router.workers.cpu_share import ThreadShare
from router.workers.idle import IdleTimer
from router.workers.lifecycle import Lifecycle, WorkerState
from router.workers.liveness import Liveness
from router.workers.loading import Loader
from router.workers.placing import SlotPlacing
from router.workers.prefix_index import PrefixIndex
from router.workers.process import WorkerProcess
from router.workers.unloading import Unloader
from router.workers.views import SlotFacts

if TYPE_CHECKING:
    from router.workers.pool import Pool

log = logging.getLogger("modelyard.pool")


class ModelSlot(SlotFacts):
    """One configured model: its worker's state machine, queue and running requests."""

    def __init__(self, model: ModelConfig, pool: Pool, replica: int = 0) -> None:
        self.model = model
        self.pool = pool
        self.replica = replica  # its number among the model's replicas (router.workers.replicas); 0: the first
        self.prefix = PrefixIndex(model.kv_events_block_size)  # what its worker's KV cache holds (router.workers.prefix_index)
        # moved only by this slot and its parts; its log lines name the replica when there are several
        self._life = Lifecycle(model.name if model.replicas == 1 else f"{model.name} replica {replica}", self._on_state)
        self.worker: WorkerProcess | None = None
        self.last_error: str | None = None
        self.last_exit_code: int | None = None
        self.last_used: float | None = None  # unix time a request last finished
        self.last_active = time.monotonic()  # last admission / finished request / load (monotonic s)
        self.changed = asyncio.Event()  # set whenever running/state changes (drain waits on it)
        # requests without a ticket (tokenize, props, ...) waiting for the worker or calling it
        # (ready_worker, use): like a waiting or running request, they keep the model from being
        # idle, so a later request for another model never evicts the one they wait for
        self.users = 0
        # unloaded for idleness (idle_ttl_s): llama-server's "sleeping" (--sleep-idle-seconds); the
        # next generation wakes it (loads it again), read-only routes (/props, /health) do not
        self.asleep = False
        self.rss_peak: int | None = None  # the largest RSS a ready worker of this model had, bytes
        self.failures = CrashHistory(crash_policy(model))
        self.admission = Admission()  # the bounded queue and the running set (moved only by this slot and its parts)
        self._threads = ThreadShare(model.name)  # the CPU share last sent to the worker (router.workers.cpu_share)
        self.idle = IdleTimer(self)
        self.liveness = Liveness(self)
        self.placing = SlotPlacing(self)
        self.loader = Loader(self)
        self.unloader = Unloader(self)

    # ------------------------------------------------------------------ state machine

    def move(self, new: WorkerState, error: str | None = None) -> None:
        """Move the state machine to ``new`` (``error``: why, kept as :attr:`last_error`); this slot and
        its parts alone call it. Raises RuntimeError for a move ``router.workers.lifecycle`` forbids."""
        self._life.move(new, error)

    def _on_state(self, old: WorkerState, new: WorkerState, note: str | None) -> None:
        if note is not None:
            self.last_error = note
        self.changed.set()
        self.emit("state", **{"from": old.value, "to": new.value, "reason": note, "condition": self.condition()})

    def emit(self, event: str, **fields: Any) -> None:
        """A model event (``GET /admin/events``); with replicas, naming the ``replica``."""
        if self.model.replicas > 1:
            fields["replica"] = self.replica
        self.pool.events.emit(self.model.name, event, **fields)

    # ------------------------------------------------------------------ admission

    def admit(self, ticket: Ticket) -> None:
        """``ticket`` takes a place in this model's queue, starting its worker if needed.

        Raises ModelUnloading (503) while draining, QueueFull (503) when
        ``1 + max_queue`` requests are already admitted (loading or not: see
        :meth:`admitted_split`). During an idle unload the request is admitted and
        waits for the model to load again.
        """
        self.check_open()
        self.check_restart(operator=False)
        running, waiting = self.admitted_split()
        if running + waiting >= self.capacity:
            jobs = self.capacity - self.model.max_queue
            loading = " (to start once the model has loaded)" if self.state is WorkerState.LOADING else ""
            raise QueueFull(
                f"model '{self.model.name}' is busy: {running} running{loading} and {waiting} waiting "
                f"(at most {jobs} running + max_queue={self.model.max_queue} waiting); retry shortly")
        self.admission.enqueue(ticket)
        self.last_active = time.monotonic()
        if self.state in (WorkerState.UNLOADED, WorkerState.FAILED):
            self.placing.ask()
        self.pump()

    async def wait_turn(self, ticket: Ticket) -> WorkerProcess:
        """The worker this ticket runs on, once it is its turn. Raises ApiError
        (load failed, crashed, unloading) if it will never be."""
        return await ticket.granted

    def withdraw(self, ticket: Ticket) -> None:
        """A waiting request leaves (its client went away). No-op once running."""
        self.admission.withdraw(ticket)
        self.changed.set()
        self.pool.place()  # a wanted load may have nobody left to wait for it

    def release(self, ticket: Ticket) -> None:
        """The worker is done with this ticket's request (Done/Error/gone)."""
        if self.admission.release(ticket):
            self.last_used = time.time()
            self.last_active = time.monotonic()
            self.idle.wake()
            if not self.busy:
                self.pool.share_cores()
        self.changed.set()
        self.pump()
        self.pool.place()  # this model may have become idle: evictable for a waiting one

    def pump(self) -> None:
        """Hand free job slots of a ready worker to waiting tickets, FIFO."""
        was_busy = self.busy
        if self.state is WorkerState.READY and self.worker is not None:
            self.admission.grant_free(self.worker, self.worker.max_jobs)
        if self.busy != was_busy:
            self.pool.share_cores()

    def refusing(self) -> bool:
        """New requests get 503: an operator unload is draining, the model was removed, or the router stops."""
        return ((self.state is WorkerState.DRAINING and not self.unloader.soft) or self.unloader.retiring
                or self.pool.closing)

    def check_open(self) -> None:
        """Raises ServerShuttingDown (router stopping) or ModelUnloading (operator unload draining)."""
        if self.pool.closing:
            raise ServerShuttingDown()
        if self.refusing():
            raise ModelUnloading(f"model '{self.model.name}' is being unloaded; retry shortly")

    def check_restart(self, *, operator: bool) -> None:
        """May a failed model start again now? An operator's load always may (and clears
        the crash window); otherwise raises ModelFailed (given up after max_crashes) or
        RestartBackoff (503, Retry-After: the remaining wait)."""
        if self.state is not WorkerState.FAILED:
            return
        if operator:
            self.failures.operator_reset()
            return
        refusal = restart_refusal(self.failures, self.model.name, self.pool.clock())
        if refusal is not None:
            raise refusal

    def refuse_waiting(self, err: ApiError) -> None:
        """Every waiting request fails with ``err`` now (the router is shutting down)."""
        self.placing.drop(err)
        self.admission.refuse_waiting(err)

    def abort_running(self, reason: str) -> int:
        """End every running generation now: each fails with ServerShuttingDown(``reason``)
        and its worker gets Cancel (by the run's own close). Returns how many."""
        n = 0
        for ticket in self.admission.running():
            if ticket.worker is not None:
                ticket.worker.abort_stream(ticket.id, reason)
                n += 1
        return n

    # ------------------------------------------------------------------ the CPU share, liveness, idleness

    def set_threads(self, n: int) -> None:
        """The pool's decision: the ready worker uses ``n`` BLAS threads (sent once per change;
        only for models without ``n_threads``)."""
        wp = self.worker
        if wp is None or self.state is not WorkerState.READY or self.model.n_threads is not None:
            return
        self._threads.send(wp, n)

    def went_silent(self, wp: WorkerProcess, silent: float) -> None:
        """The liveness judge's verdict: the ready ``wp`` sent nothing it owed for ``silent`` s."""
        log.warning("model %s: worker %s sent nothing for %.1f s (unresponsive_after_s=%g); "
                    "no new requests go to it; killed if no Pong within ping_timeout_s=%g s",
                    self.model.name, wp.pid, silent, self.model.unresponsive_after_s, self.model.ping_timeout_s)
        self.move(WorkerState.UNRESPONSIVE, f"worker sent nothing for {silent:.1f} s")
        self.emit("unresponsive", pid=wp.pid, silent_s=round(silent, 3))

    def answers_again(self, wp: WorkerProcess, after: float) -> None:
        """The liveness judge's verdict: the unresponsive ``wp`` answers again (after ``after`` s)."""
        log.warning("model %s: worker %s answers again after %.1f s unresponsive", self.model.name, wp.pid, after)
        self.move(WorkerState.READY)
        self.emit("responsive", pid=wp.pid)
        self.pump()

    async def probe(self, timeout_s: float = 2.0) -> Pong | None:
        """Ping the ready worker now (``router.workers.liveness.Liveness.probe``)."""
        return await self.liveness.probe(timeout_s)

    def stop_watchers(self) -> None:
        """The worker is gone or stopping: its ping loop and idle timer end."""
        self.liveness.stop()
        self.idle.stop()

    def set_keep_alive(self, seconds: float | None) -> None:
        """A generation request's keep_alive (s; inf: until unloaded; None: it set none, the
        config's ``idle_ttl_s`` again) decides the idle TTL from now on, as Ollama's each request
        does; 0 unloads the model once it has nothing running or waiting."""
        self.idle.set_keep_alive(seconds)

    # ------------------------------------------------------------------ callers without a ticket

    @contextlib.contextmanager
    def holding(self) -> Iterator[None]:
        """Within the block the model is not idle: a one-shot call to its worker (tokenize,
        apply-template, ...; it gets the worker with :meth:`ready_worker` inside) is not cut
        off by an eviction for another model while it waits for the load or for its answer."""
        self.users += 1
        try:
            yield
        finally:
            self._user_left()

    def _user_left(self) -> None:
        self.users -= 1
        if self.users == 0:
            self.pool.place()  # this model may have become idle: evictable for a waiting one

    async def ready_worker(self, *, operator: bool = False) -> WorkerProcess:
        """The ready worker, starting it and waiting for its load if needed (for
        requests that do not take a job slot: tokenize, detokenize, apply-template,
        admin load with ``operator``). While it waits the model is not idle (placement never
        evicts it for a later request: FIFO, as llama-server's router). Raises ModelUnloading
        (draining, or unloaded while the load it waited for ran), ModelLoadFailed,
        RestartBackoff / ModelFailed (crash backoff; never for an operator)."""
        self.users += 1
        try:
            return await self.loader.ready_worker(operator)
        finally:
            self._user_left()

    # ------------------------------------------------------------------ loading and unloading

    async def load(self) -> float:
        """Admin load: start the worker if needed and wait until it is ready.
        Returns the worker's load time, ms. Raises ModelLoadFailed, Conflict (draining)."""
        return await self.loader.load()

    def begin_load(self, *, operator: bool = True) -> bool:
        """Start loading without waiting (llama.cpp's ``POST /models/load``; ``operator``
        False for ``/health?model=``'s autoload, which respects the crash backoff).
        Returns False when the model is already loading or loaded. Raises Conflict while
        an operator unload drains, ServerShuttingDown when the router stops,
        RestartBackoff / ModelFailed (not an operator). During an idle unload the load
        starts once the worker has stopped."""
        return self.loader.begin_load(operator)

    async def unload(self, *, drain: bool = True, reason: str = "unloaded by request") -> None:
        """Stop this model's worker. With ``drain`` the running requests finish first
        (up to drain_timeout_s, then they are cancelled); waiting ones get 503 at once.
        Concurrent calls share one unload; one asked during an idle unload turns it
        into an operator unload (its waiting requests get 503). Ends in ``unloaded``."""
        await asyncio.shield(self.begin_unload(drain=drain, reason=reason))

    def begin_unload(self, *, drain: bool = True, reason: str = "unloaded by request") -> asyncio.Task[None]:
        """The synchronous start of :meth:`unload` (the state changes now); returns the
        task that finishes it, which runs whether or not anyone awaits it."""
        return self.unloader.begin_unload(drain, reason)

    def reconfigure(self, model: ModelConfig) -> None:
        """A reload changed this model's config: it applies at once when no worker runs;
        otherwise the worker drains (running requests finish, new ones wait) and the
        next load uses the new config."""
        self.unloader.reconfigure(model)

    def retire(self) -> asyncio.Task[None]:
        """A reload removed this model: drain (its running requests finish; waiting ones get
        503) and stop. The pool forgets the slot once the returned task is done."""
        return self.unloader.retire()

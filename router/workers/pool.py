"""Every configured model's slot (``router.workers.slot.ModelSlot``), name and alias
resolution, the CPU share, config reload, shutdown, and what the workers share (the zmq
context, the CURVE keypair, the launcher: ``router.workers.launchers``, which knows where
workers run, their endpoints, the host's memory and cores, and keeps the warm spare).

Placement (``Pool.place``, its one owner ``router.workers.placing.Placer``, decisions in
``router.workers.placement``): a model that must load asks the pool for room; the placer
decides over every slot in one synchronous step — load now, or evict idle
least-recently-used unpinned models first (drain-then-swap: nothing running is ever
cut) and wait, or refuse with 503 (``insufficient_memory``, ``max_loaded_reached``).
Wanted loads are placed first come, first served.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import time
from collections.abc import Callable

import zmq.asyncio

from router.config import Config, ModelConfig
from router.http.errors import NotFound, ServerShuttingDown
from router.metrics import Metrics, ModelGauges
from router.workers import cpu_share
from router.workers.admission import Ticket
from router.workers.events import EventHub
from router.workers.lifecycle import WorkerState
from router import gguf_meta
from router.workers import placement
from router.workers.launchers import Launcher
from router.workers.launchers.local import SPARE_NAME, LocalLauncher
from router.workers.placement import MemoryProbe
from router.workers.placing import Placer
from router.workers.connection import CurveKeypair, new_curve_keypair
from router.workers.process import WorkerProcess
from router.workers.replicas import ReplicaSet, replica_model
from router.workers.slot import ModelSlot

log = logging.getLogger("modelyard.pool")


def _launcher(config: Config, ctx: zmq.asyncio.Context, curve: CurveKeypair | None, module: str | None) -> Launcher:
    """The launcher ``[cluster] backend`` names (Ray is imported only for "ray"). Raises
    LaunchError when Ray's cluster cannot be joined."""
    if config.cluster.backend == "ray":
        from router.workers.launchers.ray import RayLauncher

        return RayLauncher(config.cluster, module=module)
    return LocalLauncher(config.server, ctx=ctx, curve=curve, module=module)


class Pool:
    """Every configured model's slot, name/alias resolution, and the shared zmq context."""

    def __init__(self, config: Config, *, worker_module: str | None = None,
                 metrics: Metrics | None = None, clock: Callable[[], float] = time.monotonic,
                 memory: MemoryProbe | None = None, launcher: Launcher | None = None,
                 preset_view: Callable[[ModelSlot, ModelConfig], ModelSlot] | None = None) -> None:
        self.config = config
        # how a preset's requests see its model's slot (the serving layer's PresetSlot, given by
        # the app); None: as the model's own slot
        self.preset_view = preset_view
        self.clock = clock  # monotonic seconds for backoff decisions (tests inject one)
        self.events = EventHub()  # model events (GET /admin/events)
        self._retired: set[ModelSlot] = set()  # removed by a reload, still draining
        self.placer = Placer(self)  # the one owner of placement decisions: which wanted load starts when
        self.worker_module = worker_module
        self.metrics = metrics if metrics is not None else Metrics(config.models)
        self.closing = False
        self._ctx = zmq.asyncio.Context()
        # tcp: one CURVE keypair for this service; each worker gets the public half privately
        self.curve: CurveKeypair | None = None
        if config.server.transport == "tcp" or config.cluster.backend == "ray":
            try:
                self.curve = new_curve_keypair()
            except RuntimeError as e:
                log.warning("transport = \"tcp\" without CURVE (%s): worker traffic is not encrypted; "
                            "workers still prove their per-spawn secret", e)
        # where workers run and what they may use (router.workers.launchers): their endpoints,
        # the host's memory and cores, the warm spare
        self.launcher: Launcher = launcher if launcher is not None else _launcher(config, self._ctx, self.curve,
                                                                                   worker_module)
        self.memory: MemoryProbe = memory if memory is not None else self.launcher  # placement's figures
        self.cores = self.launcher.cores()  # what CPU sharing divides
        self.slots: dict[str, ModelSlot] = {name: ModelSlot(m, self) for name, m in config.models.items()}
        # a model's replicas beyond its first (``replicas = N``: N - 1 more slots; router.workers.replicas)
        self.extra: dict[str, list[ModelSlot]] = {}
        for name in self.slots:
            self._sync_replicas(name)
        self.metrics.watch(self.gauges)
        self.launcher.begin()  # the warm spare starts now
        # the GGUF headers placement reads (tensor infos: up to ~0.5 s for a large vocabulary on a
        # busy machine), parsed now off the event loop: a model's first request does not wait for them
        asyncio.get_running_loop().run_in_executor(None, self._read_headers)

    def _read_headers(self) -> None:
        for m in list(self.config.models.values()):
            try:
                gguf_meta.model_info(m.path)
                placement.estimate(m.path, m.kv_budget_mib, None, weights=m.weights_mode)
            except Exception:  # noqa: BLE001 - a defect shows when the model is used
                log.debug("reading %s's header in advance failed", m.name, exc_info=True)

    # ------------------------------------------------------------------ replicas

    def replica_set(self, name: str) -> ReplicaSet | None:
        """The replicas of model ``name`` (canonical name) when it has several, else None."""
        extra = self.extra.get(name)
        slot = self.slots.get(name)
        return ReplicaSet([slot, *extra]) if extra and slot is not None else None

    def every_slot(self) -> list[ModelSlot]:
        """Every model's slots, replicas included (retired ones aside)."""
        return [*self.slots.values(), *(s for extra in self.extra.values() for s in extra)]

    def slot_by_key(self, key: str) -> ModelSlot:
        """The slot a placement seat names (``ModelSlot.key``). Raises KeyError."""
        return next(s for s in self.every_slot() if s.key == key)

    def _sync_replicas(self, name: str) -> None:
        """Model ``name``'s extra replicas as the config says: new ones made, surplus ones retired
        (they drain and stop), the kept ones given a changed config (applied as a reload's)."""
        slot, model = self.slots.get(name), self.config.models.get(name)
        want = model.replicas - 1 if slot is not None and model is not None and not slot.unloader.retiring else 0
        have = self.extra.get(name, [])
        for s in have[want:]:
            self._retired.add(s)
            s.retire().add_done_callback(functools.partial(self._retire_done, s))
        kept = have[:want]
        if model is not None:
            for s in kept:
                if s.model != replica_model(model, s.replica):
                    s.reconfigure(replica_model(model, s.replica))
            kept += [ModelSlot(replica_model(model, i), self, replica=i) for i in range(len(kept) + 1, want + 1)]
        if kept:
            self.extra[name] = kept
        else:
            self.extra.pop(name, None)

    def _retire_done(self, slot: ModelSlot, _task: asyncio.Task[None]) -> None:
        self._retired.discard(slot)

    def gauges(self) -> list[ModelGauges]:
        """Every model's figures, read at scrape time (``Metrics.watch``)."""
        return [g for s in self.slots.values() for g in s.all_gauges()]

    def get(self, name: str) -> ModelSlot:
        """The slot for a model name or alias. Raises NotFound listing the ids."""
        m = self.config.resolve(name) if isinstance(name, str) else None
        if m is None:
            raise NotFound(f"model '{name}' not found; available models: {', '.join(self.config.ids())}",
                           param="model")
        if m.preset is not None and self.preset_view is not None:  # the model's slot, the preset's defaults
            return self.preset_view(self.slots[m.name], m)
        return self.slots[m.name]

    # ------------------------------------------------------------------ CPU sharing

    def share_cores(self) -> None:
        """Give every ready worker without ``n_threads`` its share of the cores
        (``router.workers.cpu_share``). Called whenever a model starts or stops being busy."""
        every = self.every_slot()
        n = cpu_share.share(every, self.cores)
        for s in every:
            s.set_threads(n)

    # ------------------------------------------------------------------ config reload

    def reload(self, new: Config) -> dict[str, list[str]]:
        """Apply a re-read config (SIGHUP) in one step: added models appear, removed ones
        drain and stop (new requests for them are 404 at once), changed ones reload once
        their running requests finish. Of ``[server]``, only ``max_loaded`` applies without
        a restart; other changed keys are kept as they were (and named in the log).
        Returns what changed: ``added``, ``removed``, ``changed``, ``server_kept``."""
        old = self.config
        kept = sorted(f.name for f in dataclasses.fields(old.server)
                      if f.name != "max_loaded" and getattr(old.server, f.name) != getattr(new.server, f.name))
        server = dataclasses.replace(old.server, max_loaded=new.server.max_loaded)
        added = [n for n in new.models if n not in self.slots or self.slots[n].unloader.retiring]
        removed = [n for n, s in self.slots.items() if n not in new.models and not s.unloader.retiring]
        changed = [n for n in new.models if n in self.slots and not self.slots[n].unloader.retiring
                   and self.slots[n].model != new.models[n]]
        self.config = dataclasses.replace(new, server=server)
        for n in removed:
            slot = self.slots[n]
            self._retired.add(slot)
            task = slot.retire()

            def forget(_t: asyncio.Task[None], n: str = n, slot: ModelSlot = slot) -> None:
                self._forget(n, slot)
            task.add_done_callback(forget)
        for n in changed:
            self.slots[n].reconfigure(new.models[n])
        for n in added:
            if n in self.slots:  # still draining from an earlier removal: a fresh slot takes its name
                log.warning("model %s: re-added while its old worker still drains", n)
            self.slots[n] = ModelSlot(new.models[n], self)
            self.metrics.add_model(n)
        for n in {*removed, *changed, *added}:
            self._sync_replicas(n)
        log.info("config reloaded: added %s, removed %s, changed %s%s", added or "none", removed or "none",
                 changed or "none", f"; [server] {', '.join(kept)} need a restart (kept)" if kept else "")
        self.place()
        return {"added": added, "removed": removed, "changed": changed, "server_kept": kept}

    def _forget(self, name: str, slot: ModelSlot) -> None:
        self._retired.discard(slot)
        if self.slots.get(name) is slot:
            del self.slots[name]

    # ------------------------------------------------------------------ placement

    def want(self, slot: ModelSlot) -> None:
        """``slot`` wants to load: queue it for placement and decide now (``router.workers.placing``)."""
        self.placer.want(slot)

    def unwant(self, slot: ModelSlot) -> None:
        self.placer.unwant(slot)

    def place(self) -> None:
        """Start every wanted load that has room now (``router.workers.placing.Placer.place``)."""
        self.placer.place()

    def spare_bytes(self) -> int:
        """The warm spare's RSS, bytes (0: none to take): free for the next load, which takes it
        (that model's seat then counts it as its worker's)."""
        pid = self.launcher.spare_pid()
        return (self.memory.rss(pid, SPARE_NAME) or 0) if pid is not None else 0

    def new_worker(self, model: ModelConfig) -> WorkerProcess:
        """``model``'s next worker: the launcher's warm spare when it has one, else a new one
        (started by its ``start()``)."""
        spare = self.launcher.take_spare(model)
        if spare is not None:
            return spare
        return WorkerProcess(model, self._ctx, self.launcher, curve_server=self.curve)

    def begin_shutdown(self) -> None:
        """The router is stopping (SIGTERM/SIGINT): new requests and waiting ones get 503
        server_shutting_down now; running ones may finish until :meth:`abort_running`."""
        self.closing = True
        for slot in self.every_slot():
            slot.refuse_waiting(ServerShuttingDown())
        self.events.close()  # event streams end, so they do not hold the shutdown

    def abort_running(self, reason: str) -> int:
        """End every running generation now: each fails with ServerShuttingDown(``reason``)
        (an SSE error event if streaming) and its worker gets Cancel. Returns how many."""
        return sum(slot.abort_running(reason) for slot in self.every_slot())

    async def close(self) -> None:
        """Stop every worker (Shutdown, grace, kill) without draining. Idempotent."""
        self.closing = True
        self.events.close()
        slots = {*self.every_slot(), *self._retired}
        await asyncio.gather(*(s.unload(drain=False, reason="router shutting down") for s in slots),
                             return_exceptions=True)
        await self.launcher.close()  # the warm spare; its socket directory
        self._ctx.destroy(linger=0)


__all__ = ["ModelSlot", "Pool", "Ticket", "WorkerState"]

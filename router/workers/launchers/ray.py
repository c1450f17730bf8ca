"""The Ray launcher: each worker is started on a node of a Ray cluster that Ray picks.

``[cluster] backend = "ray"`` (router.config_cluster). The router is the Ray driver: it joins
``[cluster] address`` or starts a Ray instance on this host. For each worker it creates one
:class:`~router.workers.launchers.ray_host.WorkerHost` actor asking Ray for the model's cores
(``num_cpus`` = ``n_threads``, else 1), its memory (``memory`` = the router's own estimate,
``router.workers.placement``) and its ``node_labels`` (Ray's ``label_selector``); the actor
starts ``python -m worker`` on its node with the per-spawn credentials on a pipe, and the
worker connects back to the router's tcp endpoint with CURVE. Ray places and starts; ZeroMQ
stays the data plane, and Ray's logical resources isolate nothing, so the router's placement
still decides whether a model may load at all.

Replicas (``replicas = N``, ``router.workers.replicas``): each replica's worker is asked on an
alive node that carries the model's labels and runs none of its other workers (Ray's
``NodeAffinitySchedulingStrategy``, soft: when every such node has one, or the one asked cannot
take it, Ray picks); a node is reserved while a replica starts there, so replicas starting
together spread too.

Ends: the router kills a worker by killing its actor (the worker's parent watch ends it within
~0.2 s); a lost node or a dead actor is reported to the connection as exit code -9, as a
SIGKILLed local child would be, and the slot's usual crash handling and backoff follow. The
actors are not detached: a router that ends takes them (and so its workers) with it.

Resources: :meth:`RayLauncher.available` is the largest available memory of any alive node,
measured on the nodes (psutil, refreshed every :data:`PROBE_INTERVAL_S` s; until a node's first
answer, the ``memory`` resource Ray gave it at its start); :meth:`cores` the
most CPUs of one node (CPU sharing divides a node's cores, not the cluster's). A worker's RSS
and pids come from its actor, refreshed at the same interval.

Needs: the model files at the same path on every node that may run them (a shared or
replicated directory: the router reads the GGUF header for its estimate, the worker loads it);
modelyard installed on every node. No warm spare (a spare would have to guess the node).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
from typing import Any

from protocol import WorkerCredentials
from router.config import ModelConfig
from router.config_cluster import ClusterConfig
from router.workers import placement
from router.workers.launchers import ExitWatchingHandle, LaunchError, Launched, Launcher
from router.workers.launchers.local import WORKER_MODULE_ENV
from router.workers.launchers.ray_host import WorkerHost, node_memory_available
from router.workers.options import option_args

log = logging.getLogger("modelyard.worker")

#: How often nodes' available memory and workers' RSS are read (s).
PROBE_INTERVAL_S = 5.0
#: How long one probe may take before the node's previous figure is kept (s): a node's first
#: probe starts a Ray worker process there, seconds on a busy host.
PROBE_TIMEOUT_S = 30.0
#: Threads of each WorkerHost actor: its blocking ``wait`` plus status calls and the kill.
ACTOR_THREADS = 4
#: The exit code a worker gets when its actor or node is gone (as a SIGKILLed child's).
LOST_EXIT_CODE = -9
#: The wait before an actor lost with its node is placed again (s).
RETRY_DELAY_S = 0.5
#: How long after asking the actor to kill its worker the actor itself is killed (s).
KILL_GRACE_S = 0.5


def _lost_with_its_node(e: BaseException) -> bool:
    """The actor died (or became unreachable) with its node before it ran, not of its own doing."""
    return type(e).__name__ in ("ActorDiedError", "ActorUnavailableError") and "node" in str(e).lower()


def _ray() -> Any:
    """The ``ray`` module. Raises LaunchError naming the extra when it is not installed."""
    try:
        import ray
    except ImportError:
        raise LaunchError("[cluster] backend = \"ray\" needs Ray: pip install 'modelyard[ray]'") from None
    return ray


class RayHandle(ExitWatchingHandle):
    """One worker started by a WorkerHost actor; its figures are the actor's last report."""

    def __init__(self, ray: Any, actor: Any, info: dict[str, Any]) -> None:
        super().__init__()
        self._ray = ray
        self._actor = actor
        self._pid = int(info["pid"])
        self.host = f"{info['host']}/{str(info['node_id'])[:12]}"
        self.node_id = str(info["node_id"])
        self.model = ""  # the model it serves (the launcher spreads a model's replicas over nodes)
        self._waiter: asyncio.Task[None] | None = None
        self._rss: int | None = None
        self._pids: set[int] = {self._pid}

    @property
    def pid(self) -> int | None:
        return self._pid

    def alive(self) -> bool:
        return self._code is None

    def kill(self) -> None:
        if self._code is not None:
            return
        try:
            self._actor.kill.remote()  # the worker now; the actor shortly after (its wait reports the exit)
        except Exception:  # the actor is already gone
            pass
        try:
            asyncio.get_running_loop().call_later(KILL_GRACE_S, self._kill_actor)
        except RuntimeError:  # no loop (shutdown): now
            self._kill_actor()

    def _kill_actor(self) -> None:
        try:
            self._ray.kill(self._actor, no_restart=True)
        except Exception:  # already gone
            pass

    def _watch(self, loop: asyncio.AbstractEventLoop) -> None:
        self._waiter = loop.create_task(self._wait(), name=f"ray-worker-wait-{self._pid}")

    async def _wait(self) -> None:
        try:
            code = int(await self._actor.wait.remote())
        except asyncio.CancelledError:
            raise
        except Exception as e:  # RayActorError, node lost, ...: the worker is gone with its actor
            log.warning("worker pid %s on %s: its Ray actor is gone (%s)", self._pid, self.host, type(e).__name__)
            code = LOST_EXIT_CODE
        self._exited(code)

    def _exited(self, code: int) -> None:
        if self._code is None:
            self._rss = None
            self._kill_actor()  # its job is done
        super()._exited(code)

    async def refresh(self) -> None:
        """Read the worker's RSS and pids from its actor (called by the launcher's probe)."""
        if self._code is not None:
            return
        try:
            st = await self._actor.status.remote()
        except Exception:
            return  # the exit, if that is what it is, comes through _wait
        self._rss = st.get("rss_bytes")
        self._pids = {self._pid, *st.get("pids", ())}

    def rss_bytes(self) -> int | None:
        return self._rss if self._code is None else None

    def is_own(self, pid: int) -> bool:
        return pid in self._pids


def check_reachable(address: str | None, timeout_s: float = 3.0) -> None:
    """Fail at once, in one line, when ``address`` (``HOST:PORT`` of a cluster's GCS) does not answer:
    ``ray.init`` would retry for minutes without a word, deaf to Ctrl-C. ``auto``, ``ray://`` and
    no address (a new local instance) are left to Ray. Raises LaunchError."""
    if not address or address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
    except OSError as e:
        raise LaunchError(f"cannot reach the Ray cluster at {address} ({e}): is `ray start --head` running "
                          "there, and is [cluster] address its GCS address (HOST:6379 by default)?") from None


class RayLauncher(Launcher):
    """Workers on the nodes of a Ray cluster (see the module docstring).

    Args:
        cluster: ``[cluster]`` (address, advertise_host, place_timeout_s).
        module: the worker module (``python -m MODULE``); None: ``$MODELYARD_WORKER_MODULE`` or ``worker``.

    Raises LaunchError when Ray is not installed or the cluster cannot be joined.
    """

    host = "ray"

    def __init__(self, cluster: ClusterConfig, *, module: str | None = None) -> None:
        ray = self._ray = _ray()
        self.cluster = cluster
        self.module = module or os.environ.get(WORKER_MODULE_ENV) or "worker"
        self._own_ray = not ray.is_initialized()
        if self._own_ray:
            check_reachable(cluster.address)
            try:
                ray.init(address=cluster.address, namespace="modelyard", include_dashboard=False,
                         log_to_driver=False, configure_logging=False)
            except Exception as e:
                raise LaunchError(f"cannot join the Ray cluster at {cluster.address or '(a new local one)'}: {e}") from None
        self.advertise_host = cluster.advertise_host or ray.util.get_node_ip_address()
        self._host_cls = ray.remote(WorkerHost)
        self._probe_fn = ray.remote(node_memory_available)
        self._handles: dict[int, RayHandle] = {}  # by worker pid (pids of distinct nodes may clash: last wins)
        self._reserved: list[tuple[str, str]] = []  # (model, node id) of replicas being started
        self._node_memory: dict[str, int] = {}
        self._probe: asyncio.Task[None] | None = None
        self._closing = False
        self._node_memory = self._nodes_logical_memory()
        log.info("Ray launcher: %d node(s), workers connect to %s", len(self._alive_nodes()), self.advertise_host)

    # ------------------------------------------------------------------ Launcher

    def endpoint(self) -> str:
        return f"tcp://{self.advertise_host}:0"

    async def start(self, model: ModelConfig | None, endpoint: str, credentials: WorkerCredentials) -> Launched:
        if model is None:
            raise LaunchError("the Ray launcher keeps no warm spare")
        node = self._spread_node(model)
        if node is not None:  # reserved while it starts: a replica starting at the same time goes elsewhere
            self._reserved.append((model.name, node))
        try:
            launched = await self._start(model, endpoint, credentials, node)
        finally:
            if node is not None:
                self._reserved.remove((model.name, node))
        assert isinstance(launched.handle, RayHandle)
        launched.handle.model = model.name
        return launched

    def _spread_node(self, model: ModelConfig) -> str | None:
        """For a model with replicas: the alive node (carrying its ``node_labels``, with the cores it
        asks for) that runs none of its workers and has the most memory available; None when the
        model has one replica or every such node has one already (Ray's own choice then)."""
        if model.replicas < 2:
            return None
        taken = {h.node_id for h in self._handles.values() if h.model == model.name and h.alive()}
        taken |= {n for m, n in self._reserved if m == model.name}
        free = [n["NodeID"] for n in self._alive_nodes()
                if n["NodeID"] not in taken and float(n.get("Resources", {}).get("CPU", 0)) >= (model.n_threads or 1)
                and all(n.get("Labels", {}).get(k) == v for k, v in model.node_labels)]
        return max(free, key=lambda n: self._node_memory.get(n, 0)) if free else None

    async def _start(self, model: ModelConfig, endpoint: str, credentials: WorkerCredentials,
                     node: str | None) -> Launched:
        opts: dict[str, Any] = {"num_cpus": model.n_threads or 1, "max_concurrency": ACTOR_THREADS,
                                "max_restarts": 0}
        if node is not None:  # a replica: on a node none of its model's other workers runs on (soft: else Ray's pick)
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node, soft=True)
        try:
            opts["memory"] = placement.estimate(model.path, model.kv_budget_mib, None, weights=model.weights_mode).total
        except (OSError, ValueError):
            pass  # no estimate: Ray places by cores and labels alone
        if model.node_labels:
            opts["label_selector"] = dict(model.node_labels)
            if not any(all(n.get("Labels", {}).get(k) == v for k, v in model.node_labels)
                       for n in self._alive_nodes()):
                want = ", ".join(f"{k}={v}" for k, v in model.node_labels)
                raise LaunchError(f"no alive Ray node carries {model.name}'s node_labels ({want})")
        args = [*option_args(model), "--endpoint", endpoint]
        deadline = asyncio.get_running_loop().time() + self.cluster.place_timeout_s
        want = ", ".join(f"{k}={v}" for k, v in opts.items() if k not in ("max_concurrency", "max_restarts"))
        while True:
            actor = self._host_cls.options(**opts).remote()
            left = deadline - asyncio.get_running_loop().time()
            try:
                info = await asyncio.wait_for(self._start_ref(actor, args, credentials), max(left, 0.0))
                break
            except asyncio.TimeoutError:
                self._ray.kill(actor, no_restart=True)
                raise LaunchError(f"no Ray node could take {model.name}'s worker within "
                                  f"{self.cluster.place_timeout_s:g} s (asked for {want})") from None
            except asyncio.CancelledError:
                self._ray.kill(actor, no_restart=True)
                raise
            except Exception as e:
                self._ray.kill(actor, no_restart=True)
                if _lost_with_its_node(e) and deadline - asyncio.get_running_loop().time() > RETRY_DELAY_S:
                    # placed on a node Ray had not yet found dead (a host just lost): place it again
                    log.warning("worker for %s: its Ray node died before it started; placing it again", model.name)
                    await asyncio.sleep(RETRY_DELAY_S)
                    continue
                cause = getattr(e, "cause", None) or e  # a RayTaskError wraps the actor's own exception
                raise LaunchError(f"the Ray actor could not start {model.name}'s worker: "
                                  f"{type(cause).__name__}: {cause}") from None
        handle = RayHandle(self._ray, actor, info)
        self._handles[handle._pid] = handle
        log.info("worker for %s: pid %s on Ray node %s", model.name, handle.pid, handle.host)
        command = ("ray-actor@" + handle.host, *map(str, info["command"][1:]))
        return Launched(endpoint, credentials, handle, command)

    async def _start_ref(self, actor: Any, args: list[str], credentials: WorkerCredentials) -> dict[str, Any]:
        info: dict[str, Any] = await actor.start.remote(self.module, args, credentials.to_bytes())
        return info

    def cores(self) -> int:
        cpus = [int(n.get("Resources", {}).get("CPU", 0)) for n in self._alive_nodes()]
        return max([1, *cpus])

    def available(self) -> int:
        return max(self._node_memory.values(), default=0)

    def rss(self, pid: int | None, model: str) -> int | None:
        h = self._handles.get(pid) if pid is not None else None
        return h.rss_bytes() if h is not None else None

    # ------------------------------------------------------------------ probes

    def begin(self) -> None:
        self._probe = asyncio.get_running_loop().create_task(self._probe_loop(), name="ray-probe")

    def _alive_nodes(self) -> list[dict[str, Any]]:
        return [n for n in self._ray.nodes() if n.get("Alive")]

    def _probe_refs(self) -> dict[str, Any]:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        return {n["NodeID"]: self._probe_fn.options(
                    num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
                for n in self._alive_nodes()}

    def _nodes_logical_memory(self) -> dict[str, int]:
        """Each alive node's ``memory`` resource as Ray set it at the node's start (about its
        available memory then), bytes: the figure until the first probe has answered."""
        return {n["NodeID"]: int(n.get("Resources", {}).get("memory", 0)) for n in self._alive_nodes()}

    async def _probe_loop(self) -> None:
        first = True
        while not self._closing:
            if not first:
                await asyncio.sleep(PROBE_INTERVAL_S)
            first = False
            refs = self._probe_refs()
            memory: dict[str, int] = {}
            for node, ref in refs.items():
                try:
                    memory[node] = int(await asyncio.wait_for(asyncio.wrap_future(ref.future()), PROBE_TIMEOUT_S))
                except Exception:  # no answer now: its last figure stands until it is gone from Ray
                    if node in self._node_memory:
                        memory[node] = self._node_memory[node]
            self._node_memory = memory
            for pid, h in list(self._handles.items()):
                if not h.alive():
                    self._handles.pop(pid, None)
                else:
                    await h.refresh()

    async def close(self) -> None:
        self._closing = True
        if self._probe is not None:
            self._probe.cancel()
        for h in list(self._handles.values()):
            h.kill()
        self._handles.clear()
        if self._own_ray:
            await asyncio.get_running_loop().run_in_executor(None, self._ray.shutdown)


__all__ = ["RayHandle", "RayLauncher"]

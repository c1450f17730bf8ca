"""``[cluster]`` in config.toml: where workers run (this host, or the nodes of a Ray cluster).

Keys (all optional; without the table every worker is a child of the router, as always):

* ``backend``: ``"local"`` (default: subprocesses of the router, ``router.workers.launchers.local``)
  or ``"ray"`` (each worker started by a Ray actor on a node Ray picks,
  ``router.workers.launchers.ray``; needs ``pip install 'modelyard[ray]'``; Ray is imported only
  then). With ``"ray"`` the router-worker sockets are tcp with CURVE whatever
  ``[server] transport`` says.
* ``address``: the Ray cluster to join (``"auto"``, ``"HOST:6379"``, ``"ray://HOST:10001"``;
  as ``ray.init(address=...)``); unset: the router starts a Ray instance on this host alone.
* ``advertise_host``: the address workers connect to (the router binds its worker sockets there);
  unset: the IP Ray reports for the router's own node.
* ``place_timeout_s``: how long a worker may wait for a node with the resources it asks for
  before its load fails (default 60 s).

Per model (``[models.NAME]`` or ``[defaults]``): ``node_labels = { key = "value", ... }``, the Ray
node labels a node must carry to run that model's worker (Ray's ``label_selector``);
``replicas = N`` (1 to 64, default 1), the workers serving that model, each its own slot, on
distinct Ray nodes where the nodes allow it (all on this host with the local launcher;
``router.workers.replicas``); ``routing``, how a request picks among the ready replicas
(``router.serving.routing``): ``"cache_aware"`` (default), ``"least_loaded"`` or ``"round_robin"``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from router.config_readers import ConfigError

#: ``[cluster] backend`` values; the first is the default.
BACKENDS = ("local", "ray")
_CLUSTER_KEYS = {"backend", "address", "advertise_host", "place_timeout_s"}
#: ``routing`` values (router.serving.routing); the first is the default.
ROUTINGS = ("cache_aware", "least_loaded", "round_robin")
#: The per-model keys of replicas (``[models.NAME]``, ``[defaults]``).
REPLICA_KEYS = ("replicas", "routing")
#: The most replicas a model may have.
MAX_REPLICAS = 64


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """``[cluster]`` (see the module docstring). Times in seconds."""

    backend: str = "local"
    address: str | None = None
    advertise_host: str | None = None
    place_timeout_s: float = 60.0


def parse_cluster(data: dict[str, Any]) -> ClusterConfig:
    """The ``[cluster]`` table of a parsed config document (absent: the defaults).
    Raises ConfigError naming the key."""
    raw = data.get("cluster", {})
    if not isinstance(raw, dict):
        raise ConfigError("cluster", f"expected a table, got {type(raw).__name__}")
    unknown = sorted(set(raw) - _CLUSTER_KEYS)
    if unknown:
        raise ConfigError(f"cluster.{unknown[0]}", f"unknown key (known: {', '.join(sorted(_CLUSTER_KEYS))})")
    backend = raw.get("backend", BACKENDS[0])
    if backend not in BACKENDS:
        raise ConfigError("cluster.backend", f"expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    strings: dict[str, str | None] = {}
    for key in ("address", "advertise_host"):
        v = raw.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ConfigError(f"cluster.{key}", f"expected a non-empty string, got {v!r}")
        strings[key] = v
    timeout = raw.get("place_timeout_s", 60.0)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout <= 86400:
        raise ConfigError("cluster.place_timeout_s", f"expected seconds in (0, 86400], got {timeout!r}")
    return ClusterConfig(backend=backend, address=strings["address"], advertise_host=strings["advertise_host"],
                         place_timeout_s=float(timeout))


def node_labels(merged: dict[str, Any], where: str) -> tuple[tuple[str, str], ...]:
    """A model's ``node_labels`` table as sorted (key, value) pairs (absent: none).
    Raises ConfigError naming ``where.node_labels`` unless every key and value is a non-empty string."""
    raw = merged.get("node_labels", {})
    if not isinstance(raw, dict):
        raise ConfigError(f"{where}.node_labels", f"expected a table of strings, got {type(raw).__name__}")
    for k, v in raw.items():
        if not isinstance(v, str) or not v or not k:
            raise ConfigError(f"{where}.node_labels.{k}", f"expected a non-empty string, got {v!r}")
    return tuple(sorted(raw.items()))


def read_replicas(merged: dict[str, Any], where: str) -> int:
    """A model's ``replicas`` (absent: 1). Raises ConfigError naming ``where.replicas`` unless an
    integer in [1, MAX_REPLICAS]."""
    v = merged.get("replicas", 1)
    if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= MAX_REPLICAS:
        raise ConfigError(f"{where}.replicas", f"expected an integer in [1, {MAX_REPLICAS}], got {v!r}")
    return v


def read_routing(merged: dict[str, Any], where: str) -> str:
    """A model's ``routing`` (absent: ``"cache_aware"``). Raises ConfigError naming ``where.routing``
    unless one of ROUTINGS."""
    v = merged.get("routing", ROUTINGS[0])
    if v not in ROUTINGS:
        raise ConfigError(f"{where}.routing", f"expected one of {', '.join(map(repr, ROUTINGS))}, got {v!r}")
    return str(v)


def replica_fields(merged: dict[str, Any], src: Callable[[str], str]) -> dict[str, Any]:
    """A model's ``replicas`` and ``routing`` as ModelConfig fields, with ``kv_events_to_router`` (the
    router's prefix indexes need its workers' KV events when it has several replicas). ``src(key)``:
    the table a key came from. Raises ConfigError naming the key."""
    replicas = read_replicas(merged, src("replicas"))
    return {"replicas": replicas, "routing": read_routing(merged, src("routing")), "kv_events_to_router": replicas > 1}


def one_worker_each(key: str, replicas: int, prefill_replicas: int) -> None:
    """A disaggregated model and its prefill model have one worker each. Raises ConfigError at ``key``."""
    if replicas > 1 or prefill_replicas > 1:
        raise ConfigError(key, "a disaggregated model and its prefill model have one worker each: "
                          "replicas > 1 is not supported with prefill_model")


__all__ = ["BACKENDS", "REPLICA_KEYS", "ROUTINGS", "ClusterConfig", "node_labels", "one_worker_each", "parse_cluster", "read_replicas",
           "read_routing", "replica_fields"]

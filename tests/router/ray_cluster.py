"""A Ray cluster on this one machine for the Ray launcher's tests: a head that runs no worker
(0 CPUs: the router's node) and worker nodes with distinct labels (``zone=<name>``).

Ray's processes (and so the workers they start) inherit this process's environment when the
cluster starts: the repository on ``PYTHONPATH`` and whatever ``env`` adds (the fake worker's
switch file), restored when the cluster stops."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


@contextmanager
def ray_cluster(zones: tuple[str, ...] = ("a", "b"), env: dict[str, str] | None = None, cpus: int = 1) -> Iterator[tuple[Any, dict[str, Any]]]:
    """``(cluster, {zone: node})``: a ``ray.cluster_utils.Cluster`` with one node per zone, ``cpus``
    logical CPUs each."""
    import ray
    from ray.cluster_utils import Cluster

    names = ("PYTHONPATH", "RAY_USAGE_STATS_ENABLED", "RAY_raylet_start_wait_time_s", *(env or {}))
    keep = {k: os.environ.get(k) for k in names}
    # a raylet may take more than Ray's default 30 s to register on a busy 2-core machine
    os.environ.update(RAY_USAGE_STATS_ENABLED="0", RAY_raylet_start_wait_time_s="180",
                      PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {}))
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False})
    try:
        nodes = {name: c.add_node(num_cpus=cpus, labels={"zone": name}) for name in zones}
        c.wait_for_nodes()
        yield c, nodes
    finally:
        if ray.is_initialized():
            ray.shutdown()
        c.shutdown()
        for k, v in keep.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def ray_config(address: str, models: str, server: str = "") -> str:
    """A config.toml joining the cluster at ``address`` with ``models`` (TOML tables)."""
    return (f'[server]\nmodels_dir = "."\n{server}[cluster]\nbackend = "ray"\naddress = "{address}"\n'
            f'place_timeout_s = 120\n[defaults]\nping_interval_s = 0\n' + models)

"""The Ray launcher (``[cluster] backend = "ray"``) on a Ray cluster started by the test on this
machine: three nodes (a head that runs no worker, two worker nodes with distinct labels), fake
workers. A model lands on the node its labels name, its figures come from that node, a model
with no labels goes where Ray has room, losing a node mid-stream ends that stream with an error
event at once and the model is placed again on the node that is left, and a model no node can
take fails its load with a message saying what it asked for."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from router.config import ConfigError, parse_config
from tests.router.conftest import LiveRouter, dummy_gguf
from tests.router.inproc import InProc, chat
from tests.router.ray_cluster import ray_cluster, ray_config

ray = pytest.importorskip("ray", reason="the Ray launcher's tests need the [ray] extra (installed by .[dev])")
from ray.cluster_utils import Cluster  # noqa: E402

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Cluster, dict[str, Any], Path]]:
    """Head (0 CPUs: the router's node, runs no worker) + nodes "a" and "b" (1 CPU each, labels
    zone=a / zone=b). The fake worker's switch file is set in the environment first: Ray's
    processes (and so the workers they start) inherit it."""
    fake = tmp_path_factory.mktemp("ray") / "fake.json"
    fake.write_text("{}")
    with ray_cluster(("a", "b"), env={"MODELYARD_FAKE_FILE": str(fake)}) as (c, nodes):
        yield c, nodes, fake


def _lose_host(c: Cluster, node: Any, worker_pid: int) -> None:
    """What a host's loss does to its processes, on this one machine: the node's Ray processes,
    the worker's actor and the worker die at once (SIGKILL, no goodbye)."""
    import psutil

    actor = psutil.Process(worker_pid).parent()
    for p in (actor, psutil.Process(worker_pid)):
        if p is not None:
            p.kill()
    c.remove_node(node, allow_graceful=False)


def _row(rows: dict[str, Any], name: str) -> dict[str, Any]:
    return next(m for m in rows["data"] if m["id"] == name)


def test_cluster_config_is_read_and_checked(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"")  # config checks that the file exists, nothing more
    base = {"server": {"models_dir": "."}, "models": {"a": {"path": "m.gguf", "node_labels": {"zone": "a"}}}}
    cfg = parse_config({**base, "cluster": {"backend": "ray", "address": "auto"}}, base_dir=tmp_path)
    assert cfg.cluster.backend == "ray" and cfg.cluster.address == "auto" and cfg.cluster.place_timeout_s == 60
    assert cfg.models["a"].node_labels == (("zone", "a"),)
    assert parse_config({"server": {"models_dir": "."}, "models": {"a": {"path": "m.gguf"}}}, base_dir=tmp_path).cluster.backend == "local"
    for bad, key in (({"backend": "k8s"}, "cluster.backend"), ({"adress": "x"}, "cluster.adress"),
                     ({"place_timeout_s": 0}, "cluster.place_timeout_s")):
        with pytest.raises(ConfigError) as e:
            parse_config({**base, "cluster": bad}, base_dir=tmp_path)
        assert e.value.key == key
    with pytest.raises(ConfigError) as e:
        parse_config({"server": {"models_dir": "."}, "models": {"a": {"path": "m.gguf", "node_labels": {"zone": 1}}}}, base_dir=tmp_path)
    assert e.value.key == "models.a.node_labels.zone"


def test_workers_run_on_the_nodes_ray_picks(cluster: tuple[Cluster, dict[str, Any], Path], tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    c, nodes, fake = cluster
    env = InProc(tmp_path, monkeypatch)
    monkeypatch.setenv("MODELYARD_FAKE_FILE", str(fake))  # the one Ray's nodes were started with
    env.fake_file = fake
    models = ('[models.on_b]\npath = "m.gguf"\nnode_labels = { zone = "b" }\n'
              '[models.anywhere]\npath = "m.gguf"\n'
              '[models.nowhere]\npath = "m.gguf"\nnode_labels = { zone = "mars" }\n')
    node_b = nodes["b"].node_id

    async def go() -> None:
        async with env.app(ray_config(c.address, models)) as (pool, client):
            assert type(pool.launcher).__name__ == "RayLauncher" and pool.curve is not None
            assert pool.launcher.endpoint().startswith("tcp://")
            # labels decide the node; the answer is served over the worker's tcp socket
            r = await client.post("/v1/chat/completions", json=chat("on_b"))
            assert r.status_code == 200, r.text
            row = _row((await client.get("/admin/models")).json(), "on_b")
            assert row["state"] == "ready" and row["host"].endswith(node_b[:12]), row["host"]
            assert row["pid"] is not None
            # the head has no CPU: a model without labels runs on a or b
            r = await client.post("/v1/chat/completions", json=chat("anywhere"))
            assert r.status_code == 200, r.text
            # no node carries zone=mars: the load fails at once, saying which labels it asked for
            r = await client.post("/v1/chat/completions", json=chat("nowhere"))
            assert r.status_code == 503 and "node_labels (zone=mars)" in r.text, r.text
            # unload: the worker and its actor end
            pid = row["pid"]
            r = await client.post("/admin/models/unload", json={"model": "on_b"})
            assert r.status_code == 200, r.text
            assert _row((await client.get("/admin/models")).json(), "on_b")["pid"] is None
            assert not any(h.pid == pid and h.alive() for h in pool.launcher._handles.values())

    asyncio.run(go())


def test_a_lost_node_ends_its_stream_and_the_model_is_placed_again(
        cluster: tuple[Cluster, dict[str, Any], Path], tmp_path: Path) -> None:
    """``modelyard serve`` as a user runs it, joining the cluster; a real HTTP stream (the
    in-process client would buffer it)."""
    c, nodes, fake = cluster
    dummy_gguf(tmp_path, "m.gguf")
    fake.write_text(json.dumps({"*": {"token_delay_s": 0.2, "length": 200}}))
    models = '[models.m]\npath = "m.gguf"\nrestart_backoff_s = 0.2\n'
    try:
        with LiveRouter(tmp_path, ray_config(c.address, models)) as live, live.http(timeout=120) as client:
            r = client.post("/v1/chat/completions", json=chat("m", max_tokens=3))
            assert r.status_code == 200, r.text
            row = _row(client.get("/admin/models").json(), "m")
            host, pid = row["host"], row["pid"]
            lost = next(name for name, n in nodes.items() if host.endswith(n.node_id[:12]))
            lines: list[str] = []
            t_lost = t_removed = 0.0
            with client.stream("POST", "/v1/chat/completions", json={**chat("m", max_tokens=150), "stream": True}) as s:
                assert s.status_code == 200
                for line in s.iter_lines():
                    lines.append(line)
                    if not t_lost and sum(1 for x in lines if x.startswith("data: {")) == 3:
                        t_lost = time.monotonic()
                        _lose_host(c, nodes[lost], pid)
                        t_removed = time.monotonic()
            t_end = time.monotonic()
            events = [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
            assert t_lost and "error" in events[-1], lines[-5:]
            assert len(events) < 20, "the stream went on after its host was lost"
            # the error event within 2 s of the host's loss (the loss itself took t_removed - t_lost)
            assert t_end - t_removed < 2.0, (t_removed - t_lost, t_end - t_removed)
            # placed again, on the node that is left (after the crash backoff its 503 names)
            r = client.post("/v1/chat/completions", json=chat("m", max_tokens=3))
            if r.status_code == 503 and "restart_backoff" in r.text:
                time.sleep(float(r.headers["Retry-After"]))
                r = client.post("/v1/chat/completions", json=chat("m", max_tokens=3))
            assert r.status_code == 200, r.text
            other = next(n for name, n in nodes.items() if name != lost)
            assert _row(client.get("/admin/models").json(), "m")["host"].endswith(other.node_id[:12])
    finally:
        fake.write_text("{}")


def test_an_unreachable_cluster_address_fails_at_once_in_one_line(tmp_path: Path) -> None:
    """``modelyard serve`` with an address no cluster answers at exits 1 with one line naming it,
    within seconds (``ray.init`` alone retries for minutes, deaf to Ctrl-C)."""
    import socket
    import subprocess
    import sys

    from router.workers.launchers import LaunchError
    from router.workers.launchers.ray import check_reachable

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(LaunchError, match=f"127.0.0.1:{port}"):
        check_reachable(f"127.0.0.1:{port}")
    for left_to_ray in (None, "auto", "ray://example:10001"):
        check_reachable(left_to_ray)
    dummy_gguf(tmp_path, "m.gguf")
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'[server]\nmodels_dir = "."\n[cluster]\nbackend = "ray"\naddress = "127.0.0.1:{port}"\n'
                   '[models.m]\npath = "m.gguf"\n')
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "router", "serve", "--config", str(cfg), "--port", "0"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and time.monotonic() - t0 < 30, out
    assert out.stderr.strip().count("\n") == 0 and f"cannot reach the Ray cluster at 127.0.0.1:{port}" in out.stderr

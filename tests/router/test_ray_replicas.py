"""Two replicas of the real SmolLM2 (``replicas = 2``, ``router.workers.replicas``) on a Ray cluster
started by the test on this machine: a head that runs no worker and nodes "a", "b", "c" (1 CPU
each, distinct labels). The replicas land on distinct nodes; their answers at temperature 0 are
the single worker's; a conversation's next turn lands on the replica holding its prefix (its
cached tokens cover the previous turn); losing a replica's node mid-stream ends that stream
with an error event within 2 s, the request waiting for that replica is served by the other,
and the lost replica is placed again. One module-scoped cluster and router (~1 min on 2 cores)."""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.router.conftest import LiveRouter

ray = pytest.importorskip("ray", reason="the Ray launcher's tests need the [ray] extra (installed by .[dev])")
from ray.cluster_utils import Cluster  # noqa: E402

from tests.router.ray_cluster import ray_cluster  # noqa: E402
from tests.router.test_ray_launcher import _lose_host  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
MODELS = ROOT / "models"
SMOLLM2 = MODELS / "SmolLM2-135M-Instruct.Q4_1.gguf"

pytestmark = [pytest.mark.timeout(600),
              pytest.mark.skipif(not SMOLLM2.is_file(), reason="needs models/ (scripts/fetch_models.py)")]

SYSTEM = "You are a helpful assistant. Answer in one short sentence."
TOPICS = ["apples", "the moon", "rivers", "bicycles", "volcanoes", "owls", "bread", "winter"]


@pytest.fixture(scope="module")
def cluster() -> Iterator[tuple[Cluster, dict[str, Any]]]:
    with ray_cluster(("a", "b", "c")) as c:
        yield c


@pytest.fixture(scope="module")
def live(cluster: tuple[Cluster, dict[str, Any]], tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRouter]:
    c, _nodes = cluster
    tmp = tmp_path_factory.mktemp("ray-replicas")
    config = (f'[server]\nmodels_dir = "{MODELS}"\n[cluster]\nbackend = "ray"\naddress = "{c.address}"\n'
              'place_timeout_s = 120\n'
              '[defaults]\nn_ctx = 1024\nn_threads = 1\nparallel = 1\nmax_queue = 8\nload_timeout_s = 300\n'
              'ping_interval_s = 0\nrestart_backoff_s = 0.2\n'
              f'[models.smol]\npath = "{SMOLLM2.name}"\nreplicas = 2\n'
              f'[models.single]\npath = "{SMOLLM2.name}"\n')
    with LiveRouter(tmp, config, real=True) as r:
        yield r


def chat(model: str, messages: list[dict[str, str]], max_tokens: int = 8, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}


def first_turn(topic: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Tell me one fact about {topic}."}]


def replicas(http: httpx.Client) -> list[dict[str, Any]]:
    row = next(m for m in http.get("/admin/models").json()["data"] if m["id"] == "smol")
    return list(row["replicas"])


def test_two_replicas_on_distinct_nodes_answer_as_one_worker(live: LiveRouter) -> None:
    with live.http(timeout=300) as http:
        prompts = [first_turn(t) for t in TOPICS[:2]]
        single = [http.post("/v1/chat/completions", json=chat("single", p)).json() for p in prompts]
        assert http.post("/admin/models/unload", json={"model": "single"}).status_code == 200  # its node is free
        r = http.post("/admin/models/load", json={"model": "smol"})
        assert r.status_code == 200, r.text
        rows = replicas(http)
        assert [x["state"] for x in rows] == ["ready", "ready"]
        assert rows[0]["node"] != rows[1]["node"], rows
        # two at once: the idle replica takes the second (least loaded), so both replicas answer
        with ThreadPoolExecutor(2) as pool:
            answers = list(pool.map(lambda p: http.post("/v1/chat/completions", json=chat("smol", p)).json(), prompts))
        for a, s in zip(answers, single):
            assert a["choices"][0]["message"]["content"] == s["choices"][0]["message"]["content"]
        metrics = http.get("/metrics").text
        assert metrics.count('modelyard_replica_state{model="smol"') >= 2
        assert {s["replica"] for s in http.get("/slots", params={"model": "smol"}).json()} == {0, 1}


def test_a_conversations_next_turns_land_where_its_prefix_is(live: LiveRouter) -> None:
    with live.http(timeout=300) as http:
        assert http.post("/admin/models/load", json={"model": "smol"}).status_code == 200
        convs = [first_turn(t) for t in TOPICS]
        last: list[dict[str, Any]] = [{} for _ in convs]
        hits, checks = 0, 0

        def turn(i: int) -> tuple[int, dict[str, Any]]:
            return i, http.post("/v1/chat/completions", json=chat("smol", convs[i])).json()

        for round_ in range(3):  # turn 1, then turns 2 and 3: 16 next turns in all
            order = random.Random(round_).sample(range(len(convs)), len(convs))  # a new order each round
            with ThreadPoolExecutor(2) as pool:  # interleaved, two at a time
                results = list(pool.map(turn, order))
            for i, ans in results:
                usage = ans["usage"]
                if round_ > 0:
                    prev = last[i]["usage"]
                    checks += 1
                    held = prev["prompt_tokens"] + prev["completion_tokens"] - 4
                    hits += usage["prompt_tokens_details"]["cached_tokens"] >= held
                last[i] = ans
                convs[i] = [*convs[i], {"role": "assistant", "content": ans["choices"][0]["message"]["content"]},
                            {"role": "user", "content": "And another one?"}]
        assert checks == 16 and hits >= 15, (hits, checks)


def test_a_lost_node_fails_its_stream_and_its_waiting_request_moves(
        live: LiveRouter, cluster: tuple[Cluster, dict[str, Any]]) -> None:
    c, nodes = cluster
    with live.http(timeout=300) as http:
        assert http.post("/admin/models/load", json={"model": "smol"}).status_code == 200
        conv = first_turn("the sea")
        events: list[dict[str, Any]] = []
        t_removed = t_end = 0.0
        waiting: list[httpx.Response] = []
        started = threading.Event()

        def stream() -> None:
            nonlocal t_end
            # ignore_eos: the answer asked for is one short sentence; the stream must outlast the host
            with http.stream("POST", "/v1/chat/completions",
                             json=chat("smol", conv, 600, stream=True, ignore_eos=True)) as s:
                for line in s.iter_lines():
                    if line.startswith("data: {"):
                        events.append(json.loads(line[6:]))
                        if len(events) == 3:
                            started.set()
            t_end = time.monotonic()

        th = threading.Thread(target=stream)
        th.start()
        assert started.wait(120)
        rows = replicas(http)
        busy = next(x for x in rows if x["slots_busy"] == 1)
        # the same conversation again: its prefix is on the busy replica, so it waits there
        follow = threading.Thread(target=lambda: waiting.append(
            http.post("/v1/chat/completions", json=chat("smol", conv))))
        follow.start()
        live.wait_for(lambda: next(x for x in replicas(http) if x["replica"] == busy["replica"])["queue_depth"] == 1,
                      60, "the follow-up waiting on the busy replica")
        lost = next(name for name, n in nodes.items() if busy["node"].endswith(n.node_id[:12]))
        _lose_host(c, nodes[lost], busy["pid"])
        t_removed = time.monotonic()
        th.join(60)
        assert events and "error" in events[-1], events[-3:]
        assert t_end - t_removed < 2.0, t_end - t_removed
        follow.join(120)
        assert waiting and waiting[0].status_code == 200, waiting and waiting[0].text
        # the lost replica is placed again (after its crash backoff), on a node other than the lost one
        live.wait_for(lambda: [x["state"] for x in replicas(http)] == ["ready", "ready"], 180, "placed again")
        rows = replicas(http)
        assert all(not x["node"].endswith(nodes[lost].node_id[:12]) for x in rows), rows
        assert rows[0]["node"] != rows[1]["node"], rows

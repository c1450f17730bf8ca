"""A prefill/decode split across two hosts (issue 25): the prefill worker on one Ray node, the
decode worker on another, real workers on a tiny GGUF; the KV state crosses the wire between the
nodes (KVChunk frames relayed by the router) and the answer is the single worker's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.router.conftest import LiveRouter
from tests.router.ray_cluster import ray_cluster, ray_config
from tests.worker.tiny_gguf import write_tiny_llama

pytest.importorskip("ray", reason="the Ray launcher's tests need the [ray] extra (installed by .[dev])")

pytestmark = pytest.mark.timeout(600)

PROMPT = [10 + (i * 7) % 300 for i in range(300)]


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[tuple[LiveRouter, dict[str, Any]]]:
    write_tiny_llama(module_tmp / "wide.gguf", n_embd=256, n_head=4, n_head_kv=4, n_layer=8, n_ff=256,
                     n_ctx_train=1024)
    models = (
        '[models.one]\npath = "wide.gguf"\nn_ctx = 1024\nnode_labels = { zone = "a" }\n'
        '[models.pre]\npath = "wide.gguf"\nn_ctx = 1024\nnode_labels = { zone = "a" }\n'
        '[models.split]\npath = "wide.gguf"\nn_ctx = 1024\nprefill_model = "pre"\nnode_labels = { zone = "b" }\n')
    with ray_cluster(cpus=2) as (c, nodes):  # node a runs two workers (one, pre)
        live = LiveRouter(module_tmp, ray_config(c.address, models), real=True)
        try:
            yield live, nodes
        finally:
            live.stop(timeout=60)
            live.kill()


def test_a_split_across_two_nodes_gives_the_single_worker_text(router: tuple[LiveRouter, dict[str, Any]]) -> None:
    live, nodes = router
    http = live.http(timeout=180)

    def completion(model: str) -> dict[str, Any]:
        r = http.post("/completion", json={"model": model, "prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                           "ignore_eos": True})
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    one = completion("one")
    split = completion("split")
    assert split["content"] == one["content"]
    assert split["timings"]["cache_n"] == len(PROMPT) - 1 and split["timings"]["prompt_n"] == 1
    rows = {m["id"]: m for m in http.get("/admin/models").json()["data"]}
    assert rows["pre"]["host"].endswith(nodes["a"].node_id[:12]), rows["pre"]["host"]
    assert rows["split"]["host"].endswith(nodes["b"].node_id[:12]), rows["split"]["host"]
    assert "handed over by wire" in live.log()

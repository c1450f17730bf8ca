"""The warm spare with a real worker (``python -m worker --spare``) on SmolLM2: the first request
through the spare gives llama.cpp's temperature-0 answer, token for token, the same as a worker
started for the model; the spare is reported with its memory; nothing is left after SIGTERM."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.paths import SMOLLM2_FIXTURES
from tests.router.conftest import MODELS, SMOLLM2, LiveRouter, alive

pytestmark = [pytest.mark.slow]

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


def test_the_first_request_through_a_spare_gives_the_same_greedy_answer(tmp_path: Path) -> None:
    ref = next(g for g in json.loads(SMOLLM2_FIXTURES.read_text())["greedy"] if g.get("messages") == FRANCE)
    n = 6
    config = (f'[server]\nmodels_dir = "{MODELS}"\nwarm_spare = true\n[defaults]\nn_ctx = 512\nparallel = 1\n'
              f'load_timeout_s = 300\n[models.spare]\npath = "{SMOLLM2.name}"\n[models.own]\npath = "{SMOLLM2.name}"\n')
    r = LiveRouter(tmp_path, config, real=True)
    try:
        spare: dict[str, Any] = r.wait_for(
            lambda: (s := httpx.get(f"{r.url}/admin/models", timeout=10).json()["spare"])["state"] == "warm" and s,
            300, "a warm spare")
        assert spare["rss_bytes"] > 50 * 2**20  # numpy, the engine and its kernels are in

        def greedy(model: str) -> list[int]:
            body = {"model": model, "prompt": ref["prompt"], "n_predict": n, "temperature": 0,
                    "return_tokens": True, "cache_prompt": False}
            resp = httpx.post(f"{r.url}/completion", json=body, timeout=300)
            assert resp.status_code == 200, resp.text
            return list(resp.json()["tokens"])

        through_spare = greedy("spare")
        assert r.admin("spare")["from_spare"] is True and r.admin("spare")["pid"] == spare["pid"]
        assert through_spare == ref["ids"][:n]  # llama.cpp's greedy tokens
        # the next model starts before a new spare is warm (its replacement waits for the first
        # start to end, then SPARE_REPLACE_DELAY_S): a worker of its own
        own = greedy("own")
        assert r.admin("own")["from_spare"] is False
        assert own == through_spare
        workers = r.workers()
    finally:
        code = r.stop(timeout=60)
        r.kill()
    assert code in (0, -signal.SIGTERM)
    deadline = time.monotonic() + 10
    while alive(workers) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive(workers) == []

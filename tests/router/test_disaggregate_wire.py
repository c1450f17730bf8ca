"""The disaggregated hand-over through the router on real workers (a tiny GGUF): the KV state
streamed as KVChunk frames (the default) and through a shared file give the same greedy text
as one worker; a decode worker that refuses the state (another n_ctx) is a clean 400 naming
the field, with nothing half-loaded and the prefill worker free."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import LiveRouter
from tests.worker.tiny_gguf import write_tiny_llama

PROMPT = [10 + (i * 7) % 300 for i in range(400)]  # ~6.3 MiB of KV on this model: 7 chunks


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    write_tiny_llama(module_tmp / "wide.gguf", n_embd=256, n_head=4, n_head_kv=4, n_layer=8, n_ff=256,
                     n_ctx_train=1024)
    slots = module_tmp / "slots"
    config = f"""
[server]
models_dir = "{module_tmp}"
[defaults]
n_ctx = 1024
parallel = 2
[models.one]
path = "wide.gguf"
[models.pre]
path = "wide.gguf"
[models.split]
path = "wide.gguf"
prefill_model = "pre"
[models.pre-file]
path = "wide.gguf"
slot_save_path = "{slots}"
[models.split-file]
path = "wide.gguf"
slot_save_path = "{slots}"
prefill_model = "pre-file"
kv_transfer = "file"
[models.split-other-ctx]
path = "wide.gguf"
n_ctx = 512
prefill_model = "pre"
"""
    r = LiveRouter(module_tmp, config, real=True)
    yield r
    r.stop(timeout=60)
    r.kill()


def completion(http: httpx.Client, model: str, **kw: object) -> httpx.Response:
    return http.post("/completion", json={"model": model, "prompt": PROMPT, "n_predict": 8, "temperature": 0,
                                          "ignore_eos": True, **kw})


def test_wire_and_file_hand_over_give_the_single_worker_text(router: LiveRouter, module_tmp: Path) -> None:
    http = router.http(timeout=120)
    one = completion(http, "one")
    assert one.status_code == 200, one.text
    for model in ("split", "split-file"):
        r = completion(http, model)
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["content"] == one.json()["content"], model
        assert body["timings"]["cache_n"] == len(PROMPT) - 1 and body["timings"]["prompt_n"] == 1, model
    # cache_prompt false: the prefill worker evaluates it afresh, the decode worker still uses the state
    r = completion(http, "split", cache_prompt=False)
    assert r.json()["content"] == one.json()["content"] and r.json()["timings"]["cache_n"] == len(PROMPT) - 1
    # streamed too
    text = []
    with http.stream("POST", "/completion", json={"model": "split", "prompt": PROMPT, "n_predict": 8,
                                                  "temperature": 0, "ignore_eos": True, "stream": True}) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text.append(json.loads(line[6:]).get("content", ""))
    assert "".join(text) == one.json()["content"]
    log = router.log()
    assert "handed over by wire" in log and "handed over by file" in log
    assert not list((module_tmp / "slots").glob("xfer-*"))  # the file path cleans up


def test_a_refused_state_is_a_clean_error_and_loads_nothing(router: LiveRouter) -> None:
    http = router.http(timeout=120)
    r = completion(http, "split-other-ctx")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "kv_state_mismatch" and "n_ctx" in err["message"], err
    slots = http.get("/slots", params={"model": "split-other-ctx"}).json()
    assert all(s["n_past"] == 0 and not s["is_processing"] for s in slots)
    assert not any(s["is_processing"] for s in http.get("/slots", params={"model": "pre"}).json())
    assert completion(http, "one").status_code == 200  # nothing else is disturbed

"""llama.cpp router introspection against fake workers: /props, /slots, /models,
/models/load|unload, /health?model= (one live router for the module).

The harness check reads these routes the way a llama-server client does: props
fields present and right, a slots list as long as total_slots, ``is_processing``
true while a request runs. Every wait is on observed state (the hold file keeps a
generation or a load going exactly as long as needed).
"""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any


import httpx
import pytest

from protocol.limits import DEFAULT_WEIGHTS
from router.gguf_meta import read_string
from tests.router.conftest import LiveRouter, dummy_gguf

TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"

CONFIG = f"""
[server]
models_dir = "."
[defaults]
max_queue = 2
ping_interval_s = 0.2
[models.alpha]
path = "alpha.gguf"
aliases = ["a"]
temperature = 0.25
top_k = 7
seed = 42
[models.multi]
path = "multi.gguf"
chat_template = "chatml"
[models.own]
path = "own.gguf"
[models.broken]
path = "broken.gguf"
[models.lazy]
path = "lazy.gguf"
[models.spare]
path = "spare.gguf"
[models.quant]
path = "spare.gguf"
aliases = ["q"]
weights = "f32"
"""

SWITCHES: dict[str, Any] = {
    "multi": {"max_jobs": 3, "report_slots": True, "n_ctx": 300},
    "broken": {"load_error": True},
    "lazy": {"hold_load": True},
}


def gguf_with(path: Path, kv: list[tuple[str, int, bytes]]) -> None:
    """A GGUF v3 header holding ``kv`` (key, type code, packed value) and no tensors."""
    out = b"GGUF" + struct.pack("<IQQ", 3, 0, len(kv))
    for key, vtype, packed in kv:
        k = key.encode()
        out += struct.pack("<Q", len(k)) + k + struct.pack("<I", vtype) + packed
    path.write_bytes(out)


def gstr(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "alpha.gguf", "multi.gguf", "broken.gguf", "lazy.gguf", "spare.gguf")
    tokens = b"".join(gstr(t) for t in ("<s>", "</s>", "hello"))
    gguf_with(module_tmp / "own.gguf", [
        ("general.architecture", 8, gstr("llama")),
        ("llama.context_length", 4, struct.pack("<I", 2048)),
        ("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 3) + tokens),
        ("tokenizer.ggml.scores", 9, struct.pack("<IQ", 6, 3) + struct.pack("<3f", 0, 0, 0)),
        ("tokenizer.chat_template", 8, gstr(TEMPLATE)),
    ])
    r = LiveRouter(module_tmp, CONFIG)
    r.set_fake(SWITCHES)
    yield r
    r.stop()


def get(router: LiveRouter, path: str, **params: Any) -> httpx.Response:
    return httpx.get(router.url + path, params=params, timeout=30)


def status_of(router: LiveRouter, model: str) -> dict[str, Any]:
    data = get(router, "/models").json()["data"]
    return next(m for m in data if m["id"] == model)["status"]


def chat(model: str, content: str, **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


# ----------------------------------------------------------------------------- gguf header


def test_gguf_header_reader(router: LiveRouter, module_tmp: Path) -> None:
    own = module_tmp / "own.gguf"
    assert read_string(own, "tokenizer.chat_template") == TEMPLATE  # after a string array and a float array
    assert read_string(own, "general.architecture") == "llama"
    assert read_string(own, "llama.context_length") is None  # not a string
    assert read_string(own, "no.such.key") is None
    assert read_string(module_tmp / "alpha.gguf", "tokenizer.chat_template") is None  # not GGUF
    cut = module_tmp / "cut.gguf"
    cut.write_bytes(own.read_bytes()[:60])
    assert read_string(cut, "tokenizer.chat_template") is None
    assert read_string(module_tmp / "missing.gguf", "tokenizer.chat_template") is None


# ----------------------------------------------------------------------------- /props


def test_props_as_a_llama_server_client_reads_them(router: LiveRouter) -> None:
    r = get(router, "/props", model="a")  # an alias works; the model is loaded first (autoload)
    assert r.status_code == 200, r.text
    p = r.json()
    assert p["total_slots"] == 1
    dgs = p["default_generation_settings"]
    assert dgs["n_ctx"] == 256  # the worker's Ready.n_ctx
    params = dgs["params"]
    # /completion's defaults: llama.cpp's, overlaid with the model's config
    assert (params["temperature"], params["top_k"], params["top_p"], params["min_p"], params["seed"]) == \
        (0.25, 7, 0.95, 0.05, 42)
    assert p["model_path"] == ".../alpha.gguf"  # a client's view: the file's name, not its absolute path
    assert p["chat_template"] == ""  # no config template, and the file is no GGUF
    assert p["modalities"] == {"vision": False, "audio": False}
    assert p["build_info"].startswith("modelyard ")
    assert router.admin("alpha")["state"] == "ready"


def test_props_slots_count_and_templates(router: LiveRouter) -> None:
    p = get(router, "/props", model="multi").json()
    assert p["total_slots"] == 3 and p["default_generation_settings"]["n_ctx"] == 300
    assert p["chat_template"] == "chatml"  # the configured (built-in) name
    assert p["default_generation_settings"]["params"]["seed"] == 4294967295  # random, as llama.cpp says it
    assert get(router, "/props", model="own").json()["chat_template"] == TEMPLATE  # the GGUF's own


def test_props_errors_and_router_props(router: LiveRouter) -> None:
    r = get(router, "/props", model="nope")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    r = get(router, "/props", model="spare", autoload="false")
    assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_loaded"
    assert router.admin("spare")["state"] == "unloaded"
    r = get(router, "/props")  # several models, none named: the router's own props
    assert r.status_code == 200 and r.json()["role"] == "router" and "alpha" in r.json()["models"]
    r = get(router, "/props", model="broken")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_load_failed"
    r = get(router, "/slots")
    assert r.status_code == 400 and r.json()["error"]["param"] == "model"


# ----------------------------------------------------------------------------- /slots


def test_slots_made_by_the_router_follow_its_running_request(router: LiveRouter) -> None:
    """alpha's worker sends no slot list: /slots is made from the router's running set."""

    async def go() -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                async with c.stream("POST", "/v1/chat/completions",
                                    json=chat("alpha", "a b [hold@1]", stream=True)) as resp:
                    assert resp.status_code == 200
                    lines = resp.aiter_lines()
                    first = json.loads((await anext(lines))[len("data: "):])
                    slots = (await c.get("/slots", params={"model": "alpha"})).json()
                    assert len(slots) == 1
                    assert slots[0]["id"] == 0 and slots[0]["is_processing"] is True
                    assert slots[0]["id_task"] == first["id"] and slots[0]["n_ctx"] == 256
                    assert slots[0]["params"]["temperature"] == 0.25

    asyncio.run(go())
    router.wait_for(lambda: not get(router, "/slots", model="alpha").json()[0]["is_processing"],
                    what="slot idle")
    out = httpx.post(router.url + "/v1/completions", json={"model": "alpha", "prompt": "x y [len=5]"},
                     timeout=30).json()
    s = get(router, "/slots", model="alpha").json()[0]
    assert s == {**s, "is_processing": False, "id_task": None}
    # one slot: n_past is the worker's kv_tokens (what the finished request left in the KV)
    assert s["n_past"] == out["usage"]["prompt_tokens"] + out["usage"]["completion_tokens"]


def test_slots_from_the_workers_own_list_with_parallel_requests(router: LiveRouter) -> None:
    async def go() -> None:
        async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
            with router.hold():
                tasks = [asyncio.create_task(c.post("/completion", json={"model": "multi", "prompt": "p [hold]"}))
                         for _ in range(3)]

                async def busy() -> int:
                    r = await c.get("/slots", params={"model": "multi"})
                    return sum(1 for s in r.json() if s["is_processing"])

                while await busy() < 3:
                    await asyncio.sleep(0.02)
                slots = (await c.get("/slots", params={"model": "multi"})).json()
                assert [s["id"] for s in slots] == [0, 1, 2]
                assert len({s["id_task"] for s in slots}) == 3
                full = await c.get("/slots", params={"model": "multi", "fail_on_no_slot": "1"})
                assert full.status_code == 503 and full.json()["error"]["code"] == "no_slot_available"
            rs = await asyncio.gather(*tasks)
            assert [r.status_code for r in rs] == [200] * 3
            ok = await c.get("/slots", params={"model": "multi", "fail_on_no_slot": "1"})
            assert ok.status_code == 200 and not any(s["is_processing"] for s in ok.json())

    asyncio.run(go())


# ----------------------------------------------------------------------------- /models


def test_models_status_and_load_unload(router: LiveRouter) -> None:
    assert status_of(router, "spare") == {"value": "unloaded", "state": "unloaded"}
    r = httpx.post(router.url + "/models/load", json={"model": "spare"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    router.wait_for(lambda: status_of(router, "spare")["value"] == "loaded", what="spare loaded")
    st = status_of(router, "spare")
    assert st["state"] == "ready" and "--model" in st["args"]
    assert not any(a.startswith("/") for a in st["args"]) and ".../spare.gguf" in st["args"], st["args"]
    again = httpx.post(router.url + "/models/load", json={"model": "spare"}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["code"] == "model_already_loaded"
    r = httpx.post(router.url + "/models/unload", json={"model": "spare"}, timeout=30)
    assert r.status_code == 200 and r.json() == {"success": True}
    router.wait_for(lambda: status_of(router, "spare")["value"] == "unloaded", what="spare unloaded")
    again = httpx.post(router.url + "/models/unload", json={"model": "spare"}, timeout=30)
    assert again.status_code == 400 and again.json()["error"]["code"] == "model_not_running"
    r = httpx.post(router.url + "/models/load", json={"model": "nope"}, timeout=30)
    assert r.status_code == 404


def test_models_failed_load_shows_failed_and_exit_code(router: LiveRouter) -> None:
    httpx.post(router.url + "/models/load", json={"model": "broken"}, timeout=30)
    st = router.wait_for(lambda: (s := status_of(router, "broken")).get("failed") and s, what="broken failed")
    assert st["value"] == "unloaded" and st["failed"] is True and st["exit_code"] == 1
    assert st["state"] == "failed" and "fake load failure" in st["error"]
    entry = next(m for m in get(router, "/models").json()["data"] if m["id"] == "alpha")
    assert entry["aliases"] == ["a"] and entry["object"] == "model"
    assert entry["architecture"] == {"input_modalities": ["text"], "output_modalities": ["text"]}


def test_every_per_model_view_shows_the_weights_mode_from_the_config(router: LiveRouter) -> None:
    # unset: the worker's default (protocol.limits.DEFAULT_WEIGHTS, "quantized"); "quant" is
    # configured with the other mode, "f32"
    assert DEFAULT_WEIGHTS == "quantized"
    d = DEFAULT_WEIGHTS
    want = {"alpha": d, "multi": d, "own": d, "broken": d, "lazy": d, "spare": d, "quant": "f32"}
    assert get(router, "/health").json()["weights"] == want
    assert {m["id"]: m["weights"] for m in get(router, "/models").json()["data"]} == want
    assert {m["id"]: m["weights"] for m in get(router, "/v1/models").json()["data"]} == {**want, "a": d, "q": "f32"}
    assert get(router, "/v1/models/q").json()["weights"] == "f32"
    assert {m["id"]: m["weights"] for m in get(router, "/admin/models").json()["data"]} == want
    st = router.admin("quant")
    assert st["placement"]["estimate"]["weights"] == "f32"
    # the worker is started in that mode
    assert httpx.post(router.url + "/models/load", json={"model": "quant"}, timeout=30).status_code == 200
    router.wait_for(lambda: status_of(router, "quant")["value"] == "loaded", what="quant loaded")
    args = status_of(router, "quant")["args"]
    assert args[args.index("--weights") + 1] == "f32"
    assert "--weights" not in status_of(router, "alpha").get("args", [])
    assert router.admin("quant")["weights"] == "f32"
    assert httpx.post(router.url + "/models/unload", json={"model": "quant"}, timeout=30).status_code == 200
    router.wait_for(lambda: status_of(router, "quant")["value"] == "unloaded", what="quant unloaded")


# ----------------------------------------------------------------------------- /health?model=


def test_model_health(router: LiveRouter) -> None:
    r = get(router, "/health", model="lazy", autoload="false")
    assert r.status_code == 503 and r.json()["error"]["code"] == "model_not_loaded"
    assert router.admin("lazy")["state"] == "unloaded"
    with router.hold():
        r = get(router, "/health", model="lazy")  # starts the load, answers at once
        assert r.status_code == 503 and r.json()["error"]["code"] == "model_loading"
        assert router.admin("lazy")["state"] == "loading"
        assert status_of(router, "lazy")["value"] == "loading"
    router.wait_for(lambda: get(router, "/health", model="lazy").status_code == 200, what="lazy healthy")
    assert get(router, "/health", model="lazy").json()["status"] == "ok"
    assert get(router, "/health", model="nope").status_code == 404
    assert get(router, "/health").json()["status"] == "ok"  # the router's own, as before

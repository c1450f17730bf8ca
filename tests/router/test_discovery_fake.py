"""Models found in models_dir (issue 27, ``[server] discover_models``), with fake workers: a
GGUF copied there is served after a rescan (``POST /admin/models/rescan`` or SIGHUP) under its
file's name, with ``[defaults]`` and its header's metadata in ``/v1/models`` and ``/models``
while unloaded; config entries win; an invalid file is listed with its reason and never served."""

from __future__ import annotations

import shutil
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from router.workers.discovery import model_name
from tests.router.conftest import LiveRouter
from tests.router.test_cli_client_fake import cli
from tests.worker.tiny_gguf import write_tiny_llama

CONFIG = """
[server]
models_dir = "models"
discover_models = true
[defaults]
idle_ttl_s = 42
[models.main]
path = "main.gguf"
[models.taken]
path = "main.gguf"
aliases = ["clash"]
"""


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    d = module_tmp / "models"
    d.mkdir()
    write_tiny_llama(d / "main.gguf", n_ctx_train=300)
    write_tiny_llama(module_tmp / "spare.gguf", qtype="Q8_0", extra_metadata={"general.file_type": 7})
    r = LiveRouter(module_tmp, CONFIG)
    yield r
    r.stop()


def _ids(r: LiveRouter) -> list[str]:
    return [m["id"] for m in httpx.get(r.url + "/v1/models", timeout=10).json()["data"]]


def test_names_from_file_names() -> None:
    assert model_name(Path("Qwen3 0.6B-Q8_0.gguf")) == "Qwen3-0.6B-Q8_0"
    assert model_name(Path("big-model-00001-of-00003.gguf")) == "big-model"
    assert model_name(Path("x.GGUF")) == "x"


def test_a_copied_gguf_is_served_after_a_rescan(router: LiveRouter, module_tmp: Path) -> None:
    d = module_tmp / "models"
    assert _ids(router) == ["main", "taken", "clash"]  # main.gguf is served by config: not again
    shutil.copy(module_tmp / "spare.gguf", d / "My Model-Q8_0.gguf")
    (d / "broken.gguf").write_bytes(b"GGUF\x03\x00\x00\x00\x00")
    shutil.copy(module_tmp / "spare.gguf", d / "clash.gguf")  # the name an alias has: config wins
    with router.http() as http:
        r = http.post("/admin/models/rescan")
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["added"] == ["My-Model-Q8_0"] and body["models"] == ["My-Model-Q8_0"]
        assert body["invalid"] == [{"id": "broken", "file": "broken.gguf",
                                    "reason": "the GGUF header is cut short or malformed"}]
        assert [s["id"] for s in body["skipped"]] == ["clash"]
        assert "My-Model-Q8_0" in _ids(router) and "broken" not in _ids(router)
        [entry] = [m for m in http.get("/v1/models").json()["data"] if m["id"] == "My-Model-Q8_0"]
        assert entry["state"] == "unloaded"
        assert entry["meta"]["architecture"] == "llama" and entry["meta"]["quantization"] == "Q8_0"
        assert entry["meta"]["size"] == (d / "My Model-Q8_0.gguf").stat().st_size and entry["meta"]["n_params"] > 0
        [lm] = [m for m in http.get("/models").json()["data"] if m["id"] == "My-Model-Q8_0"]
        assert lm["source"] == "models_dir" and lm["status"]["value"] == "unloaded" and lm["meta"]["n_ctx_train"] == 256
        admin = http.get("/admin/models").json()
        assert admin["invalid"][0]["file"] == "broken.gguf"
        row = next(m for m in admin["data"] if m["id"] == "My-Model-Q8_0")
        assert row["source"] == "models_dir" and row["idle_ttl_s"] == 42  # [defaults] apply
        # it serves a chat
        chat = http.post("/v1/chat/completions", json={"model": "My-Model-Q8_0", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "hi"}]})
        assert chat.status_code == 200, chat.text
        assert chat.json()["model"] == "My-Model-Q8_0"
        # the operator's views list both
        out = cli("models", "--url", router.url).stdout
        assert "My-Model-Q8_0" in out and "models_dir" in out
        assert [line.split()[:2] for line in out.splitlines() if line.startswith("broken")] == [["broken", "invalid"]]
        assert http.get("/ui/api/status").json()["invalid"][0]["reason"] == "the GGUF header is cut short or malformed"
        # the invalid file is never served
        assert http.post("/v1/chat/completions", json={"model": "broken", "max_tokens": 4,
                                                       "messages": [{"role": "user", "content": "x"}]}).status_code == 404
    assert router.proc.poll() is None


def test_sighup_rescans_and_a_removed_file_goes(router: LiveRouter, module_tmp: Path) -> None:
    d = module_tmp / "models"
    shutil.copy(module_tmp / "spare.gguf", d / "second.gguf")
    (d / "clash.gguf").unlink()
    router.proc.send_signal(signal.SIGHUP)
    router.wait_for(lambda: "second" in _ids(router), what="second.gguf after SIGHUP")
    (d / "second.gguf").unlink()
    with router.http() as http:
        assert http.post("/admin/models/rescan").json()["removed"] == ["second"]
    router.wait_for(lambda: "second" not in _ids(router), what="second gone")


def test_rescan_when_discovery_is_off(tmp_path: Path) -> None:
    write_tiny_llama(tmp_path / "m.gguf")
    write_tiny_llama(tmp_path / "other.gguf")
    r = LiveRouter(tmp_path, '[server]\nmodels_dir = "."\n[models.m]\npath = "m.gguf"\n')
    try:
        assert _ids(r) == ["m"]  # off by default: only the config's models
        resp = httpx.post(r.url + "/admin/models/rescan", timeout=10)
        assert resp.status_code == 400 and "discover_models" in resp.json()["error"]["message"]
    finally:
        r.stop()

"""Presets over one loaded copy of a model (issue 27), with fake workers: two presets of one
model share its one worker, each request gets its preset's defaults (sampling, n_predict,
system prompt), a request's own value wins, and the config refuses what a preset cannot do."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from router.config import ConfigError, parse_config
from tests.router.conftest import LiveRouter, dummy_gguf, router_fixture
from tests.router.test_cli_client_fake import cli

CONFIG = """
[server]
models_dir = "."
[models.base]
path = "m.gguf"
aliases = ["b"]
temperature = 0.7
top_k = 20
[presets.greedy]
model = "base"
temperature = 0.0
n_predict = 5
[presets.terse]
model = "b"
aliases = ["short"]
top_p = 0.5
system_prompt = "Answer in one word."
[presets.gem]
model = "base"
chat_template = "gemma"
[presets.nothink]
model = "base"
reasoning = false
chat_template_kwargs = {tone = "dry"}
[presets.think]
model = "base"
reasoning = "on"
"""


router = router_fixture(CONFIG, ggufs=("m.gguf",))


def _chat(r: LiveRouter, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}], **extra}
    return httpx.post(r.url + "/v1/chat/completions", json=body, timeout=30)


def _last_generate(r: LiveRouter) -> dict[str, Any]:
    return r.fake_events("generate")[-1]


def test_presets_share_the_models_one_worker(router: LiveRouter) -> None:
    for model in ("greedy", "terse", "short", "base", "greedy"):
        assert _chat(router, model, max_tokens=3).status_code == 200
    assert len(router.fake_events("hello")) == 1  # loaded once
    data = httpx.get(router.url + "/admin/models", timeout=10).json()["data"]
    assert [m["id"] for m in data] == ["base"]
    ids = [m["id"] for m in httpx.get(router.url + "/v1/models", timeout=10).json()["data"]]
    assert ids == ["base", "b", "greedy", "terse", "short", "gem", "nothink", "think"]
    doc = httpx.get(router.url + "/openapi.json", timeout=10).json()
    chat = doc["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert chat["properties"]["model"]["enum"] == ids  # every name a client may use
    greedy = httpx.get(router.url + "/v1/models/greedy", timeout=10).json()
    assert greedy["root"] == "base" and greedy["state"] == "ready"
    presets = httpx.get(router.url + "/admin/models", timeout=10).json()["presets"]
    assert presets[0] == {"id": "greedy", "model": "base", "aliases": [], "state": "ready",
                          "sampling": {"temperature": 0.0}, "n_predict": 5, "system_prompt": None}
    assert presets[1]["sampling"] == {"top_p": 0.5} and presets[1]["aliases"] == ["short"]
    out = cli("models", "--url", router.url).stdout
    rows = {line.split()[0]: line.split() for line in out.splitlines()}
    assert rows["greedy"][1] == "ready" and rows["greedy"][-2:] == ["base", "preset"] and rows["terse"][-1] == "preset"


def test_each_preset_applies_its_defaults_and_a_requests_own_value_wins(router: LiveRouter) -> None:
    assert _chat(router, "greedy").status_code == 200
    g = _last_generate(router)
    assert (g["temperature"], g["top_k"], g["max_tokens"]) == (0.0, 20, 5)  # preset, model, preset's n_predict
    assert _chat(router, "greedy", temperature=0.9, max_tokens=2).status_code == 200
    g = _last_generate(router)
    assert (g["temperature"], g["max_tokens"]) == (0.9, 2)  # the request's own
    assert _chat(router, "terse").status_code == 200
    g = _last_generate(router)
    assert (g["temperature"], g["top_p"]) == (0.7, 0.5)  # the model's temperature, the preset's top_p
    assert g["messages"][0] == {"role": "system", "content": "Answer in one word."}
    assert _chat(router, "terse", messages=[{"role": "system", "content": "Mine."},
                                            {"role": "user", "content": "hi"}]).status_code == 200
    assert [m["content"] for m in _last_generate(router)["messages"]] == ["Mine.", "hi"]
    assert _chat(router, "base").status_code == 200
    g = _last_generate(router)
    assert g["temperature"] == 0.7 and g["messages"][0]["role"] == "user"  # the model: no preset's defaults
    # a preset's chat template travels with its chats only
    assert _chat(router, "gem").status_code == 200
    assert _last_generate(router)["chat_template"] == "gemma"
    assert _chat(router, "terse").status_code == 200 and _last_generate(router)["chat_template"] is None
    # a preset's reasoning switch and template variables
    assert _chat(router, "nothink").status_code == 200
    g = _last_generate(router)
    assert g["template_kwargs"] == {"enable_thinking": False, "tone": "dry"} and g["chat_template"] is None
    assert _chat(router, "base").status_code == 200
    assert _last_generate(router)["template_kwargs"] == {"enable_thinking": True}  # the model's reasoning: auto
    assert _chat(router, "think").status_code == 200
    assert _last_generate(router)["template_kwargs"] == {"enable_thinking": True}
    # a request's own chat_template_kwargs win over the preset's
    assert _chat(router, "nothink", chat_template_kwargs={"enable_thinking": True}).status_code == 200
    assert _last_generate(router)["template_kwargs"] == {"enable_thinking": True, "tone": "dry"}
    # llama.cpp's route too
    r = httpx.post(router.url + "/completion", json={"model": "greedy", "prompt": "x"}, timeout=30)
    assert r.status_code == 200 and _last_generate(router)["temperature"] == 0.0


def test_admin_load_of_a_preset_loads_its_model(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/admin/models/load", json={"model": "terse"}, timeout=30)
    assert r.status_code == 200 and r.json()["model"] == "base"


@pytest.mark.parametrize("preset, error", [
    ({"model": "nope"}, "presets.p.model: 'nope' is not a configured model"),
    ({}, "presets.p.model: required"),
    ({"model": "base", "chat_template": 3}, "presets.p.chat_template"),
    ({"model": "base", "enable_thinking": False}, "presets.p.enable_thinking: not supported in a preset"),
    ({"model": "base", "reasoning": "maybe"}, "presets.p.reasoning: expected one of auto, on, off"),
    ({"model": "base", "chat_template_kwargs": {"messages": 1}}, "presets.p.chat_template_kwargs: cannot set messages"),
    ({"model": "base", "path": "x.gguf"}, "presets.p"),
    ({"model": "base", "temperature": -1}, "presets.p.temperature"),
    ({"model": "base", "aliases": ["b"]}, "presets.p.aliases: name 'b' is already used"),
])
def test_config_errors_name_the_key(tmp_path: Path, preset: dict[str, Any], error: str) -> None:
    dummy_gguf(tmp_path, "m.gguf")
    data = {"server": {"models_dir": str(tmp_path)},
            "models": {"base": {"path": "m.gguf", "aliases": ["b"]}}, "presets": {"p": preset}}
    with pytest.raises(ConfigError) as e:
        parse_config(json.loads(json.dumps(data)), base_dir=tmp_path)
    assert str(e.value).startswith(error), str(e.value)

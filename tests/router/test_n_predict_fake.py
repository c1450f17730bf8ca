"""``n_predict`` per model, with llama.cpp's ``-n`` semantics: the length of an answer
whose request names none, and the cap of one that names more (finish_reason "length"),
on every generation route (they all pass through ``router.serving.generation.begin``)."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from router.config import ConfigError, parse_config
from tests.router.conftest import LiveRouter, dummy_gguf, router_fixture

CONFIG = """
[server]
models_dir = "."
[defaults]
n_predict = 7
[models.alpha]
path = "alpha.gguf"
[models.beta]
path = "alpha.gguf"
n_predict = -1
"""


router = router_fixture(CONFIG, ggufs=("alpha.gguf",))


MSG = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("path,body,asked", [
    ("/v1/chat/completions", {"messages": MSG}, None),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 32000}, 32000),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": 3}, 3),
    ("/v1/completions", {"prompt": "hi"}, None),
    ("/v1/messages", {"messages": MSG, "max_tokens": 32000}, 32000),
    ("/v1/responses", {"input": "hi"}, None),
    ("/completion", {"prompt": "hi", "n_predict": -1}, None),
    ("/completion", {"prompt": "hi", "n_predict": 100}, 100),
])
def test_default_and_cap(router: LiveRouter, path: str, body: dict[str, object], asked: int | None) -> None:
    r = httpx.post(router.url + path, json={"model": "alpha", **body}, timeout=30)
    assert r.status_code == 200, r.text
    sent = router.fake_events("generate")[-1]["max_tokens"]
    assert sent == (7 if asked is None or asked > 7 else asked)


def test_capped_answer_ends_with_length(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions",
                   json={"model": "alpha", "messages": MSG, "max_tokens": 500}, timeout=30)
    assert r.json()["choices"][0]["finish_reason"] == "length"
    assert r.json()["usage"]["completion_tokens"] == 7


def test_minus_one_is_no_limit(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions",
                   json={"model": "beta", "messages": MSG, "max_tokens": 500}, timeout=30)
    assert r.status_code == 200
    assert router.fake_events("generate")[-1]["max_tokens"] == 500


def test_config_values(tmp_path: Path) -> None:
    dummy_gguf(tmp_path, "a.gguf")
    for bad in (0, -2, "x"):
        with pytest.raises(ConfigError, match="n_predict"):
            parse_config({"server": {"models_dir": "."}, "models": {"a": {"path": "a.gguf", "n_predict": bad}}},
                         base_dir=tmp_path)
    cfg = parse_config({"server": {"models_dir": "."}, "defaults": {"n_predict": 64}, "models": {"a": {"path": "a.gguf"}}},
                       base_dir=tmp_path)
    assert cfg.models["a"].n_predict == 64


def test_models_state_their_context_size(router: LiveRouter) -> None:
    """Harnesses size their prompts by the model listing (Codex, aider, opencode): the context
    size (fake GGUFs have no header to read it from before a load: it is the ready worker's here;
    tests/router/test_harness_real.py checks the real GGUFs' before any load)."""
    httpx.post(router.url + "/v1/chat/completions", json={"model": "alpha", "messages": MSG}, timeout=30)
    data = {m["id"]: m for m in httpx.get(router.url + "/v1/models", timeout=10).json()["data"]}
    assert data["alpha"]["context_length"] == data["alpha"]["max_model_len"] == 256  # the fake worker's n_ctx
    assert data["alpha"]["meta"]["n_ctx"] == 256 and data["alpha"]["meta"]["n_ctx_train"] == 4096


def test_default_max_ctx_is_the_engines() -> None:
    from protocol.limits import DEFAULT_MAX_CTX
    from worker.engine.arch.registry import DEFAULT_MAX_CTX as ENGINE_MAX_CTX

    assert DEFAULT_MAX_CTX == ENGINE_MAX_CTX


def test_head_and_get_root_answer(router: LiveRouter) -> None:
    """Claude Code's connectivity check (``HEAD /api/hello``; ``HEAD /`` elsewhere)."""
    assert httpx.head(router.url + "/", timeout=10).status_code == 200
    assert httpx.head(router.url + "/api/hello", timeout=10).status_code == 200
    r = httpx.get(router.url + "/", timeout=10)
    assert r.status_code == 200 and r.json()["status"] == "ok"


def test_set_aside_items_name_the_keyword() -> None:
    from router.serving.generation import _set_aside_items

    assert _set_aside_items('Unimplemented keys: ["propertyNames", "not"]') == ["propertyNames", "not"]
    assert _set_aside_items("oneOf not fully supported; falling back to anyOf. This may cause validation errors "
                            "in some cases.") == ["oneOf"]
    assert _set_aside_items("something else; with details") == ["something else"]

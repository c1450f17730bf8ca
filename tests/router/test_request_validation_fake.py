"""Requests a new user sends that were answered wrongly, against a fake worker.

- Fields that change the answer are honoured or refused, never silently dropped
  (router/dialects/field_policy.py), on every generation route: ``stop`` on /v1/messages, ``seed``
  or ``response_format`` on /v1/responses, ``n`` on /completion, ``image_data``, ``lora``
  or ``t_max_predict_ms`` anywhere were answered 200 as if they had not been sent.
- A worker's 400 names the request field it is about; a request whose messages all fall
  away in the dialect's reading is the router's 400, never an empty prompt sent on."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from router.dialects.field_policy import FIELDS, HONOURED
from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[models.alpha]
path = "alpha.gguf"
"""

#: a minimal valid body of each generation route
BASE: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    "/v1/completions": {"model": "alpha", "max_tokens": 2, "prompt": "x"},
    "/v1/responses": {"model": "alpha", "max_output_tokens": 2, "input": "x"},
    "/v1/messages": {"model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
    "/completion": {"model": "alpha", "n_predict": 2, "prompt": "x"},
}

#: a value of each field that changes the answer (where the route does not honour it)
CHANGING: dict[str, Any] = {
    "max_tokens": 5, "max_completion_tokens": 5, "max_output_tokens": 5, "n_predict": 5, "n": 2, "n_cmpl": 2,
    "t_max_predict_ms": 100, "n_indent": 4, "stop": ["x"], "stop_sequences": ["x"], "seed": 7, "top_k": 3,
    "min_p": 0.2, "repeat_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5,
    "logit_bias": {"1": 5}, "ignore_eos": True, "logprobs": True, "top_logprobs": 2, "n_probs": 2,
    "response_format": {"type": "json_object"}, "json_schema": {"type": "object"}, "grammar": "start: \"a\"",
    "grammar_lazy": True, "grammar_triggers": [{"type": "word", "value": "x"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}], "tool_choice": "required",
    "functions": [{"name": "f", "parameters": {}}], "function_call": "auto", "system": "be brief",
    "instructions": "be brief", "chat_template_kwargs": {"enable_thinking": False},
    "add_generation_prompt": False, "image_data": [{"data": "aGk=", "id": 1}], "multimodal_data": ["aGk="],
    "audio": {"voice": "alloy", "format": "wav"}, "web_search_options": {}, "lora": [{"id": 0, "scale": 1.0}],
}

#: the same fields at their neutral value (sent by clients that write out defaults)
NEUTRAL: dict[str, Any] = {
    "n": 1, "n_cmpl": 1, "t_max_predict_ms": -1, "n_indent": 0, "stop": [], "stop_sequences": [], "seed": -1,
    "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
    "logit_bias": {}, "ignore_eos": False, "logprobs": False, "top_logprobs": 0, "n_probs": 0,
    "response_format": {"type": "text"}, "json_schema": {}, "grammar": "", "grammar_lazy": False,
    "grammar_triggers": [], "tools": [], "tool_choice": "none", "system": "", "instructions": "",
    "chat_template_kwargs": {}, "add_generation_prompt": True, "image_data": [], "multimodal_data": [],
    "lora": [],
}

UNHONOURED = [(route, key) for route in BASE for key in FIELDS if key not in HONOURED[route]]


router = router_fixture(CONFIG, ggufs=("alpha.gguf",))


def test_every_field_has_a_changing_value() -> None:
    assert set(CHANGING) == set(FIELDS)


@pytest.mark.parametrize("route, key", UNHONOURED)
def test_a_field_the_route_would_drop_is_a_400_naming_it(router: LiveRouter, route: str, key: str) -> None:
    before = len(router.fake_events("generate"))
    body = {**BASE[route], key: CHANGING[key]}
    r = httpx.post(router.url + route, json=body, timeout=30)
    assert r.status_code == 400, (route, key, r.text)
    err = r.json()["error"]
    assert err["param"] == key and f"'{key}'" in err["message"], err
    assert len(router.fake_events("generate")) == before  # refused before any worker saw it


@pytest.mark.parametrize("route, key", [(r, k) for r, k in UNHONOURED if k in NEUTRAL])
def test_the_same_field_at_its_neutral_value_is_accepted(router: LiveRouter, route: str, key: str) -> None:
    r = httpx.post(router.url + route, json={**BASE[route], key: NEUTRAL[key]}, timeout=30)
    assert r.status_code == 200, (route, key, r.text)


def test_advice_names_the_routes_own_field(router: LiveRouter) -> None:
    for route, key, own in (("/v1/messages", "stop", "stop_sequences"), ("/v1/responses", "max_tokens",
                                                                           "max_output_tokens"),
                            ("/v1/responses", "response_format", "text.format"),
                            ("/v1/chat/completions", "stop_sequences", "stop"),
                            ("/v1/chat/completions", "functions", "tools")):
        r = httpx.post(router.url + route, json={**BASE[route], key: CHANGING[key]}, timeout=30)
        assert r.status_code == 400 and f"'{own}'" in r.json()["error"]["message"], (route, key, r.text)


def test_completion_reads_llamacpps_aliases_of_n_predict(router: LiveRouter) -> None:
    """llama.cpp's /completion takes max_completion_tokens (and max_tokens) for n_predict."""
    body = {"model": "alpha", "prompt": "x", "max_completion_tokens": 3}
    r = httpx.post(router.url + "/completion", json=body, timeout=30)
    assert r.status_code == 200, r.text
    assert router.fake_events("generate")[-1]["max_tokens"] == 3


@pytest.mark.parametrize("route", list(BASE))
def test_adaptive_p_is_refused_off_its_neutral_value(router: LiveRouter, route: str) -> None:
    r = httpx.post(router.url + route, json={**BASE[route], "adaptive_target": 0.5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "adaptive_target", r.text
    r = httpx.post(router.url + route, json={**BASE[route], "adaptive_target": -1.0}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_worker_400_of_a_one_shot_call_names_the_field(router: LiveRouter) -> None:
    """/detokenize of an id outside the vocabulary names 'tokens', as /v1/completions names
    'prompt' for the same worker error (it was param null)."""
    r = httpx.post(router.url + "/detokenize", json={"model": "alpha", "tokens": [1, 10**9]}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_token", r.text
    assert r.json()["error"]["param"] == "tokens", r.text


@pytest.mark.parametrize("route, body, param", [
    ("/v1/responses", {"model": "alpha", "input": [{"type": "reasoning", "id": "rs_1", "summary": []}]}, "input"),
    ("/v1/messages", {"model": "alpha", "max_tokens": 2, "messages": [{"role": "user", "content": []}]},
     "messages"),
])
def test_a_request_whose_messages_all_fall_away_is_a_400_naming_them(router: LiveRouter, route: str,
                                                                    body: dict[str, Any], param: str) -> None:
    """Only dropped items (reasoning, empty content) reached the worker as an empty prompt: a
    400 with param null from the worker, or an answer to nothing."""
    before = len(router.fake_events("generate"))
    r = httpx.post(router.url + route, json=body, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(router.fake_events("generate")) == before


@pytest.mark.parametrize("route", ["/completion", "/v1/chat/completions", "/v1/completions"])
def test_n_predict_below_minus_one_is_a_400_as_in_llamacpp(router: LiveRouter, route: str) -> None:
    """-1 is "until n_ctx"; llama.cpp refuses anything lower (server-schema.cpp's hard limit),
    where modelyard generated until n_ctx for -5 (a 120 s non-streamed answer on SmolLM2)."""
    base = {k: v for k, v in BASE[route].items() if k not in ("max_tokens", "n_predict")}
    r = httpx.post(router.url + route, json={**base, "n_predict": -5}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "n_predict", r.text
    r = httpx.post(router.url + route, json={**base, "n_predict": -1, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text


@pytest.mark.parametrize("route", ["/completion", "/v1/chat/completions", "/v1/completions"])
def test_id_slot_must_name_a_slot_on_every_llamacpp_route(router: LiveRouter, route: str) -> None:
    """/completion refused an id_slot outside the slots; the OpenAI routes (which llama.cpp
    also reads it on) took any integer."""
    r = httpx.post(router.url + route, json={**BASE[route], "id_slot": 99}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text
    r = httpx.post(router.url + route, json={**BASE[route], "id_slot": 0}, timeout=30)
    assert r.status_code == 200, r.text

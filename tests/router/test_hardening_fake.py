"""Regressions found by a new user (fake workers):

* an integer the wire cannot carry (or a string it cannot encode) is a 400 naming
  the field, never a 500, and never poisons the worker for the next request;
* 1 + max_queue requests are admitted per model whether it is loading or loaded,
  and the 503 says so;
* OpenAI compatibility: ``"usage": null`` on every chunk before the usage chunk,
  logit_bias values outside [-100, 100] rejected on /v1/* (llama.cpp's /completion
  stays permissive).
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from protocol import Detokenize, Generate, ProtocolError, Tokenize, encode
from router.http.errors import unsendable
from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0.2
cancel_timeout_s = 2.0
[models.m]
path = "m.gguf"
[models.cold]
path = "m.gguf"
max_queue = 8
"""

BIG = 2**64  # one more than msgpack's largest unsigned integer


router = router_fixture(CONFIG, ggufs=("m.gguf",), fake={"cold": {"hold_load": True}})


def chat(content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": content}], "max_tokens": 2, **kw}


def sse_data(r: httpx.Response) -> list[Any]:
    out = []
    for line in r.text.splitlines():
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


def assert_worker_still_fine(router: LiveRouter, pid: int) -> None:
    """The next normal request succeeds on the same worker process."""
    r = httpx.post(router.url + "/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 200, r.text
    assert router.admin("m")["pid"] == pid and router.admin("m")["state"] == "ready"


@pytest.fixture()
def m_pid(router: LiveRouter) -> int:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat(), timeout=30)
    assert r.status_code == 200, r.text
    return int(router.admin("m")["pid"])


# ----------------------------------------------------------------------------- huge integers


HUGE_CASES = [
    ("/v1/chat/completions", chat(seed=BIG), "seed"),
    ("/v1/chat/completions", chat(seed=-(2**63) - 1), "seed"),
    ("/v1/chat/completions", chat(seed=18446744073709551616, stream=True), "seed"),
    ("/v1/chat/completions", chat(top_k=BIG), "top_k"),
    ("/v1/chat/completions", chat(top_k=2**31), "top_k"),
    ("/v1/chat/completions", chat(repeat_last_n=BIG), "repeat_last_n"),
    ("/v1/chat/completions", chat(logit_bias={str(BIG): 1}), "logit_bias"),
    ("/v1/chat/completions", chat(logit_bias={"5": 10**400}), "logit_bias"),
    ("/v1/chat/completions", chat(max_tokens=BIG), "max_tokens"),
    ("/v1/chat/completions", chat(max_completion_tokens=2**31), "max_completion_tokens"),
    ("/v1/chat/completions", chat(temperature=10**400), "temperature"),
    ("/v1/chat/completions", chat(presence_penalty=-(10**400)), "presence_penalty"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=BIG), "top_logprobs"),
    ("/v1/chat/completions", chat(n=BIG), "n"),
    ("/v1/completions", {"model": "m", "prompt": [1, BIG], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": [[2**31]], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": BIG}, "logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "best_of": BIG}, "best_of"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "seed": BIG, "stream": True}, "seed"),
    ("/completion", {"model": "m", "prompt": "hi", "n_predict": BIG}, "n_predict"),
    ("/completion", {"model": "m", "prompt": "hi", "n_predict": -BIG}, "n_predict"),
    ("/completion", {"model": "m", "prompt": "hi", "seed": BIG}, "seed"),
    ("/completion", {"model": "m", "prompt": "hi", "top_k": BIG}, "top_k"),
    ("/completion", {"model": "m", "prompt": "hi", "repeat_last_n": BIG}, "repeat_last_n"),
    ("/completion", {"model": "m", "prompt": "hi", "n_probs": BIG}, "n_probs"),
    ("/completion", {"model": "m", "prompt": [BIG * 1000]}, "prompt"),
    ("/completion", {"model": "m", "prompt": "hi", "logit_bias": [[BIG, 1.0]]}, "logit_bias"),
    ("/completion", {"model": "m", "prompt": "hi", "n_predict": 2, "stream": True, "seed": BIG}, "seed"),
    ("/detokenize", {"model": "m", "tokens": [18446744073709551616000]}, "tokens"),
    ("/detokenize", {"model": "m", "tokens": [2**31]}, "tokens"),
]


@pytest.mark.parametrize("path,body,param", HUGE_CASES, ids=[f"{p}-{k}" for p, _, k in HUGE_CASES])
def test_huge_integer_is_400_and_the_worker_keeps_serving(router: LiveRouter, m_pid: int, path: str,
                                                          body: dict[str, Any], param: str) -> None:
    r = httpx.post(router.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    assert_worker_still_fine(router, m_pid)


def test_integers_at_the_bounds_are_accepted(router: LiveRouter, m_pid: int) -> None:
    for body in (chat(seed=2**64 - 1), chat(seed=-(2**63)), chat(top_k=2**31 - 1, repeat_last_n=2**31 - 1),
                 chat(logit_bias={str(2**31 - 1): 1})):
        r = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=30)
        assert r.status_code == 200, (body, r.text)
    seeds = [e["seed"] for e in router.fake_events("generate", pid=m_pid)]
    assert 2**64 - 1 in seeds  # carried to the worker unchanged (a negative seed means random: None)
    r = httpx.post(router.url + "/completion", json={"model": "m", "prompt": "hi", "n_predict": -1}, timeout=30)
    assert r.status_code == 200, r.text  # llama.cpp: negative n_predict = until the context is full


# ----------------------------------------------------------------------------- unencodable strings

SURROGATE = '"\\ud800"'  # a lone surrogate: valid JSON, not encodable as UTF-8 (msgpack str)

UNENCODABLE = [
    ("/v1/chat/completions", '{"model":"m","max_tokens":2,"messages":[{"role":"user","content":%s}]}'),
    ("/v1/chat/completions", '{"model":"m","max_tokens":2,"stream":true,'
                             '"messages":[{"role":"user","content":%s}]}'),
    ("/v1/chat/completions", '{"model":"m","max_tokens":2,"stop":[%s],"messages":[{"role":"user","content":"x"}]}'),
    ("/v1/completions", '{"model":"m","max_tokens":2,"prompt":%s}'),
    ("/completion", '{"model":"m","n_predict":2,"prompt":%s}'),
    ("/completion", '{"model":"m","n_predict":2,"stream":true,"prompt":%s}'),
    ("/tokenize", '{"model":"m","content":%s}'),
    ("/apply-template", '{"model":"m","messages":[{"role":"user","content":%s}]}'),
]


@pytest.mark.parametrize("path,template", UNENCODABLE, ids=[f"{p}-{i}" for i, (p, _) in enumerate(UNENCODABLE)])
def test_a_request_the_protocol_cannot_carry_is_400_never_sent(router: LiveRouter, m_pid: int, path: str,
                                                               template: str) -> None:
    # Passes validation, fails encoding: ModelServer.start / _call must encode before recording the
    # request as sent, so no Cancel goes to a worker that never got it (it would be killed as hung).
    cancels = len(router.fake_events("cancel"))
    r = httpx.post(router.url + path, content=(template % SURROGATE).encode(),
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert_worker_still_fine(router, m_pid)
    assert len(router.fake_events("cancel")) == cancels


def test_encode_raises_protocol_error_only() -> None:
    for msg in (Generate(id="g", prompt="hi", seed=2**64), Generate(id="g", prompt=[2**70]),
                Generate(id="g", prompt="hi", top_k=-(2**63) - 1), Detokenize(id="d", tokens=b"\0\0\0"),
                Tokenize(id="t", content="\ud800")):
        with pytest.raises(ProtocolError):
            encode(msg)
    assert encode(Generate(id="g", prompt="hi", seed=2**64 - 1))


def test_unsendable_names_the_field() -> None:
    err = unsendable("generate: field 'seed': integer out of range")
    assert err.status == 400 and err.param == "seed"
    assert unsendable("frame too big").param is None


# ----------------------------------------------------------------------------- queue while loading


async def _burst(router: LiveRouter, first: dict[str, Any], rest: list[dict[str, Any]]) -> list[httpx.Response]:
    """``first`` is admitted, then ``rest`` all arrive while it still holds the model (the
    fake worker's hold file keeps a ``hold_load`` load or a ``[hold]`` generation going)."""
    async with httpx.AsyncClient(base_url=router.url, timeout=30) as c:
        with router.hold():
            tasks = [asyncio.create_task(c.post("/v1/chat/completions", json=first))]
            await router.until(lambda: (st := router.admin("cold"))["in_flight"] or st["queue_depth"], what="admitted")
            tasks += [asyncio.create_task(c.post("/v1/chat/completions", json=b)) for b in rest]
            # every one of them answered (503) or admitted before the hold lifts
            await router.until(lambda: sum(t.done() for t in tasks) + (len((st := router.admin("cold"))["in_flight"])
                                                                       + st["queue_depth"]) == len(tasks),
                               what="all admitted or refused")
        return list(await asyncio.gather(*tasks))


def test_one_running_plus_max_queue_admitted_while_loading_and_when_loaded(router: LiveRouter) -> None:
    body = {"model": "cold", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    assert router.admin("cold")["state"] == "unloaded"
    # cold: 15 at once while the model loads (held): the first in line counts as running
    rs = asyncio.run(_burst(router, body, [body] * 14))
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 9 and codes.count(503) == 6, codes
    msgs = {r.json()["error"]["message"] for r in rs if r.status_code == 503}
    assert len(msgs) == 1
    msg = msgs.pop()
    assert "1 running" in msg and "8 waiting" in msg and "max_queue=8" in msg, msg
    assert "loaded" in msg
    assert all(r.json()["error"]["code"] == "queue_full" for r in rs if r.status_code == 503)
    # loaded: one held request running, then 14 more: the same split, the same wording
    held = {**body, "messages": [{"role": "user", "content": "[hold]"}], "max_tokens": 2}
    rs = asyncio.run(_burst(router, held, [body] * 14))
    codes = [r.status_code for r in rs]
    assert codes.count(200) == 9 and codes.count(503) == 6, codes
    msg = next(r.json()["error"]["message"] for r in rs if r.status_code == 503)
    assert "1 running and 8 waiting" in msg and "max_queue=8" in msg, msg
    assert router.admin("cold")["spawn_count"] == 1


# ----------------------------------------------------------------------------- OpenAI compatibility


@pytest.mark.parametrize("path,body", [
    ("/v1/chat/completions", chat(max_tokens=3)),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 3}),
])
def test_include_usage_puts_usage_null_on_every_chunk_before_the_usage_chunk(router: LiveRouter, path: str,
                                                                              body: dict[str, Any]) -> None:
    r = httpx.post(router.url + path, json={**body, "stream": True, "stream_options": {"include_usage": True}},
                   timeout=30)
    data = sse_data(r)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert len(chunks) >= 3
    for c in chunks[:-1]:
        assert "usage" in c and c["usage"] is None, c
        assert c["choices"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    # without include_usage: no usage key at all (as OpenAI)
    r = httpx.post(router.url + path, json={**body, "stream": True}, timeout=30)
    assert all(c == "[DONE]" or "usage" not in c for c in sse_data(r))


@pytest.mark.parametrize("bias", [100.5, -101, 1e300, 10**20])
def test_openai_logit_bias_outside_plus_minus_100_is_400(router: LiveRouter, bias: float) -> None:
    for path, body in (("/v1/chat/completions", chat(logit_bias={"5": bias})),
                       ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2,
                                            "logit_bias": {"5": bias}})):
        r = httpx.post(router.url + path, json=body, timeout=30)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "logit_bias"


def test_logit_bias_in_range_and_llamacpp_permissive(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json=chat(logit_bias={"5": -100, "6": 100}), timeout=30)
    assert r.status_code == 200, r.text
    # llama.cpp's /completion: out-of-range biases are accepted (clamped), false bans
    r = httpx.post(router.url + "/completion", json={"model": "m", "prompt": "lb-permissive", "n_predict": 2,
                                                     "logit_bias": [[5, 500], [6, -1e300], [7, False]]},
                   timeout=30)
    assert r.status_code == 200, r.text
    ev = [e for e in router.fake_events("generate") if e["prompt"] == "lb-permissive"][-1]
    assert ev["logit_bias"][:2] == [[5, 100.0], [6, -100.0]]
    assert ev["logit_bias"][2][0] == 7 and ev["logit_bias"][2][1] == float("-inf")


# ----------------------------------------------------------------------------- one table of bounds


OUT_OF_TABLE = [  # (path, body, param): outside protocol.limits.GENERATE_LIMITS, which the worker enforces
    ("/completion", {"model": "m", "prompt": "hi", "n_probs": 21}, "n_probs"),
    ("/completion", {"model": "m", "prompt": "hi", "n_probs": 100}, "n_probs"),
    ("/v1/chat/completions", chat(logprobs=True, top_logprobs=21), "top_logprobs"),
    ("/v1/completions", {"model": "m", "prompt": "hi", "logprobs": 21}, "logprobs"),
    ("/completion", {"model": "m", "prompt": "hi", "repeat_penalty": 0}, "repeat_penalty"),
    ("/completion", {"model": "m", "prompt": "hi", "temperature": -0.5}, "temperature"),
    ("/completion", {"model": "m", "prompt": "hi", "top_p": 1.5}, "top_p"),
    ("/completion", {"model": "m", "prompt": "hi", "min_p": -0.1}, "min_p"),
    ("/completion", {"model": "m", "prompt": "hi", "repeat_last_n": -2}, "repeat_last_n"),
]


@pytest.mark.parametrize("path,body,param", OUT_OF_TABLE, ids=[f"{p}-{k}" for p, _, k in OUT_OF_TABLE])
def test_bounds_of_the_shared_table_are_400_naming_the_field(router: LiveRouter, path: str, body: dict[str, Any],
                                                             param: str) -> None:
    generates = len(router.fake_events("generate"))
    r = httpx.post(router.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and param in err["message"], err
    assert len(router.fake_events("generate")) == generates  # refused by the router, never sent


def test_the_edges_of_the_shared_table_are_accepted(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/completion", json={"model": "m", "prompt": "hi", "n_predict": 2, "n_probs": 20,
                                                     "repeat_penalty": 0.01, "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    assert len(r.json()["completion_probabilities"][0]["top_logprobs"]) == 20

"""The HTTP API against fake workers: shapes, streaming rules, validation, error mapping.

One live router (subprocess, loopback) for the whole module; the fake worker
speaks the real protocol (tests/fakes/fake_worker.py).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[defaults]
max_queue = 4
[models.alpha]
path = "alpha.gguf"
aliases = ["a", "org/alpha:q4"]
[models.beta]
path = "beta.gguf"
[models.gamma]
path = "gamma.gguf"
temperature = 0.25
top_k = 7
"""


router = router_fixture(CONFIG, ggufs=("alpha.gguf", "beta.gguf", "gamma.gguf"), fake={"beta": {"no_template": True}})


def sse_lines(router: LiveRouter, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", router.url + path, json=body, timeout=30) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        return [line for line in r.iter_lines()]


def sse_data(lines: list[str]) -> list[Any]:
    out = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            out.append(payload if payload == "[DONE]" else json.loads(payload))
    return out


# ----------------------------------------------------------------------------- models


def test_models_listing_never_loads(router: LiveRouter) -> None:
    ids = [m.id for m in router.client().models.list().data]
    assert ids == ["alpha", "a", "org/alpha:q4", "beta", "gamma"]
    assert router.admin("gamma")["state"] == "unloaded"
    assert router.fake_events("start") == [] or all("gamma" not in e["argv"] for e in router.fake_events("start"))


def test_model_by_id_with_slash_and_colon(router: LiveRouter) -> None:
    m = router.client().models.retrieve("org/alpha:q4")
    assert m.id == "org/alpha:q4"
    with pytest.raises(openai.NotFoundError) as e:
        router.client().models.retrieve("nope")
    assert "alpha" in str(e.value)


def test_health_and_unknown_route(router: LiveRouter) -> None:
    assert httpx.get(router.url + "/health").json()["status"] == "ok"
    r = httpx.get(router.url + "/v2/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(router.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


# ----------------------------------------------------------------------------- chat


def test_chat_non_streaming(router: LiveRouter) -> None:
    out = router.client().chat.completions.create(
        model="a", messages=[{"role": "user", "content": "hello"}], max_tokens=4)
    assert out.object == "chat.completion"
    assert out.model == "a"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == " w100 w101 w102 w103"
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None and out.usage.completion_tokens == 4 and out.usage.prompt_tokens > 0
    timings = out.model_extra["timings"]  # type: ignore[index]
    assert timings["predicted_n"] == 4 and set(timings) >= {"prompt_n", "prompt_ms", "predicted_ms", "cache_n"}


def test_chat_streaming_shape(router: LiveRouter) -> None:
    lines = sse_lines(router, "/v1/chat/completions", {
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
        "stream_options": {"include_usage": True}})
    assert not any(line.startswith(("id:", "retry:", "event:")) for line in lines)
    data = sse_data(lines)
    assert data[-1] == "[DONE]"
    chunks = data[:-1]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    assert text == " w100 w101 w102"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_chat_stream_without_include_usage_has_no_usage_chunk(router: LiveRouter) -> None:
    data = sse_data(sse_lines(router, "/v1/chat/completions", {
        "model": "alpha", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}))
    assert all(c == "[DONE]" or c["choices"] for c in data)


def test_streamed_text_equals_non_streamed_via_sdk(router: LiveRouter) -> None:
    c = router.client()
    msgs: Any = [{"role": "system", "content": "be brief"},
                 {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "two"}]}]
    full = c.chat.completions.create(model="alpha", messages=msgs, max_tokens=6, temperature=0)
    pieces = [ch.choices[0].delta.content or "" for ch in
              c.chat.completions.create(model="alpha", messages=msgs, max_tokens=6, temperature=0, stream=True)
              if ch.choices]
    assert "".join(pieces) == full.choices[0].message.content
    gen = router.fake_events("generate")[-1]
    assert gen["messages"][1]["content"] == "part one\ntwo"


def test_utf8_character_split_across_tokens_is_never_sent_half(router: LiveRouter) -> None:
    data = sse_data(sse_lines(router, "/v1/chat/completions", {
        "model": "alpha", "messages": [{"role": "user", "content": "[utf8]"}], "max_tokens": 3, "stream": True}))
    contents = [c["choices"][0]["delta"].get("content") for c in data[:-1] if c["choices"]]
    assert " é" in contents
    assert all("\ufffd" not in (x or "") for x in contents)


def test_stop_string_prefix_is_held_back_not_retracted(router: LiveRouter) -> None:
    # output " w100 w101 w102 ..."; the stop string " w102" is preceded by the possible prefix " w10"
    data = sse_data(sse_lines(router, "/v1/chat/completions", {
        "model": "alpha", "messages": [{"role": "user", "content": "x"}], "max_tokens": 8, "stream": True,
        "stop": [" w102", "zz"]}))
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in data[:-1] if c["choices"])
    assert text == " w100 w101"
    assert [c["choices"][0]["finish_reason"] for c in data[:-1] if c["choices"]][-1] == "stop"


def test_chat_logprobs(router: LiveRouter) -> None:
    out = router.client().chat.completions.create(
        model="alpha", messages=[{"role": "user", "content": "x"}], max_tokens=2, logprobs=True, top_logprobs=3)
    lp = out.choices[0].logprobs
    assert lp is not None and lp.content is not None and len(lp.content) == 2
    first = lp.content[0]
    assert first.token == " w100" and first.bytes == list(b" w100") and first.logprob == -0.5
    assert [t.token for t in first.top_logprobs] == [" w100", " w101", " w102"]


def test_chat_to_model_without_template_is_400(router: LiveRouter) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        router.client().chat.completions.create(model="beta", messages=[{"role": "user", "content": "x"}],
                                                max_tokens=2)
    assert e.value.code == "no_chat_template"


def test_unknown_fields_are_ignored(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/chat/completions", json={
        "model": "alpha", "messages": [{"role": "developer", "content": "x", "name": "n"}], "max_tokens": 1,
        "some_future_field": {"a": 1}, "parallel_tool_calls": False, "tools": [], "user": "u"}, timeout=30)
    assert r.status_code == 200, r.text
    assert router.fake_events("generate")[-1]["messages"][0]["role"] == "system"


def test_sampling_defaults(router: LiveRouter) -> None:
    c = router.client()
    c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}], max_tokens=1)
    g = router.fake_events("generate")[-1]
    assert (g["temperature"], g["top_p"], g["top_k"], g["min_p"]) == (1.0, 1.0, 0, 0.0)
    httpx.post(router.url + "/completion", json={"model": "alpha", "prompt": "x", "n_predict": 1}, timeout=30)
    g = router.fake_events("generate")[-1]
    assert (g["temperature"], g["top_p"], g["top_k"], g["min_p"]) == (0.8, 0.95, 40, 0.05)
    c.completions.create(model="gamma", prompt="x", max_tokens=1)
    g = router.fake_events("generate")[-1]
    assert (g["temperature"], g["top_k"]) == (0.25, 7)
    c.completions.create(model="gamma", prompt="x", max_tokens=1, temperature=0.5, seed=3,
                         logit_bias={"5": -100}, stop="q", extra_body={"min_p": 0.1})
    g = router.fake_events("generate")[-1]
    assert (g["temperature"], g["seed"], g["logit_bias"], g["stop"], g["min_p"]) == (0.5, 3, [[5, -100.0]], ["q"], 0.1)


# ----------------------------------------------------------------------------- completions


def test_completions_prompt_forms(router: LiveRouter) -> None:
    c = router.client()
    out = c.completions.create(model="beta", prompt="The capital", max_tokens=2)
    assert out.object == "text_completion" and out.choices[0].text == " w100 w101"
    assert out.usage is not None and out.usage.prompt_tokens == 3  # BOS + 2 words
    c.completions.create(model="beta", prompt=[5, 6, 7], max_tokens=1)
    assert router.fake_events("generate")[-1]["prompt"] == [5, 6, 7]
    c.completions.create(model="beta", prompt=["only one"], max_tokens=1)
    assert router.fake_events("generate")[-1]["prompt"] == "only one"
    with pytest.raises(openai.BadRequestError):
        c.completions.create(model="beta", prompt=["one", "two"], max_tokens=1)


def test_completions_streaming_and_logprobs(router: LiveRouter) -> None:
    chunks = list(router.client().completions.create(model="beta", prompt="x", max_tokens=3, stream=True,
                                                     logprobs=2, stream_options={"include_usage": True}))
    text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
    assert text == " w100 w101 w102"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 3
    toks = [t for ch in chunks if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens or []]
    assert toks == [" w100", " w101", " w102"]


def test_completions_logprobs_with_a_character_split_across_tokens(router: LiveRouter) -> None:
    """text_offset never runs past the text; partial-UTF-8 tokens are OpenAI's ``bytes:`` strings,
    so distinct alternatives stay distinct keys; streamed offsets equal non-streamed ones."""
    body = {"model": "alpha", "prompt": "[utf8] x", "max_tokens": 4, "logprobs": 2, "temperature": 0}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == " é w100 w101"
    lp = choice["logprobs"]
    assert lp["tokens"] == ["bytes:\\x20\\xc3", "bytes:\\xa9", " w100", " w101"]
    assert lp["text_offset"] == [0, 1, 2, 7]
    assert all(off < len(choice["text"]) for off in lp["text_offset"])
    assert [len(t) for t in lp["top_logprobs"]] == [2, 2, 2, 2]
    assert lp["top_logprobs"][0] == {"bytes:\\x20\\xc3": -0.5, "bytes:\\xc4": -1.5}

    chunks = sse_data(sse_lines(router, "/v1/completions", {**body, "stream": True}))
    streamed = [c["choices"][0]["logprobs"] for c in chunks if isinstance(c, dict) and c.get("choices")
                and c["choices"][0].get("logprobs")]
    assert sum((x["text_offset"] for x in streamed), []) == lp["text_offset"]
    assert sum((x["tokens"] for x in streamed), []) == lp["tokens"]


# ----------------------------------------------------------------------------- llama.cpp native


def test_native_completion_probabilities_one_per_token(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/completion", json={
        "model": "alpha", "prompt": "[utf8] x", "n_predict": 4, "n_probs": 2, "return_tokens": True,
        "temperature": 0}, timeout=30)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["content"] == " é w100 w101"
    assert body["tokens"] == [200, 201, 100, 101]
    assert body["stop_type"] == "limit" and body["timings"]["predicted_n"] == 4
    probs = body["completion_probabilities"]
    assert len(probs) == 4
    assert probs[0]["bytes"] == [0x20, 0xC3] and probs[1]["bytes"] == [0xA9]
    # llama.cpp's validate_utf8: a character cut off at the end is dropped from "token"
    assert probs[0]["token"] == " " and probs[2]["token"] == " w100"
    assert body["truncated"] is False  # stopped by n_predict, not by a full context
    assert set(probs[0]) == {"id", "token", "bytes", "logprob", "top_logprobs"}
    assert all(len(p["top_logprobs"]) == 2 and "id" in p["top_logprobs"][0] for p in probs)


def test_native_completion_stream(router: LiveRouter) -> None:
    data = sse_data(sse_lines(router, "/completion", {"model": "alpha", "prompt": [3, 4], "n_predict": 3,
                                                      "n_probs": 1, "stream": True}))
    assert all(d != "[DONE]" for d in data)
    assert [d["stop"] for d in data] == [False, False, False, True]
    assert [d["tokens"] for d in data] == [[100], [101], [102], []]  # llama.cpp: ids even without return_tokens
    assert sum(len(d.get("completion_probabilities", [])) for d in data) == 3
    assert data[-1]["stop_type"] == "limit" and "timings" in data[-1]


def test_token_text_drops_a_cut_off_character_as_llama_cpp() -> None:
    from router.dialects.llamacpp_answers import token_text as _token_text

    assert _token_text(b"\xf0\x9f") == "" and _token_text(b"a\xe2\x82") == "a" and _token_text(b"\xc3\xa9") == "\u00e9"
    assert _token_text(b"x\xa9") == "x\ufffd"  # a stray continuation byte is not a cut-off character


def test_tokenize_answers_rendered_in_slices_are_what_dumps_makes(monkeypatch: pytest.MonkeyPatch) -> None:
    """/tokenize's answers, rendered a slice at a time (the event loop free in between), are byte
    for byte the JSON of the whole list, over any number of slices (a piece not UTF-8 as bytes)."""
    import asyncio

    from protocol import TokenizeResult
    from router.dialects import llamacpp_api
    from router.http.responses import dumps

    monkeypatch.setattr(llamacpp_api, "TOKENS_PER_SLICE", 3)
    monkeypatch.setattr(llamacpp_api, "PIECES_PER_SLICE", 2)
    for n in (0, 1, 2, 3, 4, 7):
        ids = list(range(100, 100 + n))
        pieces = [f" w{t}".encode() for t in ids[:-1]] + [b"\xc3"] * (n > 0)
        ans = TokenizeResult.of("t", ids, pieces)
        assert asyncio.run(llamacpp_api._token_list_json(ans)) == dumps({"tokens": ids})
        want = [{"id": t, "piece": p.decode() if p != b"\xc3" else [0xC3]} for t, p in zip(ids, pieces)]
        assert asyncio.run(llamacpp_api._pieces_json(ans)) == dumps({"tokens": want})


def test_native_completion_until_the_context_is_full_is_truncated(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/completion", json={
        "model": "alpha", "prompt": "[len=100000] x", "n_predict": -1, "temperature": 0}, timeout=60)
    body = r.json()
    assert r.status_code == 200 and body["stop_type"] == "limit", r.text
    assert body["truncated"] is True and body["tokens_evaluated"] + body["tokens_predicted"] >= 256


def test_tokenize_detokenize_apply_template(router: LiveRouter) -> None:
    h = router.http()
    toks = h.post("/tokenize", json={"model": "alpha", "content": "a b", "add_special": True}).json()["tokens"]
    assert len(toks) == 3 and toks[0] == 1
    pieces = h.post("/tokenize", json={"model": "alpha", "content": "a", "with_pieces": True}).json()["tokens"]
    assert set(pieces[0]) == {"id", "piece"}
    assert h.post("/detokenize", json={"model": "alpha", "tokens": [7, 8]}).json() == {"content": " w7 w8"}
    r = h.post("/detokenize", json={"model": "alpha", "tokens": [10**9]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_token"
    prompt = h.post("/apply-template", json={"model": "alpha", "messages": [{"role": "user", "content": "q"}]}).json()
    assert prompt["prompt"].endswith("<|im_start|>assistant\n")


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("path,body,param", [
    ("/v1/chat/completions", None, None),
    ("/v1/chat/completions", "[1, 2]", None),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}, "model"),
    ("/v1/chat/completions", {"model": "alpha"}, "messages"),
    ("/v1/chat/completions", {"model": "alpha", "messages": []}, "messages"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "wizard", "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": 5}]},
     "messages[0].content"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, "messages[0].content[0]"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}], "n": 17}, "n"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "temperature": "hot"}, "temperature"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "top_p": 3}, "top_p"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "stop": [1]}, "stop"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "stream": "yes"}, "stream"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": "user", "content": "x"}],
                              "logit_bias": {"x": 1}}, "logit_bias"),
    ("/v1/completions", {"model": "alpha"}, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": {"a": 1}}, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": [-1]}, "prompt"),
    ("/v1/completions", {"model": "alpha", "prompt": "x", "echo": True}, "echo"),
    ("/completion", {"model": "alpha", "prompt": 5}, "prompt"),
    ("/completion", {"model": "alpha", "prompt": "x", "n_probs": -1}, "n_probs"),
    ("/tokenize", {"model": "alpha"}, "content"),
    ("/admin/models/load", {"model": 3}, "model"),
    # unhashable or odd role values: a 400 naming the field, not a TypeError (500)
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": ["user"], "content": "x"}]},
     "messages[0].role"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": {"a": 1}, "content": "x"}]},
     "messages[0].role"),
    ("/apply-template", {"model": "alpha", "messages": [{"role": ["user"], "content": "x"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"model": "alpha", "messages": [{"role": 1.5, "content": "x"}]}, "messages[0].role"),
])
def test_malformed_bodies_get_400(router: LiveRouter, path: str, body: Any, param: str | None) -> None:
    if body is None:
        r = httpx.post(router.url + path, content=b"{not json", headers={"content-type": "application/json"}, timeout=30)
    elif isinstance(body, str):
        r = httpx.post(router.url + path, content=body.encode(), headers={"content-type": "application/json"}, timeout=30)
    else:
        r = httpx.post(router.url + path, json=body, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"]
    assert err["param"] == param


@pytest.mark.parametrize("path,extra", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}]}),
    ("/v1/completions", {"prompt": "x"}),
    ("/completion", {"prompt": "x"}),
    ("/tokenize", {"content": "x"}),
    ("/detokenize", {"tokens": [1]}),
    ("/apply-template", {"messages": [{"role": "user", "content": "x"}]}),
    ("/admin/models/load", {}),
    ("/admin/models/unload", {}),
])
def test_a_lone_surrogate_in_the_model_name_is_a_400_not_a_500(router: LiveRouter, path: str,
                                                                extra: dict[str, Any]) -> None:
    body = json.dumps({"model": "MODEL", **extra}).replace('"MODEL"', '"\\ud800x"')  # a lone-surrogate escape
    r = httpx.post(router.url + path, content=body.encode(), headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]  # not valid Unicode text: refused where the body is read, naming the field
    assert err["param"] == "model" and "surrogate" in err["message"]


def test_a_body_over_the_limit_is_413(router: LiveRouter) -> None:
    from router.http.params import MAX_BODY_BYTES

    r = httpx.post(router.url + "/v1/completions", content=b"{" + b" " * MAX_BODY_BYTES + b"}", headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"


def test_a_413_reaches_a_client_still_sending_its_body(router: LiveRouter) -> None:
    """The router answers 413 on the head; a client that goes on sending its body still reads
    the whole answer (the connection drops the rest of the body before it closes: closing with
    unread bytes would reset it, and the client's kernel would drop the 413)."""
    import socket
    import time
    from urllib.parse import urlsplit

    from router.http.params import MAX_BODY_BYTES

    u = urlsplit(router.url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\n\r\n{" % (MAX_BODY_BYTES + 2))
        time.sleep(0.3)  # the answer is given (and the close begun) while the body is still to come
        try:
            for _ in range(64):
                s.sendall(b" " * 65536)
        except OSError as e:  # a reset: the connection was closed under the client's body
            raise AssertionError(f"the router reset the connection under the body: {e!r}") from e
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    assert head.split(b"\r\n")[0].startswith(b"HTTP/1.1 413"), data[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"


def test_type_errors_name_json_types(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/completions", content=b"null", headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("got null")
    r = httpx.post(router.url + "/v1/completions", json={"model": {"a": 1}, "prompt": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"].endswith("got object")


def test_unknown_model_is_404_listing_ids(router: LiveRouter) -> None:
    with pytest.raises(openai.NotFoundError) as e:
        router.client().chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert "alpha" in str(e.value) and "org/alpha:q4" in str(e.value)


def test_context_overflow_is_400(router: LiveRouter) -> None:
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as e:
            res = router.client().completions.create(model="alpha", prompt="x " * 300, max_tokens=4, stream=stream)
            list(res) if stream else None  # type: ignore[call-overload]
        assert e.value.code == "context_length_exceeded" and e.value.param == "prompt"
        assert "maximum context length" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        router.client().chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x " * 300}],
                                                max_tokens=4)
    assert e.value.code == "context_length_exceeded" and e.value.param == "messages"  # as OpenAI names it


# ----------------------------------------------------------------------------- fuzz: never a 500

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_json_scalar = st.one_of(st.none(), st.booleans(), st.integers(-10, 10**6), st.floats(allow_nan=False, allow_infinity=False),
                         st.text(max_size=8))
_json = st.recursive(_json_scalar, lambda inner: st.one_of(st.lists(inner, max_size=3),
                                                           st.dictionaries(st.text(max_size=5), inner, max_size=3)),
                     max_leaves=6)
_fields = {
    "model": st.one_of(st.sampled_from(["alpha", "a", "nope"]), _json),
    "messages": st.one_of(_json, st.lists(st.fixed_dictionaries(
        {"role": st.sampled_from(["user", "system", "assistant", "bot"]), "content": _json}), max_size=2)),
    "prompt": st.one_of(st.text(max_size=10), st.lists(st.integers(-2, 60000), max_size=4), _json),
    "max_tokens": st.one_of(st.integers(-2, 3), _json),
    "temperature": _json, "top_p": _json, "top_k": _json, "min_p": _json, "seed": _json, "stop": _json,
    "n": st.one_of(st.just(1), _json), "logprobs": _json, "top_logprobs": _json, "logit_bias": _json,
    "presence_penalty": _json, "n_predict": st.one_of(st.integers(-1, 3), _json), "n_probs": _json,
    "stream_options": _json, "whatever": _json,
}


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(path=st.sampled_from(["/v1/chat/completions", "/v1/completions", "/completion", "/tokenize",
                             "/detokenize", "/apply-template"]),
       body=st.fixed_dictionaries({}, optional=_fields))
def test_random_bodies_never_get_a_500(router: LiveRouter, path: str, body: dict[str, Any]) -> None:
    body.pop("stream", None)
    if isinstance(body.get("max_tokens"), int) and body["max_tokens"] > 3:
        body["max_tokens"] = 3
    body.setdefault("max_tokens", 2)
    body.setdefault("n_predict", 2)
    r = httpx.post(router.url + path, json=body, timeout=30)
    assert r.status_code in (200, 400, 404), (r.status_code, r.text)
    if r.status_code != 200:
        err = r.json()["error"]
        assert err["message"] and err["type"] == "invalid_request_error"


def test_non_standard_json_constants_are_400(router: LiveRouter) -> None:
    r = httpx.post(router.url + "/v1/completions", content=b'{"model": "alpha", "prompt": "x", "temperature": NaN}',
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == 400 and "NaN" in r.json()["error"]["message"]


def test_leniency_real_clients_need(router: LiveRouter) -> None:
    """stream_options without stream is ignored (as llama.cpp); max_tokens beyond the room
    left is clamped and ends with "length"; developer role, content parts with extra keys
    and an assistant prefill work on every chat route."""
    c = router.client()
    r = c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x"}], max_tokens=2,
                                  stream_options={"include_usage": True})
    assert r.choices[0].message.content and r.usage is not None
    r2 = c.completions.create(model="alpha", prompt="x", max_tokens=2, stream=False,
                              stream_options={"include_usage": True})
    assert r2.choices[0].text
    # the fake's n_ctx is 256: a prompt of 250 tokens leaves room for 6
    r = c.chat.completions.create(model="alpha", messages=[{"role": "user", "content": "x " * 230 + "[len=50]"}],
                                  max_tokens=100_000)
    assert r.choices[0].finish_reason == "length" and r.usage is not None
    assert r.usage.prompt_tokens + r.usage.completion_tokens == 256
    parts = [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]
    for path, body in [
        ("/v1/chat/completions", {"messages": [{"role": "developer", "content": parts},
                                               {"role": "user", "content": parts},
                                               {"role": "assistant", "content": "Sure,"}], "max_tokens": 2}),
        ("/v1/responses", {"input": [{"role": "developer", "content": [{"type": "input_text", "text": "hi",
                                                                         "cache_control": {}}]},
                                     {"role": "user", "content": "x"}, {"role": "assistant", "content": "Sure,"}],
                           "max_output_tokens": 2}),
        ("/v1/messages", {"system": [{"type": "text", "text": "s", "cache_control": {"type": "ephemeral"}}],
                          "messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "Sure,"}],
                          "max_tokens": 2}),
    ]:
        resp = httpx.post(router.url + path, json={"model": "alpha", **body}, timeout=30)
        assert resp.status_code == 200, (path, resp.text)
        msgs = router.fake_events("generate")[-1]["messages"]
        assert msgs[-1] == {"role": "assistant", "content": "Sure,"} and msgs[0]["role"] == "system", (path, msgs)


def test_two_trailing_assistant_messages_are_a_400_on_every_chat_route(router: LiveRouter) -> None:
    """An assistant prefill continues one message; two at the end are refused, as llama.cpp
    does ("Cannot have 2 or more assistant messages at the end of the list"), not merged."""
    two = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello"},
           {"role": "assistant", "content": "x"}]
    for path, body, param in [
        ("/v1/chat/completions", {"messages": two, "max_tokens": 2}, "messages"),
        ("/v1/responses", {"input": two, "max_output_tokens": 2}, "input"),
        ("/apply-template", {"messages": two}, "messages"),
    ]:
        r = httpx.post(router.url + path, json={"model": "alpha", **body}, timeout=30)
        assert r.status_code == 400, (path, r.text)
        err = r.json()["error"]
        assert "2 or more assistant messages" in err["message"], (path, err)
        if param is not None:
            assert err.get("param") == param, (path, err)
    # Anthropic's Messages API documents that consecutive turns of one role are combined
    r = httpx.post(router.url + "/v1/messages", json={"model": "alpha", "messages": two, "max_tokens": 2}, timeout=30)
    assert r.status_code == 200, r.text
    assert router.fake_events("generate")[-1]["messages"][-1] == {"role": "assistant", "content": "Hello\n\nx"}
    ok = two[:2] + [{"role": "user", "content": "more"}, {"role": "assistant", "content": "Sure,"}]
    assert httpx.post(router.url + "/v1/chat/completions", json={"model": "alpha", "messages": ok, "max_tokens": 2},
                      timeout=30).status_code == 200


def _post(router: LiveRouter, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(router.url + path, json={"model": "alpha", **body}, timeout=30)


@pytest.mark.parametrize("path,base", [
    ("/completion", {"prompt": "x", "n_predict": 2}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 2}),
])
def test_llamacpp_samplers_the_engine_lacks_are_400_unless_neutral(router: LiveRouter, path: str,
                                                                   base: dict[str, Any]) -> None:
    """mirostat, typical-p, DRY, XTC, top-n-sigma, dynamic temperature, post-sampling probs
    and a sampler order other than the engine's are refused naming the field; their
    neutral values (what llama.cpp's webui sends by default) are accepted."""
    for field, value in [("mirostat", 2), ("typical_p", 0.5), ("dry_multiplier", 0.8), ("xtc_probability", 0.5),
                         ("top_n_sigma", 1.0), ("dynatemp_range", 0.5), ("min_keep", 5),
                         ("post_sampling_probs", True), ("samplers", ["temperature", "top_k", "top_p", "min_p",
                                                                       "penalties"]),
                         ("samplers", "kpt"), ("samplers", "ekpmtq"), ("samplers", ["bogus"]), ("mirostat", "x")]:
        if field == "post_sampling_probs" and path == "/completion":
            continue  # served there (tests/router/test_llamacpp_compat_fake.py)
        r = _post(router, path, {**base, field: value})
        assert r.status_code == 400, (path, field, value, r.text)
        assert r.json()["error"]["param"] == field, r.text
    neutral = {"mirostat": 0, "typical_p": 1.0, "dry_multiplier": 0.0, "xtc_probability": 0.0, "top_n_sigma": -1,
               "dynatemp_range": 0.0, "min_keep": 0, "post_sampling_probs": False, "samplers": "edkypmxt",
               "n_keep": 0}
    assert _post(router, path, {**base, **neutral}).status_code == 200
    order = ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature"]
    assert _post(router, path, {**base, "samplers": order}).status_code == 200


def test_llamacpp_constraint_and_length_fields_on_the_openai_routes(router: LiveRouter) -> None:
    """llama.cpp's json_schema / grammar / n_predict reach the worker on its OpenAI routes
    too (not ignored); n_probs there is refused (logprobs is the field)."""
    msgs = [{"role": "user", "content": "x"}]
    schema = {"type": "integer"}
    assert _post(router, "/v1/chat/completions", {"messages": msgs, "json_schema": schema}).status_code == 200
    assert json.loads(router.fake_events("generate")[-1]["json_schema"]) == schema
    assert _post(router, "/v1/chat/completions", {"messages": msgs, "grammar": 'start: "yes"'}).status_code == 200
    assert router.fake_events("generate")[-1]["grammar"] == 'start: "yes"'
    assert _post(router, "/v1/completions", {"prompt": "x", "json_schema": schema}).status_code == 200
    assert json.loads(router.fake_events("generate")[-1]["json_schema"]) == schema
    assert _post(router, "/v1/chat/completions", {"messages": msgs, "max_tokens": 5, "n_predict": 2}).status_code == 200
    assert router.fake_events("generate")[-1]["max_tokens"] == 2
    for body, param in [({"json_schema": schema, "response_format": {"type": "json_object"}}, "json_schema"),
                        ({"grammar": 'start: "a"', "tools": [{"type": "function", "function": {"name": "f"}}],
                          "tool_choice": "required"}, "grammar"),
                        ({"json_schema": schema, "grammar": 'start: "a"'}, "grammar"),
                        ({"n_probs": 3}, "n_probs")]:
        r = _post(router, "/v1/chat/completions", {"messages": msgs, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)


def test_id_slot_outside_the_slots_is_a_400(router: LiveRouter) -> None:
    ok = _post(router, "/completion", {"prompt": "x", "n_predict": 1, "id_slot": 0})
    assert ok.status_code == 200 and ok.json()["id_slot"] >= 0
    for bad in (7, -2, "1"):
        r = _post(router, "/completion", {"prompt": "x", "n_predict": 1, "id_slot": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "id_slot", r.text


def test_a_lone_surrogate_is_a_400_naming_where_it_is(router: LiveRouter) -> None:
    """JSON may spell an unpaired UTF-16 surrogate (\\ud800); it is not Unicode text: a 400
    naming the field, not an internal encoding error. A paired one (an emoji) is fine."""
    raw = b'{"model": "alpha", "messages": [{"role": "user", "content": "a\\ud800b"}], "max_tokens": 1}'
    r = httpx.post(router.url + "/v1/chat/completions", content=raw, headers={"content-type": "application/json"},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages[0].content", r.text
    assert "surrogate" in r.json()["error"]["message"]
    ok = b'{"model": "alpha", "messages": [{"role": "user", "content": "a\\ud83d\\ude00b"}], "max_tokens": 1}'
    assert httpx.post(router.url + "/v1/chat/completions", content=ok, headers={"content-type": "application/json"},
                      timeout=30).status_code == 200


def test_worker_side_400s_name_the_field(router: LiveRouter) -> None:
    """Errors the worker finds (a token id outside the vocabulary, an empty prompt) name the
    request field as the router's own checks do."""
    r = _post(router, "/v1/completions", {"prompt": [999999], "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text

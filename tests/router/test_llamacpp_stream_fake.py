"""llama-server's resumable streams (``X-Conversation-Id``, ``GET`` / ``DELETE /v1/stream``,
``POST /v1/streams/lookup``; tools/server/server-stream.cpp), through a live router with fake
workers: the generation outlives its connection and is replayed from any byte offset."""

from __future__ import annotations

import json

import httpx

from tests.router.conftest import LiveRouter, router_fixture

CONFIG = """
[server]
models_dir = "."
[defaults]
ping_interval_s = 0
[models.a]
path = "m.gguf"
parallel = 2
"""


router = router_fixture(CONFIG, ggufs=("m.gguf",), fake={"a": {"max_jobs": 2}})


def _lookup(router: LiveRouter, *ids: str) -> list[dict]:
    r = httpx.post(router.url + "/v1/streams/lookup", json={"conversation_ids": list(ids)}, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _events(raw: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: {")]


def test_a_stream_outlives_its_connection_and_replays_from_any_offset(router: LiveRouter) -> None:
    body = {"model": "a", "prompt": "resume me [len=8] [hold@2]", "n_predict": 8, "stream": True}
    with router.hold():
        with httpx.stream("POST", router.url + "/completion", json=body, timeout=30,
                          headers={"X-Conversation-Id": "conv-1"}) as r:
            assert r.status_code == 200
            first = next(r.iter_raw())  # the client reads a little, then goes away (a page reload)
        router.wait_for(lambda: _lookup(router, "conv-1"), what="the session")
        assert _lookup(router, "conv-1")[0]["is_done"] is False  # held: still running without its client
    router.wait_for(lambda: _lookup(router, "conv-1")[0]["is_done"], what="the generation to end")
    gen = router.fake_events("generate")[-1]
    assert not router.fake_events("cancel", id=gen["id"])  # the disconnect did not cancel it
    full = httpx.get(router.url + "/v1/stream", params={"conv_id": "conv-1"}, timeout=30)
    assert full.status_code == 200 and full.headers["content-type"].startswith("text/event-stream")
    assert full.content.startswith(first)
    evs = _events(full.content)
    assert [e["stop"] for e in evs].count(True) == 1 and evs[-1]["stop"] is True
    assert evs[-1]["tokens_predicted"] == 8 and len([e for e in evs[:-1] if e["content"]]) == 8
    assert _lookup(router, "conv-1")[0]["total_bytes"] == len(full.content)
    assert _lookup(router, "conv") == []  # only the id itself and its "<id>::..." variants match
    for k in (0, 1, len(first), len(full.content) // 2, len(full.content)):
        part = httpx.get(router.url + "/v1/stream", params={"conv_id": "conv-1", "from": k}, timeout=30)
        assert part.status_code == 200 and part.content == full.content[k:]
    # an id matches its "<id>::<suffix>" variants, as llama-server's lookup
    with httpx.stream("POST", router.url + "/completion", json={**body, "prompt": "x [len=2]"}, timeout=30,
                      headers={"X-Conversation-Id": "conv-1::a"}) as r:
        r.read()
    assert sorted(s["conversation_id"] for s in _lookup(router, "conv-1")) == ["conv-1", "conv-1::a"]


def test_delete_stops_the_generation_and_a_new_request_replaces_the_old(router: LiveRouter) -> None:
    body = {"model": "a", "prompt": "stop me [hold]", "stream": True, "n_predict": 50}
    with router.hold():
        for _ in range(2):  # the second request of the conversation cancels the first one's generation
            with httpx.stream("POST", router.url + "/completion", json=body, timeout=30,
                              headers={"X-Conversation-Id": "conv-2"}) as r:
                assert r.status_code == 200
        ids = [e["id"] for e in router.fake_events("generate") if "stop me" in str(e["prompt"])]
        assert len(ids) == 2
        router.wait_for(lambda: router.fake_events("cancel", id=ids[0]), what="the replaced stream cancelled")
        assert not router.fake_events("cancel", id=ids[1])
        r = httpx.delete(router.url + "/v1/stream", params={"conv_id": "conv-2"}, timeout=30)
        assert r.status_code == 204
        router.wait_for(lambda: router.fake_events("cancel", id=ids[1]), what="the stream cancelled")
    assert _lookup(router, "conv-2") == []
    r = httpx.get(router.url + "/v1/stream", params={"conv_id": "conv-2"}, timeout=30)
    assert r.status_code == 404 and r.json()["error"]["message"] == "Stream not found or expired"
    assert httpx.delete(router.url + "/v1/stream", params={"conv_id": "conv-2"}, timeout=30).status_code == 204


def test_stream_errors(router: LiveRouter) -> None:
    r = httpx.get(router.url + "/v1/stream", timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "conv_id"
    with httpx.stream("POST", router.url + "/v1/chat/completions", timeout=30, headers={"X-Conversation-Id": "c3"},
                      json={"model": "a", "stream": True, "messages": [{"role": "user", "content": "[len=2]"}]}) as s:
        s.read()
    r = httpx.get(router.url + "/v1/stream", params={"conv_id": "c3", "from": "x"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "from"
    replay = httpx.get(router.url + "/v1/stream", params={"conv_id": "c3"}, timeout=30)
    assert replay.content == s.content and replay.text.rstrip().endswith("data: [DONE]")
    # a request refused before its stream starts leaves no session
    r = httpx.post(router.url + "/v1/chat/completions", headers={"X-Conversation-Id": "c4"},
                   json={"model": "a", "stream": True, "messages": "bad"}, timeout=30)
    assert r.status_code == 400 and _lookup(router, "c4") == []


def test_several_prompts_stream_and_a_client_leaving_cancels_every_one(router: LiveRouter) -> None:
    """/completion with several prompts streams them interleaved (each chunk names its prompt's
    ``index``); a client that leaves mid-stream cancels every one of their generations."""
    body = {"model": "a", "prompt": ["left one [len=20] [hold@1]", "left two [len=20] [hold@1]"], "n_predict": 20,
            "stream": True}
    with router.hold():
        with httpx.stream("POST", router.url + "/completion", json=body, timeout=30) as r:
            assert r.status_code == 200
            seen = set()
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    seen.add(json.loads(line[6:])["index"])
                if seen == {0, 1}:
                    break
        ids = [e["id"] for e in router.fake_events("generate") if "left " in str(e["prompt"])]
        assert len(ids) == 2
        for gid in ids:
            router.wait_for(lambda gid=gid: router.fake_events("cancel", id=gid), what=f"{gid} cancelled")

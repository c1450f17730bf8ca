"""Hung and crashed workers, judged while they generate (fake workers, one live router).

A SIGSTOPped worker becomes ``unresponsive`` within ``unresponsive_after_s`` of its
last frame: /admin/models, /admin/events and /metrics say so, no new job is handed
to it, and requests wait; it is killed at ``ping_timeout_s`` (the running stream
gets the SSE error event) and the waiting request runs on the restarted worker.
A worker that answers again (SIGCONT) is ``ready`` again with nothing lost. A
SIGKILLed worker's waiting requests also run on its successor. A draining worker is
not pinged: its stop is never reported as "hung".
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.router.conftest import LiveRouter, dummy_gguf

pytestmark = pytest.mark.reliability

MODELS = ["stop", "cont", "kill", "drainstop"]
SWITCHES = {m: {"token_delay_s": 0.02, "length": 400} for m in MODELS}


def _config() -> str:
    lines = ["[server]", 'models_dir = "."', "[defaults]", "max_queue = 4", "ping_interval_s = 0.3",
             "ping_timeout_s = 3.0", "unresponsive_after_s = 0.5", "cancel_timeout_s = 5.0",
             "shutdown_grace_s = 1.0", "restart_backoff_s = 0", "max_crashes = 1000"]
    extra = {"drainstop": ["ping_timeout_s = 0.8", "drain_timeout_s = 1.0"]}
    for m in MODELS:
        lines += [f"[models.{m}]", 'path = "m.gguf"', *extra.get(m, [])]
    return "\n".join(lines) + "\n"


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "m.gguf")
    r = LiveRouter(module_tmp, _config())
    r.set_fake(SWITCHES)
    yield r
    r.stop()


def chat(model: str, content: str = "hi", **kw: Any) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": content}], **kw}


class Stream:
    """A streaming chat read in a thread: ``events`` grows as data events arrive."""

    def __init__(self, router: LiveRouter, body: dict[str, Any]) -> None:
        self.events: list[Any] = []
        self.done = threading.Event()
        self._t = threading.Thread(target=self._run, args=(router, body), daemon=True)
        self._t.start()

    def _run(self, router: LiveRouter, body: dict[str, Any]) -> None:
        try:
            with httpx.stream("POST", router.url + "/v1/chat/completions", json=body, timeout=60) as r:
                for line in r.iter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        self.events.append(json.loads(line[6:]))
        finally:
            self.done.set()

    def text(self) -> str:
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in self.events if e.get("choices"))


class Later:
    """One non-streaming request run in a thread."""

    def __init__(self, router: LiveRouter, body: dict[str, Any]) -> None:
        self.response: httpx.Response | None = None
        self._t = threading.Thread(target=self._run, args=(router, body), daemon=True)
        self._t.start()

    def _run(self, router: LiveRouter, body: dict[str, Any]) -> None:
        self.response = httpx.post(router.url + "/v1/chat/completions", json=body, timeout=60)

    def result(self) -> httpx.Response:
        self._t.join(60)
        assert self.response is not None
        return self.response


class Events:
    """/admin/events collected in a thread."""

    def __init__(self, router: LiveRouter) -> None:
        self.seen: list[dict[str, Any]] = []
        self._stop = False
        threading.Thread(target=self._run, args=(router,), daemon=True).start()

    def _run(self, router: LiveRouter) -> None:
        with httpx.stream("GET", router.url + "/admin/events", timeout=60) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    self.seen.append(json.loads(line[6:]))
                if self._stop:
                    return

    def of(self, model: str, event: str) -> list[dict[str, Any]]:
        return [e for e in self.seen if e.get("model") == model and e.get("event") == event]


def _load(router: LiveRouter, model: str) -> int:
    httpx.post(router.url + "/admin/models/load", json={"model": model}, timeout=30).raise_for_status()
    return int(router.wait_for(lambda: router.admin(model)["pid"], what=f"{model} pid"))


def _state_metric(router: LiveRouter, model: str, state: str) -> float:
    for line in httpx.get(router.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f'modelyard_model_state{{model="{model}",state="{state}"}}'):
            return float(line.split()[-1])
    raise AssertionError(f"no state metric for {model}/{state}")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_sigstop_mid_stream_unresponsive_then_killed_and_the_waiting_request_runs_after(router: LiveRouter) -> None:
    pid = _load(router, "stop")
    events = Events(router)
    router.wait_for(lambda: events.seen, what="the events snapshot")
    s = Stream(router, chat("stop", stream=True))
    router.wait_for(lambda: len(s.events) >= 3, what="tokens flowing")
    os.kill(pid, signal.SIGSTOP)  # the router SIGKILLs it at ping_timeout_s (that works on a stopped process)
    t0 = time.monotonic()
    later = Later(router, chat("stop", "waiting", max_tokens=3))
    st = router.wait_for(lambda: (a := router.admin("stop"))["state"] == "unresponsive" and a,
                         what="stop unresponsive")
    blackout = time.monotonic() - t0
    print(f"\n[liveness] SIGSTOP -> unresponsive in {blackout * 1000:.0f} ms (unresponsive_after_s=0.5)")
    assert st["condition"] == "unresponsive" and st["unresponsive_since"] is not None
    assert st["pid"] == pid
    assert _state_metric(router, "stop", "unresponsive") == 1.0
    assert _state_metric(router, "stop", "ready") == 0.0
    router.wait_for(lambda: router.admin("stop")["queue_depth"] == 1, what="the later request waits")
    router.wait_for(lambda: events.of("stop", "unresponsive"), what="the unresponsive event")
    assert s.done.wait(30)
    err = s.events[-1]["error"]
    assert err["code"] == "worker_crashed" and "hung" in err["message"] and "ping_timeout_s" in err["message"]
    r = later.result()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] == " w100 w101 w102"
    new = router.admin("stop")
    assert new["state"] == "ready" and new["pid"] not in (None, pid)
    assert _gone(pid)
    moves = [(e["from"], e["to"]) for e in events.of("stop", "state")]
    assert ("ready", "unresponsive") in moves and ("unresponsive", "failed") in moves


def test_a_worker_that_answers_again_is_ready_with_nothing_lost(router: LiveRouter) -> None:
    pid = _load(router, "cont")
    s = Stream(router, chat("cont", stream=True, max_tokens=60))
    router.wait_for(lambda: len(s.events) >= 3, what="tokens flowing")
    os.kill(pid, signal.SIGSTOP)
    try:
        router.wait_for(lambda: router.admin("cont")["state"] == "unresponsive", what="cont unresponsive")
    finally:
        os.kill(pid, signal.SIGCONT)
    router.wait_for(lambda: router.admin("cont")["state"] == "ready", what="cont ready again")
    assert s.done.wait(30)
    assert s.text() == "".join(f" w{100 + i}" for i in range(60))
    assert s.events[-1]["choices"][0]["finish_reason"] == "length"
    assert router.admin("cont")["pid"] == pid and router.admin("cont")["spawn_count"] == 1


def test_sigkill_mid_stream_error_event_and_the_waiting_request_runs_on_the_restarted_worker(
        router: LiveRouter) -> None:
    pid = _load(router, "kill")
    s = Stream(router, chat("kill", stream=True))
    router.wait_for(lambda: len(s.events) >= 3, what="tokens flowing")
    later = Later(router, chat("kill", "waiting", max_tokens=2))
    router.wait_for(lambda: router.admin("kill")["queue_depth"] == 1, what="the later request waits")
    os.kill(pid, signal.SIGKILL)
    assert s.done.wait(30)
    err = s.events[-1]["error"]
    assert err["code"] == "worker_crashed" and "signal 9" in err["message"]
    r = later.result()
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == " w100 w101"
    assert router.admin("kill")["pid"] not in (None, pid)


def test_a_draining_worker_is_not_pinged_nor_killed_as_hung(router: LiveRouter) -> None:
    pid = _load(router, "drainstop")
    s = Stream(router, chat("drainstop", stream=True))
    router.wait_for(lambda: len(s.events) >= 3, what="tokens flowing")
    httpx.post(router.url + "/models/unload", json={"model": "drainstop"}, timeout=30).raise_for_status()  # returns at once
    router.wait_for(lambda: router.admin("drainstop")["state"] == "draining", what="draining")
    os.kill(pid, signal.SIGSTOP)  # silent while draining: drain_timeout_s, then Shutdown, grace, SIGKILL
    router.wait_for(lambda: router.admin("drainstop")["state"] == "unloaded", timeout=30, what="unloaded")
    st = router.admin("drainstop")
    assert "ignoring Shutdown" in (st["last_error"] or ""), st["last_error"]
    assert "hung" not in (st["last_error"] or "")
    assert s.done.wait(30)
    assert _gone(pid)
    assert not [line for line in router.log().splitlines() if "drainstop" in line and "hung" in line]

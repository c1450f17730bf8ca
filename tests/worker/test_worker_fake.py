"""The worker's socket loop, queue, cancel, health and exit, against a fake engine (fast, no model).

The server runs in a thread of the test process; the test plays the router
with a real bound ROUTER socket (``RouterStub``) over ipc:// or tcp://.
"""

from __future__ import annotations

import os
import random
import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from protocol import (
    MAX_FRAME_BYTES,
    ApplyTemplate,
    ApplyTemplateResult,
    Cancel,
    Detokenize,
    DetokenizeResult,
    Done,
    Error,
    Generate,
    Hello,
    LoadProgress,
    Ping,
    Pong,
    Ready,
    Shutdown,
    Token,
    Tokenize,
    TokenIds,
    TokenizeResult,
)
from tests.timing import report
from tests.worker.fake_engine import EOS, FakeEngine
from tests.worker.router_stub import RouterStub, garbage_frame
from worker.engine import EngineError, SamplingParams
from worker.config import WorkerConfig
from worker.server import WorkerServer
from worker import runner


@dataclass
class Harness:
    stub: RouterStub
    server: WorkerServer
    engine: FakeEngine
    thread: threading.Thread
    result: dict[str, Any] = field(default_factory=dict)
    ready: Ready | None = None

    def wait_exit(self, timeout_s: float = 10.0) -> int:
        self.thread.join(timeout_s)
        assert not self.thread.is_alive(), f"worker did not exit within {timeout_s} s"
        return int(self.result["code"])

    def wait(self, cond: Callable[[], bool], what: str, timeout_s: float = 30.0) -> None:
        """Until ``cond()`` holds (an observed state), at most ``timeout_s`` s."""
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.002)

    def ping(self, ident: str = "p") -> Pong:
        self.stub.send(Ping(id=ident))
        m = self.stub.next_for(ident)
        assert isinstance(m, Pong)
        return m


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="mywk", dir="/tmp")  # short: ipc paths are limited to ~100 chars
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def start(sockdir: str) -> Iterator[Callable[..., Harness]]:
    harnesses: list[Harness] = []

    def _start(engine: FakeEngine | None = None, *, endpoint: str | None = None,
               loader: Callable[..., Any] | None = None, handshake: bool = True, **cfg: Any) -> Harness:
        eng = engine or FakeEngine()
        stub = RouterStub(endpoint or f"ipc://{sockdir}/w{len(harnesses)}.sock")
        cfg.setdefault("parent_pid", os.getpid())
        server = WorkerServer(WorkerConfig(model="fake", gguf="/nonexistent/fake.gguf", endpoint=stub.endpoint,
                                           **cfg), loader=loader or (lambda *a, **kw: eng))
        h = Harness(stub, server, eng, threading.Thread(target=lambda: None, daemon=True))
        h.thread = threading.Thread(target=lambda: h.result.setdefault("code", server.serve()), daemon=True)
        h.thread.start()
        harnesses.append(h)
        if handshake:
            h.ready = stub.handshake(10)
        return h

    yield _start
    for h in harnesses:
        if h.thread.is_alive() and h.stub.ident is not None:
            h.stub.send(Shutdown(id="bye"))
            h.thread.join(10)
        h.stub.close()


def _text(tokens: list[Token], done: Done) -> str:
    return "".join(t.text for t in tokens) + done.text


# ----------------------------------------------------------------------------- start-up


def test_hello_then_ready_carry_the_model_identity(start: Callable[..., Harness]) -> None:
    h = start(handshake=False)
    hello = h.stub.next(timeout_s=10)
    assert isinstance(hello, Hello) and hello.model == "fake" and hello.pid == os.getpid()
    ready = h.stub.next(timeout_s=10)
    assert isinstance(ready, Ready)
    assert ready.id == hello.id == f"worker-{os.getpid()}"
    assert (ready.model, ready.architecture, ready.n_ctx, ready.n_vocab, ready.n_ctx_train) == ("fake", "fake", 512, 1000, 2048)
    assert ready.fingerprint == "ab" * 32 and ready.file_size == 1234 and ready.has_chat_template
    assert ready.max_jobs == 1 and ready.load_ms >= 0 and ready.gguf_path == "/nonexistent/fake.gguf"


@pytest.mark.parametrize("n_ubatch", [None, 64])
def test_n_ubatch_reaches_the_engine_load(start: Callable[..., Harness], n_ubatch: int | None) -> None:
    seen: dict[str, Any] = {}
    eng = FakeEngine()

    def loader(*_: Any, **kw: Any) -> FakeEngine:
        seen.update(kw)
        return eng

    start(loader=loader, n_ubatch=n_ubatch)
    assert seen.get("n_ubatch") == n_ubatch and ("n_ubatch" in seen) == (n_ubatch is not None)


@pytest.mark.parametrize("exc", [EngineError("file_not_found", "GGUF file not found: /x.gguf"),
                                 RuntimeError("loader bug")])
def test_load_failure_is_an_error_frame_then_exit_1(start: Callable[..., Harness], exc: Exception) -> None:
    def loader(*_: Any, **__: Any) -> Any:
        raise exc

    h = start(loader=loader, handshake=False)
    assert isinstance(h.stub.next(timeout_s=10), Hello)
    err = h.stub.next(timeout_s=10)
    assert isinstance(err, Error) and err.code == "load_failed" and err.id == f"worker-{os.getpid()}"
    assert ("file_not_found" in err.message) if isinstance(exc, EngineError) else ("loader bug" in err.message)
    assert h.wait_exit() == 1


def test_load_progress_frames_come_between_hello_and_ready(start: Callable[..., Harness],
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(runner, "LOAD_STEP_INTERVAL_S", 1e9)  # no step in between is due: first and last only
    eng = FakeEngine()

    def loader(*_: Any, progress: Callable[[str, int, int], None], **__: Any) -> FakeEngine:
        progress("reading_gguf", 0, 1)
        progress("reading_gguf", 1, 1)
        for i in range(1, 201):
            progress("preparing_tensors", i, 200)
        return eng

    h = start(loader=loader, handshake=False)
    assert isinstance(h.stub.next(timeout_s=10), Hello)
    frames = []
    while not isinstance(m := h.stub.next(timeout_s=10), Ready):
        frames.append(m)
    assert all(isinstance(f, LoadProgress) and f.id == f"worker-{os.getpid()}" for f in frames)
    steps = [(f.stage, f.done, f.total) for f in frames]
    assert steps == [("reading_gguf", 0, 1), ("reading_gguf", 1, 1), ("preparing_tensors", 1, 200),
                     ("preparing_tensors", 200, 200)]


def test_a_request_sent_while_loading_runs_after_ready(start: Callable[..., Harness]) -> None:
    release = threading.Event()
    eng = FakeEngine()

    def slow_loader(*_: Any, **__: Any) -> FakeEngine:
        release.wait(10)
        return eng

    h = start(loader=slow_loader, handshake=False)
    assert isinstance(h.stub.next(timeout_s=10), Hello)
    h.stub.send(Generate(id="early", prompt="x y", max_tokens=3, temperature=0.0))
    release.set()
    assert isinstance(h.stub.next(timeout_s=10), Ready)
    tokens, done = h.stub.stream("early")
    assert isinstance(done, Done) and len(tokens) == 3


def test_requests_waiting_for_a_failed_load_get_load_failed(start: Callable[..., Harness]) -> None:
    release = threading.Event()

    def failing_loader(*_: Any, **__: Any) -> Any:
        release.wait(10)
        raise EngineError("invalid_gguf", "truncated file")

    h = start(loader=failing_loader, handshake=False)
    assert isinstance(h.stub.next(timeout_s=10), Hello)
    h.stub.send(Generate(id="early", prompt="x"))
    assert h.ping().queue_len == 1
    release.set()
    err = h.stub.next_for("early", 10)
    assert isinstance(err, Error) and err.code == "load_failed" and "truncated file" in err.message
    assert h.wait_exit() == 1


def test_shutdown_while_loading_exits_0(start: Callable[..., Harness]) -> None:
    release = threading.Event()

    def slow_loader(*_: Any, **__: Any) -> FakeEngine:
        release.wait(10)
        return FakeEngine()

    h = start(loader=slow_loader, handshake=False)
    assert isinstance(h.stub.next(timeout_s=10), Hello)
    assert h.ping().busy is False  # answered while the model loads
    h.stub.send(Shutdown(id="s"))
    assert h.wait_exit(5) == 0
    release.set()


# ----------------------------------------------------------------------------- generation


def test_generate_streams_tokens_then_one_done(start: Callable[..., Harness]) -> None:
    h = start()
    h.stub.send(Generate(id="g1", prompt="hello there world", temperature=0.0, n_probs=3))
    tokens, done = h.stub.stream("g1")
    assert isinstance(done, Done), done
    assert len(tokens) == h.engine.length
    assert (done.finish_reason, done.stop_type) == ("stop", "eos")
    assert done.completion_tokens == done.predicted_n == len(tokens) + 1  # + the EOS token (llama.cpp counts it)
    assert done.prompt_tokens == 4 and done.prompt_n == 4 and done.cache_n == 0
    assert _text(tokens, done) == h.engine.detokenize([t.token_id for t in tokens])
    assert all(t.piece == f" w{t.token_id}".encode() for t in tokens)
    assert all(t.logprob == -0.25 and len(t.top_logprobs) == 3 and t.top_logprobs[0][:2] == [t.token_id, -0.25]
               for t in tokens)
    # each alternative carries its exact bytes, as the chosen token's piece does
    assert all(alt[2] == h.engine.token_bytes(alt[0], special=False) for t in tokens for alt in t.top_logprobs)
    # max_tokens -> "length"; token-id prompt; no logprobs unless asked
    h.stub.send(Generate(id="g2", prompt=[1, 5, 6], max_tokens=3, temperature=0.0))
    tokens, done = h.stub.stream("g2")
    assert isinstance(done, Done) and (done.finish_reason, done.stop_type) == ("length", "limit")
    assert len(tokens) == done.completion_tokens == 3 and all(t.logprob is None and not t.top_logprobs for t in tokens)


def test_chat_messages_go_through_tokenize_chat(start: Callable[..., Harness]) -> None:
    h = start()
    msgs = [{"role": "user", "content": "hi there"}]
    h.stub.send(Generate(id="c", messages=msgs, max_tokens=2, temperature=0.0))
    _, done = h.stub.stream("c")
    assert isinstance(done, Done) and done.prompt_tokens == len(h.engine.tokenize_chat(msgs))


def test_two_generates_at_once_run_one_after_the_other(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.allow(0)  # "a" is held at its first step while "b" arrives
    h.stub.send(Generate(id="a", prompt="first request", temperature=0.0))
    h.stub.send(Generate(id="b", prompt="second request", temperature=0.0))
    pong = h.ping()
    assert pong.busy and pong.running_ids == ["a"] and pong.queue_len == 1
    h.engine.allow(None)
    ta, da = h.stub.stream("a")
    tb, db = h.stub.stream("b")
    assert isinstance(da, Done) and isinstance(db, Done) and ta and tb
    order = [m.id for _, m in h.stub.received if isinstance(m, (Token, Done))]
    assert order == ["a"] * (len(ta) + 1) + ["b"] * (len(tb) + 1)  # never interleaved
    idle = h.ping("p2")
    assert (idle.busy, idle.queue_len, idle.running_ids) == (False, 0, [])


def test_parallel_slots_interleave_and_a_cancel_leaves_the_others_unchanged(start: Callable[..., Harness]) -> None:
    prompts = {"a": "first request", "b": "second one here", "c": "third"}
    solo: dict[str, list[int]] = {}
    ref = FakeEngine()
    for rid, text in prompts.items():
        events: list[Any] = []
        ref.reset_cache()
        ref.generate(text, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True, cache_prompt=False),
                     on_token=events.append)
        solo[rid] = [e.id for e in events]
    eng = FakeEngine(parallel=3)
    eng.allow(0)  # held until all three are prepared: they then step together
    h = start(eng, parallel=3, max_queue=0)
    for rid, text in prompts.items():
        h.stub.send(Generate(id=rid, prompt=text, temperature=0.0, max_tokens=30, ignore_eos=True,
                             cache_prompt=False))
    h.wait(lambda: eng.prepared == 3 and eng.held.is_set(), "three prepared, a step held")
    pong = h.ping()
    assert sorted(pong.running_ids) == ["a", "b", "c"] and pong.queue_len == 0
    eng.allow(6)  # a few steps (each at most one chunk or token per sequence, 30 tokens each): then held
    first_c = h.stub.next(lambda m: isinstance(m, Token) and m.id == "c", 10)
    h.wait(eng.held.is_set, "the next step held")
    h.stub.send(Cancel(id="b"))
    h.ping("p-cancel")  # the Cancel was handled before this Pong: b stops at the next step
    eng.allow(None)
    streams = {rid: h.stub.stream(rid) for rid in prompts}
    streams["c"] = ([first_c, *streams["c"][0]], streams["c"][1])  # type: ignore[list-item]
    order = [m.id for _, m in h.stub.received if isinstance(m, Token)]
    last_a = max(i for i, rid in enumerate(order) if rid == "a")
    assert order.index("c") < last_a and order.index("b") < last_a  # stepped together: the streams overlap
    assert isinstance(streams["b"][1], Done) and streams["b"][1].finish_reason == "cancelled"
    assert [t.token_id for t in streams["b"][0]] == solo["b"][:len(streams["b"][0])]
    for rid in ("a", "c"):
        tokens, done = streams[rid]
        assert isinstance(done, Done) and done.finish_reason == "length"
        assert [t.token_id for t in tokens] == solo[rid]
    assert len({streams[r][1].id_slot for r in prompts}) == 3  # three slots
    assert [s["id"] for s in h.ping("p2").slots] == [0, 1, 2]


def test_queue_beyond_max_queue_answers_busy(start: Callable[..., Harness]) -> None:
    h = start(max_queue=1)
    h.engine.allow(0)  # "a" held: "b" waits, "c" is one too many
    for rid in ("a", "b", "c"):
        h.stub.send(Generate(id=rid, prompt=f"request {rid}", temperature=0.0))
    err = h.stub.next_for("c", 10)
    assert isinstance(err, Error) and err.code == "busy" and "max_queue=1" in err.message
    h.engine.allow(None)
    assert isinstance(h.stub.stream("a")[1], Done) and isinstance(h.stub.stream("b")[1], Done)


def test_duplicate_request_id_is_refused(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.allow(0)  # the first "a" is still running when the second arrives
    h.stub.send(Generate(id="a", prompt="x y", temperature=0.0))
    h.stub.send(Generate(id="a", prompt="x y", temperature=0.0))
    first = h.stub.next(lambda m: isinstance(m, Error), 10)
    assert first.id == "a" and first.code == "invalid_request" and "already in use" in first.message
    h.engine.allow(None)
    _, done = h.stub.stream("a")
    assert isinstance(done, Done)


# ----------------------------------------------------------------------------- cancel


def test_cancel_mid_decode_stops_within_a_token(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.length = 1000
    h.engine.allow(tokens=2)  # two tokens, then the next step is held (a token "in flight")
    h.stub.send(Generate(id="a", prompt="tell me everything", temperature=0.0))
    first = [h.stub.next_for("a"), h.stub.next_for("a")]
    assert all(isinstance(m, Token) for m in first)
    h.wait(h.engine.held.is_set, "the third token's step held")
    sent_at = h.stub.send(Cancel(id="a"))
    h.ping()  # the Cancel was handled before this Pong
    h.engine.allow(None)
    tokens, done = h.stub.stream("a", 10)
    latency = h.stub.received[-1][0] - sent_at
    assert isinstance(done, Done) and (done.finish_reason, done.stop_type) == ("cancelled", "cancelled")
    assert len(tokens) <= 1  # at most the token whose step was under way
    assert done.completion_tokens == len(first) + len(tokens)
    print(f"fake engine: Cancel -> Done mid-decode {latency * 1e3:.1f} ms")


def test_return_progress_reports_the_prefill_chunk_by_chunk(start: Callable[..., Harness]) -> None:
    """llama-server's prompt_progress: the prefill's start (processed == cache), then one report per
    prefill chunk (4 tokens in the fake engine), the last with processed == total, before the first
    Token; a prompt found in the prefix cache reports its cached tokens; none unless asked."""
    h = start()
    prompt = " ".join(f"word{i}" for i in range(13))  # 14 tokens: chunks end at 4, 8, 12, 14
    h.stub.send(Generate(id="p1", prompt=prompt, temperature=0.0, max_tokens=2, return_progress=True))
    tokens, done = h.stub.stream("p1")
    assert isinstance(done, Done) and len(tokens) == 2
    reports = h.stub.progress["p1"]
    assert [(r.total, r.cache, r.processed) for r in reports] == [(14, 0, 0), (14, 0, 4), (14, 0, 8), (14, 0, 12),
                                                                  (14, 0, 14)]
    assert reports[0].time_ms == 0.0 and all(a.time_ms <= b.time_ms for a, b in zip(reports, reports[1:]))
    h.stub.send(Generate(id="p2", prompt=prompt, temperature=0.0, max_tokens=2, return_progress=True))
    tokens, done = h.stub.stream("p2")
    assert isinstance(done, Done) and done.cache_n == 13
    assert [(r.total, r.cache, r.processed) for r in h.stub.progress["p2"]] == [(14, 13, 13), (14, 13, 14)]
    h.stub.send(Generate(id="p3", prompt=prompt + " more", temperature=0.0, max_tokens=2))
    tokens, done = h.stub.stream("p3")
    assert isinstance(done, Done) and "p3" not in h.stub.progress


def test_cancel_mid_prefill_stops_between_chunks(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.allow(1)  # one prefill chunk, then held
    prompt = " ".join(f"word{i}" for i in range(400))  # 401 tokens = 101 chunks of 4
    h.stub.send(Generate(id="a", prompt=prompt, temperature=0.0, max_tokens=5))
    h.wait(h.engine.held.is_set, "the second chunk held")
    sent_at = h.stub.send(Cancel(id="a"))
    h.ping()  # the Cancel was handled before this Pong
    h.engine.allow(None)
    tokens, done = h.stub.stream("a", 10)
    latency = h.stub.received[-1][0] - sent_at
    assert isinstance(done, Done) and done.finish_reason == "cancelled" and tokens == []
    assert done.completion_tokens == 0 and 0 < done.prompt_n < done.prompt_tokens == 401
    print(f"fake engine: Cancel -> Done mid-prefill {latency * 1e3:.1f} ms")


def test_cancel_of_a_queued_request_removes_it(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.allow(0)  # "a" held: "b" stays queued
    h.stub.send(Generate(id="a", prompt="running one", temperature=0.0))
    h.stub.send(Generate(id="b", prompt="queued one", temperature=0.0))
    h.stub.send(Cancel(id="b"))
    done_b = h.stub.next_for("b", 10)
    assert isinstance(done_b, Done) and done_b.finish_reason == "cancelled" and done_b.completion_tokens == 0
    h.engine.allow(None)
    _, done_a = h.stub.stream("a")
    assert isinstance(done_a, Done) and done_a.finish_reason == "stop"  # the running one is untouched
    ids = [m.id for _, m in h.stub.received if isinstance(m, (Token, Done))]
    assert ids.index("b") < len(ids) - 1  # b was answered before a finished, not after
    assert h.engine.generate_calls == 1  # b never ran


def test_cancel_of_an_unknown_or_finished_id_is_ignored(start: Callable[..., Harness]) -> None:
    h = start()
    h.stub.send(Generate(id="a", prompt="x", temperature=0.0, max_tokens=2))
    assert isinstance(h.stub.stream("a")[1], Done)
    h.stub.send(Cancel(id="a"))
    h.stub.send(Cancel(id="never-seen"))
    assert h.ping().busy is False  # both Cancels were handled (ignored) before this Pong
    assert not [m for _, m in h.stub.received if m.id == "never-seen"]
    assert len([m for _, m in h.stub.received if isinstance(m, (Done, Error)) and m.id == "a"]) == 1


def test_after_a_cancel_the_next_output_equals_a_fresh_engines(start: Callable[..., Harness]) -> None:
    fresh = start(FakeEngine())
    fresh.stub.send(Generate(id="ref", prompt="the same prompt", temperature=0.0))
    ref_tokens, _ = fresh.stub.stream("ref")

    h = start()
    h.engine.length = 1000
    h.engine.allow(tokens=1)  # one token, then held
    h.stub.send(Generate(id="x", prompt="the same prompt and more", temperature=0.0))
    h.stub.next_for("x")
    h.stub.send(Cancel(id="x"))
    h.ping()
    h.engine.allow(None)
    assert h.stub.stream("x")[1].finish_reason == "cancelled"
    h.engine.length = 8
    h.stub.send(Generate(id="y", prompt="the same prompt", temperature=0.0))
    tokens, _ = h.stub.stream("y")
    assert [t.token_id for t in tokens] == [t.token_id for t in ref_tokens]


# ----------------------------------------------------------------------------- health & side requests


def test_ping_and_text_ops_are_answered_mid_generation(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.length = 40
    h.engine.allow(tokens=1)  # one token, then held: "a" is mid-generation throughout
    h.stub.send(Generate(id="a", prompt="a long one", temperature=0.0))
    h.stub.next_for("a")  # generating now
    pong = h.ping()
    assert pong.busy and pong.running_ids == ["a"] and pong.queue_len == 0 and pong.pid == os.getpid()
    h.stub.send(Tokenize(id="t", content="hello world", add_special=True, with_pieces=True))
    h.stub.send(Detokenize(id="d", tokens=TokenIds.of([12, 13])))
    h.stub.send(ApplyTemplate(id="at", messages=[{"role": "user", "content": "hi"}]))
    tok, det, tpl = h.stub.next_for("t"), h.stub.next_for("d"), h.stub.next_for("at")
    assert isinstance(tok, TokenizeResult) and tok.tokens.tolist() == h.engine.tokenize("hello world")
    assert tok.piece_slice(0, tok.tokens.count) == [h.engine.token_bytes(t) for t in tok.tokens.tolist()]
    assert isinstance(det, DetokenizeResult) and det.content == " w12 w13"
    assert isinstance(tpl, ApplyTemplateResult) and tpl.prompt.endswith("<|im_start|>assistant\n")
    h.engine.allow(None)
    tokens, done = h.stub.stream("a")
    assert isinstance(done, Done) and done.finish_reason == "stop"  # all answered before the generation ended
    assert h.stub.received.index(next(x for x in h.stub.received if x[1].id == "at")) < len(h.stub.received) - 1


@pytest.mark.parametrize("msg, code", [
    (Generate(id="r", prompt=[1, 5, 1000], temperature=0.0), "invalid_token"),
    (Generate(id="r", prompt=[1, -3], temperature=0.0), "invalid_token"),
    (Generate(id="r", prompt=[5] * 600, max_tokens=4), "context_length_exceeded"),
    (Generate(id="r", prompt="a b", temperature=-1.0), "invalid_params"),
    (Generate(id="r", prompt="a b", top_p=-0.5), "invalid_params"),
    (Generate(id="r", prompt="a b", n_probs=99), "invalid_params"),
    (Generate(id="r", prompt="a b", logit_bias=[[5]]), "invalid_params"),
    (Generate(id="r", prompt="a b", logit_bias=[[5, "big"]]), "invalid_params"),
    (Generate(id="r", prompt="a b", logit_bias=[[5000, 1.0]]), "invalid_params"),
    (Generate(id="r", prompt=[], temperature=0.0), "empty_prompt"),
    (Generate(id="r", prompt="", add_special=False), "empty_prompt"),
    (Generate(id="r"), "invalid_request"),
    (Generate(id="r", prompt="x", messages=[{"role": "user", "content": "x"}]), "invalid_request"),
    (Generate(id="r", messages=[{"role": 5}]), "invalid_params"),
    (Detokenize(id="r", tokens=TokenIds.of([1, 99999])), "invalid_token"),
    (Ping(id="r"), None),
])
def test_bad_requests_get_precise_errors_and_the_worker_keeps_serving(
        start: Callable[..., Harness], msg: Any, code: str | None) -> None:
    h = start()
    h.stub.send(msg)
    ans = h.stub.next_for("r", 10)
    if code is None:
        assert isinstance(ans, Pong)
    else:
        assert isinstance(ans, Error) and ans.code == code, ans
    h.stub.send(Generate(id="ok", prompt="still fine", temperature=0.0, max_tokens=2))
    assert isinstance(h.stub.stream("ok")[1], Done)


def test_bad_sampling_values_are_refused_at_once_not_after_the_queue(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.length = 1000
    h.engine.allow(tokens=1)  # "long" holds after its first token
    h.stub.send(Generate(id="long", prompt="runs a while", temperature=0.0))
    h.stub.next_for("long")
    for rid, msg in {"b1": Generate(id="b1", prompt="x", top_p=2.0), "b2": Generate(id="b2", prompt=[1, 4000]),
                     "b3": Generate(id="b3", prompt=[])}.items():
        h.stub.send(msg)
        assert isinstance(h.stub.next_for(rid, 10), Error)
    assert h.ping().running_ids == ["long"]  # answered while "long" still runs
    h.stub.send(Cancel(id="long"))
    h.ping("p2")
    h.engine.allow(None)
    assert h.stub.stream("long")[1].finish_reason == "cancelled"


def test_no_chat_template(start: Callable[..., Harness]) -> None:
    h = start(FakeEngine(has_template=False))
    h.stub.send(Generate(id="r", messages=[{"role": "user", "content": "x"}]))
    h.stub.send(ApplyTemplate(id="t", messages=[{"role": "user", "content": "x"}]))
    assert h.stub.next_for("r").code == "no_chat_template"
    assert h.stub.next_for("t").code == "no_chat_template"


def test_engine_bug_is_internal_error_and_the_next_request_is_clean(start: Callable[..., Harness]) -> None:
    ref = FakeEngine()
    res = ref.generate("after the crash", SamplingParams(temperature=0.0))
    h = start()
    h.stub.send(Generate(id="boom", prompt="please boom now", temperature=0.0))
    tokens, err = h.stub.stream("boom")
    assert isinstance(err, Error) and err.code == "internal_error" and "exploded" in err.message
    h.stub.send(Generate(id="next", prompt="after the crash", temperature=0.0))
    tokens, done = h.stub.stream("next")
    assert isinstance(done, Done) and [t.token_id for t in tokens] + [EOS] == res.tokens


# ----------------------------------------------------------------------------- garbage


def test_200_garbage_frames_each_get_a_protocol_error_then_a_request_works(start: Callable[..., Harness]) -> None:
    h = start()
    rng = random.Random(1234)
    for i in range(200):
        h.stub.send_raw(*garbage_frame(rng, i))
    h.stub.send_raw(b"\x00" * (MAX_FRAME_BYTES + 1))
    errors = [h.stub.next(lambda m: isinstance(m, Error), 10) for _ in range(201)]
    assert all(e.code == "protocol_error" for e in errors)
    assert {e.id for e in errors} >= {"g2", "t3", "v6", "unknown"}  # id kept when readable
    h.stub.send(Generate(id="ok", prompt="still alive", temperature=0.0))
    tokens, done = h.stub.stream("ok")
    assert isinstance(done, Done) and len(tokens) == h.engine.length


# ----------------------------------------------------------------------------- exit


def test_shutdown_cancels_running_and_queued_then_exits_0(start: Callable[..., Harness]) -> None:
    h = start()
    h.engine.length = 1000
    h.engine.allow(tokens=1)  # "a" holds after its first token; "b" waits
    h.stub.send(Generate(id="a", prompt="runs", temperature=0.0))
    h.stub.send(Generate(id="b", prompt="waits", temperature=0.0))
    h.stub.next_for("a")
    h.stub.send(Shutdown(id="s"))
    db_early = h.stub.next_for("b", 10)  # the queued one is answered as Shutdown is handled
    h.engine.allow(None)
    _, da = h.stub.stream("a", 10)
    db = db_early
    assert isinstance(da, Done) and da.finish_reason == "cancelled"
    assert isinstance(db, Done) and db.finish_reason == "cancelled" and db.completion_tokens == 0
    assert h.wait_exit(5) == 0


def test_exits_when_the_parent_process_is_gone(start: Callable[..., Harness]) -> None:
    parent = subprocess.Popen(["sleep", "60"])
    try:
        h = start(parent_pid=parent.pid, endpoint="tcp://127.0.0.1:*")
        h.engine.length = 1000
        h.engine.allow(tokens=1)  # mid-generation (held) when the parent dies
        h.stub.send(Generate(id="a", prompt="runs", temperature=0.0))
        h.stub.next_for("a")
        parent.kill()
        t0 = time.monotonic()
        parent.wait()
        h.thread.join(30)
        took = time.monotonic() - t0
    finally:
        parent.kill()
        h.engine.allow(None)
    assert not h.thread.is_alive() and h.result["code"] == 0
    report("fake engine: parent killed -> worker loop returned", took, 2.0)


def test_parent_already_gone_at_start_exits_at_once(start: Callable[..., Harness]) -> None:
    parent = subprocess.Popen(["true"])
    parent.wait()
    h = start(parent_pid=parent.pid, handshake=False)
    assert h.wait_exit(5) == 0

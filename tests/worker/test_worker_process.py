"""A real ``python -m worker`` process on the real SmolLM2 GGUF, driven over a real ZeroMQ socket.

The test plays the router (a bound ROUTER socket, ``RouterStub``). Workers:

* ``wa`` (module scope, tcp://): most tests;
* ``wb`` (module scope, ipc://): a fresh worker for the "same output as a fresh
  worker" check, then the Shutdown test;
* one spawned by a helper *router process* that the test SIGKILLs;
* cheap ones that never finish loading (bad path, SIGTERM while loading).

Measured latencies are printed (run with ``-s``), never asserted (``tests/timing.py``):
the 2 s exit bound after the router's death is checked by design (the worker's parent
check interval and socket poll) and the measured figure is reported against it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from protocol import (
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
from protocol.limits import DEFAULT_WEIGHTS
from tests.paths import SMOLLM2_FIXTURES, SMOLLM2_PATH
from tests.timing import report
from tests.worker.router_stub import REPO, RouterStub, garbage_frame, spawn_worker, worker_command
from worker.server import WorkerConfig

pytestmark = pytest.mark.slow

GGUF = SMOLLM2_PATH
FIXTURES = SMOLLM2_FIXTURES
N_CTX = 2048
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
LONG_TEXT = (
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the steps as his "
    "father had taught him, and wound the great clockwork that turned the lens. "
)


def _long_prompt(n_words: int) -> str:
    words = LONG_TEXT.split()
    return " ".join(f"{words[i % len(words)]}{'' if i % 7 else str(i)}" for i in range(n_words))



class Proc:
    def __init__(self, stub: RouterStub, proc: subprocess.Popen[bytes], ready: Ready) -> None:
        self.stub, self.proc, self.ready = stub, proc, ready

    def stop(self) -> None:
        if self.proc.poll() is None:
            try:
                self.stub.send(Shutdown(id="bye"))
                self.proc.wait(10)
            except Exception:
                self.proc.kill()
                self.proc.wait(10)
        self.stub.close()


def _start(endpoint: str, *extra: str) -> Proc:
    if not GGUF.is_file():
        pytest.fail(f"missing {GGUF} (run scripts/fetch_models.py)")
    stub = RouterStub(endpoint)
    proc = spawn_worker(str(GGUF), stub.endpoint, "--n-ctx", str(N_CTX), *extra)
    try:
        ready = stub.handshake(180)
    except RuntimeError as e:
        proc.kill()
        proc.wait()
        stub.close()
        raise
    return Proc(stub, proc, ready)


@pytest.fixture(scope="module")
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="mywp", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def wa() -> Iterator[Proc]:
    w = _start("tcp://127.0.0.1:*")
    yield w
    w.stop()


@pytest.fixture(scope="module")
def wb(sockdir: str) -> Iterator[Proc]:
    w = _start(f"ipc://{sockdir}/wb.sock")
    yield w
    w.stop()


def _text(tokens: list[Token], done: Done) -> str:
    return "".join(t.text for t in tokens) + done.text


def _wait_prefilling(stub: RouterStub, req_id: str, timeout_s: float = 120) -> None:
    """Until a Pong shows ``req_id``'s slot holding KV (a prefill chunk evaluated)."""
    deadline = time.monotonic() + timeout_s
    k = 0
    while time.monotonic() < deadline:
        k += 1
        pong = _ping(stub, f"wp-{req_id}-{k}")
        if any(sl["id_task"] == req_id and sl["n_past"] > 0 for sl in pong.slots):
            return
    raise AssertionError(f"{req_id} never seen prefilling")


def _ping(stub: RouterStub, ident: str) -> Pong:
    stub.send(Ping(id=ident))
    m = stub.next_for(ident, 30)
    assert isinstance(m, Pong)
    return m


# ----------------------------------------------------------------------------- start-up, generation


def test_load_progress_frames_before_ready(wa: Proc) -> None:
    frames = [m for _, m in wa.stub.received]
    before = frames[:next(i for i, m in enumerate(frames) if isinstance(m, Ready))]
    steps = [(m.stage, m.done, m.total) for m in before if isinstance(m, LoadProgress)]
    assert steps[:4] == [("reading_gguf", 0, 1), ("reading_gguf", 1, 1), ("building_tokenizer", 0, 1),
                         ("building_tokenizer", 1, 1)]
    rest = steps[4:]
    if DEFAULT_WEIGHTS == "quantized":  # this worker runs the default mode: it waits for its kernels last
        assert rest[-2:] == [("loading_kernels", 0, 1), ("loading_kernels", 1, 1)]
        rest = rest[:-2]
    prep = rest  # none when the prepared weights came from the weight cache
    if prep:
        n = prep[0][2]
        assert prep[0] == ("preparing_tensors", 1, n) and prep[-1] == ("preparing_tensors", n, n)
        assert [d for _, d, _ in prep] == sorted(set(d for _, d, _ in prep))
    assert isinstance(before[0], Hello)


def test_ready_describes_the_model(wa: Proc) -> None:
    r = wa.ready
    assert (r.model, r.architecture, r.n_ctx, r.n_vocab, r.max_jobs) == ("smollm2", "llama", N_CTX, 49152, 1)
    assert r.pid == wa.proc.pid and r.file_size == GGUF.stat().st_size and r.has_chat_template
    assert r.gguf_path == str(GGUF) and r.n_ctx_train >= N_CTX
    fp = r.fingerprint
    if not fp:  # the file's hash was still running at Ready (never seen before): a second Ready brings it
        again = wa.stub.next(lambda m: isinstance(m, Ready), 120)
        assert again == dataclasses.replace(r, fingerprint=again.fingerprint)
        fp = again.fingerprint
    assert fp == hashlib.sha256(GGUF.read_bytes()).hexdigest()
    print(f"SmolLM2 load: {r.load_ms:.0f} ms (fingerprint {'in the first Ready' if r.fingerprint else 'after'})")


def test_chat_generate_streams_tokens_then_done(wa: Proc) -> None:
    ref = next(g for g in json.loads(FIXTURES.read_text())["greedy"] if g.get("messages") == FRANCE)
    wa.stub.send(Generate(id="fr", messages=FRANCE, max_tokens=6, temperature=0.0, n_probs=5))
    tokens, done = wa.stub.stream("fr", 120)
    assert isinstance(done, Done), done
    assert done.prompt_tokens == len(ref["prompt_ids"])  # the chat template + tokenizer, as llama.cpp
    assert (done.finish_reason, done.stop_type) == ("length", "limit")
    assert len(tokens) == done.completion_tokens == 6
    # the first step's distribution is llama.cpp's, within the fixtures' tolerance
    first = ref["steps"][0]
    lp = dict((t, v) for t, v, _piece in tokens[0].top_logprobs)
    assert abs(lp.get(first["id"], tokens[0].logprob if tokens[0].token_id == first["id"] else -99)
               - first["logprob"]) < 0.6
    assert all(len(t.top_logprobs) == 5 and t.logprob is not None for t in tokens)
    wa.stub.send(Detokenize(id="det", tokens=TokenIds.of(t.token_id for t in tokens)))
    det = wa.stub.next_for("det")
    assert isinstance(det, DetokenizeResult) and _text(tokens, done) == det.content


def test_quantized_worker_preloads_its_kernels_and_serves(sockdir: str) -> None:
    """``--weights quantized``: the worker starts numba's import and kernels before it connects
    (engine.preload_kernels), the load takes them over, and it serves llama.cpp's greedy answer."""
    ref = next(g for g in json.loads(FIXTURES.read_text())["greedy"] if g.get("messages") == FRANCE)
    w = _start(f"ipc://{sockdir}/wq.sock", "--weights", "quantized")
    try:
        w.stub.send(Generate(id="q", messages=FRANCE, max_tokens=4, temperature=0.0))
        tokens, done = w.stub.stream("q", 300)
        assert isinstance(done, Done), done
        assert [t.token_id for t in tokens] == ref["ids"][:4]
    finally:
        w.stop()


def test_stop_string_never_reaches_the_wire(wa: Proc) -> None:
    wa.stub.send(Generate(id="stop", prompt="The three primary colors are", max_tokens=8, temperature=0.0,
                          stop=["colors"], add_special=False))
    tokens, done = wa.stub.stream("stop", 120)
    assert isinstance(done, Done) and (done.finish_reason, done.stop_type, done.stopping_word) == ("stop", "word", "colors")
    text = _text(tokens, done)
    assert "colors" not in text and text.startswith(" the primary")  # llama.cpp's greedy start (fixtures)
    assert b"".join(t.piece for t in tokens).decode().startswith(text)  # the stop token's piece was sent, not its text


def test_two_generates_at_once_come_back_one_after_the_other(wa: Proc) -> None:
    s = wa.stub
    n0 = len(s.received)
    s.send(Generate(id="one", prompt="Once upon a time", max_tokens=5, temperature=0.0))
    s.send(Generate(id="two", prompt="The weather today is", max_tokens=5, temperature=0.0))
    t1, d1 = s.stream("one", 120)
    t2, d2 = s.stream("two", 120)
    assert isinstance(d1, Done) and isinstance(d2, Done) and len(t1) == len(t2) == 5
    order = [m.id for _, m in s.received[n0:] if isinstance(m, (Token, Done)) and m.id in ("one", "two")]
    assert order == ["one"] * 6 + ["two"] * 6


def test_ping_and_tokenize_are_answered_mid_generation(wa: Proc) -> None:
    s = wa.stub
    s.send(Generate(id="long", prompt="List every country in the world:", max_tokens=40, temperature=0.0,
                    ignore_eos=True))
    s.next(lambda m: isinstance(m, Token) and m.id == "long", 120)
    pong = _ping(s, "pg")
    assert pong.busy and pong.running_ids == ["long"] and pong.pid == wa.proc.pid
    s.send(Tokenize(id="tk", content="Hello world", with_pieces=True))
    tk = s.next_for("tk", 30)
    assert isinstance(tk, TokenizeResult) and tk.tokens.tolist() == [19556, 905]
    assert tk.piece_slice(0, 2) == [b"Hello", b" world"]
    tokens, done = s.stream("long", 120)
    assert isinstance(done, Done) and tokens, "Pong and TokenizeResult came before the generation ended"
    after = _ping(s, "pg2")
    assert not after.busy
    # llama.cpp's decode-call figures: a forward pass per generated token at least, one busy slot at each
    assert after.n_decode_total - pong.n_decode_total >= done.completion_tokens - 1
    assert after.n_busy_slots_total - pong.n_busy_slots_total >= after.n_decode_total - pong.n_decode_total


# ----------------------------------------------------------------------------- cancel


def test_cancel_mid_decode(wa: Proc) -> None:
    s = wa.stub
    s.send(Generate(id="cd", prompt="Write a very long essay about the sea.", max_tokens=500, temperature=0.0,
                    ignore_eos=True))
    before = [s.next_for("cd", 120) for _ in range(3)]
    assert all(isinstance(m, Token) for m in before)
    sent = s.send(Cancel(id="cd"))
    after, done = s.stream("cd", 60)
    latency_ms = (s.received[-1][0] - sent) * 1e3
    assert isinstance(done, Done) and (done.finish_reason, done.stop_type) == ("cancelled", "cancelled")
    assert len(after) <= 2 and done.completion_tokens == 3 + len(after)
    print(f"Cancel -> Done mid-decode: {latency_ms:.1f} ms ({len(after)} token(s) after the Cancel)")


def test_cancel_mid_prefill(wa: Proc) -> None:
    s = wa.stub
    s.send(Generate(id="cp", prompt=_long_prompt(1000), max_tokens=16, temperature=0.0))
    _wait_prefilling(s, "cp")  # observed: its slot holds a first prefill chunk
    sent = s.send(Cancel(id="cp"))
    tokens, done = s.stream("cp", 120)
    latency_ms = (s.received[-1][0] - sent) * 1e3
    assert isinstance(done, Done) and done.finish_reason == "cancelled" and tokens == []
    assert done.completion_tokens == 0 and done.prompt_n < done.prompt_tokens
    print(f"Cancel -> Done mid-prefill: {latency_ms:.1f} ms (prefilled {done.prompt_n}/{done.prompt_tokens} "
          f"tokens in {done.prompt_ms:.0f} ms)")


def test_greedy_after_cancelled_requests_equals_a_fresh_worker(wa: Proc, wb: Proc) -> None:
    req = dict(prompt="The old lighthouse keeper", max_tokens=12, temperature=0.0)
    wb.stub.send(Generate(id="fresh", **req))  # wb's first request: a freshly loaded worker
    fresh, fd = wb.stub.stream("fresh", 120)
    assert isinstance(fd, Done) and fd.cache_n == 0
    # on wa: cancel mid-decode a request sharing the prompt, and mid-prefill a long one extending it
    s = wa.stub
    s.send(Generate(id="x1", prompt=req["prompt"], max_tokens=200, temperature=0.7, seed=3, ignore_eos=True))
    s.next_for("x1", 120)
    s.send(Cancel(id="x1"))
    assert s.stream("x1", 60)[1].finish_reason == "cancelled"
    s.send(Generate(id="x2", prompt=req["prompt"] + " " + _long_prompt(1000), max_tokens=4, temperature=0.0))
    _wait_prefilling(s, "x2")
    s.send(Cancel(id="x2"))
    assert s.stream("x2", 120)[1].finish_reason == "cancelled"
    s.send(Generate(id="again", **req))
    again, ad = s.stream("again", 120)
    assert isinstance(ad, Done)
    assert [t.token_id for t in again] == [t.token_id for t in fresh]
    assert _text(again, ad) == _text(fresh, fd)


# ----------------------------------------------------------------------------- bad input


def test_bad_requests_get_precise_errors_and_the_worker_keeps_serving(wa: Proc) -> None:
    s = wa.stub
    cases = {
        "e1": (Generate(id="e1", prompt=[1, 2, 49152], max_tokens=2), "invalid_token"),
        "e2": (Generate(id="e2", prompt=[1] * N_CTX, max_tokens=2), "context_length_exceeded"),
        "e3": (Generate(id="e3", prompt="hello", top_p=1.5), "invalid_params"),
        "e4": (Generate(id="e4", prompt="hello", temperature=float("nan")), "invalid_params"),
        "e5": (Generate(id="e5", prompt=""), "empty_prompt"),
        "e6": (Generate(id="e6", messages=[{"role": "user", "content": 7}]), "invalid_params"),
        "e7": (Generate(id="e7"), "invalid_request"),
    }
    for msg, _ in cases.values():
        s.send(msg)
    for rid, (_, code) in cases.items():
        ans = s.next_for(rid, 60)
        assert isinstance(ans, Error) and ans.code == code, (rid, ans)
    s.send(Generate(id="ok", prompt="Hello", max_tokens=3, temperature=0.0))
    tokens, done = s.stream("ok", 120)
    assert isinstance(done, Done) and len(tokens) == 3


def test_200_garbage_frames_then_a_valid_request(wa: Proc) -> None:
    s = wa.stub
    rng = random.Random(99)
    for i in range(200):
        s.send_raw(*garbage_frame(rng, i))
    errors = [s.next(lambda m: isinstance(m, Error), 30) for _ in range(200)]
    assert all(e.code == "protocol_error" for e in errors)
    s.send(Generate(id="after-garbage", prompt="Hello", max_tokens=3, temperature=0.0))
    tokens, done = s.stream("after-garbage", 120)
    assert isinstance(done, Done) and len(tokens) == 3
    assert wa.proc.poll() is None


# ----------------------------------------------------------------------------- exit


def test_shutdown_cancels_running_and_queued_work_then_exits_0(wb: Proc) -> None:
    s = wb.stub
    s.send(Generate(id="run", prompt="Tell me a long story.", max_tokens=500, temperature=0.0, ignore_eos=True))
    s.send(Generate(id="wait", prompt="Another one.", max_tokens=5, temperature=0.0))
    s.next_for("run", 120)
    sent = s.send(Shutdown(id="sd"))
    _, d_run = s.stream("run", 30)
    d_wait = s.next_for("wait", 30)
    assert isinstance(d_run, Done) and d_run.finish_reason == "cancelled"
    assert isinstance(d_wait, Done) and d_wait.finish_reason == "cancelled" and d_wait.completion_tokens == 0
    assert wb.proc.wait(30) == 0
    print(f"Shutdown -> exit: {(time.monotonic() - sent) * 1e3:.0f} ms")


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_worker_exits_within_2s_when_its_router_process_is_killed(sockdir: str) -> None:
    if not GGUF.is_file():
        pytest.fail(f"missing {GGUF}")
    router = subprocess.Popen(
        [sys.executable, "-m", "tests.worker.router_stub", "--gguf", str(GGUF), "--endpoint",
         f"ipc://{sockdir}/killed.sock"], cwd=REPO, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    worker_pid: int | None = None
    try:
        line = router.stdout.readline() if router.stdout else b""  # after Ready and the first Token
        if not line:
            pytest.fail(f"router stub ended without reporting (exit {router.wait(30)})")
        stub_report = json.loads(line)
        if "error" in stub_report:
            pytest.fail(stub_report["error"])
        worker_pid = stub_report["worker_pid"]
        assert not _gone(worker_pid)
        router.kill()
        t0 = time.monotonic()
        router.wait()
        while not _gone(worker_pid) and time.monotonic() - t0 < 30:
            time.sleep(0.02)
        took = time.monotonic() - t0
    finally:
        router.kill()
        router.wait()
        if worker_pid is not None and not _gone(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)  # never leave an orphan behind a failed test
    assert _gone(worker_pid), "worker still alive 30 s after its router died"
    cfg = WorkerConfig(model="m", gguf="g", endpoint="ipc://x")  # the defaults python -m worker runs with
    assert cfg.parent_check_s + cfg.poll_ms / 1e3 + cfg.parent_gone_grace_s <= 0.5  # detection well inside 2 s
    report("router SIGKILLed mid-generation -> worker gone", took, 2.0)


def test_load_failure_over_the_real_cli(sockdir: str) -> None:
    stub = RouterStub(f"ipc://{sockdir}/lf.sock")
    try:
        proc = spawn_worker("/nonexistent/model.gguf", stub.endpoint)
        hello = stub.next(timeout_s=60)
        assert isinstance(hello, Hello) and hello.pid == proc.pid and hello.model == "smollm2"
        err = stub.next(timeout_s=60)
        assert isinstance(err, Error) and err.code == "load_failed" and "file_not_found" in err.message
        assert proc.wait(30) == 1
    finally:
        stub.close()


def test_threads_flag_sets_the_blas_thread_count_before_numpy_loads(sockdir: str) -> None:
    stub = RouterStub(f"ipc://{sockdir}/th.sock")
    try:
        proc = subprocess.Popen(
            worker_command("/nonexistent/model.gguf", stub.endpoint, "--threads", "1"), cwd=REPO,
            env={**os.environ, "PYTHONPATH": str(REPO)}, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE)
        assert isinstance(stub.next(timeout_s=60), Hello)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1  # the load fails (no file); the threads were set before it
        assert ("BLAS/OpenMP threads: 1 (OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1, MKL_NUM_THREADS=1, "
                "NUMBA_NUM_THREADS=1)") in err.decode()
    finally:
        stub.close()


def test_sigterm_while_loading_exits_0_promptly(sockdir: str) -> None:
    if not GGUF.is_file():
        pytest.fail(f"missing {GGUF}")
    stub = RouterStub(f"ipc://{sockdir}/st.sock")
    try:
        proc = spawn_worker(str(GGUF), stub.endpoint)
        assert isinstance(stub.next(timeout_s=60), Hello)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        stub.close()


def test_bad_command_line_exits_2() -> None:
    r = subprocess.run([sys.executable, "-m", "worker", "--model", "m", "--gguf", "x", "--endpoint", "http://x"],
                       cwd=REPO, capture_output=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and b"--endpoint" in r.stderr


# ----------------------------------------------------------------------------- parallel slots


def test_parallel_worker_streams_together_and_matches_alone(wa: Proc, sockdir: str) -> None:
    """--parallel 3: three requests run at once (Pong lists them in three slots), their greedy
    tokens equal the same requests run one at a time, and a cancelled one leaves the others alone."""
    prompts = {"p1": "Once upon a time", "p2": "The weather today is", "p3": _long_prompt(300)}
    alone = {}
    for rid, text in prompts.items():
        wa.stub.send(Generate(id=f"solo-{rid}", prompt=text, max_tokens=12, temperature=0.0, ignore_eos=True,
                              cache_prompt=False))
        toks, done = wa.stub.stream(f"solo-{rid}", 120)
        assert isinstance(done, Done)
        alone[rid] = [t.token_id for t in toks]
    wp = _start(f"ipc://{sockdir}/wp.sock", "--parallel", "3")
    try:
        assert wp.ready.max_jobs == 3 and wp.ready.kv_budget_tokens > 0
        s = wp.stub
        for rid, text in prompts.items():
            s.send(Generate(id=rid, prompt=text, max_tokens=12, temperature=0.0, ignore_eos=True, cache_prompt=False))
        s.send(Generate(id="victim", prompt="A long story:", max_tokens=500, temperature=0.0, ignore_eos=True))
        pong = _ping(s, "pp")
        deadline = time.monotonic() + 120
        while len(pong.running_ids) < 3 and time.monotonic() < deadline:
            pong = _ping(s, f"pp{time.monotonic()}")
        assert len(pong.running_ids) == 3 and len(pong.slots) == 3 and pong.queue_len <= 1
        got = {rid: s.stream(rid, 120) for rid in prompts}
        s.next_for("victim", 120)
        s.send(Cancel(id="victim"))
        vt, vd = s.stream("victim", 60)
        assert isinstance(vd, Done) and vd.finish_reason == "cancelled" and len(vt) < 499
        for rid, (toks, done) in got.items():
            assert isinstance(done, Done) and done.finish_reason == "length" and 0 <= done.id_slot < 3
            assert [t.token_id for t in toks] == alone[rid], rid
    finally:
        wp.stop()


def test_n_choices_share_one_prefilled_prompt(wa: Proc, sockdir: str) -> None:
    """Generate.n = 3: three sequences from one prefill (the other two copy its KV and evaluate only
    the last prompt token), tokens tagged with their choice index, one Done carrying every choice;
    seeded choice i samples as a lone request with seed + i."""
    prompt = _long_prompt(120)
    solo = []
    for i in range(3):
        wa.stub.send(Generate(id=f"nsolo{i}", prompt=prompt, max_tokens=10, temperature=0.9, seed=7 + i,
                              ignore_eos=True, cache_prompt=False))
        toks, done = wa.stub.stream(f"nsolo{i}", 120)
        assert isinstance(done, Done)
        solo.append([t.token_id for t in toks])
    wp = _start(f"ipc://{sockdir}/wn.sock", "--parallel", "4", "--kv-budget-mib", "64")
    try:
        assert 3 * 200 <= wp.ready.kv_budget_tokens < 5 * N_CTX, wp.ready.kv_budget_tokens
        s = wp.stub
        s.send(Generate(id="n3", prompt=prompt, max_tokens=10, temperature=0.9, seed=7, ignore_eos=True, n=3))
        toks, done = s.stream("n3", 120)
        assert isinstance(done, Done) and done.finish_reason == "length"
        by_choice = {i: [t.token_id for t in toks if t.index == i] for i in range(3)}
        assert by_choice == {i: solo[i] for i in range(3)}
        assert [c["index"] for c in done.choices] == [0, 1, 2]
        assert all(c["finish_reason"] == "length" and c["completion_tokens"] == 10 for c in done.choices)
        assert done.completion_tokens == 30
        assert done.prompt_n <= done.prompt_tokens + 2  # prefilled once; each fork evaluated its last token
        s.send(Generate(id="nbad", prompt=prompt, max_tokens=2, n=17))
        err = s.next_for("nbad", 30)
        assert isinstance(err, Error) and err.code == "invalid_params" and "n must be" in err.message
        # n choices x (prompt + answer) beyond the KV budget: refused before any token (issue 23)
        s.send(Generate(id="nbig", prompt=prompt, n=5))
        err = s.next_for("nbig", 30)
        assert isinstance(err, Error) and err.code == "kv_budget_exceeded" and "n=5 choices" in err.message
    finally:
        wp.stop()

"""``python -m worker --spare`` over a real socket: a warm spare says Hello without a model,
answers Ping and refuses model work while it waits, then takes its model with Assign and
serves llama.cpp's greedy answer as a worker started for that model does; a spare whose parent
is gone, or that gets Shutdown while waiting, exits 0."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator

import pytest

from protocol import Assign, Done, Error, Generate, Hello, Ping, Pong, Ready, Shutdown, Tokenize
from protocol.credentials import WorkerCredentials, write_credentials
from tests.paths import SMOLLM2_FIXTURES, SMOLLM2_PATH
from tests.worker.router_stub import REPO, RouterStub

FRANCE = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture
def sockdir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="mysp", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def spawn_spare(endpoint: str, creds: WorkerCredentials, *extra: str) -> subprocess.Popen[bytes]:
    fd = write_credentials(creds)
    try:
        return subprocess.Popen([sys.executable, "-m", "worker", "--spare", "--endpoint", endpoint, "--auth-fd",
                                 str(fd), *extra], cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                                stdin=subprocess.DEVNULL, pass_fds=(fd,))
    finally:
        os.close(fd)


def test_a_spare_waits_without_a_model_then_serves_the_assigned_one(sockdir: str) -> None:
    if not SMOLLM2_PATH.is_file():
        pytest.fail(f"missing {SMOLLM2_PATH} (run scripts/fetch_models.py)")
    ref = next(g for g in json.loads(SMOLLM2_FIXTURES.read_text())["greedy"] if g.get("messages") == FRANCE)
    stub = RouterStub(f"ipc://{sockdir}/s.sock")
    creds = WorkerCredentials.new()
    proc = spawn_spare(stub.endpoint, creds)
    try:
        hello = stub.next(lambda m: isinstance(m, Hello), 180)
        assert isinstance(hello, Hello) and hello.model == "" and hello.pid == proc.pid and hello.auth == creds.secret
        stub.send(Ping(id="p1"))
        pong = stub.next_for("p1")
        assert isinstance(pong, Pong) and not pong.busy and pong.pid == proc.pid
        stub.send(Generate(id="early", messages=FRANCE, max_tokens=2, temperature=0.0))
        stub.send(Tokenize(id="tok", content="hi"))
        for rid in ("early", "tok"):
            err = stub.next_for(rid)
            assert isinstance(err, Error) and err.code == "busy" and "no model yet" in err.message
        stub.send(Assign(id="a1", model="smollm2", gguf=str(SMOLLM2_PATH), n_ctx=2048, parallel=1,
                         weights="quantized", threads=1))
        ready = stub.next(lambda m: isinstance(m, (Ready, Error)), 180)
        assert isinstance(ready, Ready), ready
        assert (ready.model, ready.architecture, ready.n_ctx, ready.pid) == ("smollm2", "llama", 2048, proc.pid)
        stub.send(Generate(id="q", messages=FRANCE, max_tokens=4, temperature=0.0))
        tokens, done = stub.stream("q", 300)
        assert isinstance(done, Done), done
        assert [t.token_id for t in tokens] == ref["ids"][:4]
        stub.send(Assign(id="a2", model="other", gguf=str(SMOLLM2_PATH)))  # once only
        again = stub.next_for("a2")
        assert isinstance(again, Error) and again.code == "protocol_error"
        stub.send(Shutdown(id="bye"))
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stub.close()


def test_a_waiting_spare_exits_0_on_shutdown(sockdir: str) -> None:
    stub = RouterStub(f"ipc://{sockdir}/s.sock")
    proc = spawn_spare(stub.endpoint, WorkerCredentials.new())
    try:
        stub.next(lambda m: isinstance(m, Hello), 180)
        stub.send(Shutdown(id="bye"))
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stub.close()


def test_spare_and_model_options_are_exclusive() -> None:
    r = subprocess.run([sys.executable, "-m", "worker", "--spare", "--model", "m", "--gguf", "/x", "--endpoint",
                        "ipc:///tmp/x.sock"], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--spare takes no --model" in r.stderr
    r = subprocess.run([sys.executable, "-m", "worker", "--endpoint", "ipc:///tmp/x.sock"], cwd=REPO,
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 2 and "--model and --gguf are required" in r.stderr

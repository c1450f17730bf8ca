"""Worker authentication (fake workers): only the spawned worker may take its socket.

An impostor — another local process that reads the endpoint from the worker's
command line and sends a Hello carrying the worker's pid, before the real worker
connects — is refused (logged, counted in /admin's ``refused_peers``), never
receives a frame, and the user gets the real worker's answer; for ipc and for tcp
(where the socket also speaks CURVE, so a peer without the server key cannot
even finish the ZeroMQ handshake).
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
import zmq

from protocol import Hello, Ready, WorkerCredentials, encode, read_credentials, write_credentials
from protocol.credentials import secret_matches
from router.workers.launchers.local import worker_command
from tests.router.conftest import LiveRouter, dummy_gguf

pytestmark = pytest.mark.reliability  # issue 11's probes (README: -m reliability)

CONFIG = """
[server]
models_dir = "."
transport = "{transport}"
[models.m]
path = "m.gguf"
ping_interval_s = 0
"""

#: Impostor attempts per transport (each a fresh socket, i.e. a fresh peer).
ATTEMPTS = 20


@pytest.fixture(params=["ipc", "tcp"])
def router(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LiveRouter]:
    dummy_gguf(tmp_path, "m.gguf")
    r = LiveRouter(tmp_path, CONFIG.format(transport=request.param))
    yield r
    r.stop()


def _worker(r: LiveRouter) -> psutil.Process | None:
    for p in r.workers():
        try:
            if "tests.fakes.fake_worker" in p.cmdline():
                return p
        except psutil.Error:
            pass
    return None


def _impostor_frames(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, pid: int, i: int) -> zmq.Socket[bytes]:
    """One impostor peer: connects and sends a Hello with ``pid`` and a guessed secret, then a
    Ready, as a worker would. Over tcp every other attempt speaks CURVE with a guessed server key."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    if endpoint.startswith("tcp://") and i % 2:
        server_guess, _ = zmq.curve_keypair()
        public, secret = zmq.curve_keypair()
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = server_guess, public, secret
    sock.connect(endpoint)
    guess = "" if i % 3 == 0 else os.urandom(32).hex()
    sock.send(encode(Hello(id="hello", model="m", pid=pid, auth=guess)))
    sock.send(encode(Ready(id="ready", model="m", architecture="fake", gguf_path="x", file_size=1,
                           fingerprint="0" * 64, n_ctx=256, n_ctx_train=256, n_vocab=50_000,
                           has_chat_template=True, pid=pid, load_ms=1.0)))
    return sock


def test_an_impostor_is_refused_and_the_user_gets_the_real_worker(router: LiveRouter) -> None:
    r = router
    r.set_fake({"m": {"hold_hello": True}})
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    socks: list[zmq.Socket[bytes]] = []
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        with r.hold():  # the real worker is spawned but waits before it connects
            fut = pool.submit(lambda: httpx.post(f"{r.url}/v1/completions", timeout=60, json={
                "model": "m", "prompt": "hello", "max_tokens": 3, "temperature": 0}))
            worker = r.wait_for(lambda: _worker(r), what="the worker process")
            argv = worker.cmdline()
            endpoint = argv[argv.index("--endpoint") + 1]  # what an attacker reads in /proc/<pid>/cmdline
            assert "--auth-fd" in argv and not any(re.fullmatch(r"[0-9a-f]{64}", a) for a in argv)
            for i in range(ATTEMPTS):
                socks.append(_impostor_frames(ctx, endpoint, worker.pid, i))
            r.wait_for(lambda: r.admin("m")["refused_peers"] >= ATTEMPTS, what="every impostor refused")
            assert r.admin("m")["state"] == "loading"
        resp = fut.result(timeout=60)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == " w100 w101 w102"  # the fake worker's own answer
        info = r.admin("m")
        assert info["pid"] == worker.pid and info["state"] == "ready"
        assert info["refused_peers"] >= ATTEMPTS  # over tcp, a refused peer may retry its handshake
        for s in socks:  # no impostor was sent anything (the Generate went to the real worker)
            assert s.poll(0) == 0
        assert "refused a peer on m's worker socket" in r.log()
        assert "Traceback" not in r.log()
    finally:
        for s in socks:
            s.close(linger=0)
        ctx.term()
        pool.shutdown(wait=False)


# ----------------------------------------------------------------------------- the hand-off


def test_credentials_reach_the_worker_through_a_pipe_only() -> None:
    creds = WorkerCredentials.new(("A" * 40, "B" * 40, "C" * 40))
    fd = write_credentials(creds)
    assert stat.S_ISFIFO(os.fstat(fd).st_mode)
    assert read_credentials(fd) == creds
    with pytest.raises(OSError):
        os.fstat(fd)  # read_credentials closed it
    assert WorkerCredentials.new().secret != WorkerCredentials.new().secret  # fresh per spawn
    assert secret_matches(creds.secret, creds.secret)
    assert not secret_matches(creds.secret, "") and not secret_matches(creds.secret, creds.secret[:-1])


def test_the_command_line_holds_only_the_descriptor_number(tmp_path: Path) -> None:
    from router.config import ModelConfig

    model = ModelConfig(name="m", path=tmp_path / "m.gguf")
    cmd = worker_command(model, "ipc:///x.sock", auth_fd=7)
    assert cmd[cmd.index("--auth-fd") + 1] == "7"


@pytest.mark.parametrize("bad", [b"", b"not json", b'{"secret": "short"}',
                                 b'{"secret": "' + b"a" * 64 + b'", "server_public": "x"}'])
def test_malformed_credentials_are_refused(bad: bytes) -> None:
    with pytest.raises(ValueError):
        WorkerCredentials.from_bytes(bad)

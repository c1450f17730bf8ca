"""The router's side of the wire, for worker tests: a bound ROUTER socket speaking the protocol.

Also runnable as the worker's *parent* process (the "router" a test kills)::

    python -m tests.worker.router_stub --gguf PATH --endpoint ENDPOINT [--prompt TEXT]

binds ENDPOINT, spawns ``python -m worker`` as its child, waits for Ready, sends
one long Generate, waits for its first Token, prints one JSON line
``{"worker_pid": N, "endpoint": ...}`` and then sleeps until killed.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgpack
import zmq

from protocol import (PROTOCOL_VERSION, Accepted, Done, Error, Generate, Hello, Message, Ping, PromptProgress, Ready,
                      Token, decode, encode)

REPO = Path(__file__).resolve().parents[2]


class RouterStub:
    """A bound ROUTER socket; learns the worker's identity from its Hello.

    ``received`` lists every decoded frame in arrival order (for ordering checks).
    """

    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.ident: bytes | None = None
        self.accepted: dict[str, Accepted] = {}  # each request's Accepted frame (stream())
        self.progress: dict[str, list[PromptProgress]] = {}  # each request's PromptProgress frames (stream())
        self.received: list[tuple[float, Message]] = []  # (monotonic s, frame)
        self._unread: list[Message] = []

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()

    # ---------------------------------------------------------------- receive

    def _recv_one(self, timeout_s: float) -> Message | None:
        if not self.sock.poll(int(max(timeout_s, 0) * 1000)):
            return None
        parts = self.sock.recv_multipart()
        assert len(parts) == 2, f"expected [identity, payload], got {len(parts)} parts"
        ident, payload = parts
        msg = decode(payload)
        if isinstance(msg, Hello):
            self.ident = ident
        else:
            assert ident == self.ident, "frame from an identity that sent no Hello"
        self.received.append((time.monotonic(), msg))
        return msg

    def next(self, pred: Callable[[Message], bool] = lambda m: True, timeout_s: float = 30.0) -> Message:
        """The first (unread or new) frame satisfying ``pred``; others stay unread, in order.
        Raises TimeoutError after ``timeout_s`` seconds."""
        for i, m in enumerate(self._unread):
            if pred(m):
                return self._unread.pop(i)
        deadline = time.monotonic() + timeout_s
        while True:
            m = self._recv_one(deadline - time.monotonic())
            if m is None:
                raise TimeoutError(f"no matching frame within {timeout_s} s; unread: {self._unread[-5:]!r}")
            if pred(m):
                return m
            self._unread.append(m)

    def next_for(self, req_id: str, timeout_s: float = 30.0, accepted: bool = False) -> Message:
        """The next frame of ``req_id``; its Accepted frame only with ``accepted`` (else it is
        kept in ``self.accepted`` and the frame after it is returned)."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.next(lambda m: m.id == req_id, deadline - time.monotonic())
            if accepted or not isinstance(m, Accepted):
                return m
            assert req_id not in self.accepted, f"two Accepted frames for {req_id}"
            self.accepted[req_id] = m

    def stream(self, req_id: str, timeout_s: float = 60.0) -> tuple[list[Token], Done | Error]:
        """Token frames of ``req_id`` up to and including its Done or Error. The worker's
        Accepted (at most one, before any Token) is kept in ``accepted[req_id]``, its PromptProgress
        frames (after the Accepted, before any Token) in ``progress[req_id]``."""
        tokens: list[Token] = []
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.next_for(req_id, deadline - time.monotonic(), accepted=True)
            if isinstance(m, Accepted):
                assert not tokens and req_id not in self.accepted, f"Accepted out of order for {req_id}"
                self.accepted[req_id] = m
            elif isinstance(m, PromptProgress):
                assert not tokens and req_id in self.accepted, f"PromptProgress out of order for {req_id}"
                self.progress.setdefault(req_id, []).append(m)
            elif isinstance(m, Token):
                tokens.append(m)
            elif isinstance(m, (Done, Error)):
                return tokens, m
            else:
                raise AssertionError(f"unexpected frame for {req_id}: {m!r}")

    def handshake(self, timeout_s: float = 120.0) -> Ready:
        """Wait for Hello then Ready (raise if an Error comes instead)."""
        hello = self.next(lambda m: isinstance(m, Hello), timeout_s)
        assert isinstance(hello, Hello)
        m = self.next(lambda m: isinstance(m, (Ready, Error)), timeout_s)
        if isinstance(m, Error):
            raise RuntimeError(f"worker failed to load: {m.code}: {m.message}")
        assert isinstance(m, Ready)
        return m

    # ---------------------------------------------------------------- send

    def send(self, msg: Message) -> float:
        """Send one frame to the worker; returns ``time.monotonic()`` just after sending."""
        return self.send_raw(encode(msg))

    def send_raw(self, *parts: bytes) -> float:
        assert self.ident is not None, "no Hello yet"
        self.sock.send_multipart([self.ident, *parts])
        return time.monotonic()


def garbage_frame(rng: random.Random, i: int) -> list[bytes]:
    """Frame ``i`` of a garbage series (message parts): random bytes, random maps, bad fields,
    wrong-direction types, multi-part, truncated, wrong version, ext types, empty."""
    kind = i % 8
    if kind == 0:
        return [rng.randbytes(rng.randrange(0, 300))]
    if kind == 1:  # random maps with envelope-ish keys
        keys = ["v", "type", "id", "prompt", "x", "tokens", "content"]
        obj = {rng.choice(keys): rng.choice([1, 2, -1, "generate", "ping", "cancel", "", None, [1, "a"], {"a": 1},
                                            b"\x00", 3.5, True, "x" * rng.randrange(0, 200)])
               for _ in range(rng.randrange(0, 6))}
        return [msgpack.packb(obj, use_bin_type=True)]
    if kind == 2:  # valid envelope, bad fields
        return [msgpack.packb({"v": PROTOCOL_VERSION, "type": "generate", "id": f"g{i}", "temperature": "hot"})]
    if kind == 3:  # a worker->router type sent to the worker
        return [encode(Token(id=f"t{i}", text="x", token_id=1, piece=b"x"))]
    if kind == 4:  # multi-part
        return [encode(Ping(id=f"m{i}")), b"extra"]
    if kind == 5:  # truncated valid frame
        f = encode(Generate(id=f"tr{i}", prompt="hello"))
        return [f[: rng.randrange(1, len(f) - 1)]]
    if kind == 6:  # wrong version
        return [msgpack.packb({"v": PROTOCOL_VERSION + 1, "type": "ping", "id": f"v{i}"})]
    return [msgpack.packb(msgpack.ExtType(3, b"xyz")) if i % 16 == 7 else b""]


def worker_command(gguf: str, endpoint: str, *extra: str, model: str = "smollm2") -> list[str]:
    return [sys.executable, "-m", "worker", "--model", model, "--gguf", gguf, "--endpoint", endpoint, *extra]


def spawn_worker(gguf: str, endpoint: str, *extra: str, model: str = "smollm2") -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(worker_command(gguf, endpoint, *extra, model=model), cwd=REPO, env=env,
                            stdin=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--prompt", default="Write a long story about a lighthouse keeper.")
    args = ap.parse_args()
    stub = RouterStub(args.endpoint)
    proc = spawn_worker(args.gguf, stub.endpoint)  # default --parent-pid: this process
    try:
        stub.handshake()
    except RuntimeError as e:
        print(json.dumps({"error": str(e)}), flush=True)
        proc.wait(30)
        return
    stub.send(Generate(id="long", prompt=args.prompt, max_tokens=4000, temperature=0.0, ignore_eos=True))
    stub.next(lambda m: isinstance(m, Token))
    print(json.dumps({"worker_pid": proc.pid, "endpoint": stub.endpoint}), flush=True)
    while True:
        stub.sock.poll(1000)  # keep reading nothing in particular; wait to be killed
        try:
            stub.sock.recv_multipart(zmq.NOBLOCK)
        except zmq.Again:
            pass


if __name__ == "__main__":
    main()

"""The worker's one socket: a ZeroMQ DEALER connected to the router's ROUTER endpoint.

Frames go out encoded by the codec and never block: while the router is not reading they queue
(up to the high-water mark), beyond that they are dropped and counted, so the socket loop (its
parent checks, its Pongs) never freezes. Frames come in decoded and validated by the codec — the
one place a request is checked for shape and types; a malformed frame is answered with an Error
``protocol_error`` (with its id when it could be read) and goes no further.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import zmq

from protocol import MAX_FRAME_BYTES, Error, Message, ProtocolError, Token, WorkerCredentials, decode, encode
from protocol.errors import ErrorCode

__all__ = ["Channel", "UNKNOWN_ID"]

log = logging.getLogger("modelyard.worker")

UNKNOWN_ID = "unknown"  # id of an Error answering a frame whose id could not be read
#: Frames handled per :meth:`Channel.receive` call, so runner frames and parent checks are never starved.
RECEIVE_BATCH = 1000


class Channel:
    """The DEALER socket to ``endpoint`` (CURVE when ``credentials`` carry keys: over tcp, the
    router's key and ours, handed over privately). ``linger_ms``: how long unsent frames may
    delay :meth:`close`."""

    def __init__(self, endpoint: str, credentials: WorkerCredentials | None, linger_ms: int) -> None:
        self.endpoint = endpoint
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = zmq.Context()
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, linger_ms)
        # Frames queue while the router is not reading; sends never block (NOBLOCK) and a
        # full queue drops frames rather than freezing the loop (parent checks must go on).
        sock.setsockopt(zmq.SNDHWM, 100_000)
        sock.setsockopt(zmq.RCVHWM, 100_000)
        if credentials is not None and credentials.curve:
            sock.curve_serverkey = str(credentials.server_public).encode()
            sock.curve_publickey = str(credentials.public).encode()
            sock.curve_secretkey = str(credentials.secret_key).encode()
        self.sock: zmq.Socket[bytes] | None = sock
        self.dropped = 0  # frames dropped because the router was not reading

    @classmethod
    def adopt(cls, ctx: zmq.Context[zmq.Socket[bytes]], sock: zmq.Socket[bytes], endpoint: str,
              linger_ms: int) -> Channel:
        """A channel over a context and DEALER socket already connected to ``endpoint`` (a warm
        spare's, ``worker.spare``: its options and credentials were set when it connected)."""
        self = cls.__new__(cls)
        self.endpoint = endpoint
        self._ctx = ctx
        sock.setsockopt(zmq.LINGER, linger_ms)
        self.sock = sock
        self.dropped = 0
        return self

    def connect(self) -> bool:
        """Connect to the endpoint; False (logged, the socket closed) when it is not valid."""
        assert self.sock is not None
        try:
            self.sock.connect(self.endpoint)
        except zmq.ZMQError as e:
            log.error("cannot connect to %s: %s", self.endpoint, e)
            self.sock.close(linger=0)
            self.sock = None
            return False
        return True

    def send(self, msg: Message) -> None:
        """Encode and send ``msg`` without blocking. A record that does not encode is our bug: a
        Token or Error is dropped (a Token's text is still accounted for by the stream's end), any
        other answer becomes an Error for its id (``invalid_request`` when it is too big for a frame)."""
        if self.sock is None:
            return
        try:
            frame = encode(msg)
        except Exception as e:  # noqa: BLE001 - a record that does not encode is our bug, not the peer's
            log.error("cannot encode %s %s: %s", msg.TYPE, msg.id, e)
            if isinstance(msg, (Token, Error)):
                return
            too_big = isinstance(e, ProtocolError) and "exceeds" in e.reason
            frame = encode(Error(
                id=msg.id, code=ErrorCode.INVALID_REQUEST if too_big else ErrorCode.INTERNAL_ERROR,
                message=(f"the {msg.TYPE} answer does not fit in one frame ({MAX_FRAME_BYTES} bytes)" if too_big
                         else f"cannot encode the {msg.TYPE} answer: {type(e).__name__}: {e}")[:1000]))
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            if self.dropped in (1, 10, 100) or self.dropped % 1000 == 0:
                log.warning("router is not reading: dropped a %s frame for %s (%d dropped so far)",
                            msg.TYPE, msg.id, self.dropped)
        except zmq.ZMQError as e:
            log.warning("cannot send a %s frame for %s: %s", msg.TYPE, msg.id, e)

    def receive(self, handle: Callable[[Message], None], done: Callable[[], bool]) -> None:
        """Hand each waiting frame, decoded, to ``handle`` (at most RECEIVE_BATCH; stop early once
        ``done()``); a frame the codec rejects is answered here."""
        assert self.sock is not None
        for _ in range(RECEIVE_BATCH):
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError as e:
                log.warning("recv failed: %s", e)
                return
            if len(parts) != 1:
                self.send(Error(id=UNKNOWN_ID, code=ErrorCode.PROTOCOL_ERROR,
                                message=f"a frame must be one message part, got {len(parts)} parts"))
            else:
                try:
                    msg = decode(parts[0])
                except ProtocolError as e:
                    self.send(Error(id=e.msg_id or UNKNOWN_ID, code=ErrorCode.PROTOCOL_ERROR, message=e.reason))
                else:
                    handle(msg)
            if done():
                return

    def close(self, linger_ms: int) -> None:
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
            self.sock = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

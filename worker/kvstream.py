"""KV-state streams over the wire: the sending side (a prefill worker's finished entry) and
the receiving side (a decode worker's incoming state), without the socket.

A stream is ``worker.engine.kv.state``'s format cut into KVChunk frames of
``protocol.KV_CHUNK_BYTES`` (the last one shorter), numbered from 0. The sender
keeps at most ``protocol.KV_WINDOW`` chunks beyond the last KVAck (the router
relays the decode worker's acks), so neither the router nor the sockets ever
hold more than a window of one stream. The receiver feeds every chunk, in order,
to :class:`~worker.engine.kv.state.StateDecoder`, which checks the header and the
identity before it accepts a payload byte and both checksums at the end; the
state is handed to the engine only once all of that passed. A dropped receiver
(Cancel, error, idle) leaves nothing behind.

The server's socket thread drives both (``worker.server``); they are plain objects.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator
from typing import Any

from protocol import KV_CHUNK_BYTES, KV_WINDOW

__all__ = ["StateReceiver", "StateSender", "StreamOrderError", "exact_chunks"]


def exact_chunks(pieces: Iterable[bytes], size: int) -> Iterator[tuple[bytes, bool]]:
    """``(chunk, last)`` of the concatenated ``pieces``: every chunk ``size`` bytes but the last
    (1..size bytes); nothing for empty input."""
    buf = bytearray()
    ready: bytes | None = None
    for p in pieces:
        buf += p
        while len(buf) >= size:
            if ready is not None:
                yield ready, False
            ready = bytes(buf[:size])
            del buf[:size]
    if buf:
        if ready is not None:
            yield ready, False
        yield bytes(buf), True
    elif ready is not None:
        yield ready, True


class StateSender:
    """One outgoing stream: ``state`` (an engine KVState) as chunks, credit-limited.

    ``final`` is the generation's Done, sent after the last chunk. ``take()`` gives the
    chunks the window allows now, ``ack(seq)`` opens it further.
    """

    def __init__(self, job_id: str, state: Any, final: Any, chunk_bytes: int = KV_CHUNK_BYTES) -> None:
        from worker.engine.kv.state import encode_state

        self.job_id = job_id
        self.final = final
        self.n_tokens = state.n_tokens
        self._chunks = exact_chunks(encode_state(state.identity, state.tokens, state.k, state.v, chunk_bytes),
                                    chunk_bytes)
        self.next_seq = 0
        self.acked = -1
        self.done = False  # the last chunk was taken
        self.n_bytes = 0
        self.last_activity = time.monotonic()

    def ack(self, seq: int) -> None:
        if seq > self.acked:
            self.acked = min(seq, self.next_seq - 1)
            self.last_activity = time.monotonic()

    def take(self) -> list[tuple[int, bytes, bool]]:
        """``[(seq, data, last)]`` to send now (at most up to chunk ``acked + KV_WINDOW``)."""
        out = []
        while not self.done and self.next_seq <= self.acked + KV_WINDOW:
            data, last = next(self._chunks)
            out.append((self.next_seq, data, last))
            self.next_seq += 1
            self.n_bytes += len(data)
            self.done = last
        return out


class StreamOrderError(Exception):
    """A chunk that is not the next one of its stream."""


class StateReceiver:
    """One incoming stream for an engine of identity ``expected`` (KVIdentity)."""

    def __init__(self, stream_id: str, expected: Any) -> None:
        from worker.engine.kv.state import StateDecoder

        self.stream_id = stream_id
        self._dec = StateDecoder(expected)
        self.next_seq = 0
        self.t0 = time.perf_counter()
        self.last_activity = time.monotonic()

    @property
    def n_bytes(self) -> int:
        return self._dec.n_read

    def feed(self, seq: int, data: bytes) -> None:
        """Take chunk ``seq``. Raises StreamOrderError (not the next one) or KVStateError
        (the decoder refused it: "kv_state_mismatch" naming the field, "kv_state_invalid")."""
        if seq != self.next_seq:
            raise StreamOrderError(f"KV chunk {seq} of stream {self.stream_id!r} arrived, expected {self.next_seq}")
        self._dec.feed(data)
        self.next_seq += 1
        self.last_activity = time.monotonic()

    def finish(self) -> Any:
        """The fully validated KVState (after the last chunk). Raises KVStateError."""
        return self._dec.finish()

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

The server's socket thread drives both through :class:`KVStreams` (``worker.server``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from protocol import KV_CHUNK_BYTES, KV_STREAM_IDLE_S, KV_WINDOW, Error, KVAck, KVChunk, Message
from protocol.errors import ErrorCode
from worker.frames import cancelled_done

__all__ = ["KVStreams", "MAX_KV_RECEIVERS", "StateReceiver", "StateSender", "StreamOrderError", "exact_chunks"]

log = logging.getLogger("modelyard.worker")

#: Incoming KV-state streams a worker validates at once (each holds up to one state in memory).
MAX_KV_RECEIVERS = 4


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


class KVStreams:
    """The KV-state streams of one worker, both ways, driven by the socket thread (``worker.server``).

    Out: a ``stream_state`` generation's entry (:class:`~worker.events.StateOut`) goes as KVChunk
    frames within the window the KVAcks open, then its Done; the job is released only then. In:
    chunks are fed to a :class:`StateReceiver` as they arrive (acknowledged one by one, at most
    MAX_KV_RECEIVERS streams at once) and the state is handed to the engine thread
    (``runner.kv.install_state``) only once complete and valid. A Cancel, an error or
    ``KV_STREAM_IDLE_S`` without progress drops a stream (nothing is installed).

    Args:
        send: sends one record to the router.
        runner: the job owner (``worker.runner.BatchRunner``): its ``jobs``, ``release`` and ``kv``.
    """

    def __init__(self, send: Callable[[Message], None], runner: Any) -> None:
        self._send = send
        self._runner = runner
        self._senders: dict[str, StateSender] = {}  # job id -> its state going out
        self._receivers: dict[str, StateReceiver] = {}  # stream id -> a state coming in

    @property
    def active(self) -> bool:
        return bool(self._senders or self._receivers)

    def state_out(self, job_id: str, state: Any, final: Any) -> None:
        """A stream_state generation ended (its engine part is over): stream ``state``, then ``final``."""
        job = self._runner.jobs.running(job_id)
        if job is None:  # given up on at exit (answered already)
            return
        if job.cancel.is_set():
            self.end(job.id, cancelled_done(job.id, job.tokens_sent))
            return
        sender = StateSender(job.id, state, final)
        self._senders[job.id] = sender
        self._pump(sender)

    def ack(self, msg: KVAck) -> None:
        sender = self._senders.get(msg.id)
        if sender is not None:  # else: a stream that ended or was cancelled
            sender.ack(msg.seq)
            self._pump(sender)

    def cancel_out(self, job_id: str, tokens_sent: int) -> bool:
        """Drop job ``job_id``'s outgoing stream and answer it cancelled; False if it streams nothing."""
        if self._senders.pop(job_id, None) is None:
            return False
        self.end(job_id, cancelled_done(job_id, tokens_sent))
        return True

    def cancel_in(self, stream_id: str) -> bool:
        """Drop incoming stream ``stream_id`` (nothing installed); False if there is none."""
        if self._receivers.pop(stream_id, None) is None:
            return False
        log.info("KV stream %s cancelled: the partial state is dropped", stream_id)
        return True

    def chunk(self, msg: KVChunk, refused: str | None) -> None:
        """Take one incoming chunk; ``refused``: why a new stream cannot open now (None: it can)."""
        from worker.engine.kv.state import KVStateError

        rcv = self._receivers.get(msg.id)
        if rcv is None:
            why = refused or (f"{len(self._receivers)} KV streams are already arriving"
                              if len(self._receivers) >= MAX_KV_RECEIVERS else None)
            if why is not None:
                self._send(Error(id=msg.id, code=ErrorCode.BUSY, message=why))
                return
            if msg.seq != 0:
                self._send(Error(id=msg.id, code=ErrorCode.PROTOCOL_ERROR,
                                 message=f"KV chunk {msg.seq} of a stream that is not open here"))
                return
            rcv = self._receivers[msg.id] = StateReceiver(msg.id, self._runner.engine.kv_identity)
        try:
            rcv.feed(msg.seq, msg.data)
            self._send(KVAck(id=msg.id, seq=msg.seq))
            if not msg.last:
                return
            state = rcv.finish()
        except (KVStateError, StreamOrderError) as e:
            del self._receivers[msg.id]
            code = e.code if isinstance(e, KVStateError) else ErrorCode.PROTOCOL_ERROR
            text = e.message if isinstance(e, KVStateError) else str(e)
            log.warning("KV stream %s refused: %s: %s", msg.id, code, text)
            self._send(Error(id=msg.id, code=code, message=text))
            return
        del self._receivers[msg.id]
        self._runner.kv.install_state(msg.id, state, rcv.n_bytes, rcv.t0)  # answered by the engine thread

    def expire(self, now: float) -> None:
        """Drop the streams without progress for KV_STREAM_IDLE_S (an outgoing one ends in an Error)."""
        for sid, rcv in list(self._receivers.items()):
            if now - rcv.last_activity > KV_STREAM_IDLE_S:
                del self._receivers[sid]
                log.warning("KV stream %s: no chunk for %.0f s; the partial state is dropped", sid, KV_STREAM_IDLE_S)
        for jid, snd in list(self._senders.items()):
            if now - snd.last_activity > KV_STREAM_IDLE_S:
                del self._senders[jid]
                log.warning("request %s: its KV stream got no acknowledgement for %.0f s; dropped", jid,
                            KV_STREAM_IDLE_S)
                self.end(jid, Error(id=jid, code=ErrorCode.INTERNAL_ERROR, message=(
                    f"the KV state stream was not acknowledged within {KV_STREAM_IDLE_S:g} s")))

    def end(self, job_id: str, final: Message) -> None:
        """Job ``job_id`` is over: release it and send ``final`` (unless given up on at exit)."""
        if self._runner.release(job_id) is not None:
            self._send(final)

    def _pump(self, sender: StateSender) -> None:
        """Send the chunks ``sender``'s window allows; after the last one, the job's Done."""
        for seq, data, last in sender.take():
            self._send(KVChunk(id=sender.job_id, seq=seq, data=data, last=last))
        if sender.done:
            self._senders.pop(sender.job_id, None)
            log.info("request %s: streamed its KV state (%d tokens, %d bytes)", sender.job_id, sender.n_tokens,
                     sender.n_bytes)
            self.end(sender.job_id, sender.final)

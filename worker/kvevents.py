"""Where a worker's KV events go (issue 25): a ZeroMQ PUB socket in vLLM's KV-events format, and
the router as KvEvents frames; both off by default.

The engine thread collects the events of each step (``Engine.take_kv_events``) and posts them as
one :class:`~worker.events.KvBatch`; the socket loop hands it to :class:`KvEventSinks`, which
numbers it (one ``seq`` counter for both sinks), encodes it once
(:func:`protocol.kv_events.encode_batch`) and sends it:

* on the PUB socket bound at ``kv_events_endpoint``, as vLLM's ``ZmqEventPublisher`` does: the
  multipart message ``[topic, seq, payload]`` with topic the model's name (UTF-8) and ``seq``
  8 bytes big-endian (:func:`protocol.kv_events.seq_bytes`). A PUB socket drops what no
  subscriber takes (and beyond its high-water mark): a gap in ``seq`` says so;
* to the router (``kv_events_to_router``) as ``KvEvents(id=worker id, seq, payload)``.

The first batch after a load is AllBlocksCleared (the engine's); on exit the worker sends one
more, so a subscriber forgets what it held. The endpoint is plaintext and unauthenticated and
carries prompts' token ids (docs/security.md). Sends never block; a failed bind is logged and
the worker serves without the PUB socket.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import zmq

from protocol import Message
from protocol.kv_events import MAX_BATCH_BYTES, AllBlocksCleared, KVEvent, KvEvents, encode_batch, seq_bytes

__all__ = ["KvEventSinks", "PUB_HWM"]

log = logging.getLogger("modelyard.worker")

#: Batches the PUB socket queues per subscriber before dropping (vLLM's publisher's default).
PUB_HWM = 100_000


class KvEventSinks:
    """The PUB socket (when ``endpoint``) and the router (when ``to_router``: ``send`` is the
    socket loop's frame sender) of one worker; used by the socket loop's thread only.

    Args:
        topic: the model's name (each PUB message's first part).
        endpoint: ``tcp://HOST:PORT`` or ``ipc://PATH`` to bind, or None.
        worker_id: the ``id`` of the KvEvents frames.
        send: sends a frame to the router, or None (not to the router).
    """

    def __init__(self, topic: str, endpoint: str | None, worker_id: str,
                 send: Callable[[Message], None] | None) -> None:
        self.topic = topic.encode()
        self.worker_id = worker_id
        self._send = send
        self.seq = 0  # the next batch's number
        self.pub: zmq.Socket[bytes] | None = None
        if endpoint is not None:
            self._bind(endpoint)

    def _bind(self, endpoint: str) -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        sock = ctx.socket(zmq.PUB)
        sock.setsockopt(zmq.SNDHWM, PUB_HWM)
        try:
            sock.bind(endpoint)
        except zmq.ZMQError as e:
            log.error("KV events: cannot bind %s (%s); serving without the KV-events socket", endpoint, e)
            sock.close(linger=0)
            ctx.term()
            return
        self.pub = sock
        log.info("KV events published on %s (topic %r)", endpoint, self.topic.decode())

    def publish(self, ts: float, events: Sequence[KVEvent]) -> None:
        """Send ``events`` (taken at unix time ``ts``) as one batch, or as several when one would
        exceed ``MAX_BATCH_BYTES``; never blocks."""
        payload = encode_batch(ts, events)
        if len(payload) > MAX_BATCH_BYTES and len(events) > 1:
            half = len(events) // 2
            self.publish(ts, events[:half])
            self.publish(ts, events[half:])
            return
        seq = self.seq
        self.seq += 1
        if self.pub is not None:
            try:
                self.pub.send_multipart([self.topic, seq_bytes(seq), payload], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # zmq.Again included: the batch is lost, the seq gap says so
                log.debug("KV events: batch %d not published: %s", seq, e)
        if self._send is not None:
            self._send(KvEvents(id=self.worker_id, seq=seq, payload=payload))

    def close(self, linger_ms: int) -> None:
        """Tell the subscribers the cache is gone (AllBlocksCleared, when anything was told) and
        close the PUB socket, waiting at most ``linger_ms`` for unsent batches."""
        if self.seq:
            self.publish(time.time(), [AllBlocksCleared()])
        pub, self.pub = self.pub, None
        if pub is not None:  # its context is its own
            ctx = pub.context
            pub.close(linger=linger_ms)
            ctx.term()

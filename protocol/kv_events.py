"""KV events: what enters and leaves a worker's KV cache, in vLLM's KV-events format (issue 25).

A worker's KV cache holds sequences of token ids (its prefix cache's entries). For the outside
they are described as **blocks** of ``block_size`` tokens, each named by a chained hash of its
tokens and its parent block's hash, as vLLM's prefix caching names its KV blocks. Only full
blocks are named (a sequence's tail shorter than a block is not an event).

Three events (``vllm/distributed/kv_events.py``; msgspec structs with ``array_like=True,
tag=True``, so each is a msgpack array whose first item is the event's tag):

* ``["BlockStored", block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium]``:
  blocks entered the cache, in order, each the child of the one before it (the first of
  ``parent_block_hash``, None for a sequence's first block); ``token_ids`` are all their tokens
  (``len(block_hashes) * block_size``).
* ``["BlockRemoved", block_hashes, medium]``: blocks no longer held by any sequence.
* ``["AllBlocksCleared"]``: every block left (the worker unloaded, its cache was erased).

A batch is ``[ts, events]`` (``ts``: unix seconds, float; vLLM's ``KVEventBatch``, whose
``data_parallel_rank`` is left out as msgspec omits a default). On the worker's PUB socket
each batch is one multipart message ``[topic, seq, payload]`` as vLLM's ``ZmqEventPublisher``
sends it: ``topic`` bytes (modelyard: the model's name, UTF-8), ``seq`` an 8-byte big-endian
unsigned counter (0, 1, ...; a gap means lost batches), ``payload`` the msgpack of the batch.
The router gets the same payloads as :class:`KvEvents` frames.

Hash (modelyard's; vLLM's own is a process-seeded hash, so any router recomputes with the
publisher's rule, here :func:`block_hashes`): ``sha256(parent || tokens)`` truncated to its
first 8 bytes, little-endian, masked to 63 bits (a non-negative msgpack int), where ``parent``
is the parent hash as 8 little-endian bytes (``b"modelyard-kv-root"`` for a first block) and
``tokens`` the block's ids as little-endian int32.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack

from protocol.frame import Message

__all__ = [
    "DEFAULT_BLOCK_SIZE", "MEDIUM", "AllBlocksCleared", "BlockRemoved", "BlockStored", "KVEvent",
    "KvEvents", "block_hashes", "decode_batch", "encode_batch", "seq_bytes",
]

#: Tokens per block when a worker's config does not say (vLLM's default block size is 16).
DEFAULT_BLOCK_SIZE = 16

#: Where modelyard's KV lives (vLLM's ``medium``: "GPU", "CPU", ...).
MEDIUM = "CPU"

_ROOT = b"modelyard-kv-root"
_MASK63 = (1 << 63) - 1


def block_hashes(token_ids: Sequence[int], block_size: int, parent: int | None = None) -> list[int]:
    """The chained hashes of the full blocks of ``token_ids`` (``len(token_ids) // block_size``
    of them), the first block's parent being ``parent`` (None: the sequence's start). Pure
    Python (the router uses it too); ids are int32. Raises ValueError for ``block_size < 1``."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[int] = []
    prev = _ROOT if parent is None else struct.pack("<Q", parent)
    fmt = f"<{block_size}i"
    for lo in range(0, len(token_ids) - block_size + 1, block_size):
        h = int.from_bytes(hashlib.sha256(prev + struct.pack(fmt, *token_ids[lo:lo + block_size])).digest()[:8],
                           "little") & _MASK63
        out.append(h)
        prev = struct.pack("<Q", h)
    return out


@dataclass(frozen=True)
class BlockStored:
    """Blocks entered the cache (see the module doc)."""

    TAG: ClassVar[str] = "BlockStored"
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM

    def to_wire(self) -> list[Any]:
        return [self.TAG, self.block_hashes, self.parent_block_hash, self.token_ids, self.block_size,
                self.lora_id, self.medium]


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks no sequence in the cache holds any more."""

    TAG: ClassVar[str] = "BlockRemoved"
    block_hashes: list[int]
    medium: str | None = MEDIUM

    def to_wire(self) -> list[Any]:
        return [self.TAG, self.block_hashes, self.medium]


@dataclass(frozen=True)
class AllBlocksCleared:
    """The cache is empty."""

    TAG: ClassVar[str] = "AllBlocksCleared"

    def to_wire(self) -> list[Any]:
        return [self.TAG]


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared

#: Largest batch payload either side decodes (bytes).
MAX_BATCH_BYTES = 8 * 1024 * 1024


def encode_batch(ts: float, events: Sequence[KVEvent]) -> bytes:
    """One ``KVEventBatch`` as msgpack bytes: ``[ts, [event, ...]]``."""
    return msgpack.packb([float(ts), [e.to_wire() for e in events]], use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    """A batch's sequence number as vLLM's publisher frames it (8 bytes, big-endian)."""
    return seq.to_bytes(8, "big")


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
        raise ValueError(f"{what} must be a list of ints")
    return v


def _opt_int(v: Any, what: str) -> int | None:
    if v is not None and (not isinstance(v, int) or isinstance(v, bool)):
        raise ValueError(f"{what} must be an int or nil")
    return v


def _opt_str(v: Any, what: str) -> str | None:
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{what} must be a str or nil")
    return v


def _event(raw: Any) -> KVEvent:
    if not isinstance(raw, list) or not raw or not isinstance(raw[0], str):
        raise ValueError("an event must be an array starting with its tag")
    tag, f = raw[0], raw[1:]
    if tag == BlockStored.TAG and 4 <= len(f) <= 6:
        f = f + [None, MEDIUM][len(f) - 4:]
        hashes, tokens, size = _ints(f[0], "block_hashes"), _ints(f[2], "token_ids"), f[3]
        if not isinstance(size, int) or isinstance(size, bool) or size < 1:
            raise ValueError("block_size must be a positive int")
        if len(tokens) != len(hashes) * size:
            raise ValueError(f"{len(tokens)} token_ids for {len(hashes)} blocks of {size}")
        return BlockStored(hashes, _opt_int(f[1], "parent_block_hash"), tokens, size,
                           _opt_int(f[4], "lora_id"), _opt_str(f[5], "medium"))
    if tag == BlockRemoved.TAG and 1 <= len(f) <= 2:
        return BlockRemoved(_ints(f[0], "block_hashes"), _opt_str(f[1] if len(f) > 1 else MEDIUM, "medium"))
    if tag == AllBlocksCleared.TAG and not f:
        return AllBlocksCleared()
    raise ValueError(f"unknown event {tag!r} with {len(f)} fields")


def decode_batch(payload: bytes) -> tuple[float, list[KVEvent]]:
    """``(ts, events)`` of one batch's msgpack bytes. Raises ValueError (only) when the payload
    is not a well-formed batch (too large, not msgpack, an unknown event, a field of another
    type); a trailing ``data_parallel_rank`` is accepted and ignored."""
    if len(payload) > MAX_BATCH_BYTES:
        raise ValueError(f"batch of {len(payload)} bytes > {MAX_BATCH_BYTES}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several types for malformed input
        raise ValueError(f"not msgpack: {e}") from None
    if not isinstance(raw, list) or len(raw) not in (2, 3) or not isinstance(raw[1], list):
        raise ValueError("a batch must be [ts, events] or [ts, events, data_parallel_rank]")
    ts = raw[0]
    if not isinstance(ts, (int, float)) or isinstance(ts, bool):
        raise ValueError("ts must be a number")
    return float(ts), [_event(e) for e in raw[1]]


@dataclass(frozen=True, kw_only=True)
class KvEvents(Message):
    """Worker -> router: one batch of KV events (``payload``: :func:`encode_batch`'s bytes,
    ``seq``: the batch's number, as on the PUB socket). ``id`` is the worker's own id."""

    TYPE: ClassVar[str] = "kv_events"
    seq: int
    payload: bytes

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if fields["seq"] < 0:
            return "seq must be >= 0"
        try:
            decode_batch(fields["payload"])
        except ValueError as e:
            return f"payload: {e}"
        return None

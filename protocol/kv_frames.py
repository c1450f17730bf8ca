"""KV states between router and worker: slot actions (save / restore / erase a slot through a
file of the worker's) and KV-state streams (KVChunk / KVAck, the disaggregated hand-over)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from protocol.frame import Message

#: KV-state streams (KVChunk): what a sender puts in one chunk (bytes) ...
KV_CHUNK_BYTES = 1024 * 1024
#: ... and the most a KVChunk may carry (validated on both sides; far within MAX_FRAME_BYTES).
KV_CHUNK_MAX_BYTES = 4 * 1024 * 1024
#: Chunks a sender may have sent beyond the last one acknowledged (KVAck): with the router
#: relaying, at most this many chunks of one stream are in flight, so memory stays bounded.
KV_WINDOW = 4
#: A KV stream with no chunk (receiver) or no acknowledgement (sender) for this long is dropped (s).
KV_STREAM_IDLE_S = 60.0


#: SlotAction.action values (llama.cpp's ``POST /slots/{id}?action=``).
SLOT_ACTIONS = ("save", "restore", "erase")


def slot_filename_error(name: str) -> str | None:
    """Why ``name`` is not a plain file name for a slot save directory (llama.cpp's
    fs_validate_filename in spirit), or None: non-empty, at most 255 bytes, no path
    separator, no ``..``, no control character or BOM, no leading/trailing whitespace,
    no trailing dot."""
    if not isinstance(name, str) or not name:
        return "the filename is empty"
    if len(name.encode("utf-8", "surrogatepass")) > 255:
        return "the filename is longer than 255 bytes"
    if "/" in name or "\\" in name or ".." in name:
        return "the filename must not contain a path separator or '..'"
    if any(ord(c) < 32 or ord(c) == 127 for c in name) or "\ufeff" in name:
        return "the filename contains a control character"
    if name != name.strip() or name.endswith("."):
        return "the filename must not start or end with whitespace or end with '.'"
    return None


@dataclass(frozen=True, kw_only=True)
class SlotAction(Message):
    """Save, restore or erase KV slot ``id_slot`` (llama.cpp's slot actions).

    ``filename`` (save / restore): a plain file name inside the worker's
    ``--slot-save-path`` directory (no path separator, no ``..``; checked on both
    sides). A slot action's state never crosses the wire: the worker reads / writes the file
    (``worker.engine.kv.state`` format). A busy slot's action waits until the slot
    is idle (llama.cpp defers it too). Answered by a SlotActionResult or an Error
    ("kv_state_mismatch" naming the field, "kv_state_invalid", "invalid_params",
    "kv_budget_exceeded", "invalid_request" when the worker has no save path).
    """

    TYPE: ClassVar[str] = "slot_action"
    action: str  # one of SLOT_ACTIONS
    id_slot: int  # -1 with "restore": into the prefix cache, no slot (the disaggregated hand-over)
    filename: str = ""


@dataclass(frozen=True, kw_only=True)
class SlotActionResult(Message):
    """A SlotAction done: ``n_tokens`` saved / restored / erased, ``n_bytes`` written / read,
    ``ms`` its wall time (milliseconds)."""

    TYPE: ClassVar[str] = "slot_action_result"
    action: str
    id_slot: int
    filename: str = ""
    n_tokens: int
    n_bytes: int = 0
    ms: float = 0.0


@dataclass(frozen=True, kw_only=True)
class KVChunk(Message):
    """One piece of a KV state stream (``worker.engine.kv.state`` format, opaque here).

    ``seq``: 0, 1, 2, ... within the stream ``id``; ``data``: 1..KV_CHUNK_MAX_BYTES bytes;
    ``last``: the stream's final chunk. A prefill worker sends them for a Generate with
    ``stream_state`` (id = the Generate's); the router relays the bytes to the decode worker
    under its own transfer id, without looking into them. The decode worker validates the
    stream as it arrives (identity before any payload byte, checksums at the end), answers a
    KVAck per chunk, and after the last one a SlotActionResult (``action`` "restore",
    ``id_slot`` -1: the state is in its prefix cache) or an Error ("kv_state_mismatch",
    "kv_state_invalid", "kv_budget_exceeded", "protocol_error" for a chunk out of order, "busy").
    A Cancel with the transfer id drops a partial stream (nothing is installed)."""

    TYPE: ClassVar[str] = "kv_chunk"
    seq: int
    data: bytes
    last: bool = False

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        if fields["seq"] < 0:
            return f"seq must be >= 0, got {fields['seq']}"
        if not 1 <= len(fields["data"]) <= KV_CHUNK_MAX_BYTES:
            return f"data of {len(fields['data'])} bytes: a chunk carries 1..{KV_CHUNK_MAX_BYTES} bytes"
        return None


@dataclass(frozen=True, kw_only=True)
class KVAck(Message):
    """Chunk ``seq`` of KV stream ``id`` was taken: from a decode worker to the router, and
    relayed by the router to the prefill worker as its credit (it may send up to chunk
    ``seq + KV_WINDOW``)."""

    TYPE: ClassVar[str] = "kv_ack"
    seq: int

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        return None if fields["seq"] >= 0 else f"seq must be >= 0, got {fields['seq']}"

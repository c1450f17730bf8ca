"""The frame's envelope and base record: every router <-> worker frame is one msgpack map::

    {"v": PROTOCOL_VERSION, "type": "<tag>", "id": "<request id>", ...fields}

``id`` is the request id the message belongs to (a Generate and all its Token /
Done / Error frames share it; worker-level messages such as Hello, Ready, Ping
use their own id). :class:`Error` is here too: any request (or a load) may end with one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

#: Bumped on any incompatible change; a frame with another version is rejected.
#: 5: KV-state streams (KVChunk / KVAck, Generate.stream_state).
#: 6: token ids of TokenizeResult / Detokenize travel as TokenIds (int32 bytes), pieces as one blob.
#: 7: LoadProgress stage ``loading_kernels``.
#: 8: Accepted (a Generate's prompt fits and is queued; what its constraint set aside); ApplyTemplate.tools.
#: 9: Error.n_prompt_tokens / n_ctx (a context overflow's figures); Generate / ApplyTemplate template_kwargs;
#:    Generate.post_sampling_probs.
#: 10: Pong.n_decode_total / n_busy_slots_total (llama.cpp's decode-call metrics).
#: 11: Assign (a warm spare, started without a model, is given one; Hello.model "" until then).
#: 12: PromptProgress (a prompt's prefill, chunk by chunk, for a Generate with return_progress).
#: 13: KvEvents (a worker's KV-cache events, vLLM's format: protocol.kv_events).
PROTOCOL_VERSION = 13

#: Largest frame either side accepts, in bytes (a 100 KB prompt as token ids is < 1 MiB).
MAX_FRAME_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class Message:
    """Base of every frame. ``id``: request id (str, 1..128 chars)."""

    TYPE: ClassVar[str] = ""
    id: str

    @classmethod
    def value_problem(cls, fields: dict[str, Any]) -> str | None:
        """What is wrong with these type-checked field values (optional fields the frame
        leaves out are absent from ``fields``), or None. The codec rejects a frame for which
        this is not None, on encode and on decode."""
        return None


@dataclass(frozen=True, kw_only=True)
class Error(Message):
    """A request failed (or, with the worker's own id, the worker failed to load).

    ``code`` is machine-readable: a ``protocol.errors.ErrorCode`` (a str on the wire;
    the router maps every member, and logs any other code as a 502).
    """

    TYPE: ClassVar[str] = "error"
    code: str
    message: str
    # context_length_exceeded: the prompt's tokens and the context size, as llama-server's
    # exceed_context_size_error carries them (None: not known, or another code)
    n_prompt_tokens: int | None = None
    n_ctx: int | None = None

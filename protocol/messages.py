"""Router <-> worker message types: small typed records, one per frame, declared by concept.

Every frame is one msgpack map ``{"v": PROTOCOL_VERSION, "type": "<tag>", "id": "<request id>",
...fields}`` (``protocol.frame``: the envelope, the base :class:`Message`, :class:`Error`). Field
names follow OpenAI's and llama.cpp's wire names (max_tokens, n_probs, finish_reason, prompt_n, ...).

The records, by concept:

* ``protocol.lifecycle`` — the worker's life: Hello, LoadProgress, Ready, Assign, Ping, Pong, Shutdown
* ``protocol.generation`` — a generation: Generate, Cancel, Accepted, PromptProgress, Token, Done
* ``protocol.text_calls`` — tokenizer and template calls: Tokenize, Detokenize, ApplyTemplate and their results
* ``protocol.kv_frames`` — KV states: SlotAction, SlotActionResult, KVChunk, KVAck
* ``protocol.kv_events`` — what enters and leaves a worker's KV cache (vLLM's KV-events format): KvEvents

Direction:

* worker -> router: Hello, LoadProgress, Ready, Accepted, PromptProgress, Token, Done, Error, Pong,
  TokenizeResult, DetokenizeResult, ApplyTemplateResult, SlotActionResult, KVChunk (a prefill
  worker's state), KVAck (a decode worker took a chunk), KvEvents
* router -> worker: Assign (a warm spare's model), Generate, Cancel, Ping, Shutdown, Tokenize,
  Detokenize, ApplyTemplate, SlotAction, KVChunk (to a decode worker), KVAck (credit to a prefill worker)

This module gathers them (:data:`MESSAGE_TYPES`); ``protocol.codec`` encodes, decodes and
validates them. It imports neither the router nor the worker.
"""

from __future__ import annotations

from protocol.frame import MAX_FRAME_BYTES, PROTOCOL_VERSION, Error, Message
from protocol.generation import FINISH_REASONS, Accepted, Cancel, Done, Generate, PromptProgress, Token
from protocol.kv_events import KvEvents
from protocol.kv_frames import (
    KV_CHUNK_BYTES,
    KV_CHUNK_MAX_BYTES,
    KV_STREAM_IDLE_S,
    KV_WINDOW,
    SLOT_ACTIONS,
    KVAck,
    KVChunk,
    SlotAction,
    SlotActionResult,
    slot_filename_error,
)
from protocol.lifecycle import LOAD_STAGES, Assign, Hello, LoadProgress, Ping, Pong, Ready, Shutdown
from protocol.text_calls import (
    ApplyTemplate,
    ApplyTemplateResult,
    Detokenize,
    DetokenizeResult,
    Tokenize,
    TokenizeResult,
)

__all__ = [
    "FINISH_REASONS", "KV_CHUNK_BYTES", "KV_CHUNK_MAX_BYTES", "KV_STREAM_IDLE_S", "KV_WINDOW", "LOAD_STAGES",
    "MAX_FRAME_BYTES", "MESSAGE_TYPES", "PROTOCOL_VERSION", "SLOT_ACTIONS", "Accepted", "ApplyTemplate",
    "ApplyTemplateResult", "Assign", "Cancel", "Detokenize", "DetokenizeResult", "Done", "Error", "Generate",
    "Hello", "KVAck", "KVChunk", "KvEvents", "LoadProgress", "Message", "Ping", "Pong", "PromptProgress", "Ready",
    "Shutdown", "SlotAction", "SlotActionResult", "Token", "Tokenize", "TokenizeResult", "slot_filename_error",
]

#: Every message type by its wire tag.
MESSAGE_TYPES: dict[str, type[Message]] = {
    cls.TYPE: cls
    for cls in (
        Hello, LoadProgress, Ready, Accepted, PromptProgress, Token, Done, Error, Pong, TokenizeResult,
        DetokenizeResult, ApplyTemplateResult, Assign, Generate, Cancel, Ping, Shutdown, Tokenize, Detokenize,
        ApplyTemplate, SlotAction, SlotActionResult, KVChunk, KVAck, KvEvents,
    )
}

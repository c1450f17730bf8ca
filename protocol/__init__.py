"""The router <-> worker wire contract: typed messages and their msgpack codec.

Imports neither ``router`` nor ``worker``; both import it.
"""

from protocol.codec import ProtocolError, decode, encode
from protocol.errors import ErrorCode
from protocol.token_ids import TokenIds
from protocol.sampling import SAMPLING_DEFAULTS, SAMPLING_FIELDS, SamplingField, SamplingFields
from protocol.credentials import WorkerCredentials, read_credentials, secret_matches, write_credentials
from protocol.messages import (
    FINISH_REASONS, KV_CHUNK_BYTES, KV_CHUNK_MAX_BYTES, KV_STREAM_IDLE_S, KV_WINDOW, LOAD_STAGES,
    MAX_FRAME_BYTES, MESSAGE_TYPES, PROTOCOL_VERSION, Accepted, ApplyTemplate, Assign, ApplyTemplateResult,
    Cancel, Detokenize, DetokenizeResult, Done, Error, Generate, Hello, KVAck, KVChunk, LoadProgress, Message,
    Ping, Pong, PromptProgress, Ready, Shutdown, SLOT_ACTIONS, SlotAction, SlotActionResult, Token, Tokenize,
    TokenizeResult, slot_filename_error,
)

__all__ = [
    "FINISH_REASONS", "KV_CHUNK_BYTES", "KV_CHUNK_MAX_BYTES", "KV_STREAM_IDLE_S", "KV_WINDOW", "LOAD_STAGES", "MAX_FRAME_BYTES", "MESSAGE_TYPES", "PROTOCOL_VERSION",
    "Accepted", "ApplyTemplate", "Assign", "ApplyTemplateResult", "Cancel", "Detokenize", "DetokenizeResult", "Done",
    "Error", "ErrorCode", "Generate", "SAMPLING_DEFAULTS", "SAMPLING_FIELDS", "SamplingField", "SamplingFields", "Hello", "KVAck", "KVChunk", "LoadProgress", "Message", "Ping", "Pong", "PromptProgress", "ProtocolError", "Ready",
    "Shutdown", "SLOT_ACTIONS", "SlotAction", "SlotActionResult",
    "Token", "TokenIds", "Tokenize", "TokenizeResult", "WorkerCredentials", "decode", "encode", "read_credentials",
    "secret_matches", "slot_filename_error", "write_credentials",
]

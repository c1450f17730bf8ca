"""The codes an ``Error`` frame carries: one typed enumeration for the worker (which sends
them) and the router (which maps each to an HTTP answer, ``router.http.errors``).

``ErrorCode`` is a ``StrEnum``: a member *is* its string on the wire, so frames are
unchanged. The router's mapping covers every member (a test holds it to that); a code
outside the enumeration from a newer or buggy worker is logged and answered 502.
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    # the request cannot run (the router answers 400)
    INVALID_REQUEST = "invalid_request"
    INVALID_TOKEN = "invalid_token"
    INVALID_PARAMS = "invalid_params"
    EMPTY_PROMPT = "empty_prompt"
    CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
    KV_BUDGET_EXCEEDED = "kv_budget_exceeded"
    NO_CHAT_TEMPLATE = "no_chat_template"
    TEMPLATE_ERROR = "template_error"
    INVALID_GRAMMAR = "invalid_grammar"
    KV_STATE_MISMATCH = "kv_state_mismatch"  # a KV state of another model / quantization / n_ctx ...
    KV_STATE_INVALID = "kv_state_invalid"  # a truncated, corrupt, foreign or missing state file
    # the worker cannot take it now (503)
    BUSY = "busy"
    # loading the model failed (the engine's codes name why)
    LOAD_FAILED = "load_failed"
    FILE_NOT_FOUND = "file_not_found"
    INVALID_GGUF = "invalid_gguf"
    UNSUPPORTED_ARCHITECTURE = "unsupported_architecture"
    UNSUPPORTED_TENSOR_TYPE = "unsupported_tensor_type"
    UNSUPPORTED_TOKENIZER = "unsupported_tokenizer"
    # something is wrong with the frames or the worker (502 / 500)
    PROTOCOL_ERROR = "protocol_error"
    INTERNAL_ERROR = "internal_error"
    # router-side only: the worker process exited while a call waited for its answer
    WORKER_GONE = "worker_gone"

    @classmethod
    def of(cls, code: str) -> ErrorCode | None:
        """The member for ``code``, or None when the enumeration has none."""
        try:
            return cls(code)
        except ValueError:
            return None

"""Every error the router answers, and the one place they become HTTP.

Handlers and the pool *raise* an :class:`ApiError` subclass; the app turns it
into an OpenAI-shaped body (``{"error": {"message", "type", "param", "code"}}``;
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages*``;
Ollama's ``{"error": "<message>"}`` on ``/api/*``)
with the class's status (:func:`error_response`), or, once a stream has started,
into an SSE ``data: {"error": ...}`` event (:func:`error_payload`). Worker
``Error`` frames map to these classes in :func:`from_worker_error` — nowhere else.
"""

from __future__ import annotations

import logging
import re
from typing import Any, ClassVar

from protocol.errors import ErrorCode
from router.http.responses import JSONResponse

log = logging.getLogger("modelyard.errors")


class _Unset:
    """The marker of a class argument left out (``None`` is a value of ``retry_after_s``)."""


_UNSET = _Unset()


class ApiError(Exception):
    """Base class. ``status`` (HTTP), ``type`` (OpenAI error type), ``code`` (machine-readable)."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    retry_after_s: ClassVar[int | None] = None

    def __init_subclass__(cls, *, status: int | None = None, type: str | None = None, code: str | None = None,
                          retry_after_s: int | None | _Unset = _UNSET, **kw: Any) -> None:
        """A subclass declares what differs from its base as class arguments:
        ``class NotFound(ApiError, status=404, type="invalid_request_error", code="model_not_found")``
        (``retry_after_s=None`` takes a base's Retry-After away)."""
        super().__init_subclass__(**kw)
        if status is not None:
            cls.status = status
        if type is not None:
            cls.type = type
        if code is not None:
            cls.default_code = code
        if not isinstance(retry_after_s, _Unset):
            cls.retry_after_s = retry_after_s

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param
        if retry_after_s is not None:  # this instance's own wait (crash backoff), else the class's
            self.retry_after_s = retry_after_s  # type: ignore[misc]

    def payload(self) -> dict[str, Any]:
        return error_payload(self)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}

    def extra_fields(self) -> dict[str, Any]:
        """Fields beyond message/type/param/code in the OpenAI-shaped ``error`` (llama-server's)."""
        return {}


class BadRequest(ApiError, status=400, type="invalid_request_error"):
    """400: malformed JSON, invalid values, input the model cannot take."""


class ContextLengthExceeded(BadRequest, type="exceed_context_size_error", code="context_length_exceeded"):
    """400: the prompt (+ max_tokens) does not fit n_ctx.

    ``n_prompt_tokens`` and ``n_ctx`` come from the worker's Error frame when it carries them,
    else (with ``n_completion``, the completion tokens the request needs room for) from its
    message (else 0). Each dialect words the error its clients parse: on the OpenAI and
    llama.cpp routes llama-server's ``type`` "exceed_context_size_error" with ``n_prompt_tokens``
    and ``n_ctx`` and its message "request (N tokens) exceeds the available context size (M
    tokens), try increasing it", OpenAI's ``code`` "context_length_exceeded" and wording
    ("maximum context length") kept after it; on /v1/messages Anthropic's ``prompt is too long``
    (router.dialects.anthropic_api)."""

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None,
                 retry_after_s: int | None = None, n_prompt_tokens: int | None = None,
                 n_ctx: int | None = None) -> None:
        m = _CONTEXT_FIGURES.search(message)
        self.n_ctx, _, self.n_prompt_tokens, self.n_completion = (int(g) for g in m.groups()) if m else (0, 0, 0, 0)
        if n_prompt_tokens is not None and n_ctx is not None:
            self.n_prompt_tokens, self.n_ctx = n_prompt_tokens, n_ctx
            message = (f"request ({n_prompt_tokens} tokens) exceeds the available context size ({n_ctx} tokens), "
                       f"try increasing it. {message}")
        super().__init__(message, code=code, param=param, retry_after_s=retry_after_s)

    def extra_fields(self) -> dict[str, Any]:
        return {"n_prompt_tokens": self.n_prompt_tokens, "n_ctx": self.n_ctx} if self.n_ctx else {}


#: The figures of the worker's context-length message (``worker.engine.generate.check_context``).
_CONTEXT_FIGURES = re.compile(r"maximum context length is (\d+) tokens\. However, you requested (\d+) tokens "
                              r"\((\d+) in the prompt, (\d+) for the completion\)")


class PayloadTooLarge(ApiError, status=413, type="invalid_request_error", code="request_too_large"):
    """413: the request body is over the router's limit."""


class Unauthorized(ApiError, status=401, type="authentication_error", code="invalid_api_key"):
    """401: a missing or wrong key. ``type`` is llama-server's (and Anthropic's) "authentication_error";
    ``code`` OpenAI's "invalid_api_key"."""


class Forbidden(ApiError, status=403, type="invalid_request_error", code="forbidden"):
    """403: a browser-origin rule refused the request (``router.http.security``)."""


class RequestTimeout(ApiError, status=408, type="invalid_request_error", code="request_timeout",
                     retry_after_s=1):
    """408: the client did not send its whole body within ``server.body_timeout_s``."""

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class UnsupportedMediaType(ApiError, status=415, type="invalid_request_error", code="unsupported_media_type"):
    """415: a JSON route got a body that does not say it is JSON."""


class NotFound(ApiError, status=404, type="invalid_request_error", code="model_not_found"):
    """404: no such model (or route object)."""


class MethodNotAllowed(ApiError, status=405, type="invalid_request_error", code="method_not_allowed"):
    """405: the route does not take this method."""


class Conflict(ApiError, status=409, type="invalid_request_error", code="conflict"):
    """409: the request contradicts the current state."""


class NotSupported(ApiError, status=501, type="not_supported_error", code="not_supported"):
    """501: a capability this server was not configured for (llama.cpp's not_supported_error)."""


class Unavailable(ApiError, status=503, type="server_error", code="unavailable", retry_after_s=1):
    """503: try again later (Retry-After)."""


class QueueFull(Unavailable, code="queue_full"):
    """The model's bounded queue is full (503 at once)."""


class ModelUnloading(Unavailable, code="model_unloading"):
    """The model is unloading; it may be loaded again."""


class ServerShuttingDown(Unavailable, code="server_shutting_down"):
    """The router is stopping: a waiting request is refused, a running one is ended
    once the shutdown grace period (``shutdown_timeout_s``) runs out."""

    def __init__(self, message: str = "the server is shutting down; retry against a running instance") -> None:
        super().__init__(message)


class ModelLoadFailed(Unavailable, code="model_load_failed", retry_after_s=5):
    """The model's worker failed to load it."""


class WorkerCrashed(Unavailable, code="worker_crashed"):
    """The worker process died (or was killed as hung) while the request was queued."""


class RestartBackoff(Unavailable, code="restart_backoff"):
    """The model's worker crashed recently; it may start again in ``retry_after_s`` seconds
    (exponential backoff, ``router.workers.backoff``)."""


class ModelFailed(Unavailable, code="model_failed", retry_after_s=None):
    """The model failed ``max_crashes`` times within ``crash_window_s``: it stays failed
    until an operator loads it. No Retry-After: retrying will not help."""


class InsufficientMemory(Unavailable, code="insufficient_memory", retry_after_s=10):
    """Placement: the model's estimate does not fit in the available memory even with
    every unpinned model unloaded (the message has the figures)."""


class MaxLoadedReached(Unavailable, code="max_loaded_reached", retry_after_s=10):
    """Placement: ``max_loaded`` models are loaded and none of them may be evicted (pinned)."""


class BadGateway(ApiError, status=502, type="server_error", code="worker_error"):
    """502: the worker failed during this request (crash mid-request, protocol error)."""


class InternalError(ApiError, status=500, type="server_error", code="internal_error"):
    """500: a fault of the router itself."""


#: Every worker ``Error.code`` -> the ApiError class it becomes (the worker's code and
#: message are kept). Exhaustive over ``ErrorCode`` (tests/protocol holds it to that).
WORKER_CODES: dict[ErrorCode, type[ApiError]] = {
    ErrorCode.INVALID_REQUEST: BadRequest,
    ErrorCode.INVALID_TOKEN: BadRequest,
    ErrorCode.INVALID_PARAMS: BadRequest,
    ErrorCode.EMPTY_PROMPT: BadRequest,
    ErrorCode.CONTEXT_LENGTH_EXCEEDED: ContextLengthExceeded,
    ErrorCode.KV_BUDGET_EXCEEDED: BadRequest,
    ErrorCode.NO_CHAT_TEMPLATE: BadRequest,
    ErrorCode.TEMPLATE_ERROR: BadRequest,
    ErrorCode.BUSY: Unavailable,
    ErrorCode.LOAD_FAILED: ModelLoadFailed,
    ErrorCode.FILE_NOT_FOUND: ModelLoadFailed,
    ErrorCode.INVALID_GGUF: ModelLoadFailed,
    ErrorCode.UNSUPPORTED_ARCHITECTURE: ModelLoadFailed,
    ErrorCode.UNSUPPORTED_TENSOR_TYPE: ModelLoadFailed,
    ErrorCode.UNSUPPORTED_TOKENIZER: ModelLoadFailed,
    ErrorCode.PROTOCOL_ERROR: BadGateway,
    ErrorCode.INTERNAL_ERROR: InternalError,
    ErrorCode.WORKER_GONE: BadGateway,
    ErrorCode.INVALID_GRAMMAR: BadRequest,
    ErrorCode.KV_STATE_MISMATCH: BadRequest,
    ErrorCode.KV_STATE_INVALID: BadRequest,
}


def from_worker_error(code: str, message: str, *, n_prompt_tokens: int | None = None,
                      n_ctx: int | None = None) -> ApiError:
    """The ApiError for a worker ``Error`` frame (keeps the worker's code and message; a context
    overflow's ``n_prompt_tokens`` / ``n_ctx`` too). A code outside ``ErrorCode`` is logged and
    becomes a 502 ``worker_error``."""
    known = ErrorCode.of(code)
    if known is None:
        log.warning("worker sent an unknown error code %r (%s); answering 502", code, message[:200])
        return BadGateway(f"the worker failed with an unknown error code {code!r}: {message}")
    if known is ErrorCode.WORKER_GONE:
        return BadGateway(message, code="worker_crashed")
    if known is ErrorCode.CONTEXT_LENGTH_EXCEEDED:
        return ContextLengthExceeded(message, code=str(known), n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)
    return WORKER_CODES[known](message, code=str(known))


def unsendable(reason: str) -> BadRequest:
    """The 400 for a request the protocol cannot carry (``protocol.ProtocolError`` raised
    while encoding it: nothing reached the worker). ``param`` is the offending field
    when the reason names one."""
    m = re.search(r"field '([A-Za-z_][A-Za-z0-9_]*)'", reason)
    return BadRequest(f"the request cannot be passed to the model: {reason}", code="invalid_request",
                      param=m.group(1) if m else None)


#: An absolute file path inside a message (two or more components): ``/a/b/model.gguf``.
_ABS_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"`:,;()<>]+/)+([^\s/'\"`:,;()<>]+)")


#: A worker socket's endpoint (``ipc:///run/.../w.sock``, ``tcp://127.0.0.1:40123``).
_ENDPOINT = re.compile(r"\b(ipc|tcp|inproc)://[^\s'\"`,;()<>]+")


#: First components of this API's own routes (``/v1/chat/completions``, ``/api/chat``, ...): an
#: error naming a route is not naming a file (tests hold every route of the app to this set).
API_ROOTS = frozenset({"v1", "api", "admin", "slots", "props", "models", "health", "metrics", "tokenize",
                       "detokenize", "apply-template", "completion", "completions", "infill", "embedding",
                       "embeddings", "rerank", "reranking", "openapi.json", "docs",
                       "chat", "responses",  # llama-server's /chat/completions, /responses without /v1
                       "ui"})


def _redact_path(m: re.Match[str]) -> str:
    first = m.group(0)[1:].split("/", 1)[0]
    return m.group(0) if first in API_ROOTS else f".../{m.group(1)}"


def redact_paths(message: str) -> str:
    """``message`` with every absolute file path cut to its last component (``.../model.gguf``)
    and every worker socket endpoint cut to its scheme (``ipc://...``): what a client sees
    (every error body goes through it, :func:`error_payload`); the router log and /admin
    keep the full text. The API's own routes (:data:`API_ROOTS`) are left as they are."""
    return _ABS_PATH.sub(_redact_path, _ENDPOINT.sub(lambda m: f"{m.group(1)}://...", message))


def error_payload(err: ApiError) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI shapes it (the message without host paths: :func:`redact_paths`)."""
    return {"error": {"message": redact_paths(err.message), "type": err.type, "param": err.param,
                      "code": err.code, **err.extra_fields()}}


#: HTTP status -> Anthropic's error ``type`` (docs.anthropic.com "Errors"); others: ``api_error``.
_ANTHROPIC_TYPES: dict[int, str] = {
    400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
    404: "not_found_error", 405: "invalid_request_error", 408: "timeout_error", 409: "invalid_request_error",
    413: "request_too_large", 415: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error",
    503: "overloaded_error",
}


#: Path prefixes whose errors take Anthropic's shape (the Messages API).
ANTHROPIC_PATHS = ("/v1/messages",)


def anthropic_error_payload(err: ApiError) -> dict[str, Any]:
    """``{"type": "error", "error": {"type", "message"}}`` as Anthropic shapes it (our
    machine-readable ``code`` and ``param`` ride along; the SDK ignores extra keys)."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(err.status, "api_error"),
                                       "message": redact_paths(err.message), "code": err.code, "param": err.param}}


def is_anthropic_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


#: Path prefix whose errors take Ollama's shape (its native API, ``router.dialects.ollama_api``).
OLLAMA_PREFIX = "/api/"


def ollama_error_payload(err: ApiError) -> dict[str, Any]:
    """``{"error": "<message>"}`` as Ollama shapes it (its clients read that one key; on a
    stream it is the last NDJSON line)."""
    return {"error": redact_paths(err.message)}


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """The HTTP answer for ``err``: Anthropic-shaped on the Messages API's paths, Ollama-shaped
    on ``/api/*``, else OpenAI-shaped."""
    if is_anthropic_path(path):
        body = anthropic_error_payload(err)
    elif path.startswith(OLLAMA_PREFIX):
        body = ollama_error_payload(err)
    else:
        body = error_payload(err)
    return JSONResponse(body, status_code=err.status, headers=err.headers())

"""Every error the router answers, and the one place they become HTTP.

Handlers and the pool *raise* an :class:`ApiError` subclass; the app turns it
into an OpenAI-shaped body (``{"error": {"message", "type", "param", "code"}}``;
Anthropic's ``{"type": "error", "error": {"type", "message"}}`` on ``/v1/messages*``)
with the class's status (:func:`error_response`), or, once a stream has started,
into an SSE ``data: {"error": ...}`` event (:func:`error_payload`). Worker
``Error`` frames map to these classes in :func:`from_worker_error` — nowhere else.
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from router.responses import JSONResponse


class ApiError(Exception):
    """Base class. ``status`` (HTTP), ``type`` (OpenAI error type), ``code`` (machine-readable)."""

    status: ClassVar[int] = 500
    type: ClassVar[str] = "server_error"
    default_code: ClassVar[str | None] = None
    retry_after_s: ClassVar[int | None] = None

    def __init__(self, message: str, *, code: str | None = None, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.code = code if code is not None else self.default_code
        self.param = param

    def payload(self) -> dict[str, Any]:
        return error_payload(self)

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)} if self.retry_after_s is not None else {}


class BadRequest(ApiError):
    """400: malformed JSON, invalid values, input the model cannot take."""

    status = 400
    type = "invalid_request_error"


class ContextLengthExceeded(BadRequest):
    """400: prompt + max_tokens beyond n_ctx (message contains "maximum context length")."""

    default_code = "context_length_exceeded"


class PayloadTooLarge(ApiError):
    """413: the request body is over the router's limit."""

    status = 413
    type = "invalid_request_error"
    default_code = "request_too_large"


class Unauthorized(ApiError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class Forbidden(ApiError):
    """403: a browser-origin rule refused the request (``router.security``)."""

    status = 403
    type = "invalid_request_error"
    default_code = "forbidden"


class RequestTimeout(ApiError):
    """408: the client did not send its whole body within ``server.body_timeout_s``."""

    status = 408
    type = "invalid_request_error"
    default_code = "request_timeout"

    def headers(self) -> dict[str, str]:
        return {"Connection": "close"}


class UnsupportedMediaType(ApiError):
    """415: a JSON route got a body that does not say it is JSON."""

    status = 415
    type = "invalid_request_error"
    default_code = "unsupported_media_type"


class NotFound(ApiError):
    status = 404
    type = "invalid_request_error"
    default_code = "model_not_found"


class MethodNotAllowed(ApiError):
    status = 405
    type = "invalid_request_error"
    default_code = "method_not_allowed"


class Conflict(ApiError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class Unavailable(ApiError):
    """503: try again later (Retry-After)."""

    status = 503
    type = "server_error"
    default_code = "unavailable"
    retry_after_s = 1


class QueueFull(Unavailable):
    default_code = "queue_full"


class ModelUnloading(Unavailable):
    default_code = "model_unloading"


class ServerShuttingDown(Unavailable):
    """The router is stopping: a waiting request is refused, a running one is ended
    once the shutdown grace period (``shutdown_timeout_s``) runs out."""

    default_code = "server_shutting_down"

    def __init__(self, message: str = "the server is shutting down; retry against a running instance") -> None:
        super().__init__(message)


class ModelLoadFailed(Unavailable):
    default_code = "model_load_failed"
    retry_after_s = 5


class WorkerCrashed(Unavailable):
    """The worker process died (or was killed as hung) while the request was queued."""

    default_code = "worker_crashed"


class BadGateway(ApiError):
    """502: the worker failed during this request (crash mid-request, protocol error)."""

    status = 502
    type = "server_error"
    default_code = "worker_error"


class InternalError(ApiError):
    status = 500
    type = "server_error"
    default_code = "internal_error"


#: Worker Error.code -> the ApiError class it becomes. Codes not listed: BadGateway (502).
_WORKER_CODES: dict[str, type[ApiError]] = {
    "context_length_exceeded": ContextLengthExceeded,
    "kv_budget_exceeded": BadRequest,
    "invalid_request": BadRequest,
    "invalid_token": BadRequest,
    "invalid_params": BadRequest,
    "empty_prompt": BadRequest,
    "no_chat_template": BadRequest,
    "template_error": BadRequest,
    "invalid_grammar": BadRequest,
    "busy": Unavailable,
    "load_failed": ModelLoadFailed,
    "internal_error": InternalError,
}


def from_worker_error(code: str, message: str) -> ApiError:
    """The ApiError for a worker ``Error`` frame (keeps the worker's code and message)."""
    cls = _WORKER_CODES.get(code, BadGateway)
    return cls(message, code=code)


def unsendable(reason: str) -> BadRequest:
    """The 400 for a request the protocol cannot carry (``protocol.ProtocolError`` raised
    while encoding it: nothing reached the worker). ``param`` is the offending field
    when the reason names one."""
    m = re.search(r"field '([A-Za-z_][A-Za-z0-9_]*)'", reason)
    return BadRequest(f"the request cannot be passed to the model: {reason}", code="invalid_request",
                      param=m.group(1) if m else None)


#: An absolute file path inside a message (two or more components): ``/a/b/model.gguf``.
_ABS_PATH = re.compile(r"(?<![\w.~:/-])/(?:[^\s/'\"`:,;()<>]+/)+([^\s/'\"`:,;()<>]+)")


def redact_paths(message: str) -> str:
    """``message`` with every absolute path cut to its last component (``.../model.gguf``):
    what a client sees of a load error (the router log and /admin keep the full text)."""
    return _ABS_PATH.sub(lambda m: f".../{m.group(1)}", message)


def error_payload(err: ApiError) -> dict[str, Any]:
    """``{"error": {...}}`` as OpenAI shapes it."""
    return {"error": {"message": err.message, "type": err.type, "param": err.param, "code": err.code}}


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
                                       "message": err.message, "code": err.code, "param": err.param}}


def is_anthropic_path(path: str) -> bool:
    return any(path == p or path.startswith(p + "/") for p in ANTHROPIC_PATHS)


def error_response(err: ApiError, path: str = "") -> JSONResponse:
    """The HTTP answer for ``err``: Anthropic-shaped on the Messages API's paths, else OpenAI-shaped."""
    body = anthropic_error_payload(err) if is_anthropic_path(path) else error_payload(err)
    return JSONResponse(body, status_code=err.status, headers=err.headers())

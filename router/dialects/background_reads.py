"""What the routes that read background jobs share (``/v1/decode/{id}``, ``/v1/responses/{id}``):
the ``?stream=`` query and a job's events replayed as SSE (router.dialects.background)."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from router.dialects.background import Job
from router.http.errors import BadRequest
from router.http.sse import SSEResponse, sse_event


def stream_query(request: Request) -> bool | None:
    """``?stream=true|false`` (None when absent). Raises BadRequest for another value."""
    v = request.query_params.get("stream")
    if v is None:
        return None
    if v.lower() in ("true", "1"):
        return True
    if v.lower() in ("false", "0"):
        return False
    raise BadRequest(f"'stream' must be true or false, got {v!r}", param="stream")


def job_events(job: Job, skip: int = 0) -> SSEResponse:
    """The job's events from event ``skip`` on, as SSE; a job that ends without a final event
    of its own (cancelled, or failed before its stream began) ends with an error event."""

    async def events() -> Any:
        n = 0
        async for ev in job.follow():
            if n >= skip:
                yield ev
            n += 1
        if job.status in ("cancelled", "failed") and not job.error_in_events:
            err = job.error or {"message": "the generation was cancelled", "type": "invalid_request_error",
                                "param": None, "code": "cancelled"}
            yield sse_event({"error": err})

    return SSEResponse(events(), lambda: None)  # a reader leaving never cancels the job

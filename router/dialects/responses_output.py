"""The Responses API's answer (router.dialects.openai_responses): the ``response`` object as it
builds up (:class:`Answer`, shared by the JSON answer, the SSE stream and a background job's
snapshot; stored when ``store``), its output items (``message`` with an ``output_text`` part,
``function_call``, ``custom_tool_call``) and ``usage``.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from starlette.requests import Request

from protocol import Done, Token
from router.dialects.response_store import store_of
from router.dialects.responses_input import ResponsesRequest
from router.dialects.tools import ChatTurn, ToolCall
from router.http.errors import ApiError, redact_paths
from router.serving.generation import openai_logprob, token_probs

def hex_id() -> str:
    """24 random hex digits: the tail of a response's, message's or count's id."""
    return uuid.uuid4().hex[:24]


def _usage(done: Done) -> dict[str, Any]:
    return {"input_tokens": done.prompt_tokens, "input_tokens_details": {"cached_tokens": done.cache_n},
            "output_tokens": done.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done.prompt_tokens + done.completion_tokens}


def message_item(mid: str, text: str, status: str, logprobs: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    return {"type": "message", "id": mid, "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}]}


def output_logprobs(req: ResponsesRequest, tokens: list[Token]) -> list[dict[str, Any]]:
    """The ``output_text.logprobs`` of ``tokens`` (empty unless asked for)."""
    if req.n_top is None:
        return []
    return [openai_logprob(p, req.n_top) for p in token_probs(tokens, req.n_top)]


def call_item(req: ResponsesRequest, c: ToolCall, status: str, arguments: str | None = None) -> dict[str, Any]:
    text = c.arguments if arguments is None else arguments
    names = req.call_names(c)
    if c.custom:
        return {"type": "custom_tool_call", "id": "ctc_" + c.id.split("_", 1)[1], "call_id": c.id, **names,
                "input": text, "status": status}
    return {"type": "function_call", "id": "fc_" + c.id.split("_", 1)[1], "call_id": c.id, **names,
            "arguments": text, "status": status}


class Answer:
    """The response object of one request as it builds up (shared by JSON and SSE)."""

    def __init__(self, req: ResponsesRequest, rid: str) -> None:
        self.req = req
        self.id = rid
        self.created_at = int(time.time())
        self.completed_at: int | None = None
        self.output: list[dict[str, Any]] = []

    def obj(self, status: str, done: Done | None = None, error: ApiError | None = None) -> dict[str, Any]:
        incomplete = {"reason": "max_output_tokens"} if status == "incomplete" else None
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "completed_at": self.completed_at if status == "completed" else None,
                "model": self.req.model, "output": list(self.output), "error": (
                    {"code": error.code or "server_error", "message": redact_paths(error.message)} if error else None),
                "incomplete_details": incomplete, "usage": _usage(done) if done is not None else None,
                "truncation": "disabled", "max_output_tokens": None, "instructions": None,
                "previous_response_id": None, "temperature": None, "top_p": None, **self.req.echo}

    def finish(self, request: Request, done: Done, calls: list[ToolCall], text: str | None) -> dict[str, Any]:
        status = "incomplete" if done.finish_reason == "length" else "completed"
        self.completed_at = int(time.time())
        resp = self.obj(status, done)
        if self.req.echo["store"]:
            history = list(self.req.history)
            text = text or ""
            if history and history[-1].role == "assistant" and not history[-1].tool_calls:
                text = history.pop().content + text  # a prefill: the answer continues that turn
            store_of(request).put(self.id, resp, [*history, ChatTurn("assistant", text, tool_calls=list(calls))])
        return resp

"""The Responses API's stream (router.dialects.openai_responses): the named SSE events of one
response, each with its ``sequence_number`` — ``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` /
``.done``, ``response.content_part.done``, ``response.function_call_arguments.delta`` / ``.done``
(``response.custom_tool_call_input.*`` for custom tools), ``response.output_item.done``, then
``response.completed`` or ``response.incomplete``; ``response.failed`` for a failure after the
first byte.
"""

from __future__ import annotations

from typing import Any

from starlette.requests import Request

from protocol import Accepted, Done, Token
from router.dialects.call_parser import CallParser
from router.dialects.responses_output import Answer, call_item, message_item, output_logprobs
from router.dialects.tools import ToolCall
from router.http.errors import ApiError
from router.http.sse import sse_named


class EventStream:
    """The events of one streamed response, as ``router.serving.generation.stream`` asks for
    them: :meth:`on_open` (the worker accepted the prompt), :meth:`on_frame` (each Token, then
    the Done), :meth:`on_error`. The output items build up in ``ans`` (a background job's
    snapshot reads it)."""

    def __init__(self, request: Request, ans: Answer, parser: CallParser, mid: str) -> None:
        self.request = request
        self.ans = ans
        self.req = ans.req
        self.parser = parser
        self.mid = mid  # the message item's id
        self.seq = 0
        self.events: list[bytes] = []
        self.text_parts: list[str] = []
        self.all_lp: list[dict[str, Any]] = []  # the output text's logprobs (when asked for)
        self.pending_lp: list[dict[str, Any]] = []  # those of tokens whose text has not been sent yet
        self.msg_open = False
        self.started = False

    def _ev(self, kind: str, **fields: Any) -> None:
        self.events.append(sse_named(kind, {"type": kind, "sequence_number": self.seq, **fields}))
        self.seq += 1

    def _open_message(self) -> None:
        self.msg_open = True
        out = self.ans.output
        out.append({"type": "message", "id": self.mid, "status": "in_progress", "role": "assistant", "content": []})
        self._ev("response.output_item.added", output_index=len(out) - 1, item=out[-1])
        self._ev("response.content_part.added", item_id=self.mid, output_index=len(out) - 1, content_index=0,
                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def _close_message(self, status: str) -> None:
        text = "".join(self.text_parts)
        idx = len(self.ans.output) - 1
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": list(self.all_lp)}
        self._ev("response.output_text.done", item_id=self.mid, output_index=idx, content_index=0, text=text,
                 logprobs=list(self.all_lp))
        self._ev("response.content_part.done", item_id=self.mid, output_index=idx, content_index=0, part=part)
        self.ans.output[idx] = message_item(self.mid, text, status, self.all_lp)
        self._ev("response.output_item.done", output_index=idx, item=self.ans.output[idx])

    def _emit(self, text: str, calls: list[ToolCall]) -> None:
        out = self.ans.output
        if text:
            if not self.msg_open:
                self._open_message()
            self.text_parts.append(text)
            self._ev("response.output_text.delta", item_id=self.mid, output_index=len(out) - 1, content_index=0,
                     delta=text, logprobs=list(self.pending_lp))
            self.pending_lp.clear()
        for c in calls:
            out.append(call_item(self.req, c, "in_progress", ""))
            idx = len(out) - 1
            item_id = out[idx]["id"]
            self._ev("response.output_item.added", output_index=idx, item=out[idx])
            if c.custom:
                self._ev("response.custom_tool_call_input.delta", item_id=item_id, output_index=idx, delta=c.arguments)
                self._ev("response.custom_tool_call_input.done", item_id=item_id, output_index=idx, input=c.arguments)
            else:
                self._ev("response.function_call_arguments.delta", item_id=item_id, output_index=idx,
                         delta=c.arguments)
                self._ev("response.function_call_arguments.done", item_id=item_id, output_index=idx,
                         arguments=c.arguments, **self.req.call_names(c))
            out[idx] = call_item(self.req, c, "completed")
            self._ev("response.output_item.done", output_index=idx, item=out[idx])

    def _start(self) -> None:
        if not self.started:
            self.started = True
            self._ev("response.created", response=self.ans.obj("in_progress"))
            self._ev("response.in_progress", response=self.ans.obj("in_progress"))
            if self.parser.mode != "undecided":
                self._open_message()

    def on_open(self, accepted: Accepted) -> list[bytes]:
        self.events.clear()
        self._start()  # response.created at once, before the prompt is prefilled
        return list(self.events)

    async def on_frame(self, item: Token | Done) -> list[bytes]:
        self.events.clear()
        self._start()
        if isinstance(item, Token):
            lp = output_logprobs(self.req, [item])
            self.all_lp.extend(lp)
            self.pending_lp.extend(lp)
        self._emit(*self.parser.feed(item.text))
        if isinstance(item, Token):
            return list(self.events)
        self._emit(*self.parser.finish())
        status = "incomplete" if item.finish_reason == "length" else "completed"
        if not self.ans.output:
            self._open_message()
        if self.msg_open:
            self._close_message(status)
        out = self.parser.result()
        resp = self.ans.finish(self.request, item, out.calls, out.content)
        self._ev("response.completed" if status == "completed" else "response.incomplete", response=resp)
        return list(self.events)

    def on_error(self, err: ApiError) -> bytes:
        self.events.clear()
        self._ev("response.failed", response=self.ans.obj("failed", error=err))
        return self.events[0]

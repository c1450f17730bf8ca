"""A finished background job's answer, read from the SSE events its dialect's streaming handler
wrote (router.dialects.background): the events' JSON payloads, and one ``chat.completion`` /
``text_completion`` object assembled from its chunks as the OpenAI SDKs assemble a stream.
"""

from __future__ import annotations

import json
from typing import Any


def event_data(events: list[bytes]) -> list[Any]:
    """The JSON payload of every ``data:`` line of ``events`` (SSE bytes), ``[DONE]`` aside."""
    out = []
    for ev in events:
        for line in ev.split(b"\n"):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                out.append(json.loads(line[6:]))
    return out


def accumulate(chunks: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    """One ``chat.completion`` / ``text_completion`` object from its stream's chunks:
    content and text concatenated, tool calls merged by index, logprobs joined, the
    last finish_reason, the usage and timings chunk's figures."""
    head = chunks[0]
    choices: dict[int, dict[str, Any]] = {}
    usage = timings = None
    for ch in chunks:
        usage = ch.get("usage") or usage
        timings = ch.get("timings") or timings
        for c in ch["choices"]:
            i = int(c["index"])
            if kind == "chat.completion":
                acc = choices.setdefault(i, {"index": i, "message": {"role": "assistant", "content": None,
                                                                     "refusal": None},
                                             "logprobs": None, "finish_reason": None})
                delta = c.get("delta") or {}
                msg = acc["message"]
                if delta.get("content") is not None:
                    msg["content"] = (msg["content"] or "") + delta["content"]
                for tc in delta.get("tool_calls") or []:
                    calls = msg.setdefault("tool_calls", [])
                    j = int(tc["index"])
                    while len(calls) <= j:
                        calls.append({"id": None, "type": "function", "function": {"name": "", "arguments": ""}})
                    if tc.get("id"):
                        calls[j]["id"] = tc["id"]
                    fn = tc.get("function") or {}
                    calls[j]["function"]["name"] += fn.get("name") or ""
                    calls[j]["function"]["arguments"] += fn.get("arguments") or ""
                lp = c.get("logprobs")
                if lp is not None:
                    acc["logprobs"] = acc["logprobs"] or {"content": [], "refusal": None}
                    acc["logprobs"]["content"].extend(lp.get("content") or [])
            else:
                acc = choices.setdefault(i, {"index": i, "text": "", "logprobs": None, "finish_reason": None})
                acc["text"] += c.get("text") or ""
                lp = c.get("logprobs")
                if lp is not None:
                    if acc["logprobs"] is None:
                        acc["logprobs"] = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
                    for k in acc["logprobs"]:
                        acc["logprobs"][k].extend(lp.get(k) or [])
            if c.get("finish_reason") is not None:
                acc["finish_reason"] = c["finish_reason"]
    out = {"id": head.get("id"), "object": kind, "created": head.get("created"), "model": head.get("model"),
           "system_fingerprint": head.get("system_fingerprint"),
           "choices": [choices[i] for i in sorted(choices)], "usage": usage}
    if timings is not None:
        out["timings"] = timings
    return out

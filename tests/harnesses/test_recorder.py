"""The recording proxy's one judgement: a harness that left right after the stream's own
end event had the whole answer; one that left before it did not."""

from __future__ import annotations

import pytest

from tests.harnesses.recorder import ends_answer


@pytest.mark.parametrize("tail", [
    b'data: {"choices":[]}\n\ndata: [DONE]\n\n',
    b'event: message_stop\ndata: {"type": "message_stop"}\n\n',
    b'event: response.incomplete\ndata: {"type":"response.incomplete","response":{}}\n\n',
    b'event: response.completed\ndata: {"type":"response.completed","response":{}}\n\n',
    b'{"model":"m","done":true,"done_reason":"stop"}\n',
])
def test_an_end_event_is_the_whole_answer(tail: bytes) -> None:
    assert ends_answer(tail)


@pytest.mark.parametrize("tail", [
    b"",
    b'data: {"choices":[{"delta":{"content":"[DONE]?"}}]}\n\ndata: {"choices":[]}\n\n',
    b'event: content_block_delta\ndata: {"type":"content_block_delta"}\n\n',
    b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta","delta":"x"}\n\n',
    b'{"model":"m","done":false}\n',
    b": keep-alive\n\n",
])
def test_a_stream_cut_before_its_end_event_is_not(tail: bytes) -> None:
    assert not ends_answer(tail)

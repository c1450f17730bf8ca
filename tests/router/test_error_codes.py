"""Protocol error codes are one typed enumeration (protocol.errors.ErrorCode) that the
worker sends and the router maps, every member to a definite answer; a code outside
it is logged and answered 502, never silently."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from protocol import Error, ErrorCode, decode, encode
from router.http.errors import WORKER_CODES, BadGateway, BadRequest, ContextLengthExceeded, from_worker_error

ROOT = Path(__file__).resolve().parents[2]


def test_every_code_has_an_answer() -> None:
    assert set(WORKER_CODES) == set(ErrorCode)
    assert from_worker_error("context_length_exceeded", "m").__class__ is ContextLengthExceeded
    err = from_worker_error(ErrorCode.KV_BUDGET_EXCEEDED, "too big")
    assert isinstance(err, BadRequest) and err.code == "kv_budget_exceeded" and type(err.code) is str
    assert from_worker_error("worker_gone", "x").code == "worker_crashed"


def test_unknown_code_is_logged_and_a_502(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="modelyard.errors"):
        err = from_worker_error("brand_new_code", "something")
    assert isinstance(err, BadGateway) and err.status == 502 and err.code == "worker_error"
    assert "brand_new_code" in err.message and "brand_new_code" in caplog.text


def test_a_member_is_its_string_on_the_wire() -> None:
    frame = encode(Error(id="r1", code=ErrorCode.BUSY, message="later"))
    back = decode(frame)
    assert isinstance(back, Error) and back.code == "busy" and ErrorCode.of(back.code) is ErrorCode.BUSY
    assert ErrorCode.of("nope") is None


def test_every_code_the_worker_and_engine_send_is_enumerated() -> None:
    sent: set[str] = set()
    for path in (ROOT / "worker").rglob("*.py"):
        text = path.read_text()
        sent |= set(re.findall(r'EngineError\(\s*"([a-z_]+)"', text))
        sent |= set(re.findall(r'\bError\("([a-z_]+)"', text))
        sent |= set(re.findall(r'code="([a-z_]+)"', text))
        sent |= {m.lower() for m in re.findall(r"ErrorCode\.([A-Z_]+)", text)}
    assert sent, "found no codes: the scan is broken"
    assert sent <= {c.value for c in ErrorCode}, sent - {c.value for c in ErrorCode}

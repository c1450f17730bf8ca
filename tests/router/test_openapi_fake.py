"""``GET /openapi.json`` and a schemathesis run against it (fake workers): the document
covers exactly the public routes of the routes table, and no generated request (valid or
not by the document) gets a 5xx; the router answers as before afterwards."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from starlette.routing import Route

from router.app import create_app
from router.config import parse_config
from router.dialects.openapi import PRIVATE_PREFIXES
from tests.router.conftest import LiveRouter, dummy_gguf

pytestmark = pytest.mark.reliability

CONFIG = """
[server]
models_dir = "."
header_timeout_s = 2
body_timeout_s = 2
[models.m]
path = "m.gguf"
[models.other]
path = "other.gguf"
"""

#: Examples per operation: bounded so the run stays a few seconds.
EXAMPLES = 12


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    dummy_gguf(module_tmp, "m.gguf")
    dummy_gguf(module_tmp, "other.gguf")
    r = LiveRouter(module_tmp, CONFIG)
    yield r
    r.stop()


@pytest.fixture(scope="module")
def api(router: LiveRouter) -> Any:
    return schemathesis.openapi.from_url(router.url + "/openapi.json")


def _reference(router: LiveRouter) -> str:
    r = httpx.post(router.url + "/v1/completions", timeout=30,
                   json={"model": "m", "prompt": "same", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


def test_document_lists_every_public_route_of_the_table(router: LiveRouter, module_tmp: Path) -> None:
    doc = httpx.get(router.url + "/openapi.json", timeout=30).json()
    assert doc["openapi"].startswith("3.") and doc["info"]["title"] == "modelyard"
    app = create_app(parse_config({"server": {"models_dir": str(module_tmp)}, "models": {"m": {"path": "m.gguf"}}},
                                  base_dir=module_tmp))
    want = {(re.sub(r":\w+}", "}", r.path), m.lower()) for r in app.routes if isinstance(r, Route) and not r.path.startswith(PRIVATE_PREFIXES)
            for m in (r.methods or set()) - {"HEAD"}}
    got = {(p, m) for p, ops in doc["paths"].items() for m in ops}
    assert got == want
    assert ("/v1/chat/completions", "post") in got and not any(p.startswith("/admin") for p, _ in got)
    chat = doc["paths"]["/v1/chat/completions"]["post"]
    assert chat["requestBody"]["content"]["application/json"]["schema"]["properties"]["model"]["enum"] == ["m", "other"]
    assert doc["paths"]["/slots/{id_slot}"]["post"]["parameters"][0]["name"] == "id_slot"


@pytest.fixture(scope="module")
def before(router: LiveRouter) -> str:
    return _reference(router)


def test_schemathesis_finds_no_5xx(api: Any, before: str) -> None:
    """Every operation of the document, ``EXAMPLES`` generated requests each (schemathesis's
    own strategies, driven by hypothesis here: its pytest plugin does not load on pytest 9)."""
    ops = [r.ok() for r in api.get_all_operations()]
    assert len(ops) > 20
    seen: dict[int, int] = {}
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=list(HealthCheck))
        def run(case: Any) -> None:
            case.headers = {**(case.headers or {}), "Connection": "close"}
            response = case.call(timeout=30)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            if response.status_code == 501 and op.path == "/slots/{id_slot}":
                # llama.cpp's answer (README) while slot_save_path is unset (the fake worker has no slots)
                assert response.json()["error"]["code"] == "not_supported"
                return
            case.validate_response(response, checks=[not_a_server_error])

        run()
    print(f"\n[schemathesis] {len(ops)} operations, statuses {dict(sorted(seen.items()))}")
    assert not any(code >= 500 and code != 501 for code in seen)


def test_router_answers_as_before_after_the_fuzz(router: LiveRouter, before: str) -> None:
    assert _reference(router) == before

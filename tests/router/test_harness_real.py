"""The harness APIs against the real SmolLM2 worker, driven by the official SDKs at
temperature 0: Anthropic Messages (``anthropic``), OpenAI Responses and chat tools /
structured output (``openai``). Streamed answers equal non-streamed ones.

The model's config sets ``temperature = 0`` (the current anthropic SDK sends no
temperature at all), so every request here is greedy.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import anthropic
import openai
import pytest

from tests.router.conftest import MODELS, SMOLLM2, LiveRouter

pytestmark = [pytest.mark.slow]

CONFIG = f"""
[server]
models_dir = "{MODELS}"
[defaults]
n_ctx = 1024
load_timeout_s = 300
temperature = 0
[models.SmolLM2-135M-Instruct]
path = "{SMOLLM2.name}"
aliases = ["smollm2"]
"""

MSG = [{"role": "user", "content": "Name three colours of the rainbow."}]


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    r = LiveRouter(module_tmp, CONFIG, real=True)
    yield r
    r.stop(timeout=60)
    r.kill()


@pytest.fixture(scope="module")
def claude(router: LiveRouter) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=router.url, api_key="unused", max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def oai(router: LiveRouter) -> openai.OpenAI:
    return router.client(timeout=300)


# ----------------------------------------------------------------------------- Anthropic


def test_anthropic_messages_streamed_equals_non_streamed(claude: anthropic.Anthropic) -> None:
    kw = dict(model="smollm2", max_tokens=24, system="Answer briefly.", messages=MSG)
    m = claude.messages.create(**kw)  # type: ignore[arg-type]
    assert m.content[0].type == "text" and m.content[0].text.strip()
    assert m.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(**kw) as s:  # type: ignore[arg-type]
        deltas = [t for t in s.text_stream]
        final = s.get_final_message()
    assert "".join(deltas) == m.content[0].text == final.content[0].text  # type: ignore[union-attr]
    assert final.stop_reason == m.stop_reason and final.usage.output_tokens == m.usage.output_tokens
    n = claude.messages.count_tokens(model="smollm2", system="Answer briefly.", messages=MSG)  # type: ignore[arg-type]
    for u in (m.usage, final.usage):
        assert u.input_tokens + (u.cache_read_input_tokens or 0) == n.input_tokens


def test_anthropic_max_tokens_and_stop_sequence(claude: anthropic.Anthropic) -> None:
    m = claude.messages.create(model="smollm2", max_tokens=3, messages=MSG)  # type: ignore[arg-type]
    assert m.stop_reason == "max_tokens" and m.usage.output_tokens == 3
    full = claude.messages.create(model="smollm2", max_tokens=24, messages=MSG)  # type: ignore[arg-type]
    word = full.content[0].text.split()[2]  # type: ignore[union-attr]
    m = claude.messages.create(model="smollm2", max_tokens=24, stop_sequences=[word], messages=MSG)  # type: ignore[arg-type]
    assert m.stop_reason == "stop_sequence" and m.stop_sequence == word
    assert word not in m.content[0].text  # type: ignore[union-attr]


# ----------------------------------------------------------------------------- OpenAI Responses


def test_responses_streamed_equals_non_streamed(oai: openai.OpenAI) -> None:
    kw = dict(model="smollm2", instructions="Answer briefly.", input=MSG[0]["content"], max_output_tokens=24)
    r = oai.responses.create(**kw)  # type: ignore[call-overload]
    assert r.output_text.strip() and r.status in ("completed", "incomplete")
    deltas, final = [], None
    for ev in oai.responses.create(**kw, stream=True):  # type: ignore[call-overload]
        if ev.type == "response.output_text.delta":
            deltas.append(ev.delta)
        elif ev.type in ("response.completed", "response.incomplete"):
            final = ev.response
    assert final is not None and "".join(deltas) == final.output_text == r.output_text
    assert final.status == r.status and final.usage.output_tokens == r.usage.output_tokens  # type: ignore[union-attr]
    n = oai.responses.input_tokens.count(model="smollm2", instructions="Answer briefly.", input=MSG[0]["content"])
    assert n.input_tokens == r.usage.input_tokens == final.usage.input_tokens  # type: ignore[union-attr]
    follow = oai.responses.create(model="smollm2", input="Now one more colour.", previous_response_id=r.id,
                                  max_output_tokens=16)
    assert follow.output_text.strip() and follow.usage is not None
    assert follow.usage.input_tokens > r.usage.output_tokens  # type: ignore[union-attr]  # the answer is in the prompt

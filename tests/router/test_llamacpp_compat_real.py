"""The llama-server behaviours of issue 28 that go through the real worker (``python -m worker``
on SmolLM2-135M): the template variables (date_string, enable_thinking, a turn's
reasoning_content) reach the engine's renderer, the engine's context overflow answers
llama-server's exceed_context_size_error with its figures, and a long prompt's prefill is
reported pass by pass (return_progress)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import httpx
import pytest

from tests.router.conftest import MODELS, SMOLLM2, LiveRouter

pytestmark = [pytest.mark.slow]

TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
            "{%- if m.get('reasoning_content') %}{{ '<think>' + m['reasoning_content'] + '</think>' }}{%- endif %}"
            "{{ m['content'] + '<|im_end|>\\n' }}{%- endfor %}"
            "{{ 'date=' + date_string + '\\n' }}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
            "{%- if not enable_thinking %}{{ '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}")


@pytest.fixture(scope="module")
def router(module_tmp: Path) -> Iterator[LiveRouter]:
    config = f"""
[server]
models_dir = "{MODELS}"
[defaults]
n_ctx = 64
load_timeout_s = 300
ping_interval_s = 0
[models.think]
path = "{SMOLLM2.name}"
chat_template = {json.dumps(TEMPLATE)}
[models.nothink]
path = "{SMOLLM2.name}"
chat_template = {json.dumps(TEMPLATE)}
reasoning = "off"
[models.long]
path = "{SMOLLM2.name}"
n_ctx = 1024
"""
    r = LiveRouter(module_tmp, config, real=True)
    yield r
    r.stop()


def test_template_variables_reach_the_engine(router: LiveRouter) -> None:
    msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo", "reasoning_content": "greet"},
            {"role": "user", "content": "bye"}]
    before = datetime.now().strftime("%d %b %Y")
    r = httpx.post(router.url + "/apply-template", json={"model": "think", "messages": msgs}, timeout=300)
    after = datetime.now().strftime("%d %b %Y")
    assert r.status_code == 200, r.text
    prompt = r.json()["prompt"]
    assert "<|im_start|>assistant\n<think>greet</think>yo<|im_end|>" in prompt
    assert any(f"date={d}\n" in prompt for d in (before, after)), prompt
    assert prompt.endswith("<|im_start|>assistant\n")  # enable_thinking: the think block stays open
    r = httpx.post(router.url + "/apply-template", json={"model": "nothink", "messages": msgs}, timeout=300)
    assert r.json()["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    r = httpx.post(router.url + "/apply-template", timeout=300, json={
        "model": "nothink", "messages": msgs, "chat_template_kwargs": {"enable_thinking": True}})
    assert r.json()["prompt"].endswith("<|im_start|>assistant\n")
    # a generation renders the same way: its prompt counts the same tokens as the rendered text
    r = httpx.post(router.url + "/chat/completions/input_tokens", json={"model": "think", "messages": msgs},
                   timeout=300)
    text = httpx.post(router.url + "/apply-template", json={"model": "think", "messages": msgs}, timeout=300)
    n = httpx.post(router.url + "/tokenize", json={"model": "think", "content": text.json()["prompt"],
                                                   "add_special": True}, timeout=300).json()["tokens"]
    assert r.status_code == 200 and r.json()["input_tokens"] == len(n)


def test_an_over_long_prompt_is_exceed_context_size_error(router: LiveRouter) -> None:
    words = " ".join(["hello"] * 100)
    r = httpx.post(router.url + "/completion", json={"model": "think", "prompt": words, "n_predict": 4}, timeout=300)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "exceed_context_size_error" and err["n_ctx"] == 64 and err["n_prompt_tokens"] > 64, err
    assert err["message"].startswith(f"request ({err['n_prompt_tokens']} tokens) exceeds the available context "
                                     "size (64 tokens), try increasing it")
    n = httpx.post(router.url + "/tokenize", json={"model": "think", "content": words, "add_special": True},
                   timeout=300).json()["tokens"]
    assert err["n_prompt_tokens"] == len(n)


def test_post_sampling_probs_are_the_chains_candidates(router: LiveRouter) -> None:
    """With top_k 5 and n_probs 10, each token's top_probs are the 5 candidates left after the
    chain, their probabilities sum to 1, and the chosen token is one of them with its prob."""
    body = {"model": "think", "prompt": "The capital of France is", "n_predict": 4, "n_probs": 10, "top_k": 5,
            "top_p": 1.0, "min_p": 0.0, "temperature": 0.7, "seed": 3, "post_sampling_probs": True}
    r = httpx.post(router.url + "/completion", json=body, timeout=300)
    assert r.status_code == 200, r.text
    probs = r.json()["completion_probabilities"]
    assert len(probs) == 4
    for e in probs:
        top = e["top_probs"]
        assert len(top) == 5 and abs(sum(t["prob"] for t in top) - 1.0) < 1e-6
        assert [t["prob"] for t in top] == sorted((t["prob"] for t in top), reverse=True)
        assert any(t["id"] == e["id"] and abs(t["prob"] - e["prob"]) < 1e-9 for t in top)
    plain = httpx.post(router.url + "/completion", json={**body, "post_sampling_probs": False}, timeout=300)
    assert [e["id"] for e in plain.json()["completion_probabilities"]] == [e["id"] for e in probs]  # same sampling


def test_several_prompts_answer_as_each_alone(router: LiveRouter) -> None:
    """/completion with several prompts (run side by side in the worker's batch) answers each
    prompt exactly as a request of its own does, in order and when streamed (temperature 0; no
    prompt cache, so every evaluation is fresh)."""
    prompts = ["The sky is", "One, two, three,"]
    common = {"model": "think", "n_predict": 6, "temperature": 0, "cache_prompt": False}
    alone = []
    for p in prompts:
        r = httpx.post(router.url + "/completion", json={**common, "prompt": p}, timeout=300)
        assert r.status_code == 200, r.text
        alone.append(r.json()["content"])
    r = httpx.post(router.url + "/completion", json={**common, "prompt": prompts}, timeout=300)
    assert r.status_code == 200, r.text
    assert [o["index"] for o in r.json()] == [0, 1] and [o["content"] for o in r.json()] == alone
    r = httpx.post(router.url + "/completion", json={**common, "prompt": prompts, "stream": True}, timeout=300)
    chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
    assert ["".join(c["content"] for c in chunks if c["index"] == i) for i in range(2)] == alone


def test_return_progress_reports_each_prefill_pass(router: LiveRouter) -> None:
    """llama-server's return_progress on the real engine: a prompt of ~600 tokens is prefilled in
    passes of at most 256 tokens (the engine's n_batch), each reported before the first token —
    its start (processed == cache == 0), then every pass, the last with processed == total;
    the same prompt again starts from what the prefix cache holds."""
    prompt = "Progress check. " + " ".join(f"item {i}," for i in range(120))
    body = {"model": "long", "prompt": prompt, "n_predict": 3, "temperature": 0, "stream": True,
            "return_progress": True}

    def progress_of() -> tuple[list[dict], dict]:
        r = httpx.post(router.url + "/completion", json=body, timeout=300)
        assert r.status_code == 200, r.text
        chunks = [json.loads(ln[6:]) for ln in r.text.splitlines() if ln.startswith("data: {")]
        reports = [c["prompt_progress"] for c in chunks if "prompt_progress" in c]
        assert chunks[:len(reports)] == [c for c in chunks if "prompt_progress" in c]  # all before any token
        return reports, chunks[-1]

    reports, final = progress_of()
    total = final["tokens_evaluated"]
    assert 512 < total < 1000 and final["stop"] is True
    assert reports[0] == {"total": total, "cache": 0, "processed": 0, "time_ms": 0}
    done = [r["processed"] for r in reports]
    assert done[-1] == total and len(reports) >= 4  # the start and at least three passes
    assert all(0 < b - a <= 256 for a, b in zip(done, done[1:]))
    assert all(r["total"] == total and r["cache"] == 0 for r in reports)
    assert all(a["time_ms"] <= b["time_ms"] for a, b in zip(reports, reports[1:]))
    again, _ = progress_of()
    cache = again[0]["cache"]
    assert 0 < cache < total and again[0]["processed"] == cache and again[-1]["processed"] == total
    assert len(again) == 2 and all(r["cache"] == cache for r in again)
    print(f"return_progress: processed {done} of {total}; again from the cache: {[r['processed'] for r in again]}")

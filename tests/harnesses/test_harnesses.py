"""The real harnesses, installed from npm and PyPI (pinned: ``install.py``), each run once
with its default settings on a throwaway git repository with a one-line task, against
a live router on the shipped models (``conftest.CONFIG``; ``n_predict`` bounds every
answer). Each must exit 0 with every request it sent answered 200 and read to the end;
the exchanges are kept (the directory is printed at the end of the run).

The settings each test uses are the ones README's "Harnesses" section gives, and only
those: an endpoint, a key the router does not check, a model name — nothing switched off.
One harness runs at a time (the machine has 2 cores).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.harnesses.conftest import RUN_TIMEOUT_S, TASK, Workspace, check_run

pytestmark = [pytest.mark.harness, pytest.mark.slow, pytest.mark.timeout(3000)]

KEY = "modelyard"  # any value: the router here has no api_key


# The harnesses' configuration files, as README's "Harnesses" section gives them (``url``: the
# router's base URL; README writes it http://127.0.0.1:PORT and the key <any>).


def codex_config(url: str) -> str:
    return (f'model = "gemma3"\nmodel_provider = "modelyard"\n\n[model_providers.modelyard]\nname = "modelyard"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\n')


def opencode_config(url: str, key: str = KEY) -> dict[str, Any]:
    return {"$schema": "https://opencode.ai/config.json",
            "provider": {"modelyard": {
                "npm": "@ai-sdk/openai-compatible", "name": "modelyard",
                "options": {"baseURL": f"{url}/v1", "apiKey": key},
                "models": {"gemma3": {"name": "Gemma 3 270M", "limit": {"context": 32768, "output": 4096}}}}},
            "model": "modelyard/gemma3"}


def llm_models(url: str) -> str:
    return f'- model_id: smollm2\n  model_name: smollm2\n  api_base: "{url}/v1"\n'


def test_claude_code(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """Claude Code (``claude -p``) on /v1/messages: ANTHROPIC_BASE_URL + ANTHROPIC_API_KEY, no
    login; its main and its small/fast model both gemma3."""
    env = workspace.env(ANTHROPIC_BASE_URL=workspace.url, ANTHROPIC_API_KEY=KEY, ANTHROPIC_MODEL="gemma3",
                        ANTHROPIC_DEFAULT_HAIKU_MODEL="gemma3", ANTHROPIC_SMALL_FAST_MODEL="gemma3")
    run = workspace.run([str(harness_bins["claude"]), "-p", TASK], env)
    errors = {line.strip() for line in run.output.splitlines() if "API Error" in line}
    if run.returncode == 1 and errors and all(e.startswith(CLAUDE_CUT) for e in errors):
        # Every answer ran into the router's n_predict (stop_reason max_tokens: base Gemma rarely
        # stops by itself); Claude Code resumes a few times, asking up to 128000 tokens, then reports
        # "exceeded the ... output token maximum" and exits 1: the model's limit, not a failed request.
        # Every exchange is still checked; the last answer must have ended so.
        assert _stop_reason(run.exchanges[-1]) == "max_tokens", run.output[-3000:]
        run.returncode, errors = 0, set()
    check_run(run, workspace.router, ("/v1/messages",))
    assert not errors, run.output[-3000:]


CLAUDE_CUT = "API Error: Claude's response exceeded the"


def _stop_reason(x: dict[str, Any]) -> str | None:
    body = x["response"].get("body")
    if not isinstance(body, str):
        return None
    for line in reversed(body.splitlines()):
        if line.startswith("data: ") and '"message_delta"' in line:
            return json.loads(line[6:])["delta"].get("stop_reason")  # type: ignore[no-any-return]
    return None


def test_codex_cli(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """Codex CLI (``codex exec``) on /v1/responses: a custom model provider in
    $CODEX_HOME/config.toml pointing at the router, wire_api "responses"."""
    codex_home = workspace.home / ".codex"
    codex_home.mkdir()
    (codex_home / "config.toml").write_text(codex_config(workspace.url))
    run = workspace.run([str(harness_bins["codex"]), "exec", TASK], workspace.env(CODEX_HOME=str(codex_home)))
    errors = {line.strip() for line in run.output.splitlines() if line.startswith("ERROR:")}
    if run.returncode == 1 and errors == {CODEX_CUT}:
        # The model's answer ran into the router's n_predict (Gemma 270M is a base model: at
        # temperature 0 it rarely stops by itself) and the response said so (status incomplete,
        # max_output_tokens), which Codex reports and exits 1 on: the model's limit, not an API
        # error. Every exchange is still checked; one of them must be that incomplete answer.
        assert any(_incomplete(x) for x in run.exchanges), run.output[-3000:]
        run.returncode = 0
    check_run(run, workspace.router, ("/v1/responses",))
    assert not errors - {CODEX_CUT}, run.output[-3000:]


CODEX_CUT = "ERROR: Incomplete response returned, reason: max_output_tokens"


def _incomplete(x: dict[str, Any]) -> bool:
    body = x["response"].get("body")
    return isinstance(body, str) and '"type":"response.incomplete"' in body.replace(" ", "") \
        and '"reason":"max_output_tokens"' in body.replace(" ", "")


def test_qwen_code(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """qwen-code (one-shot prompt) on /v1/chat/completions: OPENAI_BASE_URL, OPENAI_API_KEY,
    OPENAI_MODEL."""
    env = workspace.env(OPENAI_BASE_URL=f"{workspace.url}/v1", OPENAI_API_KEY=KEY, OPENAI_MODEL="gemma3")
    run = workspace.run([str(harness_bins["qwen"]), TASK], env, timeout=QWEN_TIMEOUT_S)
    if run.returncode != 0 and QWEN_RETRY in run.output:
        # Every answer ran into the router's n_predict (finish_reason "length": base Gemma rarely stops
        # by itself) and qwen-code asks again, keeping what was delivered ("Retrying provider attempt"),
        # until the run's bound ends it: the model's limit, not a failed request. Every answer read to
        # the end is still checked (200, consumed, the access log agrees), and each must have been cut
        # at the suite's n_predict; the one in flight when the bound killed qwen-code is left out.
        finished = [x for x in run.exchanges if x["consumed"]]
        gens = [x for x in finished if x["request"]["path"].split("?")[0] == "/v1/chat/completions"]
        assert gens and all(_finish_reason(x) == "length" for x in gens), run.output[-3000:]
        run.exchanges, run.returncode = finished, 0
    check_run(run, workspace.router, ("/v1/chat/completions",))


#: qwen-code's line when it asks again after an answer cut by the length limit.
QWEN_RETRY = "Retrying provider attempt"
#: qwen-code's bound: its retry loop on cut answers never ends by itself (see test_qwen_code).
QWEN_TIMEOUT_S = min(RUN_TIMEOUT_S, 300.0)


def _finish_reason(x: dict[str, Any]) -> str | None:
    """The finish_reason of a streamed (or not) chat completion exchange."""
    body = x["response"].get("body")
    if not isinstance(body, str):
        return None
    if not body.lstrip().startswith("data:"):
        try:
            return json.loads(body)["choices"][0].get("finish_reason")  # type: ignore[no-any-return]
        except (ValueError, KeyError, IndexError):
            return None
    for line in reversed(body.splitlines()):
        if line.startswith("data: {") and '"finish_reason":"' in line.replace(" ", ""):
            for c in json.loads(line[6:]).get("choices") or []:
                if c.get("finish_reason"):
                    return c["finish_reason"]  # type: ignore[no-any-return]
    return None


def test_opencode(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """opencode (``opencode run``) on /v1/chat/completions: a provider in
    $XDG_CONFIG_HOME/opencode/opencode.json (``@ai-sdk/openai-compatible``, baseURL the router)."""
    conf = workspace.home / ".config" / "opencode"
    conf.mkdir(parents=True)
    (conf / "opencode.json").write_text(json.dumps(opencode_config(workspace.url), indent=2))
    run = workspace.run([str(harness_bins["opencode"]), "run", TASK], workspace.env())
    check_run(run, workspace.router, ("/v1/chat/completions",))


def test_aider(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """aider (``--message ... --yes-always``) on /v1/chat/completions: OPENAI_API_BASE,
    OPENAI_API_KEY, model ``openai/smollm2``."""
    env = workspace.env(OPENAI_API_BASE=f"{workspace.url}/v1", OPENAI_API_KEY=KEY)
    run = workspace.run([str(harness_bins["aider"]), "--model", "openai/smollm2", "--message", TASK,
                         "--yes-always", "calc.py"], env)
    check_run(run, workspace.router, ("/v1/chat/completions",))


def test_llm(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """llm (``llm -m smollm2``) on /v1/chat/completions: the model declared in
    $LLM_USER_PATH/extra-openai-models.yaml with the router as api_base."""
    user = workspace.home / "llm"
    user.mkdir()
    (user / "extra-openai-models.yaml").write_text(llm_models(workspace.url))
    env = workspace.env(LLM_USER_PATH=str(user), OPENAI_API_KEY=KEY)
    run = workspace.run([str(harness_bins["llm"]), "-m", "smollm2", TASK], env)
    check_run(run, workspace.router, ("/v1/chat/completions",))


def test_mini_swe_agent(workspace: Workspace, harness_bins: dict[str, Path]) -> None:
    """mini-swe-agent (``mini -t ... --yolo --exit-immediately``) on /v1/chat/completions through
    litellm: OPENAI_API_BASE, OPENAI_API_KEY, model ``openai/smollm2``; MSWEA_CONFIGURED (no
    first-run wizard) and MSWEA_COST_TRACKING=ignore_errors (a local model has no price: its
    documented setting for local models). Its default step limit is none, so the run is bounded
    with ``agent.step_limit`` as n_predict bounds the answers."""
    env = workspace.env(OPENAI_API_BASE=f"{workspace.url}/v1", OPENAI_API_KEY=KEY, MSWEA_CONFIGURED="true",
                        MSWEA_COST_TRACKING="ignore_errors")
    run = workspace.run([str(harness_bins["mini"]), "-m", "openai/smollm2", "-t", TASK, "--yolo",
                         "--exit-immediately", "-c", "mini.yaml", "-c", "agent.step_limit=3"], env)
    check_run(run, workspace.router, ("/v1/chat/completions",))

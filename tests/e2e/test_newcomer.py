"""End to end, as a newcomer runs it: README's first command, then the openai SDK.

Starts ``./scripts/serve --port <free port>`` (README's serve command, which
creates/validates the venv, fetches the models and runs ``modelyard serve`` with
the shipped ``config.toml``) as a subprocess, then with the official ``openai``
SDK: lists models, streams a chat completion from ``smollm2`` and checks the
streamed text equals the non-streamed text at temperature 0, runs a completion
on the Gemma model, and stops the service with SIGTERM, checking no process
(router or worker) is left behind.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import psutil
import pytest
from openai import OpenAI

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _descendants(pid: int) -> list[psutil.Process]:
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


class Service:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log
        self.base_url = f"http://127.0.0.1:{port}"
        self.seen: dict[int, psutil.Process] = {}

    def remember_processes(self) -> None:
        for p in [psutil.Process(self.proc.pid), *_descendants(self.proc.pid)]:
            self.seen[p.pid] = p


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    port = _free_port()
    log = tmp_path_factory.mktemp("e2e") / "serve.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(["./scripts/serve", "--port", str(port)], cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    svc = Service(proc, port, log)
    deadline = time.monotonic() + 600
    while True:
        if proc.poll() is not None:
            pytest.fail(f"scripts/serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(f"{svc.base_url}/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"service did not come up:\n{log.read_text()[-4000:]}")
        time.sleep(0.3)
    try:
        yield svc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def client(service: Service) -> OpenAI:
    return OpenAI(base_url=f"{service.base_url}/v1", api_key="unused", max_retries=0, timeout=300)


def test_list_models(client: OpenAI) -> None:
    ids = {m.id for m in client.models.list().data}
    assert "smollm2" in ids
    assert any("gemma" in i for i in ids), ids


def test_streamed_chat_equals_non_streamed(client: OpenAI, service: Service) -> None:
    messages = [{"role": "user", "content": "Name three colours of the rainbow."}]
    full = client.chat.completions.create(model="smollm2", messages=messages, temperature=0, max_tokens=40)
    text = full.choices[0].message.content or ""
    assert text.strip()
    assert full.usage is not None and full.usage.completion_tokens > 0

    pieces: list[str] = []
    roles: list[str] = []
    stream = client.chat.completions.create(model="smollm2", messages=messages, temperature=0,
                                            max_tokens=40, stream=True)
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        for choice in chunk.choices:
            if choice.delta.role:
                roles.append(choice.delta.role)
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert roles and roles[0] == "assistant"
    assert "".join(pieces) == text
    service.remember_processes()


def test_gemma_completion(client: OpenAI, service: Service) -> None:
    gemma = next(m.id for m in client.models.list().data if "gemma" in m.id)
    out = client.completions.create(model=gemma, prompt="The capital of France is", temperature=0, max_tokens=8)
    assert out.choices[0].text.strip()
    assert out.usage is not None and out.usage.prompt_tokens > 0
    service.remember_processes()


def test_shutdown_leaves_no_process(service: Service) -> None:
    service.remember_processes()
    assert len(service.seen) >= 3, "expected the router plus two workers"
    os.kill(service.proc.pid, signal.SIGTERM)
    service.proc.wait(timeout=60)
    deadline = time.monotonic() + 15
    alive = [p for p in service.seen.values() if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {[(p.pid, p.cmdline()) for p in alive]}"

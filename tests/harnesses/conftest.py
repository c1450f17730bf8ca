"""The real-harness suite's set-up: the harnesses installed (pinned, cached outside the
repo: ``tests/harnesses/install.py``), one live router on the shipped models for the
session, a throwaway git repository and a recording proxy per test, and the
exchanges kept as artifacts (their directory is printed at the end of the run).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.harnesses.install import cache_dir, install
from tests.harnesses.recorder import Recorder
from tests.router.conftest import GEMMA, MODELS, SMOLLM2, LiveRouter

#: An answer's length when a request names none, and its cap (llama.cpp's -n): every harness
#: run is bounded by it (Claude Code asks 32000 tokens, Codex and aider name none).
N_PREDICT = 256

#: The router the harnesses talk to: the shipped models; Gemma with a context large enough for
#: the big harness prompts (Claude Code, Codex, qwen-code, opencode: 10k-25k tokens).
CONFIG = f"""
[server]
models_dir = "{MODELS}"
[defaults]
load_timeout_s = 300
n_predict = {N_PREDICT}
temperature = 0
[models.SmolLM2-135M-Instruct]
path = "{SMOLLM2.name}"
aliases = ["smollm2"]
n_ctx = 8192
[models.gemma-3-270m]
path = "{GEMMA.name}"
aliases = ["gemma3"]
chat_template = "gemma"
n_ctx = 32768
"""

#: Bounds one harness run: on a quiet 2-core machine each takes a minute or two (a 12k-token prompt
#: prefills in ~15-20 s on Gemma, 256 tokens decode in ~4 s); seven such bounds stay within CI's 90 min.
RUN_TIMEOUT_S = float(os.environ.get("MODELYARD_HARNESS_TIMEOUT_S") or 600)  # a slow or busy machine may raise it

TASK = "Fix the bug in calc.py: add() must return the sum of its arguments."

_ARTIFACTS: list[Path] = []


@pytest.fixture(scope="session")
def harness_bins() -> dict[str, Path]:
    """Every harness installed (once; cached between runs). Fails — never skips — when one
    cannot be installed."""
    return install()


#: Runs' exchange directories kept under <cache>/exchanges (oldest removed first).
KEEP_RUNS = 10


@pytest.fixture(scope="session")
def artifacts_root() -> Path:
    """Where this run's exchanges go: ``$MODELYARD_HARNESS_ARTIFACTS``, else
    ``<harness cache>/exchanges/<UTC time>-<pid>`` (outside the repository and outside pytest's
    rotating temp dirs; the newest KEEP_RUNS runs are kept). Printed at the end of the run."""
    if os.environ.get("MODELYARD_HARNESS_ARTIFACTS"):
        root = Path(os.environ["MODELYARD_HARNESS_ARTIFACTS"])
    else:
        base = cache_dir() / "exchanges"
        base.mkdir(parents=True, exist_ok=True)
        for old in sorted(p for p in base.iterdir() if p.is_dir())[:-(KEEP_RUNS - 1)]:
            shutil.rmtree(old, ignore_errors=True)
        root = base / f"{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}-{os.getpid()}"
    root.mkdir(parents=True, exist_ok=True)
    _ARTIFACTS.append(root)
    return root


@pytest.fixture(scope="session")
def live_router(artifacts_root: Path) -> Iterator[LiveRouter]:
    """One router for the session (its log, with the access lines, is kept with the exchanges)."""
    d = artifacts_root / "router"
    d.mkdir(exist_ok=True)
    with LiveRouter(d, CONFIG, real=True) as r:
        yield r


def pytest_terminal_summary(terminalreporter: Any) -> None:
    for root in _ARTIFACTS:
        terminalreporter.write_line(f"harness exchanges (requests and answers each harness sent): {root}")


@dataclass
class HarnessRun:
    """One harness run: its exit code and output, and the exchanges it had with the router."""

    name: str
    argv: list[str]
    returncode: int
    output: str
    seconds: float
    exchanges: list[dict[str, Any]] = field(default_factory=list)


class Workspace:
    """Per test: a throwaway git repository with a one-line bug, a private HOME, a recording
    proxy in front of the live router, and the directory where the exchanges go."""

    def __init__(self, name: str, tmp: Path, router: LiveRouter, artifacts: Path) -> None:
        self.name = name
        self.router = router
        self.out = artifacts / name
        if self.out.exists():
            shutil.rmtree(self.out)
        self.out.mkdir(parents=True)
        self.home = tmp / "home"
        self.home.mkdir()
        self.repo = tmp / "repo"
        self.repo.mkdir()
        (self.repo / "calc.py").write_text("def add(a, b):\n    return a - b\n")
        git = ["git", "-c", "user.name=modelyard", "-c", "user.email=harness@modelyard.invalid"]
        for args in (["init", "-q"], ["add", "calc.py"], ["commit", "-qm", "calc"]):
            subprocess.run([*git, *args], cwd=self.repo, check=True, capture_output=True)
        self.proxy = Recorder(router.url, self.out / "exchanges")
        self.url = self.proxy.url

    def env(self, **extra: str) -> dict[str, str]:
        """A clean environment: PATH and locale from ours, a private HOME (no user config of
        this machine leaks in), XDG caches shared between runs (harnesses that fetch packages
        at run time, as opencode its provider SDK, fetch them once), no provider keys or
        endpoints but those given."""
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "LC_ALL", "TERM", "TMPDIR", "USER")}
        keep.setdefault("LANG", "C.UTF-8")
        home_cache = cache_dir() / "xdg-cache"
        home_cache.mkdir(parents=True, exist_ok=True)
        return {**keep, "HOME": str(self.home), "XDG_CONFIG_HOME": str(self.home / ".config"),
                "XDG_DATA_HOME": str(self.home / ".local" / "share"), "XDG_CACHE_HOME": str(home_cache),
                "NO_COLOR": "1", **extra}

    def run(self, argv: list[str], env: dict[str, str], timeout: float = RUN_TIMEOUT_S) -> HarnessRun:
        """Runs the harness in its own process group (no stdin); at the end — exit or ``timeout`` —
        the whole group is killed, so no helper process it started (qwen-code's second node,
        opencode's server) goes on sending requests after the test."""
        t0 = time.monotonic()
        so, se = self.out / "stdout.txt", self.out / "stderr.txt"
        with so.open("w") as fo, se.open("w") as fe:  # files, not pipes: a helper left running holds no pipe
            p = subprocess.Popen(argv, cwd=self.repo, env=env, stdin=subprocess.DEVNULL, stdout=fo, stderr=fe,
                                 start_new_session=True)
            try:
                rc, head = p.wait(timeout=timeout), ""
            except subprocess.TimeoutExpired:
                rc, head = -9, f"TIMEOUT after {timeout} s\n"
            finally:
                _kill_group(p.pid)
                p.wait()
        stdout, stderr = so.read_text(errors="replace"), se.read_text(errors="replace")
        out = head + (stdout or "") + "\n--- stderr ---\n" + (stderr or "")
        seconds = time.monotonic() - t0
        (self.out / "output.txt").write_text(f"$ {' '.join(argv)}\nexit {rc} after {seconds:.1f} s\n\n{out}")
        time.sleep(0.5)  # the proxy records an exchange when its stream ends
        return HarnessRun(self.name, argv, rc, out, seconds, self.proxy.exchanges())

    def close(self) -> None:
        self.proxy.close()


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


_ACCESS = re.compile(r"modelyard\.access: (.*)$")


def access_lines(router: LiveRouter) -> dict[str, dict[str, str]]:
    """The router's access-log lines by request id."""
    out: dict[str, dict[str, str]] = {}
    for line in router.log_path.read_text(errors="replace").splitlines():
        m = _ACCESS.search(line)
        if m:
            rec = dict(kv.split("=", 1) for kv in m.group(1).split() if "=" in kv)
            out[rec.get("request_id", "")] = rec
    return out


def check_run(run: HarnessRun, router: LiveRouter, generation_routes: tuple[str, ...]) -> None:
    """The suite's verdict on one run: the harness exited 0; it sent at least one generation
    request; every request it sent was answered 200 and read to the end (the proxy's record
    and the router's access line agree: status 200, not disconnected)."""
    where = f"{run.name}: see {run.exchanges[0]['file'] if run.exchanges else 'output.txt'}\n{run.output[-3000:]}"
    assert run.returncode == 0, f"{run.name} exited {run.returncode} after {run.seconds:.0f} s\n{where}"
    gens = [x for x in run.exchanges if x["request"]["path"].split("?")[0] in generation_routes]
    assert gens, f"{run.name} sent no generation request ({generation_routes})\n{where}"
    access = access_lines(router)
    for x in run.exchanges:
        req, resp = x["request"], x["response"]
        what = f"{req['method']} {req['path']} ({x.get('file')})"
        assert resp.get("status") == 200, f"{run.name}: {what} answered {resp.get('status')}: " \
                                          f"{str(resp.get('body'))[:600]}"
        assert x["consumed"], f"{run.name}: {what} was not read to the end ({resp.get('error')})"
        rid = (resp.get("headers") or {}).get("x-request-id")
        line = access.get(rid or "")
        assert line is not None, f"{run.name}: {what}: no access-log line for request id {rid}"
        assert line["status"] == "200" and line["disconnected"] == "false", f"{run.name}: {what}: {line}"


@pytest.fixture
def workspace(request: pytest.FixtureRequest, tmp_path: Path, live_router: LiveRouter,
              artifacts_root: Path, harness_bins: dict[str, Path]) -> Iterator[Workspace]:
    name = request.node.name.removeprefix("test_")
    ws = Workspace(name, tmp_path, live_router, artifacts_root)
    yield ws
    ws.close()

"""The real harnesses, pinned, installed once into a cache outside the repository.

``HARNESSES`` is the one table of what the suite runs: the registry package, its
pinned version and the command it installs. npm packages go into one prefix
(``<cache>/npm``, ``npm install --prefix``); each PyPI package gets its own venv
(``<cache>/venv-<name>``: their pinned dependency sets — aider's especially — do not
mix). The cache is ``$MODELYARD_HARNESS_CACHE``, else
``${XDG_CACHE_HOME:-~/.cache}/modelyard/harnesses`` of the user (see :func:`cache_dir`); a
stamp file per install records
the pin, so a second run installs nothing, and a changed pin installs again.

An install that fails (no network, registry unreachable, npm missing) raises
:class:`InstallError`: the harness tests then FAIL, they never skip.

``python -m tests.harnesses.install`` installs them all ahead of a run (prints
where they are).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Harness:
    name: str  # the suite's name for it
    registry: str  # "npm" | "pypi"
    package: str
    version: str
    command: str  # the executable it installs

    @property
    def pin(self) -> str:
        return f"{self.package}@{self.version}" if self.registry == "npm" else f"{self.package}=={self.version}"


#: Everything the suite runs, pinned (late-2026 releases).
HARNESSES: dict[str, Harness] = {h.name: h for h in [
    Harness("claude", "npm", "@anthropic-ai/claude-code", "2.1.328", "claude"),
    Harness("codex", "npm", "@openai/codex", "0.169.0", "codex"),
    Harness("qwen", "npm", "@qwen-code/qwen-code", "0.24.4", "qwen"),
    Harness("opencode", "npm", "opencode-ai", "1.18.33", "opencode"),
    Harness("aider", "pypi", "aider-chat", "0.86.2", "aider"),
    Harness("llm", "pypi", "llm", "0.36", "llm"),
    Harness("mini", "pypi", "mini-swe-agent", "2.4.6", "mini"),
]}


class InstallError(RuntimeError):
    """A harness could not be installed (the message has the installer's output tail)."""


def cache_dir() -> Path:
    """``$MODELYARD_HARNESS_CACHE``, else ``<the user's cache>/modelyard/harnesses``. The user's
    cache is ``$MODELYARD_USER_CACHE_HOME`` when set — inside the test session
    ``tests/conftest.py`` points ``XDG_CACHE_HOME`` at a temporary directory removed at the end,
    and keeps the real one there — else ``$XDG_CACHE_HOME``, else ``~/.cache``."""
    env = os.environ.get("MODELYARD_HARNESS_CACHE")
    if env:
        return Path(env)
    base = (os.environ.get("MODELYARD_USER_CACHE_HOME") or os.environ.get("XDG_CACHE_HOME")
            or str(Path.home() / ".cache"))
    return Path(base) / "modelyard" / "harnesses"


def _run(cmd: list[str], what: str, timeout: float, cwd: Path | None = None) -> None:
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as e:
        raise InstallError(f"{what}: {cmd[0]} not found ({e})") from None
    except subprocess.TimeoutExpired:
        raise InstallError(f"{what}: {' '.join(cmd[:4])} ... still running after {timeout:.0f} s") from None
    if p.returncode != 0:
        raise InstallError(f"{what}: {' '.join(cmd[:6])} ... exited {p.returncode}\n"
                           f"{(p.stdout + p.stderr)[-4000:]}")
    print(f"[harnesses] {what}: installed in {time.monotonic() - t0:.0f} s", file=sys.stderr)


def _npm_bin(root: Path, h: Harness) -> Path:
    return root / "npm" / "node_modules" / ".bin" / h.command


def _venv_bin(root: Path, h: Harness) -> Path:
    return root / f"venv-{h.name}" / "bin" / h.command


def executable(h: Harness, root: Path | None = None) -> Path:
    """Where harness ``h``'s command is (installed or not)."""
    root = root or cache_dir()
    return _npm_bin(root, h) if h.registry == "npm" else _venv_bin(root, h)


def _install_npm(root: Path, hs: list[Harness]) -> None:
    prefix = root / "npm"
    stamp = prefix / ".modelyard-pins"
    want = "\n".join(sorted(h.pin for h in hs))
    if stamp.exists() and stamp.read_text() == want and all(_npm_bin(root, h).exists() for h in hs):
        return
    prefix.mkdir(parents=True, exist_ok=True)
    npm = shutil.which("npm")
    if npm is None:
        raise InstallError("npm is not on PATH: Node.js (>= 20) and npm are needed for the npm harnesses")
    _run([npm, "install", "--prefix", str(prefix), "--no-audit", "--no-fund", "--save-exact", "--loglevel=error",
          *(h.pin for h in hs)], "npm " + " ".join(h.pin for h in hs), timeout=1500)
    missing = [h.command for h in hs if not _npm_bin(root, h).exists()]
    if missing:
        raise InstallError(f"npm installed no {missing} under {prefix}/node_modules/.bin")
    stamp.write_text(want)


def _install_pypi(root: Path, h: Harness) -> None:
    venv = root / f"venv-{h.name}"
    stamp = venv / ".modelyard-pin"
    if stamp.exists() and stamp.read_text() == h.pin and _venv_bin(root, h).exists():
        return
    if not (venv / "bin" / "python").exists():
        _run([sys.executable, "-m", "venv", str(venv)], f"venv for {h.name}", timeout=300)
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--disable-pip-version-check", h.pin],
         f"pip {h.pin}", timeout=1500)
    if not _venv_bin(root, h).exists():
        raise InstallError(f"pip installed no {h.command} in {venv}/bin")
    stamp.write_text(h.pin)


def install(names: list[str] | None = None) -> dict[str, Path]:
    """Installs (or finds current) the named harnesses (all by default); returns name -> the
    command's path. Raises InstallError when one cannot be installed."""
    root = cache_dir()
    root.mkdir(parents=True, exist_ok=True)
    hs = [HARNESSES[n] for n in (names or list(HARNESSES))]
    npm = [h for h in hs if h.registry == "npm"]
    if npm:
        # one prefix holds every npm harness: install the whole pinned set together
        _install_npm(root, [h for h in HARNESSES.values() if h.registry == "npm"])
    for h in hs:
        if h.registry == "pypi":
            _install_pypi(root, h)
    return {h.name: executable(h, root) for h in hs}


if __name__ == "__main__":
    for name, path in install(sys.argv[1:] or None).items():
        print(f"{name}: {path}")

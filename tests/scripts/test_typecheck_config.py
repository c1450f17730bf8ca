"""pyproject.toml's [tool.mypy]: protocol/ and router/ get every flag the installed mypy's
--strict enables (listed flag by flag, see the comment there), and nothing else gets them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
STRICT_PACKAGES = ["protocol.*", "router.*"]


def _config() -> dict[str, Any]:
    with open(ROOT / "pyproject.toml", "rb") as f:
        mypy: dict[str, Any] = tomllib.load(f)["tool"]["mypy"]
    return mypy


def _strict_flags() -> list[str]:
    """The config names of the flags ``mypy --strict`` enables, from the installed mypy's help."""
    env = {**os.environ, "COLUMNS": "10000"}  # argparse wraps the help at the terminal's width: one line each
    out = subprocess.run([sys.executable, "-m", "mypy", "--help"], capture_output=True, text=True,
                         check=True, env=env).stdout
    m = re.search(r"--strict\s+Strict mode; enables the following flags: (.*)", out)
    assert m is not None, "mypy --help no longer lists what --strict enables"
    flags = re.findall(r"--([a-z][a-z-]+)", m.group(1))
    assert len(flags) >= 10, flags
    return [f.replace("-", "_") for f in flags]


def test_protocol_and_router_get_every_strict_flag() -> None:
    cfg = _config()
    strict = [o for o in cfg.get("overrides", []) if o.get("module") == STRICT_PACKAGES]
    assert len(strict) == 1, "one override section for protocol.* and router.*"
    missing = [f for f in _strict_flags() if strict[0].get(f) is not True and cfg.get(f) is not True]
    assert missing == [], f"flags --strict enables that protocol/ and router/ lack: {missing}"


def test_no_section_says_strict() -> None:
    # mypy 2.4 applies `strict = true` of an override section to every module (worker/ included)
    cfg = _config()
    assert "strict" not in cfg
    assert [o["module"] for o in cfg.get("overrides", []) if "strict" in o] == []


def test_worker_is_checked_with_mypy_defaults() -> None:
    cfg = _config()
    assert set(cfg["files"]) == {"protocol", "router", "worker"}
    for o in cfg.get("overrides", []):
        mods = o["module"] if isinstance(o["module"], list) else [o["module"]]
        assert not any(m == "worker" or m.startswith("worker.") for m in mods), "worker/ is not excluded or relaxed"

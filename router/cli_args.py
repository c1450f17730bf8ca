"""``modelyard``'s command line: the parser and the version, with nothing but the standard
library, so ``./scripts/serve --help`` can answer before any set-up
(``python3 -m router.cli_args --help`` from the checkout)."""

from __future__ import annotations

import argparse
import re
import sys
from importlib import metadata
from pathlib import Path


def version() -> str:
    """The installed package's version, else the checkout's ``pyproject.toml`` one."""
    try:
        return metadata.version("modelyard")
    except metadata.PackageNotFoundError:
        try:
            text = (Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
        except OSError:
            return "unknown"
        m = re.search(r'^version\s*=\s*"([^"]+)"', text, re.M)
        return m.group(1) if m else "unknown"


def parser() -> argparse.ArgumentParser:
    epilog = ("The command is installed in .venv/bin/modelyard (./scripts/serve sets it up and runs "
              "'modelyard serve --config config.toml'). Ctrl-C stops: running generations get "
              "shutdown_timeout_s to finish; a second Ctrl-C ends them at once.")
    p = argparse.ArgumentParser(
        prog="modelyard", description="Serve GGUF models behind an OpenAI-compatible API.", epilog=epilog)
    p.add_argument("--version", action="version", version=f"modelyard {version()}")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="run the router (the default command)", epilog=epilog,
                       description="Serve the models of a config file until Ctrl-C or SIGTERM.")
    for q in (p, s):
        q.add_argument("--config", default="config.toml", help="config file (default: config.toml)")
        q.add_argument("--host", default=None, help="override [server].host")
        q.add_argument("--port", type=int, default=None, help="override [server].port")
        q.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


if __name__ == "__main__":
    parser().parse_args(sys.argv[1:])  # --help / --version print and exit
    print("modelyard: not set up yet; run ./scripts/serve to set up and start", file=sys.stderr)
    sys.exit(2)

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
    s = sub.add_parser("serve", help="run the router (the command when only options are given)", epilog=epilog,
                       description="Serve the models of a config file until Ctrl-C or SIGTERM.")
    for q in (p, s):
        q.add_argument("--config", default="config.toml", help="config file (default: config.toml)")
        q.add_argument("--host", default=None, help="override [server].host")
        q.add_argument("--port", type=int, default=None, help="override [server].port")
        q.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    client_epilog = ("The address is --url, else $MODELYARD_URL, else [server].host and port of --config "
                     "(default config.toml), else http://127.0.0.1:8080. Keys: $MODELYARD_API_KEY and "
                     "$MODELYARD_ADMIN_KEY, else [server].api_key and admin_key of the config file.")
    clients = {
        "ps": "the loaded models: state, pid, memory, slots busy/total, queue, load time, expiry",
        "models": "every model the service knows (configured and found in models_dir), with what its GGUF "
                  "header says: architecture, parameters, quantization, context, file size; invalid files "
                  "with the reason",
        "load": "load a model and wait until it is ready",
        "unload": "drain a model (running requests finish) and stop its worker",
        "events": "model events (state changes, load progress, crashes): the snapshot and recent ones; "
                  "--follow keeps printing them as they happen",
    }
    for name, text in clients.items():
        c = sub.add_parser(name, help=text, description=f"{text[0].upper()}{text[1:]}.", epilog=client_epilog)
        if name in ("load", "unload"):
            c.add_argument("model", metavar="NAME", help="model name (or alias)")
        if name == "events":
            c.add_argument("--follow", "-f", action="store_true", help="keep following until Ctrl-C")
            c.add_argument("-n", "--recent", type=int, default=20, metavar="N",
                           help="past events to show first (0..200, default 20)")
        c.add_argument("--url", default=None, help="the running service, e.g. http://127.0.0.1:8080")
        c.add_argument("--config", default="config.toml",
                       help="config file whose [server] address and keys to use (default: config.toml)")
        c.add_argument("--json", action="store_true",
                       help="print the service's JSON (events: one object a line) instead of a table")
        c.add_argument("--timeout", type=float, default=None, metavar="S",
                       help="give up after S seconds (default: 10; load and unload wait 600)")
    return p


#: The commands that talk to a running service (``router.cli_client``).
CLIENT_COMMANDS = ("ps", "models", "load", "unload", "events")


if __name__ == "__main__":
    parser().parse_args(sys.argv[1:])  # --help / --version print and exit
    print("modelyard: not set up yet; run ./scripts/serve to set up and start", file=sys.stderr)
    sys.exit(2)

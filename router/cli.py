"""``modelyard serve [--config PATH] [--host H] [--port P]`` (also ``python -m router``).

Exits 1 with the offending key path on a config error. SIGTERM / SIGINT shut
uvicorn down gracefully (``server.shutdown_timeout_s`` for open requests), then
every worker is stopped; workers also exit by themselves if this process dies
(they watch ``--parent-pid``).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

import uvicorn

from router.app import create_app
from router.config import ConfigError, check_public_bind, load_config


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="modelyard", description="Serve GGUF models behind an OpenAI-compatible API.")
    sub = p.add_subparsers(dest="command")
    s = sub.add_parser("serve", help="run the router (the default command)")
    for q in (p, s):
        q.add_argument("--config", default="config.toml", help="config file (default: config.toml)")
        q.add_argument("--host", default=None, help="override [server].host")
        q.add_argument("--port", type=int, default=None, help="override [server].port")
        q.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        config = load_config(args.config)
        server = config.server
        if args.host is not None:
            server = dataclasses.replace(server, host=args.host)
        if args.port is not None:
            if not 0 <= args.port <= 65535:
                raise ConfigError("--port", f"must be 0..65535, got {args.port}")
            server = dataclasses.replace(server, port=args.port)
        check_public_bind(server)
        config = dataclasses.replace(config, server=server)
    except ConfigError as e:
        print(f"modelyard: config error: {e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app = create_app(config)
    uv = uvicorn.Config(app, host=server.host, port=server.port, log_level=args.log_level, lifespan="on",
                        timeout_graceful_shutdown=int(max(1, round(server.shutdown_timeout_s))),
                        access_log=args.log_level == "debug")
    server_ = uvicorn.Server(uv)
    server_.run()  # handles SIGINT/SIGTERM; the lifespan shutdown stops the workers
    return 0 if server_.started else 1


if __name__ == "__main__":
    sys.exit(main())

"""``modelyard serve [--config PATH] [--host H] [--port P]`` (also ``python -m router``).

Exits 1 with the offending key path on a config error. SIGTERM / SIGINT shut
down in this order (:class:`RouterServer`): the port closes (uvicorn refuses new
connections) and waiting requests get 503 ``server_shutting_down`` at once; running generations get ``server.shutdown_timeout_s``
to finish, then each ends cleanly (an SSE error event, or a 503 body) and its
worker gets Cancel; then uvicorn closes the connections and every worker is
stopped. Workers also exit by themselves if this process dies (they watch
``--parent-pid``).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import socket
import sys

import uvicorn
from starlette.applications import Starlette

from router.app import create_app
from router.config import ConfigError, check_public_bind, load_config
from router.http_server import uvicorn_settings


#: Seconds between ending the running generations and uvicorn's own deadline, which
#: cancels whatever is left (a bare 500 / a cut stream): time for the error events to go out.
ABORT_MARGIN_S = 3.0


class RouterServer(uvicorn.Server):
    """uvicorn's server with the router's shutdown order (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app: Starlette, grace_s: float) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        pool = getattr(self.app.state, "pool", None)
        timer: asyncio.TimerHandle | None = None
        if pool is not None:
            pool.begin_shutdown()
            reason = (f"the server is shutting down; the request was still running after "
                      f"shutdown_timeout_s={self.grace_s:g} s")
            timer = asyncio.get_running_loop().call_later(self.grace_s, pool.abort_running, reason)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


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
                        timeout_graceful_shutdown=math.ceil(server.shutdown_timeout_s + ABORT_MARGIN_S),
                        access_log=args.log_level == "debug", **uvicorn_settings(server))
    server_ = RouterServer(uv, app, server.shutdown_timeout_s)
    server_.run()  # handles SIGINT/SIGTERM; the lifespan shutdown stops the workers
    return 0 if server_.started else 1


if __name__ == "__main__":
    sys.exit(main())

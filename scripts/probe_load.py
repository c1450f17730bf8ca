#!/usr/bin/env python3
"""Load probe of a router serving real models: many clients on every generation route at once.

    .venv/bin/python scripts/probe_load.py [--url http://127.0.0.1:8080] [--clients 32]
        [--duration 180] [--models SmolLM2-135M-Instruct,gemma-3-270m] [--max-tokens 24]
        [--fuzz 3000] [--json FILE] [--loadgen /work/shared/tools/loadgen.py]

Without ``--url`` it starts ``python -m router serve`` on a free port with the models of the
checkout's ``config.toml`` (both shipped models: ``scripts/fetch_models.py`` puts them in
``models/`` or ``$MODELYARD_MODELS_DIR``), ``n_predict`` capped at ``--n-predict`` (so a fuzzed
request cannot generate for minutes) and stops it at the end. With ``--url`` it probes that
router as it is configured (``--api-key`` / ``--admin-key`` when it has keys).

What it does, in order:

1. **References.** For each model, route and prompt, one non-streaming request at temperature 0
   with ``cache_prompt: false`` (a fresh evaluation): its text is that case's reference.
2. **Load.** ``--clients`` clients, each a loop until ``--duration`` s have passed, every
   request picked at random: a temperature-0 case (``/v1/chat/completions``, ``/v1/completions``,
   ``/v1/messages``, ``/completion``, ``/v1/responses``; streaming or not; with the prompt cache
   or without) whose text is compared with its reference; a stream the client abandons after its
   first text (a client that goes away mid-generation); a request with bad input (each kind
   must get a 4xx). A 503 must carry ``Retry-After`` (the client then waits that long, at most
   2 s). Meanwhile the worker pids are read from ``GET /admin/models`` every 2 s and the load
   average every 5 s.
3. **After.** The references are asked again (the router answers as before), the worker
   crash counter of ``/metrics`` is read, and with ``--fuzz N`` about N schemathesis-generated
   requests (``/openapi.json``, every operation) are sent, then the references once more.
4. **Summary** (stdout, and ``--json``): requests and statuses by route, violations, texts
   checked / identical / different, deaths, 503s and their ``Retry-After``, the load average.

Violations (exit status 1 when there is any): a 5xx (but a 501, llama.cpp's "not supported", and
a 503 with ``Retry-After``, a request refused at once because the model's queue is full — the
router's promise under overload); a 503 without ``Retry-After``; a 2xx to a bad input; a request with no answer within
``--timeout`` s; a worker death (its pid changed or vanished while the probe ran, or
``modelyard_worker_crashes_total`` grew); a temperature-0 text that differs from its reference.
One difference is documented and counted apart, not as a violation: an answer that reused a
cached prefix of a model listed in ``--allow-reuse-diff`` (default: Gemma 3, the sliding-window
model: README "Sliding-window models (Gemma 3) reuse as llama-server does" — its reused prefix is
evaluated in other micro-batches than a fresh prompt, which may change a greedy token).

``--loadgen PATH``: afterwards, the team's throughput tool (``loadgen.py BASE_URL MODEL
CONCURRENCY``) is run once per model at the concurrency the model admits (its slots +
``max_queue``, at most ``--clients``: loadgen counts a refused stream as one of 0 tokens) and its
line is reported (it needs a keyless router). The probe loads the machine on purpose; its figures are meaningful
together with the load average it prints.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]

#: Prompts of the temperature-0 cases (the same few again and again: the prefix cache is hit).
PROMPTS = ("Write one sentence about the sea.", "List three colours.")
#: Raw-text prompts of the completion routes.
RAW_PROMPTS = ("The capital of France is", "Once upon a time, in a small village,")

#: The routes a temperature-0 case runs on.
ROUTES = ("chat", "completions", "messages", "completion", "responses")

#: Shares of the request kinds each client picks from.
MIX = {"check": 0.70, "cancel": 0.15, "bad": 0.15}


# ---------------------------------------------------------------------------- requests


def _case_body(route: str, model: str, prompt_i: int, max_tokens: int, stream: bool,
               cache_prompt: bool) -> tuple[str, dict[str, Any]]:
    """The path and body of a temperature-0 request (``cache_prompt``: llama.cpp's field, honoured
    on every route but /v1/messages, whose body has no place for it)."""
    msgs = [{"role": "user", "content": PROMPTS[prompt_i]}]
    if route == "chat":
        body: dict[str, Any] = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
        if stream:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/chat/completions"
    elif route == "completions":
        body = {"model": model, "prompt": RAW_PROMPTS[prompt_i], "max_tokens": max_tokens, "temperature": 0}
        if stream:
            body["stream_options"] = {"include_usage": True}
        path = "/v1/completions"
    elif route == "messages":
        body = {"model": model, "messages": msgs, "max_tokens": max_tokens, "temperature": 0}
        path = "/v1/messages"
    elif route == "completion":
        body = {"model": model, "prompt": RAW_PROMPTS[prompt_i], "n_predict": max_tokens, "temperature": 0}
        path = "/completion"
    elif route == "responses":
        body = {"model": model, "input": PROMPTS[prompt_i], "max_output_tokens": max_tokens, "temperature": 0,
                "store": False}
        path = "/v1/responses"
    else:
        raise ValueError(route)
    body["stream"] = stream
    if route != "messages":
        body["cache_prompt"] = cache_prompt
    return path, body


def _text_and_cache(route: str, obj: dict[str, Any]) -> tuple[str, int | None]:
    """A non-streaming answer's text and its cached prompt tokens (None: not said)."""
    if route == "chat":
        usage = obj.get("usage") or {}
        return (obj["choices"][0]["message"].get("content") or "",
                (usage.get("prompt_tokens_details") or {}).get("cached_tokens"))
    if route == "completions":
        usage = obj.get("usage") or {}
        return obj["choices"][0]["text"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
    if route == "messages":
        text = "".join(b.get("text", "") for b in obj["content"] if b.get("type") == "text")
        return text, (obj.get("usage") or {}).get("cache_read_input_tokens")
    if route == "completion":
        return obj["content"], (obj.get("timings") or {}).get("cache_n")
    if route == "responses":
        text = "".join(c.get("text", "") for item in obj.get("output", []) if item.get("type") == "message"
                       for c in item.get("content", []) if c.get("type") == "output_text")
        return text, ((obj.get("usage") or {}).get("input_tokens_details") or {}).get("cached_tokens")
    raise ValueError(route)


class StreamText:
    """Text and cached prompt tokens gathered from one route's SSE events."""

    def __init__(self, route: str) -> None:
        self.route = route
        self.parts: list[str] = []
        self.cache_n: int | None = None
        self.error: Any = None

    def feed(self, ev: dict[str, Any]) -> str:
        """Take one event's JSON; return the text it adds ("" when none)."""
        r = self.route
        if "error" in ev and r not in ("messages", "responses"):
            self.error = ev["error"]
            return ""
        add = ""
        if r in ("chat", "completions"):
            for ch in ev.get("choices") or []:
                add += ((ch.get("delta") or {}).get("content") or "") if r == "chat" else (ch.get("text") or "")
            usage = ev.get("usage")
            if usage:
                self.cache_n = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        elif r == "messages":
            t = ev.get("type")
            if t == "error":
                self.error = ev.get("error")
            elif t == "message_start":
                self.cache_n = ((ev.get("message") or {}).get("usage") or {}).get("cache_read_input_tokens")
            elif t == "content_block_delta" and (ev.get("delta") or {}).get("type") == "text_delta":
                add = ev["delta"]["text"]
        elif r == "completion":
            add = ev.get("content") or ""
            if ev.get("stop"):
                self.cache_n = (ev.get("timings") or {}).get("cache_n")
        elif r == "responses":
            t = ev.get("type")
            if t in ("error", "response.failed"):
                self.error = ev
            elif t == "response.output_text.delta":
                add = ev.get("delta") or ""
            elif t == "response.completed":
                usage = (ev.get("response") or {}).get("usage") or {}
                self.cache_n = (usage.get("input_tokens_details") or {}).get("cached_tokens")
        self.parts.append(add)
        return add

    @property
    def text(self) -> str:
        return "".join(self.parts)


def _bad_requests(models: list[str]) -> list[tuple[str, str, Any]]:
    """(label, path, body) of requests that must get a 4xx; ``body`` bytes are sent as they are."""
    m = models[0]
    long_prompt = "x " * 40000  # ~40,000 tokens: beyond any n_ctx the shipped models get by default
    return [
        ("chat-messages-not-list", "/v1/chat/completions", {"model": m, "messages": "hi"}),
        ("chat-unknown-model", "/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}),
        ("chat-negative-max-tokens", "/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}),
        ("chat-bad-json", "/v1/chat/completions", b'{"model": "' + m.encode() + b'", "messages": [}'),
        ("chat-temperature-string", "/v1/chat/completions", {"model": m, "messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}),
        ("messages-no-max-tokens", "/v1/messages", {"model": m, "messages": [{"role": "user", "content": "hi"}]}),
        ("completion-bad-n-predict", "/completion", {"model": m, "prompt": "hi", "n_predict": "many"}),
        ("completion-token-out-of-range", "/completion", {"model": m, "prompt": [1, 2, 2 ** 31]}),
        ("completions-too-long", "/v1/completions", {"model": m, "prompt": long_prompt, "max_tokens": 4}),
        ("responses-bad-input", "/v1/responses", {"model": m, "input": 42}),
        ("tokenize-content-number", "/tokenize", {"model": m, "content": 5}),
    ]


# ---------------------------------------------------------------------------- the tally


@dataclass
class Tally:
    statuses: dict[str, Counter[int]] = field(default_factory=lambda: defaultdict(Counter))
    violations: list[str] = field(default_factory=list)
    checked: int = 0
    same: int = 0
    reuse_diff: Counter[str] = field(default_factory=Counter)  # model -> allowed differences
    cache_hits: int = 0
    cancelled: int = 0
    bad: int = 0
    retry_after: Counter[str] = field(default_factory=Counter)  # value -> 503s
    timeouts: int = 0
    errors_in_stream: int = 0

    def violate(self, what: str) -> None:
        if len(self.violations) < 200:
            self.violations.append(what)
        else:
            self.violations[-1] = f"... and more (last: {what})"

    def status(self, label: str, resp: httpx.Response) -> None:
        """Count ``resp``'s status (its body read already, or not at all: a stream)."""
        code = resp.status_code
        self.statuses[label][code] += 1
        if code >= 500 and code not in (501, 503):  # 503: refused at once (queue full), Retry-After below
            self.violate(f"{label}: {code} {resp.text[:300] if resp.is_stream_consumed else ''}")
        if code == 503:
            ra = resp.headers.get("retry-after")
            self.retry_after[ra or "(none)"] += 1
            if not ra:
                self.violate(f"{label}: 503 without Retry-After")


@dataclass
class Ref:
    text: str
    cache_n: int | None


# ---------------------------------------------------------------------------- the probe


class Probe:
    def __init__(self, args: argparse.Namespace, base: str, models: list[str]) -> None:
        self.args = args
        self.base = base
        self.models = models
        self.t = Tally()
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        limits = httpx.Limits(max_connections=args.clients * 2 + 8, max_keepalive_connections=args.clients * 2)
        self.http = httpx.AsyncClient(base_url=base, headers=headers, limits=limits,
                                      timeout=httpx.Timeout(args.timeout, connect=30.0))
        self.admin_headers = {"Authorization": f"Bearer {args.admin_key or args.api_key}"} \
            if (args.admin_key or args.api_key) else {}
        self.refs: dict[tuple[str, str, int], Ref] = {}
        self.pids: dict[str, int | None] = {}
        self.pid_changes: list[str] = []
        self.loads: list[tuple[float, float, float]] = []
        self.stop = False

    # ------------------------------------------------------------------ one temperature-0 case

    async def case(self, route: str, model: str, prompt_i: int, stream: bool, cache_prompt: bool,
                   label: str) -> tuple[str, int | None] | None:
        """Run one case; its (text, cache_n), or None when it got no 200 (counted)."""
        path, body = _case_body(route, model, prompt_i, self.args.max_tokens, stream, cache_prompt)
        if not stream:
            r = await self.http.post(path, json=body)
            self.t.status(label, r)
            if r.status_code != 200:
                await self._backoff(r)
                return None
            return _text_and_cache(route, r.json())
        acc = StreamText(route)
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
            self.t.status(label, r)
            if r.status_code != 200:
                await self._backoff(r)
                return None
            async for ev in _events(r):
                acc.feed(ev)
        if acc.error is not None:
            self.t.errors_in_stream += 1
            self.t.violate(f"{label}: error event in a 200 stream: {json.dumps(acc.error)[:300]}")
            return None
        return acc.text, acc.cache_n

    async def _backoff(self, r: httpx.Response) -> None:
        if r.status_code == 503:
            try:
                wait = float(r.headers.get("retry-after", "1"))
            except ValueError:
                wait = 1.0
            await asyncio.sleep(min(max(wait, 0.1), 2.0))

    def compare(self, route: str, model: str, prompt_i: int, got: tuple[str, int | None], label: str) -> None:
        ref = self.refs[(route, model, prompt_i)]
        text, cache_n = got
        self.t.checked += 1
        if cache_n:
            self.t.cache_hits += 1
        if text == ref.text:
            self.t.same += 1
            return
        reused = bool(cache_n) or bool(ref.cache_n)
        if reused and model in self.args.allow_reuse_diff:
            self.t.reuse_diff[model] += 1
            return
        self.t.violate(f"{label}: text differs from its reference (cache_n {cache_n}, reference's "
                       f"{ref.cache_n}): {text[:80]!r} vs {ref.text[:80]!r}")

    # ------------------------------------------------------------------ references

    async def take_references(self) -> None:
        for model in self.models:
            for route in ROUTES:
                for i in range(len(PROMPTS)):
                    got = await self.case(route, model, i, False, False, f"ref {route}")
                    if got is None:
                        raise SystemExit(f"reference {route} {model} #{i} got no 200: see the statuses "
                                         f"{dict(self.t.statuses[f'ref {route}'])}")
                    self.refs[(route, model, i)] = Ref(*got)

    async def check_references(self, label: str) -> int:
        """Ask every reference again (no cache: a fresh evaluation); the number that differ."""
        differ = 0
        for (route, model, i), ref in self.refs.items():
            got = await self.case(route, model, i, False, False, label)
            if got is None or got[0] != ref.text:
                differ += 1
                self.t.violate(f"{label} {route} {model} #{i}: {got and got[0][:80]!r} vs {ref.text[:80]!r}")
        return differ

    # ------------------------------------------------------------------ clients

    async def client(self, k: int, deadline: float) -> None:
        rng = random.Random(self.args.seed * 1000 + k)
        bad = _bad_requests(self.models)
        kinds, weights = zip(*MIX.items())
        while time.monotonic() < deadline:
            kind = rng.choices(kinds, weights)[0]
            try:
                if kind == "check":
                    route, model = rng.choice(ROUTES), rng.choice(self.models)
                    i, stream, cache = rng.randrange(len(PROMPTS)), rng.random() < 0.5, rng.random() < 0.7
                    label = f"{route}{' stream' if stream else ''}"
                    got = await self.case(route, model, i, stream, cache, label)
                    if got is not None:
                        self.compare(route, model, i, got, f"{label} {model} #{i}")
                elif kind == "cancel":
                    await self.cancel(rng.choice(self.models), rng.choice(("chat", "messages", "completion")))
                else:
                    name, path, body = rng.choice(bad)
                    await self.bad(name, path, body)
            except httpx.TimeoutException as e:
                self.t.timeouts += 1
                self.t.violate(f"client {k} {kind}: no answer within {self.args.timeout:g} s ({type(e).__name__})")
            except httpx.HTTPError as e:
                self.t.violate(f"client {k} {kind}: {type(e).__name__}: {e}")

    async def cancel(self, model: str, route: str) -> None:
        """A stream the client leaves after its first text (the router cancels its generation)."""
        path, body = _case_body(route, model, 0, 200, True, True)
        body["temperature"] = 0.7
        label = f"cancel {route}"
        async with self.http.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
            self.t.status(label, r)
            if r.status_code != 200:
                await self._backoff(r)
                return
            acc = StreamText(route)
            async for ev in _events(r):
                if acc.feed(ev):
                    break
        self.t.cancelled += 1

    async def bad(self, name: str, path: str, body: Any) -> None:
        if isinstance(body, bytes):
            r = await self.http.post(path, content=body, headers={"Content-Type": "application/json"})
        else:
            r = await self.http.post(path, json=body)
        self.t.status(f"bad {name}", r)
        self.t.bad += 1
        if r.status_code < 400:
            self.t.violate(f"bad {name}: {r.status_code} (a bad input must get a 4xx): {r.text[:200]}")
        await self._backoff(r)

    # ------------------------------------------------------------------ watchers

    async def worker_pids(self) -> dict[str, int | None]:
        r = await self.http.get("/admin/models", headers=self.admin_headers)
        r.raise_for_status()
        return {row["id"]: row.get("pid") for row in r.json()["data"] if row["id"] in self.models}

    async def capacity(self) -> dict[str, int]:
        """Requests each model admits at once: its KV slots + ``max_queue``."""
        r = await self.http.get("/admin/models", headers=self.admin_headers)
        r.raise_for_status()
        return {row["id"]: int(row["slots_total"]) + int(row["max_queue"]) for row in r.json()["data"]}

    async def watch_pids(self) -> None:
        while not self.stop:
            try:
                now = await self.worker_pids()
            except httpx.HTTPError as e:
                self.t.violate(f"GET /admin/models failed: {type(e).__name__}: {e}")
                now = {}
            for m, pid in now.items():
                was = self.pids.get(m)
                if was != pid:
                    self.pid_changes.append(f"{m}: pid {was} -> {pid}")
                    self.pids[m] = pid
            await asyncio.sleep(2.0)

    async def watch_load(self) -> None:
        while not self.stop:
            self.loads.append(os.getloadavg())
            await asyncio.sleep(5.0)

    async def crashes(self) -> float:
        r = await self.http.get("/metrics")
        r.raise_for_status()
        total = 0.0
        for line in r.text.splitlines():
            if line.startswith("modelyard_worker_crashes_total{"):
                total += float(line.rsplit(" ", 1)[1])
        return total


async def _events(r: httpx.Response) -> Any:
    async for line in r.aiter_lines():
        if line.startswith("data:"):
            data = line[5:].strip()
            if data and data != "[DONE]":
                yield json.loads(data)


# ---------------------------------------------------------------------------- fuzz


def fuzz(base: str, n: int, headers: dict[str, str], seed: int) -> tuple[Counter[int], list[str]]:
    """About ``n`` schemathesis-generated requests over every operation of ``/openapi.json``;
    (statuses, violations: a 5xx other than 501 and 503 with Retry-After, a transport failure)."""
    import schemathesis
    from schemathesis.core.result import Ok

    api = schemathesis.openapi.from_url(base + "/openapi.json", headers=headers)
    seen: Counter[int] = Counter()
    bad: list[str] = []
    ops = []
    for r in api.get_all_operations():
        if isinstance(r, Ok):
            ops.append(r.ok())
        else:  # the document has an operation schemathesis cannot read
            bad.append(f"/openapi.json: {r.err()}"[:300])
    # hypothesis stops early on an operation with few distinct requests (a GET without parameters):
    # further rounds, other seeds, until about n were sent (at most 8 rounds)
    for round_ in range(8):
        left = n - sum(seen.values()) - len(bad)
        if left <= 0:
            break
        per_op = max(1, math.ceil(left / max(1, len(ops))))
        for op in ops:
            _fuzz_op(op, per_op, headers, seed + round_, seen, bad)
    return seen, bad


def _fuzz_op(op: Any, examples: int, headers: dict[str, str], seed: int, seen: Counter[int], bad: list[str]) -> None:
    """Up to ``examples`` schemathesis requests of one operation, counted into ``seen`` / ``bad``."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import seed as hseed

    @hseed(seed)
    @given(case=op.as_strategy())
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    def run(case: Any) -> None:
        case.headers = {**(case.headers or {}), **headers, "Connection": "close"}
        try:
            resp = case.call(timeout=120)
        except Exception as e:  # noqa: BLE001 - a transport failure is a finding, not a crash of the probe
            bad.append(f"{op.method.upper()} {op.path}: {type(e).__name__}: {e}"[:300])
            return
        seen[resp.status_code] += 1
        if resp.status_code >= 500 and resp.status_code != 501 and not (
                resp.status_code == 503 and resp.headers.get("retry-after")):
            bad.append(f"{op.method.upper()} {op.path}: {resp.status_code} {resp.text[:200]}")

    run()




# ---------------------------------------------------------------------------- router


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"config value {v!r} cannot be written")


def write_config(path: Path, models: list[str] | None, n_predict: int) -> list[str]:
    """A config with the checkout's ``[models.*]`` (those in ``models``; all when None), their
    files in the models directory, ``n_predict`` capped; the model names."""
    shipped = tomllib.loads((ROOT / "config.toml").read_text())
    models_dir = Path(os.environ.get("MODELYARD_MODELS_DIR") or ROOT / "models").resolve()
    tables = {k: v for k, v in shipped["models"].items() if models is None or k in models}
    if models is not None and set(models) - set(tables):
        raise SystemExit(f"not in config.toml: {sorted(set(models) - set(tables))}")
    lines = ["[server]", f"models_dir = {_toml_value(str(models_dir))}", "discover_models = false", "",
             "[defaults]", f"n_predict = {n_predict}", ""]
    for name, table in tables.items():
        lines.append(f"[models.{json.dumps(name)}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in table.items()]
        lines.append("")
    path.write_text("\n".join(lines))
    return list(tables)


async def start_router(cfg: Path, log: Path) -> tuple[subprocess.Popen[bytes], str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "router", "serve", "--config", str(cfg), "--port", str(port),
                             "--log-level", "warning"], cwd=ROOT, stdout=log.open("wb"), stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    async with httpx.AsyncClient() as c:
        for _ in range(600):
            if proc.poll() is not None:
                raise SystemExit(f"the router exited with {proc.returncode}: see {log}")
            try:
                if (await c.get(base + "/health", timeout=2)).status_code == 200:
                    return proc, base
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
    proc.terminate()
    raise SystemExit(f"the router did not answer /health within 120 s: see {log}")


# ---------------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> int:
    tmp = Path(tempfile.mkdtemp(prefix="probe-load-"))
    proc = None
    if args.url:
        base = args.url.rstrip("/")
        models = args.models.split(",") if args.models else []
        if not models:
            raise SystemExit("--models is required with --url")
    else:
        cfg = tmp / "config.toml"
        models = write_config(cfg, args.models.split(",") if args.models else None, args.n_predict)
        proc, base = await start_router(cfg, tmp / "router.log")
        print(f"[probe] router pid {proc.pid} on {base}, log {tmp / 'router.log'}", flush=True)
    probe = Probe(args, base, models)
    summary: dict[str, Any] = {"base": base, "models": models, "clients": args.clients, "duration_s": args.duration,
                               "max_tokens": args.max_tokens, "seed": args.seed}
    deaths = 0
    try:
        t0 = time.monotonic()
        await probe.take_references()
        summary["references_s"] = round(time.monotonic() - t0, 1)
        print(f"[probe] {len(probe.refs)} references in {summary['references_s']} s (models loaded)", flush=True)
        probe.pids = await probe.worker_pids()
        crashes0 = await probe.crashes()
        watchers = [asyncio.create_task(probe.watch_pids()), asyncio.create_task(probe.watch_load())]
        t1 = time.monotonic()
        deadline = t1 + args.duration
        await asyncio.gather(*(probe.client(k, deadline) for k in range(args.clients)))
        summary["load_s"] = round(time.monotonic() - t1, 1)
        probe.stop = True
        await asyncio.gather(*watchers)
        for m, pid in (await probe.worker_pids()).items():  # a change since the watcher's last look
            if probe.pids.get(m) != pid:
                probe.pid_changes.append(f"{m}: pid {probe.pids.get(m)} -> {pid}")
        for change in probe.pid_changes:  # nothing unloads a model during the load: a change is a death
            probe.t.violate(f"worker pid changed during the load: {change}")
        summary["after_load_references_differ"] = await probe.check_references("after load")
        # the load phase's figures, printed (and saved) before anything else can go wrong
        summary["load_phase"] = figures(probe, len(probe.pid_changes) + int(await probe.crashes() - crashes0))
        print(f"[probe] load phase: {headline(summary['load_phase'])}", flush=True)
        if args.json:
            Path(args.json).write_text(json.dumps(summary, indent=1))
        if args.fuzz:
            t2 = time.monotonic()
            try:
                seen, bad = await asyncio.to_thread(fuzz, base, args.fuzz, probe.admin_headers, args.seed)
            except Exception as e:  # noqa: BLE001 - reported as a violation with the figures so far
                seen, bad = Counter(), [f"the fuzz stopped: {type(e).__name__}: {e}"]
            summary["fuzz"] = {"requests": sum(seen.values()), "statuses": dict(sorted(seen.items())),
                               "violations": len(bad), "s": round(time.monotonic() - t2, 1)}
            for b in bad:
                probe.t.violate(f"fuzz: {b}")
            summary["after_fuzz_references_differ"] = await probe.check_references("after fuzz")
        # the fuzz may call llama-server's /models/unload and /models/load: there only the router's
        # crash counter (a worker that died or was killed as hung) tells a death
        crashes = await probe.crashes() - crashes0
        deaths = len(probe.pid_changes) + int(crashes)
        if crashes:
            probe.t.violate(f"modelyard_worker_crashes_total grew by {crashes:g}")
        if args.loadgen:
            summary["loadgen"] = {}
            capacity = await probe.capacity()
            for m in models:
                # at most what the model admits at once (slots + max_queue): loadgen counts a 503 as
                # a stream of 0 tokens, which would make its medians meaningless
                conc = min(args.clients, capacity.get(m) or args.clients)
                out = await asyncio.to_thread(subprocess.run, [sys.executable, args.loadgen, base, m,
                                                               str(conc), str(args.max_tokens)],
                                              capture_output=True, text=True, timeout=1800)
                summary["loadgen"][m] = out.stdout.strip() or out.stderr.strip()[-300:]
    finally:
        probe.stop = True
        await probe.http.aclose()
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
    summary.update(figures(probe, deaths))
    print(json.dumps(summary, indent=1))
    print(f"[probe] {headline(summary)}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=1))
    return 1 if probe.t.violations else 0


def figures(probe: Probe, deaths: int) -> dict[str, Any]:
    """The tally so far, as the summary gives it."""
    t = probe.t
    every: Counter[int] = Counter()
    for c in t.statuses.values():
        every.update(c)
    loads = probe.loads or [os.getloadavg()]
    return {
        "requests": sum(every.values()), "statuses": dict(sorted(every.items())),
        "x5xx": sum(v for k, v in every.items() if k >= 500 and k not in (501, 503)),
        "by_route": {k: dict(sorted(v.items())) for k, v in sorted(t.statuses.items())},
        "texts_checked": t.checked, "texts_same": t.same, "texts_reused_prefix": t.cache_hits,
        "texts_wrong": t.checked - t.same - sum(t.reuse_diff.values()),
        "allowed_reuse_differences": dict(t.reuse_diff),
        "cancelled_streams": t.cancelled, "bad_inputs": t.bad, "timeouts": t.timeouts,
        "retry_after_503": dict(t.retry_after), "deaths": deaths, "pid_changes": list(probe.pid_changes),
        "loadavg_1m_max": round(max(x[0] for x in loads), 2),
        "loadavg_1m_mean": round(sum(x[0] for x in loads) / len(loads), 2),
        "loadavg_end": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(),
        "violations": list(t.violations),
    }


def headline(f: dict[str, Any]) -> str:
    """One line of :func:`figures`."""
    return (f"{f['requests']} requests: {f['x5xx']} x 5xx (besides {f['statuses'].get(503, 0)} x 503 queue full "
            f"with Retry-After), {f['deaths']} deaths, {f['texts_wrong']} wrong texts of {f['texts_checked']} "
            f"checked ({sum(f['allowed_reuse_differences'].values())} allowed prefix-reuse differences), "
            f"{f['retry_after_503'].get('(none)', 0)} 503s without Retry-After, {f['timeouts']} timeouts; "
            f"load average 1 min: max {f['loadavg_1m_max']}, mean {f['loadavg_1m_mean']} on {f['cpus']} cpus; "
            f"{len(f['violations'])} violations")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="probe this router (default: start one with config.toml's models)")
    p.add_argument("--models", help="comma-separated model names (default: every model of config.toml)")
    p.add_argument("--api-key", default=os.environ.get("MODELYARD_API_KEY", ""))
    p.add_argument("--admin-key", default="")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per temperature-0 answer")
    p.add_argument("--n-predict", type=int, default=64, help="[defaults] n_predict of a router this script starts")
    p.add_argument("--timeout", type=float, default=300.0, help="s a request may take before it is a violation")
    p.add_argument("--fuzz", type=int, default=0, help="about this many schemathesis requests after the load")
    p.add_argument("--allow-reuse-diff", default="gemma-3-270m",
                   help="comma-separated models whose prefix-reuse answers may differ (documented)")
    p.add_argument("--loadgen", default="", help="path of loadgen.py, run once per model afterwards")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", help="write the summary here too")
    args = p.parse_args()
    args.allow_reuse_diff = {m for m in args.allow_reuse_diff.split(",") if m}
    if args.fuzz:
        try:
            import schemathesis  # noqa: F401 - checked now, not after minutes of load
        except ImportError:
            raise SystemExit("--fuzz needs schemathesis (the dev extras: pip install -e '.[dev]')") from None
    return asyncio.run(run(args))


if __name__ == "__main__":
    sys.exit(main())

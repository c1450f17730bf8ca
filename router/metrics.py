"""Prometheus metrics of one router (``GET /metrics``), with prometheus-client.

llama-server's own ``llamacpp:*`` families are there too, by its names
(:class:`_LlamacppCollector`), so dashboards written for llama-server read them unchanged.

Every metric lives on the app's own :class:`~prometheus_client.CollectorRegistry`
(never the process-global one), so several apps in one process — tests — keep
separate counts. Names are ``modelyard_*`` and follow vLLM's where one exists
(``num_requests_running``, ``prompt_tokens_total``, ``time_to_first_token_seconds``,
``inter_token_latency_seconds``, ``e2e_request_latency_seconds``,
``request_queue_time_seconds``).

* Counters and histograms are written where the event happens: the HTTP layer
  (:class:`RequestMetrics`, requests by route and status; the error handler,
  rejections), the pool (loads, failures, crashes, restarts, load time) and each
  run (tokens, latencies, cancellations).
* Gauges (state, queue, running, slots, KV tokens) are read at scrape time from
  a snapshot function the pool provides (:class:`ModelGauges` per model), so they
  are never stale and nothing has to keep them in step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from starlette.requests import Request
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router.http.access_log import route_template

#: ``Content-Type`` of the text exposition.
CONTENT_TYPE = CONTENT_TYPE_LATEST

#: Where a cancelled request was: waiting for its turn, prefilling (no token yet), decoding.
CANCEL_STAGES = ("queue", "prefill", "decode")

_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0, 160.0, 640.0)
_ITL_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                5.0, 10.0, 20.0, 40.0, 80.0)
_E2E_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0)
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

#: How often the event-loop lag probe sets its timer, s (:meth:`Metrics.watch_event_loop`).
LOOP_LAG_INTERVAL_S = 0.02

_LOAD_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)


@dataclass
class LlamacppTotals:
    """One model's figures behind llama-server's ``llamacpp:*`` metrics (tools/server
    server-context.cpp ``metrics``): totals since start, and the window since the last scrape
    the throughput gauges average over (llama-server resets that window at each /metrics)."""

    prompt_tokens: int = 0  # prompt tokens evaluated (Done.prompt_n: cached ones excluded)
    prompt_seconds: float = 0.0  # time spent evaluating them (Done.prompt_ms)
    tokens_predicted: int = 0  # tokens generated (Done.predicted_n)
    predicted_seconds: float = 0.0  # time spent generating them (Done.predicted_ms)
    n_tokens_max: int = 0  # the most KV positions one request held (prompt + generated)
    window_prompt_tokens: int = 0
    window_prompt_seconds: float = 0.0
    window_predicted_tokens: int = 0
    window_predicted_seconds: float = 0.0
    # the workers' forward passes (llama_decode calls) and busy slots summed over them: the
    # workers gone before (their last Pong's figures) plus the current one's, which its
    # Pongs report as totals since it started
    decodes_before: int = 0
    busy_slots_before: int = 0
    worker: int | None = None  # the current worker (pid) whose totals follow
    worker_decodes: int = 0
    worker_busy_slots: int = 0

    @property
    def n_decode_total(self) -> int:
        return self.decodes_before + self.worker_decodes

    @property
    def n_busy_slots_total(self) -> int:
        return self.busy_slots_before + self.worker_busy_slots


@dataclass(frozen=True)
class ModelGauges:
    """One model's point-in-time figures, as the pool sees them at scrape time."""

    model: str
    state: str  # one of states
    states: tuple[str, ...]  # every state a model's worker can be in (``modelyard_model_state``'s label)
    loaded: bool  # a worker holds the model (ready or draining)
    waiting: int  # requests admitted, waiting for a job slot
    running: int  # requests holding a job slot
    total_slots: int  # the worker's KV slots (Ready.max_jobs); 0 when no worker is up
    busy_slots: int  # KV slots running a request
    kv_tokens: int  # KV positions held (the worker's last Pong; 0 without one)
    kv_budget_tokens: int  # KV positions the worker's budget allows (0: unknown)
    # a replica's row (router.workers.replicas): its number and node; None: the model as a whole
    replica: int | None = None
    node: str = ""


class Metrics:
    """The metric objects of one router app and its registry. ``models``: configured
    model names, whose per-model counters start at 0 (so a scrape shows every model)."""

    def __init__(self, models: Iterable[str]) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        reg = self.registry
        self.requests = Counter("modelyard_requests", "HTTP requests answered, by model (empty when the "
                                "route names none), route template and status code",
                                ["model", "route", "status"], registry=reg)
        self.rejections = Counter("modelyard_rejections", "Requests refused with a 503 before they ran, "
                                  "by reason (the error code: queue_full, model_unloading, ...)",
                                  ["model", "reason"], registry=reg)
        self.loads = Counter("modelyard_model_loads", "Worker loads started", ["model"], registry=reg)
        self.load_failures = Counter("modelyard_model_load_failures", "Worker loads that failed "
                                     "(error, exit or load_timeout_s)", ["model"], registry=reg)
        self.evictions = Counter("modelyard_model_evictions", "Idle models unloaded to make room for another "
                                 "(max_loaded or memory)", ["model"], registry=reg)
        self.crashes = Counter("modelyard_worker_crashes", "Ready workers that died or were killed as hung",
                               ["model"], registry=reg)
        self.restarts = Counter("modelyard_worker_restarts", "Loads started after a crash", ["model"],
                                registry=reg)
        self.cancellations = Counter("modelyard_request_cancellations", "Requests cancelled (client gone, "
                                     "unload, shutdown), by stage: queue, prefill, decode",
                                     ["model", "stage"], registry=reg)
        self.prompt_tokens = Counter("modelyard_prompt_tokens", "Prompt tokens of finished generations",
                                     ["model"], registry=reg)
        self.prompt_tokens_cached = Counter("modelyard_prompt_tokens_cached", "Prompt tokens reused from "
                                            "the KV cache (Done.cache_n)", ["model"], registry=reg)
        self.generation_tokens = Counter("modelyard_generation_tokens", "Generated tokens", ["model"],
                                         registry=reg)
        self.ttft = Histogram("modelyard_time_to_first_token_seconds", "Admission to the first token",
                              ["model"], buckets=_TTFT_BUCKETS, registry=reg)
        self.itl = Histogram("modelyard_inter_token_latency_seconds", "Between two tokens of one stream",
                             ["model"], buckets=_ITL_BUCKETS, registry=reg)
        self.e2e = Histogram("modelyard_e2e_request_latency_seconds", "Admission to the final frame of "
                             "a generation", ["model"], buckets=_E2E_BUCKETS, registry=reg)
        self.queue_time = Histogram("modelyard_request_queue_time_seconds", "Admission to getting a job "
                                    "slot (includes waiting for the model to load)", ["model"],
                                    buckets=_E2E_BUCKETS, registry=reg)
        self.load_time = Histogram("modelyard_model_load_seconds", "Worker spawn to Ready", ["model"],
                                   buckets=_LOAD_BUCKETS, registry=reg)
        self.loop_lag = Histogram("modelyard_event_loop_lag_seconds", "How late the router's event loop ran "
                                  f"a timer set every {LOOP_LAG_INTERVAL_S:g} s (while it is late, every "
                                  "stream of the router waits)", buckets=_LAG_BUCKETS, registry=reg)
        self.loop_lag_max = Gauge("modelyard_event_loop_lag_max_seconds", "The longest event-loop lag "
                                  "seen since the router started", registry=reg)
        self.llamacpp: dict[str, LlamacppTotals] = {}
        for m in models:
            self.add_model(m)

    async def watch_event_loop(self) -> None:
        """Measure the event loop's lag until cancelled: sleep ``LOOP_LAG_INTERVAL_S``, observe
        how much later than asked the loop woke this task (s, >= 0): a callback that blocks
        the loop (decoding a huge frame, rendering a huge answer) shows up here."""
        loop = asyncio.get_running_loop()
        worst = 0.0
        while True:
            t0 = loop.time()
            await asyncio.sleep(LOOP_LAG_INTERVAL_S)
            lag = max(0.0, loop.time() - t0 - LOOP_LAG_INTERVAL_S)
            self.loop_lag.observe(lag)
            if lag > worst:
                worst = lag
                self.loop_lag_max.set(lag)

    def add_model(self, m: str) -> None:
        """Start ``m``'s per-model counters at 0 (at start, and for a model a reload adds)."""
        for c in (self.loads, self.load_failures, self.evictions, self.crashes, self.restarts, self.prompt_tokens,
                  self.prompt_tokens_cached, self.generation_tokens):
            c.labels(m)
        for stage in CANCEL_STAGES:
            self.cancellations.labels(m, stage)
        self.llamacpp.setdefault(m, LlamacppTotals())

    def count_generation(self, model: str, prompt_n: int, prompt_ms: float, predicted_n: int,
                         predicted_ms: float, n_tokens: int) -> None:
        """Add one finished generation to ``model``'s ``llamacpp:*`` figures: ``prompt_n`` tokens
        evaluated in ``prompt_ms`` ms, ``predicted_n`` generated in ``predicted_ms`` ms, ``n_tokens``
        KV positions held at its end (as llama-server counts them when a slot is released)."""
        t = self.llamacpp.setdefault(model, LlamacppTotals())
        t.prompt_tokens += prompt_n
        t.prompt_seconds += prompt_ms / 1000
        t.tokens_predicted += predicted_n
        t.predicted_seconds += predicted_ms / 1000
        t.n_tokens_max = max(t.n_tokens_max, n_tokens)
        t.window_prompt_tokens += prompt_n
        t.window_prompt_seconds += prompt_ms / 1000
        t.window_predicted_tokens += predicted_n
        t.window_predicted_seconds += predicted_ms / 1000

    def count_decodes(self, model: str, worker: int | None, n_decode: int, n_busy_slots: int) -> None:
        """Take a worker's Pong figures for ``model``'s ``llamacpp:n_decode_total`` and
        ``llamacpp:n_busy_slots_per_decode``: ``n_decode`` forward passes and ``n_busy_slots``
        busy slots summed over them, totals since that worker (``worker``: its pid, None when not
        known) started.
        Another worker (or totals that went down: a new process with a reused pid) starts a new
        run on top of what the previous ones counted, so the counter never goes back."""
        t = self.llamacpp.setdefault(model, LlamacppTotals())
        if worker != t.worker or n_decode < t.worker_decodes or n_busy_slots < t.worker_busy_slots:
            t.decodes_before += t.worker_decodes
            t.busy_slots_before += t.worker_busy_slots
            t.worker = worker
        t.worker_decodes, t.worker_busy_slots = n_decode, n_busy_slots

    def watch(self, snapshot: Callable[[], list[ModelGauges]]) -> None:
        """Read the per-model gauges from ``snapshot()`` at every scrape."""
        self.registry.register(_GaugeCollector(snapshot))
        self.registry.register(_LlamacppCollector(snapshot, self.llamacpp))

    def render(self) -> bytes:
        """The text exposition of every metric."""
        return generate_latest(self.registry)


class _GaugeCollector:
    def __init__(self, snapshot: Callable[[], list[ModelGauges]]) -> None:
        self._snapshot = snapshot

    def describe(self) -> list[Metric]:
        return []  # families are made at collect time; nothing to check against at registration

    def collect(self) -> Iterator[Metric]:
        rows = self._snapshot()
        state = GaugeMetricFamily("modelyard_model_state", "1 for the state the model is in, 0 for the others",
                                  labels=["model", "state"])
        families = {
            "loaded": GaugeMetricFamily("modelyard_model_loaded", "1 while a worker holds the model "
                                        "(ready or draining)", labels=["model"]),
            "waiting": GaugeMetricFamily("modelyard_num_requests_waiting", "Requests waiting for a job slot "
                                         "(the queue depth)", labels=["model"]),
            "running": GaugeMetricFamily("modelyard_num_requests_running", "Requests holding a job slot",
                                         labels=["model"]),
            "total_slots": GaugeMetricFamily("modelyard_slots_total", "KV slots of the worker (0: none up)",
                                             labels=["model"]),
            "busy_slots": GaugeMetricFamily("modelyard_slots_busy", "KV slots running a request",
                                            labels=["model"]),
            "kv_tokens": GaugeMetricFamily("modelyard_kv_cache_tokens", "KV positions held (running "
                                           "sequences and idle prefix-cache entries)", labels=["model"]),
            "kv_budget_tokens": GaugeMetricFamily("modelyard_kv_cache_budget_tokens", "KV positions the "
                                                  "worker's budget allows (0: unknown)", labels=["model"]),
        }
        for row in rows:
            if row.replica is not None:
                continue
            for s in row.states:
                state.add_metric([row.model, s], 1.0 if row.state == s else 0.0)
            for key, fam in families.items():
                fam.add_metric([row.model], float(getattr(row, key)))
        yield state
        yield from families.values()
        yield from _replica_families([r for r in rows if r.replica is not None])


def _replica_families(rows: list[ModelGauges]) -> Iterator[Metric]:
    """Each replica's gauges (models with ``replicas > 1``): labels model, replica, node."""
    if not rows:
        return
    labels = ["model", "replica", "node"]
    state = GaugeMetricFamily("modelyard_replica_state", "1 for the state the replica's worker is in, 0 for "
                              "the others", labels=[*labels, "state"])
    families = {
        "waiting": GaugeMetricFamily("modelyard_replica_requests_waiting", "Requests waiting in the replica's "
                                     "queue", labels=labels),
        "running": GaugeMetricFamily("modelyard_replica_requests_running", "Requests holding a job slot of "
                                     "the replica's worker", labels=labels),
        "total_slots": GaugeMetricFamily("modelyard_replica_slots_total", "KV slots of the replica's worker "
                                         "(0: none up)", labels=labels),
        "busy_slots": GaugeMetricFamily("modelyard_replica_slots_busy", "KV slots of the replica running a "
                                        "request", labels=labels),
    }
    for row in rows:
        ids = [row.model, str(row.replica), row.node]
        for s in row.states:
            state.add_metric([*ids, s], 1.0 if row.state == s else 0.0)
        for key, fam in families.items():
            fam.add_metric(ids, float(getattr(row, key)))
    yield state
    yield from families.values()


class _LlamacppCollector:
    """llama-server's ``llamacpp:*`` families (its README "GET /metrics"), one series per model
    (label ``model``, as its router mode's ``/metrics?model=`` gives one model's). The throughput
    gauges average over the window since the previous scrape, which a scrape then resets, as
    llama-server does. ``n_decode_total`` and ``n_busy_slots_per_decode`` come from the workers'
    Pongs (:meth:`Metrics.count_decodes`; a scrape pings every ready worker first), as
    llama-server computes them: busy slots summed over decode calls / decode calls (at least 1)."""

    def __init__(self, snapshot: Callable[[], list[ModelGauges]], totals: dict[str, LlamacppTotals]) -> None:
        self._snapshot = snapshot
        self._totals = totals

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        rows = {r.model: r for r in self._snapshot() if r.replica is None}

        families = [((CounterMetricFamily if counter else GaugeMetricFamily)(f"llamacpp:{name}", doc, labels=["model"]),
                     value) for name, counter, doc, value in _LLAMACPP_FAMILIES]
        for model, t in self._totals.items():
            row = rows.get(model)
            for family, value in families:
                family.add_metric([model], value(t, row))
            t.window_prompt_tokens = t.window_predicted_tokens = 0
            t.window_prompt_seconds = t.window_predicted_seconds = 0.0
        yield from (family for family, _ in families)


def _per_s(tokens: int, seconds: float) -> float:
    """A throughput over a window, tokens/s (0 for an empty window)."""
    return tokens / seconds if seconds > 0 else 0.0


#: llama-server's ``llamacpp:*`` families in its order: (name, a counter (else a gauge), its help, its
#: value from a model's totals ``t`` and its gauges ``r`` (None: no row for it)).
_LLAMACPP_FAMILIES: tuple[tuple[str, bool, str, Callable[[LlamacppTotals, ModelGauges | None], float]], ...] = (
    ("prompt_tokens", True, "Number of prompt tokens processed.", lambda t, r: t.prompt_tokens),
    ("prompt_seconds", True, "Prompt process time", lambda t, r: t.prompt_seconds),
    ("tokens_predicted", True, "Number of generation tokens processed.", lambda t, r: t.tokens_predicted),
    ("tokens_predicted_seconds", True, "Predict process time", lambda t, r: t.predicted_seconds),
    ("n_tokens_max", False, "Largest observed n_tokens.", lambda t, r: t.n_tokens_max),
    ("prompt_tokens_seconds", False, "Average prompt throughput in tokens/s.",
     lambda t, r: _per_s(t.window_prompt_tokens, t.window_prompt_seconds)),
    ("predicted_tokens_seconds", False, "Average generation throughput in tokens/s.",
     lambda t, r: _per_s(t.window_predicted_tokens, t.window_predicted_seconds)),
    ("requests_processing", False, "Number of requests processing.", lambda t, r: r.running if r else 0),
    ("requests_deferred", False, "Number of requests deferred.", lambda t, r: r.waiting if r else 0),
    ("kv_cache_usage_ratio", False, "KV-cache usage. 1 means 100 percent usage.",
     lambda t, r: r.kv_tokens / r.kv_budget_tokens if r and r.kv_budget_tokens else 0.0),
    ("kv_cache_tokens", False, "KV-cache tokens.", lambda t, r: r.kv_tokens if r else 0),
    ("n_decode", True, "Total number of llama_decode() calls", lambda t, r: t.n_decode_total),
    ("n_busy_slots_per_decode", False, "Average number of busy slots per llama_decode() call",
     lambda t, r: t.n_busy_slots_total / max(t.n_decode_total, 1)),
)


def label_request(request: Request, model: str) -> None:
    """Name the model a request is for, as ``modelyard_requests_total``'s ``model`` label."""
    request.state.model = model


class RequestMetrics:
    """ASGI middleware counting every HTTP answer by route template and status
    (``modelyard_requests_total``). Outermost, so auth failures (401) count too. The
    model label is the one a handler resolved (``request.state.model``), else empty."""

    def __init__(self, app: ASGIApp, metrics: Metrics, routes: list[BaseRoute]) -> None:
        self.app = app
        self.metrics = metrics
        self.routes = routes

    def _template(self, scope: Scope) -> str:
        return route_template(self.routes, scope, "other")  # unknown paths share one label (bounded values)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = [0]

        async def send_wrapper(msg: Message) -> None:
            if msg["type"] == "http.response.start":
                status[0] = int(msg["status"])
            await send(msg)

        failed = True
        try:
            await self.app(scope, receive, send_wrapper)
            failed = False
        finally:
            model = scope.get("state", {}).get("model", "")
            # no answer started: a bug (Starlette's outer handler answers 500), else the client went away
            code = str(status[0]) if status[0] else ("500" if failed else "499")
            self.metrics.requests.labels(model, self._template(scope), code).inc()

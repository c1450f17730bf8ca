"""``config.toml``: read once with :mod:`tomllib`, validated into typed, frozen records.

Layout::

    [server]            host, port, api_key, admin_key, models_dir, transport,
                        shutdown_timeout_s, allowed_hosts, cors_origins, header_timeout_s,
                        body_timeout_s, keep_alive_timeout_s, max_connections, max_header_bytes,
                        stream_stall_timeout_s, sse_keepalive_s, max_loaded, default_model,
                        discover_models, max_keep_alive_s, warm_spare
    [defaults]          any per-model key below except path/aliases; applies to every model
    [presets.NAME]      model (required), aliases, sampling keys, n_predict, system_prompt, chat_template,
                        reasoning, chat_template_kwargs (router.config_presets)
    [models.NAME]       path (required), aliases, n_ctx, chat_template, reasoning, max_queue,
                        load_timeout_s, cancel_timeout_s, drain_timeout_s,
                        shutdown_grace_s, ping_interval_s, ping_timeout_s, unresponsive_after_s,
                        idle_ttl_s, n_threads, parallel, kv_budget_mib, restart_backoff_s, restart_backoff_max_s,
                        max_crashes, crash_window_s, pinned, n_predict, system_prompt,
                        and default sampling values (temperature, top_p, top_k, min_p,
                        repeat_penalty, repeat_last_n, presence_penalty,
                        frequency_penalty, seed), node_labels, replicas, routing
    [cluster]           backend, address, advertise_host, place_timeout_s (router.config_cluster)

Every defect raises :class:`ConfigError` whose message starts with the key path
(``models.smollm2.max_queue: ...``); unknown keys are defects too (a typo must not
silently fall back to a default). ``models_dir`` is relative to the config file's
directory; when it is not set, ``$MODELYARD_MODELS_DIR`` (the directory
``scripts/fetch_models.py`` downloads into) is the default, else ``models``. Each
model ``path`` is relative to ``models_dir``.
"""

from __future__ import annotations

import ipaddress
import os
import re
import tomllib
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

from protocol.lifecycle import option_defaults
from protocol.limits import DEFAULT_WEIGHTS, WEIGHT_MODES
from router.config_cluster import REPLICA_KEYS, ClusterConfig, node_labels, one_worker_each, parse_cluster, replica_fields
from router.config_presets import parse_presets
from router.config_readers import ConfigError as ConfigError  # re-exported: every caller's name for it
from router.config_readers import (
    REASONING_MODES, SAMPLING_KEYS, TableReader, check_id, no_unknown, read_aliases, read_choice, read_endpoint,
    read_n_predict, read_opt_dir, read_opt_str, read_sampling, read_str, replica_endpoint, table_of,
)

#: config.toml's defaults of the worker options (ModelConfig's fields named as protocol.ModelOptions'): the
#: worker's (protocol.lifecycle.option_defaults) but ``parallel``: a served model decodes 4 sequences at once
#: unless told (docs/configuration.md), a bare ``python -m worker`` 1. The fields below take theirs from here.
_W: dict[str, Any] = {**option_defaults(), "parallel": 4}

@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """One served model.

    ``n_ctx`` in tokens (None: the worker's choice, min(n_ctx_train, 8192));
    ``chat_template`` a known template name ("chatml", "gemma") or template text
    (None: the GGUF's own); ``max_queue``: requests allowed to wait (for the
    load or for the running request) beyond the one running. Times in seconds.
    """

    name: str
    path: Path  # absolute
    aliases: tuple[str, ...] = ()
    n_ctx: int | None = _W["n_ctx"]
    chat_template: str | None = _W["chat_template"]
    # llama.cpp's --reasoning: "auto" / "on" render the template with enable_thinking true (a reasoning
    # template opens its think block; others ignore it), "off" with enable_thinking false (it is closed);
    # a request's chat_template_kwargs.enable_thinking wins
    reasoning: str = "auto"
    max_queue: int = _W["max_queue"]
    load_timeout_s: float = 120.0
    cancel_timeout_s: float = 10.0  # Cancel sent -> no Done within this: the worker is killed
    drain_timeout_s: float = 600.0  # unload waits this long for running requests, then cancels them
    shutdown_grace_s: float = 5.0  # Shutdown sent -> still alive after this: SIGKILL
    ping_interval_s: float = 5.0  # liveness ping of a ready worker; 0 turns it off
    ping_timeout_s: float = 30.0  # no Pong within this: the worker is declared hung and killed
    # no frame (Token, Pong) from a worker that owes one for this long: state unresponsive (no new
    # jobs handed to it) until a frame comes, or it is killed at ping_timeout_s (router.workers.liveness)
    unresponsive_after_s: float = 3.0
    idle_ttl_s: float = 0.0  # nothing running or waiting this long: unload the worker; 0 = never
    n_threads: int | None = None  # the worker's BLAS threads (python -m worker --threads); None: environment's
    parallel: int = _W["parallel"]  # KV slots: sequences the worker decodes at once (python -m worker --parallel)
    kv_budget_mib: float | None = _W["kv_budget_mib"]  # KV memory of the worker's sequences + prefix cache; None: the worker's
    weights: str | None = _W["weights"]  # "quantized" | "f32" (python -m worker --weights); None: the worker's ("f32")
    n_ubatch: int | None = _W["n_ubatch"]  # tokens of a prompt's micro-batch (python -m worker --n-ubatch); None: the worker's (512)
    # crash backoff (router.workers.backoff): the n-th failure within crash_window_s waits
    # min(restart_backoff_s * 2**(n-1), restart_backoff_max_s) before the next start;
    # the max_crashes-th makes the model failed until an operator loads it
    restart_backoff_s: float = 1.0
    restart_backoff_max_s: float = 60.0
    max_crashes: int = 5
    crash_window_s: float = 300.0
    node_labels: tuple[tuple[str, str], ...] = ()  # Ray node labels its worker's node must carry (router.config_cluster)
    replicas: int = 1  # workers serving it, each its own slot (router.workers.replicas); routing: how a
    routing: str = "cache_aware"  # request picks one (router.serving.routing; router.config_cluster)
    pinned: bool = False  # never evicted for another model (router.workers.placement) nor unloaded for idleness
    # KV states (worker.engine.kv.state): POST /slots/{id}?action=save|restore|erase files live in
    # slot_save_path (None: slot actions are a 501); kv_cache_dir/<model name> keeps the idle KV
    # caches across unload / eviction / stop, restored lazily on a prefix match (None: off),
    # within kv_cache_mib of disk per model
    slot_save_path: Path | None = _W["slot_save_path"]
    kv_cache_dir: Path | None = _W["kv_cache_dir"]
    kv_cache_mib: float = _W["kv_cache_mib"]
    # KV events (worker.kvevents; docs/operations.md#kv-events): the PUB endpoint its worker binds (None:
    # none) and their block size; kv_events_to_router is no key: set when the router routes by them
    kv_events_endpoint: str | None = _W["kv_events_endpoint"]
    kv_events_block_size: int = _W["kv_events_block_size"]
    kv_events_to_router: bool = _W["kv_events_to_router"]
    # disaggregated prefill/decode (router.serving.disaggregate): another configured model (same GGUF)
    # whose worker prefills this model's prompts; this model's worker decodes. None: this worker
    # does both. kv_transfer: how the KV state moves between them: "wire" (KVChunk frames
    # relayed by the router, the default) or "file" (through a slot_save_path both share)
    prefill_model: str | None = None
    kv_transfer: str = "wire"
    # llama.cpp's -n / --n-predict: the length of an answer whose request names none, and the cap of
    # one that names more (it then ends with finish_reason "length"); -1: no limit but n_ctx
    n_predict: int = -1
    # budgets (router.serving.budget): n x max_tokens of one request at most this many tokens (0: n_ctx);
    # background generations' choices running at once on this model (0: max(1, parallel // 2))
    max_request_tokens: int = 0
    background_slots: int = 0
    sampling: dict[str, float | int] = field(default_factory=dict)
    discovered: bool = False  # found in models_dir (router.workers.discovery), not a [models.NAME] table
    system_prompt: str | None = None  # the system message a chat request without one gets
    preset: str | None = None  # set on the view a [presets.NAME] gives of this model (router.serving.presets)
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # a preset's chat template variables

    @property
    def weights_mode(self) -> str:
        """The weights mode its worker runs ("f32" or "quantized"): ``weights``, or when unset
        the worker's default (``protocol.limits.DEFAULT_WEIGHTS``). What the banner, /health,
        the model listings and placement's estimate show and use."""
        return self.weights if self.weights is not None else DEFAULT_WEIGHTS


@dataclass(frozen=True, kw_only=True)
class ServerConfig:
    """``[server]``. ``transport``: "ipc" (a socket file in a private temp
    directory) or "tcp" (127.0.0.1, an ephemeral port) for the worker sockets."""

    host: str = "127.0.0.1"
    port: int = 8080
    api_key: str | None = None
    admin_key: str | None = None
    models_dir: Path = Path("models")
    transport: str = "ipc"
    shutdown_timeout_s: float = 10.0  # uvicorn's graceful-shutdown bound for open HTTP requests
    # browser-origin protection (router.http.security)
    allowed_hosts: tuple[str, ...] = ()  # Host names accepted besides loopback ones; "*": any
    cors_origins: tuple[str, ...] = ()  # Origins allowed cross-origin (with CORS headers); "*": any
    # slow or absent clients (router.http.http_server)
    header_timeout_s: float = 10.0  # a connection's request head must arrive within this
    body_timeout_s: float = 30.0  # a request body must arrive in full within this (else 408)
    keep_alive_timeout_s: float = 5.0  # an idle keep-alive connection is closed after this
    max_connections: int = 256  # requests in progress beyond this get 503; idle sockets beyond it are closed
    max_header_bytes: int = 16 * 1024  # a request head larger than this is a 400 (h11)
    stream_stall_timeout_s: float = 30.0  # a client that reads nothing of its answer this long is cut off
    sse_keepalive_s: float = 5.0  # a stream silent this long (a prompt prefilling) sends a keep-alive
    max_loaded: int = 0  # models holding a worker at once (0: no limit); router.workers.placement evicts idle ones
    # the Responses API's stored responses (router.dialects.response_store)
    responses_store_max: int = 256  # responses kept for GET /v1/responses/{id} and previous_response_id
    responses_store_ttl_s: float = 3600.0  # a stored response is forgotten this long after it was made
    # background generations: POST /v1/decode, background Responses (router.dialects.background)
    background_max: int = 256  # jobs kept, running or finished (the oldest finished is dropped first)
    background_ttl_s: float = 3600.0  # a finished job is forgotten this long after it ended (0: never)
    background_max_mib: float = 64.0  # the stored events of all jobs, MiB (oldest finished dropped first)
    discover_models: bool = False  # serve every GGUF in models_dir under its file's name (router.workers.discovery)
    max_keep_alive_s: float | None = None  # the longest keep_alive / ttl a request may set (None: no cap)
    background_per_key: int = 8  # background jobs running at once per API key (keyless clients share one)
    background_unread_s: float = 600.0  # a running job nobody has read for this long is cancelled (0: never)
    # the model a request without "model" gets (a name or alias; None: the only model when exactly one
    # is configured, else "model" is required), as llama-server answers with the model it serves
    default_model: str | None = None
    # keep one worker process started without a model (imports and kernels done), taken by the next
    # model to load (router.workers.launchers.local): its cold start skips the process's own start
    warm_spare: bool = True


@dataclass(frozen=True, kw_only=True)
class Config:
    server: ServerConfig
    models: dict[str, ModelConfig]  # by canonical name, in file order
    source: Path | None = None
    defaults: dict[str, Any] = field(default_factory=dict)  # the [defaults] table (discovered models use it)
    presets: dict[str, ModelConfig] = field(default_factory=dict)  # [presets.NAME]: a model's view (router.serving.presets)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)  # [cluster]: where workers run (router.config_cluster)

    def resolve(self, name: str) -> ModelConfig | None:
        """The model called ``name`` (canonical name or alias), else None."""
        if name in self.models:
            return self.models[name]
        for m in self.models.values():
            if name in m.aliases:
                return m
        if name in self.presets:
            return self.presets[name]
        for m in self.presets.values():
            if name in m.aliases:
                return m
        return None

    def default_name(self) -> str | None:
        """The model a request without ``"model"`` is served by: ``[server] default_model``, else
        the only configured model, else None (``"model"`` is then required)."""
        if self.server.default_model is not None:
            return self.server.default_model
        return next(iter(self.models)) if len(self.models) == 1 else None

    def ids(self) -> list[str]:
        """Every name a client may use: canonical names and aliases."""
        out: list[str] = []
        for m in self.models.values():
            out.append(m.name)
            out.extend(m.aliases)
        for name, p in self.presets.items():
            out.append(name)
            out.extend(p.aliases)
        return out


_MODEL_KEYS = {
    "path", "aliases", "n_ctx", "chat_template", "reasoning", "max_queue", "load_timeout_s",
    "cancel_timeout_s", "drain_timeout_s", "shutdown_grace_s", "ping_interval_s",
    "ping_timeout_s", "unresponsive_after_s", "idle_ttl_s", "n_threads", "parallel", "kv_budget_mib", "weights",
    "n_ubatch", "restart_backoff_s", "restart_backoff_max_s", "max_crashes", "crash_window_s", "pinned", "slot_save_path",
    "kv_cache_dir", "kv_cache_mib", "prefill_model", "kv_transfer", "n_predict", "max_request_tokens", *REPLICA_KEYS,
    "background_slots", "system_prompt", "node_labels", "kv_events_endpoint", "kv_events_block_size", *SAMPLING_KEYS,
}
#: Each ServerConfig field's default: what a key left out of [server] gives.
_SERVER_DEFAULTS = {f.name: f.default for f in fields(ServerConfig) if f.default is not MISSING}
#: Each ModelConfig field's default (those without a default_factory): what a key left out of config.toml gives.
_MODEL_DEFAULTS = {f.name: f.default for f in fields(ModelConfig) if f.default is not MISSING}
_DEFAULTS_KEYS = _MODEL_KEYS - {"path", "aliases", "prefill_model", "kv_transfer"}
#: ``kv_transfer`` values (router.serving.disaggregate).
KV_TRANSFERS = ("wire", "file")
_SERVER_KEYS = {"host", "port", "api_key", "admin_key", "models_dir", "transport", "shutdown_timeout_s",
                "allowed_hosts", "cors_origins", "header_timeout_s", "body_timeout_s",
                "keep_alive_timeout_s", "max_connections", "max_header_bytes", "stream_stall_timeout_s", "sse_keepalive_s",
                "max_loaded",
                "responses_store_max", "responses_store_ttl_s", "background_max", "background_ttl_s", "background_max_mib",
                "background_per_key", "background_unread_s", "default_model", "discover_models", "max_keep_alive_s",
                "warm_spare"}

#: A ``cors_origins`` entry: scheme://host[:port], nothing after it (or "*").
_ORIGIN = re.compile(r"^[a-z][a-z0-9+.-]*://[^/\s?#]+$")


def load_config(path: str | Path) -> Config:
    """Read and validate ``path``. Raises ConfigError (naming the key) on any defect,
    including an unreadable file or malformed TOML."""
    p = Path(path)
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise ConfigError("", f"cannot read config file {p}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError("", f"{p}: invalid TOML: {e}") from None
    return parse_config(data, base_dir=p.resolve().parent, source=p.resolve())


def parse_config(data: dict[str, Any], *, base_dir: Path, source: Path | None = None) -> Config:
    """Validate an already-parsed TOML document. Raises ConfigError."""
    no_unknown(data, {"server", "defaults", "models", "presets", "cluster"}, "")
    server = _server(table_of(data, "server", "server"), base_dir)
    check_public_bind(server)

    defaults = table_of(data, "defaults", "defaults")
    no_unknown(defaults, _DEFAULTS_KEYS, "defaults")
    models_raw = table_of(data, "models", "models")
    if not models_raw and not server.discover_models:
        raise ConfigError("models", "at least one [models.NAME] table is required")
    models: dict[str, ModelConfig] = {}
    seen_ids: dict[str, str] = {}
    for name, table in models_raw.items():
        models[name] = _model(name, table, defaults, server.models_dir, base_dir, seen_ids)
    bound: dict[str, str] = {}  # KV-events endpoint -> the model whose worker binds it
    for name, m in models.items():
        _check_prefill_model(name, m, models)
        for ep in (replica_endpoint(m.kv_events_endpoint, r) for r in range(m.replicas) if m.kv_events_endpoint):
            if bound.setdefault(ep, name) != name:
                raise ConfigError(f"models.{name}.kv_events_endpoint", f"{ep} is {bound[ep]}'s too: each worker binds "
                                  "its own (in [defaults], put {model} in it)")
    presets = parse_presets(table_of(data, "presets", "presets"), models, seen_ids)
    if server.default_model is not None and server.default_model not in seen_ids:
        raise ConfigError("server.default_model", f"{server.default_model!r} is not a configured model name or "
                          f"alias (configured: {', '.join(seen_ids)})")
    return Config(server=server, models=models, source=source, defaults=dict(defaults), presets=presets,
                  cluster=parse_cluster(data))


def _server(server_raw: dict[str, Any], base_dir: Path) -> ServerConfig:
    """``[server]``. Raises ConfigError naming the key."""
    no_unknown(server_raw, _SERVER_KEYS, "server")
    r = TableReader(server_raw, lambda key: "server", _SERVER_DEFAULTS)
    transport = read_str(server_raw, "transport", "server", _SERVER_DEFAULTS["transport"])
    if transport not in ("ipc", "tcp"):
        raise ConfigError("server.transport", f'expected "ipc" or "tcp", got {transport!r}')
    return ServerConfig(
        host=read_str(server_raw, "host", "server", _SERVER_DEFAULTS["host"]), port=r.integer("port", 0, 65535),
        api_key=read_opt_str(server_raw, "api_key", "server"), admin_key=read_opt_str(server_raw, "admin_key", "server"),
        models_dir=resolve_models_dir(server_raw, base_dir), transport=transport,
        shutdown_timeout_s=r.real("shutdown_timeout_s", 0.0),
        allowed_hosts=_hosts(server_raw),
        cors_origins=_origins(server_raw),
        header_timeout_s=r.real("header_timeout_s", 0.1),
        body_timeout_s=r.real("body_timeout_s", 0.1),
        keep_alive_timeout_s=r.real("keep_alive_timeout_s", 0.1),
        max_connections=r.integer("max_connections", 1, 1_000_000),
        max_header_bytes=r.integer("max_header_bytes", 1024, 1024 * 1024),
        stream_stall_timeout_s=r.real("stream_stall_timeout_s", 0.1),
        sse_keepalive_s=r.real("sse_keepalive_s", 0.05, 3600.0),
        max_loaded=r.integer("max_loaded", 0, 100_000),
        responses_store_max=r.integer("responses_store_max", 0, 1_000_000),
        responses_store_ttl_s=r.real("responses_store_ttl_s", 0.0),
        background_max=r.integer("background_max", 1, 1_000_000),
        background_ttl_s=r.real("background_ttl_s", 0.0),
        background_max_mib=r.real("background_max_mib", 0.01),
        discover_models=r.flag("discover_models"),
        max_keep_alive_s=r.opt_real("max_keep_alive_s", 0.0),
        background_per_key=r.integer("background_per_key", 1, 1_000_000),
        background_unread_s=r.real("background_unread_s", 0.0),
        default_model=read_opt_str(server_raw, "default_model", "server"),
        warm_spare=r.flag("warm_spare"),
    )


def _model(name: str, table: Any, defaults: dict[str, Any], models_dir: Path, base_dir: Path,
           seen_ids: dict[str, str]) -> ModelConfig:
    """``[models.NAME]`` over ``[defaults]``; ``seen_ids`` (id -> model) gets its name and aliases.
    Raises ConfigError naming the key (in ``defaults`` when the value came from there)."""
    where = f"models.{name}"
    if not isinstance(table, dict):
        raise ConfigError(where, f"expected a table, got {type(table).__name__}")
    no_unknown(table, _MODEL_KEYS, where)
    check_id(name, where)
    merged = {**defaults, **table}

    def src(key: str) -> str:
        return where if key in table else "defaults"

    if "path" not in table:
        raise ConfigError(f"{where}.path", "required (the GGUF file, relative to server.models_dir)")
    rel = read_str(table, "path", where, "")
    gguf = Path(rel) if Path(rel).is_absolute() else models_dir / rel
    if not gguf.is_file():
        raise ConfigError(f"{where}.path", f"no such file: {gguf}")
    aliases_raw = read_aliases(table, name, where, seen_ids, "model ")
    r = TableReader(merged, src, _MODEL_DEFAULTS)
    ping_timeout = r.real("ping_timeout_s", 0.001)
    return ModelConfig(
        name=name,
        path=gguf.resolve(),
        aliases=tuple(aliases_raw),
        n_ctx=r.opt_integer("n_ctx", 16, 1 << 20),
        chat_template=read_opt_str(merged, "chat_template", src("chat_template")),
        reasoning=read_choice(merged, "reasoning", src("reasoning"), REASONING_MODES),
        max_queue=r.integer("max_queue", 0, 100_000),
        load_timeout_s=r.real("load_timeout_s", 0.001),
        cancel_timeout_s=r.real("cancel_timeout_s", 0.001),
        drain_timeout_s=r.real("drain_timeout_s", 0.0),
        shutdown_grace_s=r.real("shutdown_grace_s", 0.0),
        ping_interval_s=r.real("ping_interval_s", 0.0),
        ping_timeout_s=ping_timeout,
        unresponsive_after_s=min(ping_timeout, r.real("unresponsive_after_s", 0.001)),
        idle_ttl_s=r.real("idle_ttl_s", 0.0),
        n_threads=r.opt_integer("n_threads", 1, 1024),
        parallel=r.integer("parallel", 1, 256),
        kv_budget_mib=r.opt_real("kv_budget_mib", 1.0, float(1 << 24)),
        weights=_weights(merged, src("weights")),
        n_ubatch=r.opt_integer("n_ubatch", 1, 65536),
        restart_backoff_s=r.real("restart_backoff_s", 0.0),
        restart_backoff_max_s=r.real("restart_backoff_max_s", 0.0),
        max_crashes=r.integer("max_crashes", 1, 1_000_000),
        crash_window_s=r.real("crash_window_s", 0.0),
        pinned=r.flag("pinned"),
        slot_save_path=read_opt_dir(merged, "slot_save_path", src("slot_save_path"), base_dir),
        kv_cache_dir=read_opt_dir(merged, "kv_cache_dir", src("kv_cache_dir"), base_dir),
        kv_cache_mib=r.real("kv_cache_mib", 0.0, float(1 << 30)),
        kv_events_endpoint=read_endpoint(merged, "kv_events_endpoint", src("kv_events_endpoint"), base_dir, name),
        kv_events_block_size=r.integer("kv_events_block_size", 1, 65536),
        prefill_model=read_opt_str(table, "prefill_model", where),
        kv_transfer=_kv_transfer(table, where),
        n_predict=read_n_predict(merged, src("n_predict")),
        max_request_tokens=r.integer("max_request_tokens", 0, 1 << 30),
        background_slots=r.integer("background_slots", 0, 100_000),
        sampling=read_sampling(merged, src),
        system_prompt=read_opt_str(merged, "system_prompt", src("system_prompt")),
        node_labels=node_labels(merged, src("node_labels")),
        **replica_fields(merged, src),
    )


def _check_prefill_model(name: str, m: ModelConfig, models: dict[str, ModelConfig]) -> None:
    """``prefill_model`` names another model of the same GGUF (and, with ``kv_transfer = "file"``,
    the same slot_save_path), itself not split. Raises ConfigError naming the key."""
    if m.prefill_model is None:
        return
    key = f"models.{name}.prefill_model"
    p = models.get(m.prefill_model)
    if p is None or p is m:
        raise ConfigError(key, f"{m.prefill_model!r} is not another configured model (by its canonical name)")
    one_worker_each(key, m.replicas, p.replicas)
    if p.path != m.path:
        raise ConfigError(key, f"{m.prefill_model!r} serves {p.path.name}, not {m.path.name}: the KV state "
                          "is only valid for the same GGUF")
    if m.kv_transfer == "file" and (m.slot_save_path is None or p.slot_save_path != m.slot_save_path):
        raise ConfigError(key, 'with kv_transfer = "file" both models need the same slot_save_path (the KV '
                          "state is handed over there)")
    if p.prefill_model is not None:
        raise ConfigError(key, f"{m.prefill_model!r} has a prefill_model itself")


#: Where the models are when ``[server].models_dir`` is not set (``scripts/fetch_models.py``
#: downloads there too); a relative value is relative to the current directory, as there.
MODELS_DIR_ENV = "MODELYARD_MODELS_DIR"


def resolve_models_dir(server_raw: dict[str, Any], base_dir: Path, env: dict[str, str] | None = None) -> Path:
    """``[server].models_dir`` (relative to the config file's directory) when set — the
    config wins; else ``$MODELYARD_MODELS_DIR`` if set and non-empty (relative to the
    current directory); else ``models`` next to the config file."""
    if "models_dir" in server_raw:
        d = Path(read_str(server_raw, "models_dir", "server", "models"))
        return d if d.is_absolute() else base_dir / d
    from_env = (os.environ if env is None else env).get(MODELS_DIR_ENV, "")
    if from_env:
        return Path(from_env).absolute()
    return base_dir / "models"


def is_loopback(host: str) -> bool:
    """True for "localhost" and loopback addresses (127.0.0.0/8, ::1)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_public_bind(server: ServerConfig) -> None:
    """Binding a non-loopback host is an explicit choice that needs an api_key.
    Raises ConfigError("server.api_key") otherwise."""
    if not is_loopback(server.host) and not server.api_key:
        raise ConfigError(
            "server.api_key",
            f"binding the non-loopback host {server.host!r} requires server.api_key "
            "(every route but /health then needs 'Authorization: Bearer <api_key>')",
        )


def _str_list(t: dict[str, Any], key: str, where: str) -> list[str]:
    v = t.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) and x.strip() for x in v):
        raise ConfigError(f"{where}.{key}", "expected a list of non-empty strings")
    return [x.strip() for x in v]


def _hosts(server_raw: dict[str, Any]) -> tuple[str, ...]:
    out = []
    for h in _str_list(server_raw, "allowed_hosts", "server"):
        if any(c.isspace() or c in "/:[]" for c in h) and h != "*":
            raise ConfigError("server.allowed_hosts",
                              f"{h!r}: expected a host name without scheme, port or path (or \"*\")")
        out.append(h.lower().rstrip("."))
    return tuple(out)


def _origins(server_raw: dict[str, Any]) -> tuple[str, ...]:
    out = []
    for o in _str_list(server_raw, "cors_origins", "server"):
        o = o.rstrip("/")
        if o != "*" and not _ORIGIN.match(o.lower()):
            raise ConfigError("server.cors_origins",
                              f"{o!r}: expected an origin such as \"http://localhost:3000\" (or \"*\")")
        out.append(o)
    return tuple(out)


def _weights(t: dict[str, Any], where: str) -> str | None:
    v = read_opt_str(t, "weights", where)
    if v is not None and v not in WEIGHT_MODES:
        raise ConfigError(f"{where}.weights", f"expected one of {', '.join(WEIGHT_MODES)}, got {v!r}")
    return v


def _kv_transfer(t: dict[str, Any], where: str) -> str:
    if "kv_transfer" in t and "prefill_model" not in t:
        raise ConfigError(f"{where}.kv_transfer", "only a model with a prefill_model hands KV states over")
    return read_choice(t, "kv_transfer", where, KV_TRANSFERS)

"""``protocol.lifecycle.option_defaults``: the one table of the worker options' defaults, and what
takes its defaults from it: the worker's flags (``python -m worker``), ``router.config.ModelConfig``
and config.toml's reader (a model table that leaves every key out; ``[server]`` likewise)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from protocol.lifecycle import ModelOptions, option_defaults
from router.config import ModelConfig, ServerConfig, parse_config
from worker.__main__ import parse_args


def _config_defaults() -> dict[str, object]:
    return {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}


def test_the_table_is_model_options_defaults() -> None:
    d = option_defaults()
    assert set(d) == {f.name for f in dataclasses.fields(ModelOptions)} - {"model", "gguf"}
    assert d["parallel"] == 1 and d["max_queue"] == 8 and d["kv_cache_mib"] == 1024.0


def test_the_worker_flags_default_to_the_table() -> None:
    args = vars(parse_args(["--model", "m", "--gguf", "/x.gguf", "--endpoint", "ipc:///tmp/x.sock"]))
    assert {k: args[k] for k in option_defaults()} == option_defaults()


def test_config_defaults_are_the_workers_but_parallel() -> None:
    """config.toml's default of each worker option is the worker's own, but ``parallel``: a served
    model decodes 4 sequences at once (docs/configuration.md), a bare worker 1."""
    config, worker = _config_defaults(), option_defaults()
    assert set(worker) <= set(config)  # ModelConfig names every worker option as ModelOptions does
    assert {k: config[k] for k in worker if config[k] != worker[k]} == {"parallel": 4}


def test_a_model_table_without_keys_reads_as_model_config_defaults(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    data = {"server": {"models_dir": str(tmp_path)}, "models": {"m": {"path": "m.gguf"}}}
    m = parse_config(data, base_dir=tmp_path).models["m"]
    built = ModelConfig(name="m", path=m.path)
    assert m == built
    assert m.parallel == 4 and m.max_queue == 8


def test_an_empty_server_table_reads_as_server_config_defaults(tmp_path: Path) -> None:
    (tmp_path / "m.gguf").write_bytes(b"GGUF fake")
    data = {"server": {"models_dir": str(tmp_path)}, "models": {"m": {"path": "m.gguf"}}}
    server = parse_config(data, base_dir=tmp_path).server
    assert server == ServerConfig(models_dir=server.models_dir)
    assert server.port == 8080 and server.warm_spare is True and server.max_keep_alive_s is None

"""The readers ``config.toml``'s tables are validated with (router.config, router.config_presets):
each takes a table, a key and the table's dotted path, and raises :class:`ConfigError` naming
the key path (``models.smollm2.max_queue: ...``) on any defect.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from protocol.limits import GENERATE_LIMITS

#: Sampling keys a model (or [defaults]) may preset. A request's own value wins;
#: these win over the API's built-in defaults (OpenAI's for /v1/*, llama.cpp's for /completion).
SAMPLING_KEYS: dict[str, tuple[type, float | None, float | None]] = {
    # key: (type, minimum, maximum)
    "temperature": (float, 0.0, 100.0),
    "top_p": (float, 0.0, 1.0),
    "top_k": (int, 0, 2**31 - 1),
    "min_p": (float, 0.0, 1.0),
    "repeat_penalty": (float, 0.0, None),
    "repeat_last_n": (int, -1, 2**31 - 1),
    "presence_penalty": (float, -2.0, 2.0),
    "frequency_penalty": (float, -2.0, 2.0),
    "seed": (int, -(2**63), 2**64 - 1),  # what the protocol carries; negative: random
}


class ConfigError(ValueError):
    """The configuration is invalid. ``key`` is the dotted key path at fault."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key




def no_unknown(table: dict[str, Any], allowed: set[str], where: str) -> None:
    for key in table:
        if key not in allowed:
            path = f"{where}.{key}" if where else key
            raise ConfigError(path, f"unknown key (allowed: {', '.join(sorted(allowed))})")


def table_of(data: dict[str, Any], key: str, where: str) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise ConfigError(where, f"expected a table, got {type(value).__name__}")
    return value


def check_id(ident: str, where: str) -> None:
    if not ident or len(ident) > 128 or any(c.isspace() for c in ident):
        raise ConfigError(where, f"invalid model id {ident!r} (1..128 characters, no whitespace)")


def read_opt_dir(t: dict[str, Any], key: str, where: str, base_dir: Path) -> Path | None:
    """An optional directory (relative to the config file's directory); it need not exist yet,
    but an existing non-directory there is an error."""
    v = read_opt_str(t, key, where)
    if v is None:
        return None
    d = Path(v) if Path(v).is_absolute() else base_dir / v
    if d.exists() and not d.is_dir():
        raise ConfigError(f"{where}.{key}", f"not a directory: {d}")
    return d.resolve()


def read_endpoint(t: dict[str, Any], key: str, where: str, base_dir: Path, model: str) -> str | None:
    """An optional ZeroMQ endpoint to bind, ``tcp://HOST:PORT`` or ``ipc://PATH`` (a relative PATH
    is relative to ``base_dir``), with ``{model}`` replaced by ``model``; None when absent."""
    v = read_opt_str(t, key, where)
    if v is None:
        return None
    v = v.replace("{model}", model)
    if v.startswith("ipc://") and len(v) > len("ipc://"):
        p = Path(v[len("ipc://"):])
        return "ipc://" + str(p if p.is_absolute() else base_dir / p)
    host, sep, port = v[len("tcp://"):].rpartition(":")
    if v.startswith("tcp://") and host and sep and port.isdigit() and 0 < int(port) < 65536:
        return v
    raise ConfigError(f"{where}.{key}", f"expected tcp://HOST:PORT or ipc://PATH, got {v!r}")


def replica_endpoint(endpoint: str, replica: int) -> str:
    """The KV-events endpoint replica ``replica`` of a model binds: replica 0 ``endpoint`` itself,
    replica N ``tcp://HOST:PORT+N`` (vLLM's rule for its data-parallel ranks) or ``ipc://PATH-N``,
    so that no two replicas on one host bind the same socket."""
    if replica == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        host, _, port = endpoint.rpartition(":")
        return f"{host}:{int(port) + replica}"
    return f"{endpoint}-{replica}"


def read_bool(t: dict[str, Any], key: str, where: str, default: bool) -> bool:
    v = t.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{where}.{key}", f"expected true or false, got {v!r}")
    return v


def read_str(t: dict[str, Any], key: str, where: str, default: str) -> str:
    v = t.get(key, default)
    if not isinstance(v, str):
        raise ConfigError(f"{where}.{key}", f"expected a string, got {type(v).__name__}")
    return v


def read_choice(t: dict[str, Any], key: str, where: str, choices: tuple[str, ...]) -> str:
    """``t[key]``, one of ``choices`` (default: the first)."""
    v = read_opt_str(t, key, where)
    if v is None:
        return choices[0]
    if v not in choices:
        raise ConfigError(f"{where}.{key}", f"expected one of {', '.join(choices)}, got {v!r}")
    return v


def read_opt_str(t: dict[str, Any], key: str, where: str) -> str | None:
    if key not in t:
        return None
    v = read_str(t, key, where, "")
    return v or None


def read_int(t: dict[str, Any], key: str, where: str, default: int, lo: float | None = None,
         hi: float | None = None) -> int:
    v = t.get(key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"{where}.{key}", f"expected an integer, got {type(v).__name__}")
    _range(v, f"{where}.{key}", lo, hi)
    return v


def read_float(t: dict[str, Any], key: str, where: str, default: float, lo: float | None = None,
           hi: float | None = None) -> float:
    v = t.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"{where}.{key}", f"expected a finite number, got {v!r}")
    _range(v, f"{where}.{key}", lo, hi)
    return float(v)


class TableReader:
    """Reads one model's keys: ``merged`` is its table over ``[defaults]``, ``where_of(key)`` the
    path of the table that gave ``key``, ``defaults`` each key's value when it is absent (a
    ModelConfig field's default: that default is written once, there). The ``opt_`` readers also
    take an explicit absent value (TOML has no null, but a merged dict may) as absent."""

    def __init__(self, merged: dict[str, Any], where_of: Callable[[str], str], defaults: dict[str, Any]) -> None:
        self.merged, self.where_of, self.defaults = merged, where_of, defaults

    def integer(self, key: str, lo: float | None = None, hi: float | None = None) -> int:
        return read_int(self.merged, key, self.where_of(key), self.defaults[key], lo, hi)

    def real(self, key: str, lo: float | None = None, hi: float | None = None) -> float:
        return read_float(self.merged, key, self.where_of(key), self.defaults[key], lo, hi)

    def flag(self, key: str) -> bool:
        return read_bool(self.merged, key, self.where_of(key), self.defaults[key])

    def opt_integer(self, key: str, lo: float | None = None, hi: float | None = None) -> int | None:
        absent: int | None = self.defaults[key]
        return absent if self.merged.get(key) is None else self.integer(key, lo, hi)

    def opt_real(self, key: str, lo: float | None = None, hi: float | None = None) -> float | None:
        absent: float | None = self.defaults[key]
        return absent if self.merged.get(key) is None else self.real(key, lo, hi)


def _range(v: float, path: str, lo: float | None, hi: float | None) -> None:
    if lo is not None and v < lo:
        raise ConfigError(path, f"must be >= {lo}, got {v}")
    if hi is not None and v > hi:
        raise ConfigError(path, f"must be <= {hi}, got {v}")


def read_n_predict(merged: dict[str, Any], where: str) -> int:
    """``n_predict``: -1 (no limit) or a positive number of tokens."""
    n = read_int(merged, "n_predict", where, -1, -1, 2**31 - 1)
    if n == 0:
        raise ConfigError(f"{where}.n_predict", "must be -1 (no limit) or a positive number of tokens, got 0")
    return n


#: ``reasoning`` values (llama.cpp's ``--reasoning``): the first is the default.
REASONING_MODES = ("auto", "on", "off")


def read_sampling(t: dict[str, Any], where_of: Callable[[str], str]) -> dict[str, float | int]:
    """The :data:`SAMPLING_KEYS` present in ``t``, each of its type, within its range and within
    what the worker accepts (``protocol.limits.GENERATE_LIMITS``); ``where_of(key)``: the path
    of the table that gave ``key``."""
    sampling: dict[str, float | int] = {}
    for key, (tp, lo, hi) in SAMPLING_KEYS.items():
        if key in t:
            where = where_of(key)
            sampling[key] = read_int(t, key, where, 0, lo, hi) if tp is int else read_float(t, key, where, 0.0, lo, hi)
            bound = GENERATE_LIMITS.get(key)  # what the worker accepts
            if bound is not None and not bound.contains(sampling[key]):
                raise ConfigError(f"{where}.{key}", f"must be {bound.describe()}, got {sampling[key]}")
    return sampling


def read_aliases(t: dict[str, Any], name: str, where: str, seen_ids: dict[str, str], owner: str) -> list[str]:
    """``aliases``: a list of ids, none (nor ``name``) already in ``seen_ids`` (id -> owner),
    which gets them (``owner``: how the error names an earlier owner, e.g. ``"model "``)."""
    aliases = t.get("aliases", [])
    if not isinstance(aliases, list) or not all(isinstance(a, str) for a in aliases):
        raise ConfigError(f"{where}.aliases", "expected a list of strings")
    for ident in [name, *aliases]:
        check_id(ident, f"{where}.aliases")
        if ident in seen_ids:
            raise ConfigError(f"{where}.aliases" if ident != name else where,
                              f"name {ident!r} is already used by {owner}{seen_ids[ident]!r}")
        seen_ids[ident] = name
    return aliases

"""Models found in ``models_dir`` (``[server] discover_models = true``), as llama.cpp's
``--models-dir``: each ``*.gguf`` file there that no ``[models.NAME]`` table serves is served
under a name derived from its file name (:func:`model_name`), with the ``[defaults]`` of the
config. Config entries win: a file a table serves is not discovered again, and a derived name
that a table (or an alias) already uses is skipped (and said so). A file that is not a valid
GGUF is never served; it is listed with the reason (``/admin/models``'s ``invalid``).

:func:`scan` reads the directory and the files' headers (``router.gguf_meta``; call it off the
event loop), :func:`apply` makes the config the pool then serves. The router scans at start,
on SIGHUP (with the re-read config) and on ``POST /admin/models/rescan``.
"""

from __future__ import annotations

import dataclasses
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from router import gguf_meta
from router.config import Config, ConfigError, ModelConfig, parse_config

log = logging.getLogger("modelyard.discovery")

#: ``name-00001-of-00003.gguf``: a split model's parts (its first part names it).
_SHARD = re.compile(r"^(?P<base>.+)-(?P<i>\d{5})-of-(?P<n>\d{5})$")


def model_name(path: Path) -> str:
    """The name a discovered file is served under: its file name without ``.gguf`` (and
    without a split model's ``-00001-of-0000N``), whitespace replaced by ``-``."""
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.stem
    m = _SHARD.match(stem)
    if m:
        stem = m.group("base")
    return re.sub(r"\s+", "-", stem.strip())[:128] or "model"


@dataclass(frozen=True)
class Scan:
    """One look at ``models_dir``: ``models`` to serve (by name), ``invalid`` files
    (``{"id", "file", "reason"}``), ``skipped`` names (``{"id", "file", "reason"}``: config wins)."""

    models: dict[str, ModelConfig] = field(default_factory=dict)
    invalid: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[dict[str, Any]] = field(default_factory=list)
    enabled: bool = False

    def describe(self) -> dict[str, Any]:
        return {"enabled": self.enabled, "models": sorted(self.models), "invalid": self.invalid,
                "skipped": self.skipped}


def scan(config: Config) -> Scan:
    """The GGUF files of ``config.server.models_dir`` (not recursive) that no configured model
    serves; nothing when ``discover_models`` is off. Never raises for a bad file."""
    if not config.server.discover_models:
        return Scan()
    d = config.server.models_dir
    try:
        files = sorted(p for p in d.iterdir() if p.name.lower().endswith(".gguf") and not p.name.startswith("."))
    except OSError as e:
        log.warning("models_dir %s cannot be listed: %s", d, e.strerror or e)
        return Scan(enabled=True)
    configured = [m for m in config.models.values() if not m.discovered]
    served = {m.path for m in configured}
    taken = {i for m in configured for i in (m.name, *m.aliases)}
    base_dir = config.source.parent if config.source is not None else d
    models: dict[str, ModelConfig] = {}
    invalid: list[dict[str, Any]] = []
    skipped: list[dict[str, Any]] = []
    for f in files:
        try:
            if not f.is_file() or f.resolve() in served:
                continue
        except OSError:
            continue
        stem = f.name[:-5]
        shard = _SHARD.match(stem)
        if shard and int(shard.group("i")) != 1:
            continue  # a later part of a split model: its first part names it
        name = model_name(f)
        info = gguf_meta.model_info(f)
        if not info.valid:
            invalid.append({"id": name, "file": f.name, "reason": info.reason})
            continue
        if name in taken or name in models:
            skipped.append({"id": name, "file": f.name,
                            "reason": f"the name {name!r} is already used by a configured model"})
            continue
        try:
            parsed = parse_config({"server": {"models_dir": str(d)}, "defaults": config.defaults,
                                   "models": {name: {"path": str(f.resolve())}}}, base_dir=base_dir)
        except ConfigError as e:
            invalid.append({"id": name, "file": f.name, "reason": str(e)})
            continue
        models[name] = dataclasses.replace(parsed.models[name], discovered=True)
    for bad in invalid:
        log.warning("models_dir: %s is not served: %s", bad["file"], bad["reason"])
    return Scan(models=models, invalid=invalid, skipped=skipped, enabled=True)


def apply(config: Config, found: Scan) -> Config:
    """``config`` serving its own models and the discovered ones (those it served before
    discovery dropped, the new scan's added)."""
    own = {n: m for n, m in config.models.items() if not m.discovered}
    return dataclasses.replace(config, models={**own, **found.models})

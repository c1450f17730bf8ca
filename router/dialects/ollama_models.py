"""Ollama's model routes: ``GET /api/tags`` (every configured name with its tag), ``POST /api/show``
(a model's details, header keys, template and parameters), ``GET /api/ps`` (the loaded models)
and ``GET /api/version`` (router.dialects.ollama_api serves them). None of them loads a model.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import math
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from router.dialects.ollama_request import resolve, tagged
from router.http.errors import NotFound
from router.http.params import get_bool, read_json
from router.http.responses import JSONResponse
from router.metrics import label_request
from router.serving.models import ModelPool, ServedModel
from router.gguf_meta import chat_template, metadata, tensor_infos
from router.serving.models import LOADED

#: The Ollama version ``/api/version`` reports: the API level whose fields router.dialects.ollama_api serves
#: (tool-call ids and indexes, ``logprobs``, ``prompt_eval_cached_count``, ``capabilities`` in
#: ``/api/show``, ``context_length`` in ``/api/ps``).
OLLAMA_VERSION = "0.33.2"

#: ``general.file_type`` (llama.cpp's ``llama_ftype``) -> Ollama's ``quantization_level``.
FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K",
              11: "Q3_K_S", 12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S",
              17: "Q5_K_M", 18: "Q6_K", 19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS",
              23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL", 26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S",
              29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0", 37: "TQ2_0", 38: "MXFP4"}

#: What ``/api/show`` says every model can do (Ollama's capability names): plain generation and
#: tools (every template gets them, in its own syntax or the generic one).
CAPABILITIES = ["completion", "tools"]

def _iso(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")


# ----------------------------------------------------------------------------- routes: models


def parameter_size(n: int) -> str:
    """A parameter count as Ollama writes it (``format.HumanNumber``): 134.52M, 8.0B, 7B."""
    if n >= 1_000_000_000:
        x = n / 1e9
        return f"{x:.0f}B" if x == math.floor(x) else f"{x:.1f}B"
    if n >= 1_000_000:
        x = n / 1e6
        return f"{x:.0f}M" if x == math.floor(x) else f"{x:.2f}M"
    if n >= 1000:
        return f"{n / 1e3:.0f}K"
    return str(n)


def _parameter_count(path: Path, meta: dict[str, Any]) -> int | None:
    count = meta.get("general.parameter_count")
    if isinstance(count, int) and count > 0:
        return count
    infos = tensor_infos(path)
    return sum(math.prod(t.dims) for t in infos) if infos else None


def model_facts(path: Path, *, arrays: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(details, model_info)`` of a GGUF file, as Ollama's ``/api/show`` gives them:
    ``details`` {parent_model, format, family, families, parameter_size, quantization_level};
    ``model_info`` every key/value of its header (arrays as ``[]`` unless ``arrays``) and
    ``general.parameter_count`` (summed over its tensors when the header lacks it)."""
    meta = metadata(path, arrays=arrays) or {}
    arch = meta.get("general.architecture")
    count = _parameter_count(path, meta)
    ftype = meta.get("general.file_type")
    if count is not None:
        meta["general.parameter_count"] = count
    details = {
        "parent_model": "", "format": "gguf",
        "family": arch if isinstance(arch, str) else "",
        "families": [arch] if isinstance(arch, str) else None,
        "parameter_size": parameter_size(count) if count else "",
        "quantization_level": FILE_TYPES.get(ftype, "") if isinstance(ftype, int) else "",
    }
    return details, meta


@functools.lru_cache(maxsize=32)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


async def digest(slot: ServedModel) -> str:
    """The GGUF file's SHA-256 (what Ollama's digests are): its worker's fingerprint when it
    has one, else hashed here once per file version (in a thread; cached)."""
    ready = slot.ready_info
    if ready is not None and ready.fingerprint:
        return ready.fingerprint
    try:
        st = slot.model.path.stat()
        return await asyncio.to_thread(_file_sha256, str(slot.model.path), st.st_size, st.st_mtime_ns)
    except OSError:
        return ""


async def tags(request: Request) -> Response:
    """Every configured name and alias, with its tag. Never loads a model."""
    pool: ModelPool = request.app.state.pool
    out = []
    for ident in pool.config.ids():
        slot = resolve(pool, ident)
        path = slot.model.path
        try:
            st = path.stat()
        except OSError:
            continue  # a configured file that is missing is not "available locally"
        details, _ = model_facts(path)
        out.append({"name": tagged(ident), "model": tagged(ident), "modified_at": _iso(st.st_mtime),
                    "size": st.st_size, "digest": await digest(slot), "details": details})
    return JSONResponse({"models": out})


def _parameters(slot: ServedModel) -> str:
    """The model's configured generation parameters, one ``name value`` a line (Ollama's
    ``parameters``): its sampling defaults, num_ctx and num_predict (config's ``n_predict``)."""
    params: list[tuple[str, Any]] = sorted(slot.model.sampling.items())
    if slot.model.n_ctx is not None:
        params.append(("num_ctx", slot.model.n_ctx))
    if slot.model.n_predict > 0:
        params.append(("num_predict", slot.model.n_predict))
    return "\n".join(f"{k:<30} {v}" for k, v in params)


async def show(request: Request) -> Response:
    body = await read_json(request)
    pool: ModelPool = request.app.state.pool
    name = body.get("model") if body.get("model") is not None else body.get("name")  # "name": older clients
    slot = resolve(pool, name)
    label_request(request, slot.model.name)
    verbose = get_bool(body, "verbose", False)
    path = slot.model.path
    try:
        st = path.stat()
    except OSError:
        raise NotFound(f"model '{name}' not found: its GGUF file is missing", param="model") from None
    details, info = await asyncio.to_thread(model_facts, path, arrays=verbose)
    template = chat_template(slot.model.chat_template, path)
    params = _parameters(slot)
    modelfile = (f"# Modelfile of {tagged(slot.model.name)}, served by modelyard\nFROM ./{path.name}\n"
                 + (f'TEMPLATE """{template}"""\n' if template else "")
                 + "".join(f"PARAMETER {ln.split(None, 1)[0]} {ln.split(None, 1)[1]}\n" for ln in params.splitlines()))
    license_ = info.get("general.license")
    return JSONResponse({
        "license": license_ if isinstance(license_, str) else "",
        "modelfile": modelfile,
        "parameters": params,
        "template": template,
        "details": details,
        "model_info": info,
        "capabilities": CAPABILITIES,
        "modified_at": _iso(st.st_mtime),
    })


async def ps(request: Request) -> Response:
    """The loaded models: size (the worker's resident memory, else placement's estimate),
    ``expires_at`` (when the idle unload is due: ``idle_ttl_s`` or the last request's
    ``keep_alive`` after the last activity; about 292 years away for a model never unloaded), ``context_length`` (n_ctx). ``size_vram`` is 0: everything is on the CPU."""
    pool: ModelPool = request.app.state.pool
    out = []
    for slot in pool.slots.values():
        ready = slot.ready_info
        if slot.state not in LOADED or ready is None:
            continue
        since = slot.last_used or slot.loaded_at or time.time()
        due, ttl = slot.expires_at(), slot.idle_ttl()  # idle_ttl_s, or the last request's keep_alive
        expires = (_iso(due) if due is not None else _iso_forever(since) if ttl is None
                   else _iso(time.time() + ttl))  # busy: the TTL starts when it is idle
        details, _ = model_facts(slot.model.path)
        out.append({"name": tagged(slot.model.name), "model": tagged(slot.model.name),
                    "size": slot.resident_bytes(),
                    "digest": await digest(slot), "details": details,
                    "expires_at": expires,
                    "size_vram": 0, "context_length": ready.n_ctx})
    return JSONResponse({"models": out})


def _iso_forever(since: float) -> str:
    """``expires_at`` of a model never unloaded for idleness: ~292 years on, as Ollama's for
    keep_alive < 0 (the longest Go duration)."""
    d = datetime.fromtimestamp(since, UTC)
    return d.replace(year=d.year + 292).isoformat(timespec="microseconds").replace("+00:00", "Z")


async def version(request: Request) -> Response:
    return JSONResponse({"version": OLLAMA_VERSION})


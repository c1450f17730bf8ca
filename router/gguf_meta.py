"""What the router reads of a GGUF file itself: string values of its metadata header
and its tensor infos.

Only what the router needs without asking a worker: ``/props``'s
``tokenizer.chat_template``, the tensor infos placement sizes a model by, and the
whole key/value header (:func:`metadata`) that Ollama's ``/api/show`` lists.
Pure Python (``struct``; the router never imports numpy or ``gguf``): it walks
the key/value section of the header (GGUF v2/v3, little-endian), skipping values
it does not need — arrays of fixed-size items with one seek, string arrays
string by string — and stops at the first key asked for. Results are cached
per (path, size, mtime). A file that is not GGUF, or is cut short, gives None.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

_MAGIC = b"GGUF"
#: Byte size of each fixed-size GGUF value type (type code -> size).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
#: Longest string value accepted, bytes (a chat template is a few KiB).
_MAX_STRING = 16 * 1024 * 1024


class _Truncated(Exception):
    pass


def _read(f: BinaryIO, n: int) -> bytes:
    b = f.read(n)
    if len(b) != n:
        raise _Truncated
    return b


def _u32(f: BinaryIO) -> int:
    return int(struct.unpack("<I", _read(f, 4))[0])


def _u64(f: BinaryIO) -> int:
    return int(struct.unpack("<Q", _read(f, 8))[0])


def _string(f: BinaryIO) -> bytes:
    n = _u64(f)
    if n > _MAX_STRING:
        raise _Truncated
    return _read(f, n)


def _skip(f: BinaryIO, vtype: int) -> None:
    if vtype in _FIXED:
        f.seek(_FIXED[vtype], 1)
    elif vtype == _STRING:
        f.seek(_u64(f), 1)
    elif vtype == _ARRAY:
        itype, count = _u32(f), _u64(f)
        if itype in _FIXED:
            f.seek(_FIXED[itype] * count, 1)
        else:
            for _ in range(count):
                _skip(f, itype)
    else:
        raise _Truncated  # unknown type: cannot know its size


def read_string(path: Path, key: str) -> str | None:
    """The string value of ``key`` in the GGUF header of ``path`` (None if absent,
    not a string, or the file is unreadable or not GGUF)."""
    v = _read_scalar(path, key)
    return v if isinstance(v, str) else None


def read_int(path: Path, key: str) -> int | None:
    """The integer value of ``key`` in the GGUF header of ``path`` (None if absent, not an
    integer, or the file is unreadable or not GGUF), e.g. ``llama.context_length``."""
    v = _read_scalar(path, key)
    return v if isinstance(v, int) and not isinstance(v, bool) else None


#: struct formats of the integer GGUF value types (type code -> format).
_INTS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 10: "<Q", 11: "<q"}


def _read_scalar(path: Path, key: str) -> str | int | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return _scalar(str(path), st.st_size, st.st_mtime_ns, key)


@functools.lru_cache(maxsize=128)
def _scalar(path: str, size: int, mtime_ns: int, key: str) -> str | int | None:
    """``key``'s value when it is a string or an integer (else None), reading the header up to it
    (cached per path, size, mtime and key)."""
    want = key.encode()
    try:
        with open(path, "rb") as f:
            if _read(f, 4) != _MAGIC or _u32(f) < 2:
                return None
            _u64(f)  # tensor count
            for _ in range(_u64(f)):
                k = _string(f)
                vtype = _u32(f)
                if k == want:
                    if vtype == _STRING:
                        return _string(f).decode("utf-8", "replace")
                    fmt = _INTS.get(vtype)
                    return int(struct.unpack(fmt, _read(f, struct.calcsize(fmt)))[0]) if fmt else None
                _skip(f, vtype)
    except (OSError, _Truncated, struct.error):
        return None
    return None


def n_ctx_train(path: Path) -> int | None:
    """The context length the model was trained with (``<arch>.context_length``), or None."""
    arch = read_string(path, "general.architecture")
    return read_int(path, f"{arch}.context_length") if arch else None


@dataclass(frozen=True)
class TensorInfo:
    """One tensor info of a GGUF file: ``name``, ``dims`` in GGUF order (``ne[0]``, the row
    length, first), ``type_code`` (its ``ggml_type``, e.g. 3 for Q4_1)."""

    name: str
    dims: tuple[int, ...]
    type_code: int


def tensor_infos(path: Path) -> tuple[TensorInfo, ...] | None:
    """The tensor infos of the GGUF file at ``path``, read after its key/value header, in file
    order; None if the file is unreadable, not GGUF or cut short. Placement turns them into the
    bytes the worker will hold (``protocol.weight_bytes``)."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _tensor_infos(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=64)
def _tensor_infos(path: str, size: int, mtime_ns: int) -> tuple[TensorInfo, ...] | None:
    try:
        with open(path, "rb") as f:
            if _read(f, 4) != _MAGIC or _u32(f) < 2:
                return None
            n_tensors, n_kv = _u64(f), _u64(f)
            for _ in range(n_kv):
                _string(f)
                _skip(f, _u32(f))
            infos = []
            for _ in range(n_tensors):
                name = _string(f).decode("utf-8", "replace")
                n_dims = _u32(f)
                if n_dims > 8:
                    return None
                dims = tuple(_u64(f) for _ in range(n_dims))
                type_code = _u32(f)
                _u64(f)  # offset
                infos.append(TensorInfo(name, dims, type_code))
            return tuple(infos)
    except (OSError, _Truncated, struct.error):
        return None


#: struct format of each fixed-size GGUF value type (type code -> format; 7 is bool).
_FORMATS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
            12: "<d"}


def _value(f: BinaryIO, vtype: int, arrays: bool) -> Any:
    """One value of type ``vtype``: a number, bool or str; an array as a list (``arrays``)
    or skipped and given as ``[]``."""
    if vtype == 6:  # float32: its shortest decimal that reads back to the same float32 (1e-05, not 9.99e-06)
        raw = _read(f, 4)
        v = struct.unpack("<f", raw)[0]
        for digits in range(1, 10):
            short = float(f"{v:.{digits}g}")
            if struct.pack("<f", short) == raw:
                return short
        return v
    if vtype in _FORMATS:
        return struct.unpack(_FORMATS[vtype], _read(f, _FIXED[vtype]))[0]
    if vtype == _STRING:
        return _string(f).decode("utf-8", "replace")
    if vtype == _ARRAY:
        if not arrays:
            _skip(f, vtype)
            return []
        itype, count = _u32(f), _u64(f)
        return [_value(f, itype, True) for _ in range(count)]
    raise _Truncated  # unknown type


def metadata(path: Path, *, arrays: bool = False) -> dict[str, Any] | None:
    """Every key/value of the GGUF header of ``path``, in file order: numbers, bools and
    strings as they are; arrays (``tokenizer.ggml.tokens``, ...) as lists with ``arrays``,
    else as ``[]`` (they can hold 100k+ items). None if the file is unreadable, not GGUF
    or cut short. Cached per (path, size, mtime)."""
    try:
        st = path.stat()
    except OSError:
        return None
    out = _metadata(str(path), st.st_size, st.st_mtime_ns, arrays)
    return dict(out) if out is not None else None


@functools.lru_cache(maxsize=16)
def _metadata(path: str, size: int, mtime_ns: int, arrays: bool) -> tuple[tuple[str, Any], ...] | None:
    try:
        with open(path, "rb") as f:
            if _read(f, 4) != _MAGIC or _u32(f) < 2:
                return None
            _u64(f)  # tensor count
            items = []
            for _ in range(_u64(f)):
                key = _string(f).decode("utf-8", "replace")
                items.append((key, _value(f, _u32(f), arrays)))
            return tuple(items)
    except (OSError, _Truncated, struct.error):
        return None


def chat_template(configured: str | None, path: Path) -> str:
    """A model's chat template: the configured one (text or built-in name), else the GGUF's
    own ``tokenizer.chat_template``, else ""."""
    if configured is not None:
        return configured
    return read_string(path, "tokenizer.chat_template") or ""


#: llama.cpp's ``llama_ftype`` (``general.file_type``): the quantization a file was made with.
FILE_TYPES = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 10: "Q2_K", 11: "Q3_K_S",
    12: "Q3_K_M", 13: "Q3_K_L", 14: "Q4_K_S", 15: "Q4_K_M", 16: "Q5_K_S", 17: "Q5_K_M", 18: "Q6_K",
    19: "IQ2_XXS", 20: "IQ2_XS", 21: "Q2_K_S", 22: "IQ3_XS", 23: "IQ3_XXS", 24: "IQ1_S", 25: "IQ4_NL",
    26: "IQ3_S", 27: "IQ3_M", 28: "IQ2_S", 29: "IQ2_M", 30: "IQ4_XS", 31: "IQ1_M", 32: "BF16", 36: "TQ1_0",
    37: "TQ2_0",
}


@dataclass(frozen=True)
class ModelInfo:
    """What a GGUF file says of its model, read from its header without loading it.

    ``valid`` False means the router cannot serve the file; ``reason`` then says why
    (not GGUF, version, cut short, unreadable, no architecture). Sizes in bytes;
    ``parameters`` is the element count of every tensor; ``context_length`` the
    model's trained context (``<arch>.context_length``); ``quantization`` the file type
    (``general.file_type`` as llama.cpp names it, e.g. ``Q4_K_M``)."""

    valid: bool
    reason: str | None
    file_size: int | None
    architecture: str | None = None
    name: str | None = None
    parameters: int | None = None
    quantization: str | None = None
    context_length: int | None = None
    gguf_version: int | None = None

    def describe(self) -> dict[str, object]:
        return {"valid": self.valid, "reason": self.reason, "file_size": self.file_size,
                "architecture": self.architecture, "name": self.name, "parameters": self.parameters,
                "parameters_text": params_text(self.parameters), "quantization": self.quantization,
                "context_length": self.context_length, "gguf_version": self.gguf_version}


def params_text(n: int | None) -> str | None:
    """``135M``, ``1.5B``: a parameter count as model cards write it."""
    if n is None:
        return None
    for div, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= div:
            v = n / div
            return f"{v:.0f}{unit}" if v >= 100 else f"{v:.3g}{unit}"
    return str(n)


def model_info(path: Path) -> ModelInfo:
    """The model the GGUF file at ``path`` holds (see :class:`ModelInfo`); never raises:
    a missing, unreadable or invalid file is ``valid=False`` with the reason. Cached per
    (path, size, mtime)."""
    try:
        st = path.stat()
    except OSError as e:
        return ModelInfo(False, f"cannot read the file: {e.strerror or e}", None)
    if not path.is_file():
        return ModelInfo(False, "not a regular file", None)
    return _model_info(str(path), st.st_size, st.st_mtime_ns)


@functools.lru_cache(maxsize=256)
def _model_info(path: str, size: int, mtime_ns: int) -> ModelInfo:
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
            if magic != _MAGIC:
                return ModelInfo(False, f"not a GGUF file (starts with {magic!r}, expected b'GGUF')", size)
            version = _u32(f)
            if version not in (2, 3):
                return ModelInfo(False, f"GGUF version {version} is not supported (2 or 3)", size)
            n_tensors, n_kv = _u64(f), _u64(f)
            if n_kv > 1_000_000 or n_tensors > 1_000_000:
                return ModelInfo(False, f"implausible header ({n_kv} keys, {n_tensors} tensors)", size)
            meta: dict[str, object] = {}
            for _ in range(n_kv):
                k = _string(f).decode("utf-8", "replace")
                meta[k] = _value(f, _u32(f), False)  # arrays skipped
            params = 0
            for _ in range(n_tensors):
                _string(f)
                n_dims = _u32(f)
                if n_dims > 8:
                    return ModelInfo(False, f"a tensor has {n_dims} dimensions (at most 8)", size, gguf_version=version)
                n = 1
                for _ in range(n_dims):
                    n *= _u64(f)
                params += n
                _u32(f)
                _u64(f)
    except _Truncated:
        return ModelInfo(False, "the GGUF header is cut short or malformed", size)
    except struct.error:
        return ModelInfo(False, "the GGUF header is cut short or malformed", size)
    except OSError as e:
        return ModelInfo(False, f"cannot read the file: {e.strerror or e}", size)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        return ModelInfo(False, "no general.architecture in the GGUF header", size, gguf_version=version)
    ftype = meta.get("general.file_type")
    ctx = meta.get(f"{arch}.context_length")
    name = meta.get("general.name")
    return ModelInfo(True, None, size, architecture=arch, name=name if isinstance(name, str) else None,
                     parameters=params or None,
                     quantization=FILE_TYPES.get(ftype, f"type {ftype}") if isinstance(ftype, int) else None,
                     context_length=ctx if isinstance(ctx, int) else None, gguf_version=version)


def meta(path: Path) -> dict[str, object]:
    """``/v1/models``' ``meta`` for a model file, in llama-server's names where it has them
    (``n_ctx_train``, ``n_params``, ``size``) plus ``architecture``, ``quantization`` and, for a
    file that is not a valid GGUF, ``invalid`` (the reason). Read from the header, cached."""
    info = model_info(path)
    out: dict[str, object] = {"n_ctx_train": info.context_length, "n_params": info.parameters,
                              "size": info.file_size, "architecture": info.architecture,
                              "quantization": info.quantization}
    if not info.valid:
        out["invalid"] = info.reason
    return out


async def warm(paths: list[Path]) -> None:
    """Read (and cache) the headers of ``paths`` off the event loop: the first read of a
    large vocabulary's header takes up to a second."""
    import asyncio

    await asyncio.to_thread(lambda: [model_info(p) for p in paths])

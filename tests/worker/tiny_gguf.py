"""Tiny GGUF files for tests, written with ``gguf.GGUFWriter``.

* :func:`write_tiny_llama` -- a ``llama``-architecture model (SmolLM2-like:
  GQA, tied embeddings by default, RoPE base 1e5) with random weights.
* :func:`write_tiny_gemma3` -- a ``gemma3``-architecture model (q/k norms,
  four norms per layer, head_dim != n_embd / n_head, sliding window with the
  5-local-1-global layer pattern, one KV head).
* :func:`write_tiny_qwen` -- a ``qwen2`` (q/k/v biases) or ``qwen3`` (per-head
  q/k norms, head_dim from ``attention.key_length`` != n_embd / n_head) model.
* :func:`write_gguf` -- the generic writer both use (any metadata, any tensors,
  each tensor quantized to the requested ggml type with ``gguf.quants.quantize``).

Both models carry a real byte-level BPE tokenizer (``tokenizer.ggml.model`` =
"gpt2", ``.pre`` = "smollm") trained here by a deterministic little BPE on
:data:`BPE_CORPUS`: control tokens ``<|endoftext|>`` (0, eos/unk),
``<|im_start|>`` (1, bos), ``<|im_end|>`` (2), a user-defined token ``<tool>``
(3), the 256 GPT-2 byte characters (4..259), then one token per merge
(:data:`N_MERGES`), plus a ChatML ``tokenizer.chat_template``. Vocabulary size
is :data:`TINY_VOCAB_SIZE` (padded with unused tokens to a multiple of 32, as
quantized embedding rows need nothing but it keeps sizes round).

Usage from other tests::

    from tests.worker.tiny_gguf import write_tiny_llama
    path = write_tiny_llama(tmp_path / "tiny.gguf", qtype="Q8_0")
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from worker.engine.text.bpe import BYTE_TO_UNICODE

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named Tiny.<|im_end|>\n' }}"
    "{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

SPECIAL_TOKENS: list[tuple[str, int]] = [
    ("<|endoftext|>", 3),  # control
    ("<|im_start|>", 3),   # control
    ("<|im_end|>", 3),     # control (end of generation by text)
    ("<tool>", 4),         # user-defined: always split out, even without parse_special
]
EOS_ID, BOS_ID, IM_END_ID, USER_DEFINED_ID = 0, 1, 2, 3

BPE_CORPUS = """\
The quick brown fox jumps over the lazy dog. The dog sleeps in the sun.
Hello world! Hello there, how are you today? I am fine, thank you.
A tiny model is a model with tiny weights; the tests use the tiny model.
Once upon a time there was a little robot that liked to count: 1 2 3 4 5 6 7 8 9 10.
The assistant answers the question of the user in a helpful and honest way.
system user assistant message content hello again and again, the end.
"""
N_MERGES = 160


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable unicode character map (the engine's, a copy)."""
    return dict(BYTE_TO_UNICODE)


_WORD_RE = re.compile(r" ?[A-Za-z]+| ?[0-9]| ?[^\sA-Za-z0-9]+|\s+")


@lru_cache(maxsize=4)
def tiny_bpe_vocab(n_merges: int = N_MERGES) -> tuple[tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """Train a deterministic byte-level BPE on :data:`BPE_CORPUS`.

    Returns:
        (tokens, token_types, merges): token texts (GPT-2 byte characters),
        llama.cpp token types (1 normal, 3 control, 4 user-defined, 5 unused),
        and merges ``"a b"`` in rank order. Every merge's concatenation is a token.
    """
    b2u = bytes_to_unicode()
    words = Counter("".join(b2u[b] for b in w.encode("utf-8")) for w in _WORD_RE.findall(BPE_CORPUS))
    seqs = {w: list(w) for w in words}
    merges: list[str] = []
    new_tokens: list[str] = []
    for _ in range(n_merges):
        pairs: Counter[tuple[str, str]] = Counter()
        for w, c in words.items():
            s = seqs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        best = min(pairs, key=lambda pr: (-pairs[pr], pr))  # most frequent, then lexicographic
        a, b = best
        merges.append(f"{a} {b}")
        new_tokens.append(a + b)
        for w in seqs:
            s, out, i = seqs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            seqs[w] = out
    tokens = [t for t, _ in SPECIAL_TOKENS] + [b2u[b] for b in range(256)]
    types = [ty for _, ty in SPECIAL_TOKENS] + [1] * 256
    for t in new_tokens:
        if t not in tokens:
            tokens.append(t)
            types.append(1)
    i = 0
    while len(tokens) % 32:
        tokens.append(f"<unused{i}>")
        types.append(5)
        i += 1
    return tuple(tokens), tuple(types), tuple(merges)


TINY_VOCAB_SIZE = len(tiny_bpe_vocab()[0])


def add_tiny_tokenizer(wr: GGUFWriter, chat_template: str | None = CHATML_TEMPLATE) -> int:
    """Add the tiny gpt2-style BPE tokenizer keys to ``wr``; returns the vocabulary size."""
    tokens, types, merges = tiny_bpe_vocab()
    wr.add_tokenizer_model("gpt2")
    wr.add_tokenizer_pre("smollm")
    wr.add_token_list(list(tokens))
    wr.add_token_types(list(types))
    wr.add_token_merges(list(merges))
    wr.add_bos_token_id(BOS_ID)
    wr.add_eos_token_id(EOS_ID)
    wr.add_unk_token_id(EOS_ID)
    wr.add_pad_token_id(EOS_ID)
    wr.add_add_bos_token(False)
    wr.add_add_space_prefix(False)
    if chat_template is not None:
        wr.add_chat_template(chat_template)
    return len(tokens)


def _qtype(q: str | GGMLQuantizationType) -> GGMLQuantizationType:
    return q if isinstance(q, GGMLQuantizationType) else GGMLQuantizationType[q]


def write_gguf(path: str | Path, arch: str, metadata: Mapping[str, Any],
               tensors: Mapping[str, tuple[np.ndarray, str | GGMLQuantizationType]],
               tokenizer: bool = True, chat_template: str | None = CHATML_TEMPLATE) -> Path:
    """Write a GGUF file.

    Args:
        path: output path.
        arch: ``general.architecture``.
        metadata: extra keys; Python int -> UINT32 (INT32 if negative), float ->
            FLOAT32, bool, str, list[str|int|float] -> arrays. Keys may use
            ``{arch}`` as a placeholder.
        tensors: ``name -> (float array numpy-shaped, ggml type name)``; 1-D
            tensors are always stored F32 (like llama.cpp's converter does for norms).
            A uint8 array with a quantized type is written as those blocks
            (``[rows, bytes per row]``, e.g. from :func:`random_kquant`).
        tokenizer: add the tiny BPE tokenizer keys.
        chat_template: ``tokenizer.chat_template`` (None: omitted).
    """
    path = Path(path)
    wr = GGUFWriter(str(path), arch)
    wr.add_name(f"tiny-test-{arch}")
    for k, v in metadata.items():
        k = k.replace("{arch}", arch)
        if isinstance(v, bool):
            wr.add_bool(k, v)
        elif isinstance(v, int):
            (wr.add_uint32 if v >= 0 else wr.add_int32)(k, v)
        elif isinstance(v, float):
            wr.add_float32(k, v)
        elif isinstance(v, str):
            wr.add_string(k, v)
        elif isinstance(v, (list, tuple)):
            wr.add_array(k, list(v))
        else:
            raise TypeError(f"unsupported metadata value for {k!r}: {v!r}")
    if tokenizer:
        add_tiny_tokenizer(wr, chat_template)
    for name, (arr, q) in tensors.items():
        qt = _qtype(q)
        if isinstance(arr, np.ndarray) and arr.dtype == np.uint8 and qt not in (GGMLQuantizationType.F32,
                                                                               GGMLQuantizationType.F16):
            wr.add_tensor(name, arr, raw_dtype=qt)  # already quantized blocks [rows, bytes per row]
            continue
        arr = np.asarray(arr, dtype=np.float32)
        if arr.ndim == 1 or qt == GGMLQuantizationType.F32:
            wr.add_tensor(name, np.ascontiguousarray(arr, dtype=np.float32))
        elif qt == GGMLQuantizationType.F16:
            wr.add_tensor(name, arr.astype(np.float16))
        else:
            wr.add_tensor(name, quantize(arr, qt), raw_dtype=qt)  # uint8 bytes; shape derived
    wr.write_header_to_file()
    wr.write_kv_data_to_file()
    wr.write_tensors_to_file()
    wr.close()
    return path


def _rand(rng: np.random.Generator, *shape: int, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


#: standard deviation of a random block value per unit of its f16 scale d (see :func:`random_kquant`)
_KQUANT_STD = {"Q4_K": 263.0, "Q6_K": 1369.0}


def random_kquant(rng: np.random.Generator, n_rows: int, n_cols: int, qtype: str, scale: float) -> np.ndarray:
    """Random but valid ``Q4_K`` / ``Q6_K`` blocks ``uint8 [n_rows, bytes per row]`` whose values
    have mean ~0 and standard deviation ~``scale`` (gguf-py has no K-quant quantizer).

    Every byte is random except the f16 super-block scales: Q4_K ``d = scale/263``,
    ``dmin = 7.5 d`` (random 6-bit scales/mins and 4-bit levels: ``E[sc*q] = 7.5 E[m]``);
    Q6_K ``d = scale/1369`` (random int8 scales, 6-bit levels minus 32). ``n_cols % 256 == 0``.
    """
    from gguf import GGML_QUANT_SIZES
    qt = _qtype(qtype)
    block, size = GGML_QUANT_SIZES[qt]
    if qtype not in _KQUANT_STD or n_cols % block:
        raise ValueError(f"random_kquant makes Q4_K / Q6_K rows of multiples of {block} values, got {qtype} {n_cols}")
    raw = rng.integers(0, 256, (n_rows * n_cols // block, size), dtype=np.uint8)
    d = np.float16(scale / _KQUANT_STD[qtype])
    if qtype == "Q4_K":
        raw[:, 0:2] = np.full(raw.shape[0], d, np.float16).view(np.uint8).reshape(-1, 2)
        raw[:, 2:4] = np.full(raw.shape[0], np.float16(7.5 * float(d)), np.float16).view(np.uint8).reshape(-1, 2)
    else:
        raw[:, 208:210] = np.full(raw.shape[0], d, np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


#: standard deviation of a random Q4_0 / Q8_0 level per unit of its f16 scale d: uniform 0..15
#: minus 8 (sqrt((16^2 - 1) / 12) with mean -0.5) and uniform -127..127 (see :func:`random_blocks`)
_BLOCK_STD = {"Q4_0": 4.63, "Q8_0": 73.6}


def random_blocks(rng: np.random.Generator, n_rows: int, n_cols: int, qtype: str, scale: float) -> np.ndarray:
    """Random but valid blocks ``uint8 [n_rows, bytes per row]`` of ``Q4_0``, ``Q8_0``, ``Q4_K`` or
    ``Q6_K`` whose values have mean ~0 and standard deviation ~``scale``, written straight as
    bytes (quantizing random floats of a 1B-parameter model with gguf-py takes minutes).

    Q4_0 / Q8_0: random levels (4-bit 0..15; int8 -127..127) with one f16 ``d`` for every block;
    the K-quants: :func:`random_kquant`. ``n_cols`` a multiple of the type's block size.
    """
    if qtype in _KQUANT_STD:
        return random_kquant(rng, n_rows, n_cols, qtype, scale)
    from gguf import GGML_QUANT_SIZES
    qt = _qtype(qtype)
    block, size = GGML_QUANT_SIZES[qt]
    if qtype not in _BLOCK_STD or n_cols % block:
        raise ValueError(f"random_blocks makes Q4_0 / Q8_0 / Q4_K / Q6_K rows of whole blocks, got {qtype} {n_cols}")
    nb = n_rows * n_cols // block
    raw = rng.integers(0, 256, (nb, size), dtype=np.uint8)
    if qtype == "Q8_0":
        q = raw[:, 2:].view(np.int8)
        q[q == -128] = -127                       # llama.cpp's quantizer never writes -128
    raw[:, 0:2] = np.full(nb, np.float16(scale / _BLOCK_STD[qtype]), np.float16).view(np.uint8).reshape(-1, 2)
    return raw.reshape(n_rows, -1)


def tiny_llama_tensors(*, n_vocab: int, n_embd: int, n_head: int, n_head_kv: int, n_layer: int, n_ff: int,
                       qtype: str, tied: bool, seed: int, omit: Iterable[str] = ()) -> dict[str, tuple[np.ndarray, str]]:
    """Random llama tensors, numpy-shaped ``[out, in]`` (GGUF ne = [in, out])."""
    rng = np.random.default_rng(seed)
    hd = n_embd // n_head
    t: dict[str, tuple[np.ndarray, str]] = {
        "token_embd.weight": (_rand(rng, n_vocab, n_embd), qtype),
        "output_norm.weight": (1.0 + _rand(rng, n_embd, scale=0.1), "F32"),
    }
    if not tied:
        t["output.weight"] = (_rand(rng, n_vocab, n_embd, scale=n_embd ** -0.5), qtype)
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1.0 + _rand(rng, n_embd, scale=0.1), "F32")
        t[p + "attn_q.weight"] = (_rand(rng, n_head * hd, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "attn_k.weight"] = (_rand(rng, n_head_kv * hd, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "attn_v.weight"] = (_rand(rng, n_head_kv * hd, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "attn_output.weight"] = (_rand(rng, n_embd, n_head * hd, scale=(n_head * hd) ** -0.5), qtype)
        t[p + "ffn_norm.weight"] = (1.0 + _rand(rng, n_embd, scale=0.1), "F32")
        t[p + "ffn_gate.weight"] = (_rand(rng, n_ff, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "ffn_up.weight"] = (_rand(rng, n_ff, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "ffn_down.weight"] = (_rand(rng, n_embd, n_ff, scale=n_ff ** -0.5), qtype)
    for name in omit:
        t.pop(name, None)
    return t


def write_tiny_llama(path: str | Path, *, qtype: str = "F32", n_embd: int = 64, n_head: int = 4,
                     n_head_kv: int = 2, n_layer: int = 2, n_ff: int = 128, n_ctx_train: int = 256,
                     rope_base: float = 100000.0, eps: float = 1e-5, tied: bool = True, seed: int = 0,
                     chat_template: str | None = CHATML_TEMPLATE, omit: Iterable[str] = (),
                     extra_metadata: Mapping[str, Any] | None = None, arch: str = "llama") -> Path:
    """Write a tiny ``llama`` GGUF with random weights and the tiny BPE tokenizer.

    ``qtype`` applies to every 2-D weight (F32, F16, Q8_0, Q4_0, Q4_1, Q5_0,
    Q5_1; K-quants need rows that are multiples of 256). ``omit`` drops named
    tensors (for missing-tensor tests); ``extra_metadata`` adds/overrides keys
    (``{arch}`` is replaced). ``arch`` writes the same content under another
    architecture name (for unknown-architecture tests).
    """
    n_vocab = TINY_VOCAB_SIZE
    md: dict[str, Any] = {
        "{arch}.context_length": n_ctx_train,
        "{arch}.embedding_length": n_embd,
        "{arch}.block_count": n_layer,
        "{arch}.feed_forward_length": n_ff,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_head_kv,
        "{arch}.rope.freq_base": float(rope_base),
        "{arch}.rope.dimension_count": n_embd // n_head,
        "{arch}.attention.layer_norm_rms_epsilon": float(eps),
        "{arch}.vocab_size": n_vocab,
    }
    md.update(extra_metadata or {})
    tensors = tiny_llama_tensors(n_vocab=n_vocab, n_embd=n_embd, n_head=n_head, n_head_kv=n_head_kv,
                                 n_layer=n_layer, n_ff=n_ff, qtype=qtype, tied=tied, seed=seed, omit=omit)
    return write_gguf(path, arch, md, tensors, chat_template=chat_template)


def write_tiny_gemma3(path: str | Path, *, qtype: str = "F32", n_embd: int = 64, n_head: int = 4,
                      n_head_kv: int = 1, head_dim: int = 32, n_layer: int = 6, n_ff: int = 128,
                      n_ctx_train: int = 512, sliding_window: int = 8, rope_base: float = 1e6,
                      eps: float = 1e-6, seed: int = 0, chat_template: str | None = CHATML_TEMPLATE,
                      omit: Iterable[str] = (), extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a tiny ``gemma3`` GGUF with random weights and the tiny BPE tokenizer.

    ``head_dim * n_head != n_embd`` on purpose (as in Gemma 3 270M); with 6
    layers, layer 5 is global and layers 0-4 use the sliding window (which is
    small, 8 by default, so short test prompts exercise it). Norm weights are
    stored already "+1"-folded like llama.cpp's converter does (values near 1).
    """
    rng = np.random.default_rng(seed)
    n_vocab = TINY_VOCAB_SIZE
    md: dict[str, Any] = {
        "{arch}.context_length": n_ctx_train,
        "{arch}.embedding_length": n_embd,
        "{arch}.block_count": n_layer,
        "{arch}.feed_forward_length": n_ff,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_head_kv,
        "{arch}.attention.key_length": head_dim,
        "{arch}.attention.value_length": head_dim,
        "{arch}.rope.freq_base": float(rope_base),
        "{arch}.attention.layer_norm_rms_epsilon": float(eps),
        "{arch}.attention.sliding_window": sliding_window,
    }
    md.update(extra_metadata or {})
    t: dict[str, tuple[np.ndarray, str]] = {
        "token_embd.weight": (_rand(rng, n_vocab, n_embd, scale=n_embd ** -0.5), qtype),
        "output_norm.weight": (1.0 + _rand(rng, n_embd, scale=0.1), "F32"),
    }
    for i in range(n_layer):
        p = f"blk.{i}."
        for nm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            t[p + nm + ".weight"] = (1.0 + _rand(rng, n_embd, scale=0.1), "F32")
        t[p + "attn_q_norm.weight"] = (1.0 + _rand(rng, head_dim, scale=0.1), "F32")
        t[p + "attn_k_norm.weight"] = (1.0 + _rand(rng, head_dim, scale=0.1), "F32")
        t[p + "attn_q.weight"] = (_rand(rng, n_head * head_dim, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "attn_k.weight"] = (_rand(rng, n_head_kv * head_dim, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "attn_v.weight"] = (_rand(rng, n_head_kv * head_dim, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "attn_output.weight"] = (_rand(rng, n_embd, n_head * head_dim, scale=(n_head * head_dim) ** -0.5), qtype)
        t[p + "ffn_gate.weight"] = (_rand(rng, n_ff, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "ffn_up.weight"] = (_rand(rng, n_ff, n_embd, scale=n_embd ** -0.5), qtype)
        t[p + "ffn_down.weight"] = (_rand(rng, n_embd, n_ff, scale=n_ff ** -0.5), qtype)
    for name in omit:
        t.pop(name, None)
    return write_gguf(path, "gemma3", md, t, chat_template=chat_template)


def write_tiny_qwen(path: str | Path, arch: str = "qwen2", *, qtype: str = "F32", n_embd: int = 64,
                    n_head: int = 4, n_head_kv: int = 2, head_dim: int | None = None, n_layer: int = 2,
                    n_ff: int = 128, n_ctx_train: int = 256, rope_base: float = 1e6, eps: float = 1e-6,
                    tied: bool = True, biases: bool | None = None, output_bias: bool = False, seed: int = 0,
                    qtype_overrides: Mapping[str, str] | None = None,
                    chat_template: str | None = CHATML_TEMPLATE, omit: Iterable[str] = (),
                    extra_metadata: Mapping[str, Any] | None = None) -> Path:
    """Write a tiny ``qwen2`` or ``qwen3`` GGUF with random weights and the tiny BPE tokenizer.

    qwen2: q/k/v biases (``biases`` default True), head_dim = n_embd / n_head, an optional
    ``output.bias``. qwen3: per-head ``attn_q_norm`` / ``attn_k_norm`` ``[head_dim]``,
    ``attention.key_length`` = head_dim (default 32 with 4 heads over n_embd 64, so
    n_head * head_dim != n_embd as in Qwen3), no biases by default. ``qtype`` applies to
    every 2-D weight (biases and norms are F32, as llama.cpp's converter stores them);
    ``qtype_overrides`` maps a tensor kind (``token_embd``, ``output``, ``attn_q`` ..
    ``ffn_down``) to another type. ``Q4_K`` / ``Q6_K`` weights are :func:`random_kquant`
    blocks (gguf-py cannot quantize to them), the others are quantized random normals.
    """
    if arch not in ("qwen2", "qwen3"):
        raise ValueError(f"arch must be qwen2 or qwen3, got {arch!r}")
    qwen3 = arch == "qwen3"
    hd = head_dim or (32 if qwen3 else n_embd // n_head)
    biases = (not qwen3) if biases is None else biases
    rng = np.random.default_rng(seed)
    n_vocab = TINY_VOCAB_SIZE
    md: dict[str, Any] = {
        "{arch}.context_length": n_ctx_train,
        "{arch}.embedding_length": n_embd,
        "{arch}.block_count": n_layer,
        "{arch}.feed_forward_length": n_ff,
        "{arch}.attention.head_count": n_head,
        "{arch}.attention.head_count_kv": n_head_kv,
        "{arch}.rope.freq_base": float(rope_base),
        "{arch}.attention.layer_norm_rms_epsilon": float(eps),
    }
    if qwen3:
        md["{arch}.attention.key_length"] = hd
        md["{arch}.attention.value_length"] = hd
    md.update(extra_metadata or {})
    over = dict(qtype_overrides or {})

    def mat(kind: str, n_out: int, n_in: int, scale: float) -> tuple[np.ndarray, str]:
        qt = over.get(kind, qtype)
        if qt in _KQUANT_STD:
            return random_kquant(rng, n_out, n_in, qt, scale), qt
        return _rand(rng, n_out, n_in, scale=scale), qt

    t: dict[str, tuple[np.ndarray, str]] = {
        "token_embd.weight": mat("token_embd", n_vocab, n_embd, 0.25),  # logits of O(1) when tied
        "output_norm.weight": (1.0 + _rand(rng, n_embd, scale=0.1), "F32"),
    }
    if not tied:
        t["output.weight"] = mat("output", n_vocab, n_embd, n_embd ** -0.5)
    if output_bias:
        t["output.bias"] = (_rand(rng, n_vocab, scale=0.5), "F32")
    nq, nk = n_head * hd, n_head_kv * hd
    for i in range(n_layer):
        p = f"blk.{i}."
        t[p + "attn_norm.weight"] = (1.0 + _rand(rng, n_embd, scale=0.1), "F32")
        t[p + "attn_q.weight"] = mat("attn_q", nq, n_embd, n_embd ** -0.5)
        t[p + "attn_k.weight"] = mat("attn_k", nk, n_embd, n_embd ** -0.5)
        t[p + "attn_v.weight"] = mat("attn_v", nk, n_embd, n_embd ** -0.5)
        if biases:
            t[p + "attn_q.bias"] = (_rand(rng, nq, scale=0.5), "F32")
            t[p + "attn_k.bias"] = (_rand(rng, nk, scale=0.5), "F32")
            t[p + "attn_v.bias"] = (_rand(rng, nk, scale=0.5), "F32")
        if qwen3:
            t[p + "attn_q_norm.weight"] = (1.0 + _rand(rng, hd, scale=0.1), "F32")
            t[p + "attn_k_norm.weight"] = (1.0 + _rand(rng, hd, scale=0.1), "F32")
        t[p + "attn_output.weight"] = mat("attn_output", n_embd, nq, nq ** -0.5)
        t[p + "ffn_norm.weight"] = (1.0 + _rand(rng, n_embd, scale=0.1), "F32")
        t[p + "ffn_gate.weight"] = mat("ffn_gate", n_ff, n_embd, n_embd ** -0.5)
        t[p + "ffn_up.weight"] = mat("ffn_up", n_ff, n_embd, n_embd ** -0.5)
        t[p + "ffn_down.weight"] = mat("ffn_down", n_embd, n_ff, n_ff ** -0.5)
    for name in omit:
        t.pop(name, None)
    return write_gguf(path, arch, md, t, chat_template=chat_template)


__all__ = [
    "BOS_ID", "BPE_CORPUS", "CHATML_TEMPLATE", "EOS_ID", "IM_END_ID", "N_MERGES", "SPECIAL_TOKENS",
    "TINY_VOCAB_SIZE", "USER_DEFINED_ID", "GGUFValueType", "add_tiny_tokenizer", "bytes_to_unicode",
    "tiny_bpe_vocab", "tiny_llama_tensors", "write_gguf", "write_tiny_gemma3", "write_tiny_llama",
    "write_tiny_qwen", "random_blocks", "random_kquant",
]

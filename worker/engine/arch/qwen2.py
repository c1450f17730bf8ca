"""``qwen2`` architecture (Qwen2, Qwen2.5 dense models).

Block (llama.cpp ``src/models/qwen2.cpp``, ``llama_model_qwen2::graph``)::

    q,k,v = Wq . rms(x) + bq, Wk . rms(x) + bk, Wv . rms(x) + bv
    h = x + Wo . attn(rope(q), rope(k), v)            # kq_scale 1/sqrt(head_dim)
    x = h + Wdown . (silu(Wgate . rms(h)) * Wup . rms(h))
    logits = Wout . rms(x) + bout     # Wout = token_embd when there is no output.weight; bout optional

Facts taken from llama.cpp:

* RoPE "NEOX" pairing ``(x[i], x[i + n_rot/2])`` (``llama_model_rope_type``:
  ``LLM_ARCH_QWEN2`` -> ``LLAMA_ROPE_TYPE_NEOX``); ``convert_hf_to_gguf.py`` does
  not permute Q/K rows for Qwen2, so the stored weights are used as they are.
* Q/K/V biases (``create_tensor_qkv``): ``attn_{q,k,v}.bias`` are each optional and
  added when present (real Qwen2 files have all three). A fused
  ``attn_qkv.weight`` is used when the file has one, with ``attn_qkv.bias`` or
  else the three separate biases only when all three exist (``build_qkv``).
* ``output.bias`` is optional (``qwen2.cpp``: added to the logits).
* The graph asserts head_dim == n_rot (``rope.dimension_count``) and Wq/Wo are
  ``[n_embd, n_embd]``: n_head * head_dim must equal n_embd.

Hyperparameters (``qwen2.*``): as ``llama`` (:meth:`Model._read_attention_hparams`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..attention import AttnBatch
from ..errors import EngineError
from .layers import Matrix, RopeTable, Weights, fuse_rows, linear, rms_norm
from .model import Model
from .registry import register


@register
class Qwen2Model(Model):
    """Qwen2 / Qwen2.5 model; see the module docstring for the block."""

    arch = "qwen2"
    layout_version = 1
    #: per-head q/k RMSNorm over head_dim before RoPE (qwen3)
    qk_norm = False
    #: an optional ``output.bias`` is added to the logits (qwen2 only)
    output_bias = True
    #: Wq and Wo are ``[n_embd, n_embd]`` (n_head * head_dim == n_embd; qwen2 only)
    square_attention = True

    def _read_hparams(self, md: dict[str, Any]) -> None:
        self._read_attention_hparams(md, check_embd_divisible=True)
        if self.n_rot != self.head_dim:
            raise EngineError("invalid_gguf", f"{self.arch}.rope.dimension_count ({self.n_rot}) must equal the "
                              f"head size {self.head_dim}")
        if self.square_attention and self.n_head * self.head_dim != self.n_embd:
            raise EngineError("invalid_gguf", f"{self.arch}: head_count * key_length ({self.n_head} * "
                              f"{self.head_dim}) must equal embedding_length ({self.n_embd})")
        self.scale = 1.0 / float(np.sqrt(self.head_dim))

    def _qkv(self, p: str) -> tuple[Matrix, np.ndarray | None]:
        """Block ``p``'s fused Wqkv ``[(nh+2nkv)*hd, n_embd]`` and fused bias ``[(nh+2nkv)*hd]``
        (None without biases; a missing part of separate biases is zero, i.e. not added)."""
        E, hd = self.n_embd, self.head_dim
        sizes = (self.n_head * hd, self.n_head_kv * hd, self.n_head_kv * hd)
        n = sum(sizes)
        names = [p + f"attn_{x}.bias" for x in "qkv"]
        present = [self.has_tensor(b) for b in names]
        if self.has_tensor(p + "attn_qkv.weight"):
            wqkv: Matrix = self.matrix(p + "attn_qkv.weight", (n, E))
            if self.has_tensor(p + "attn_qkv.bias"):
                return wqkv, self.tensor(p + "attn_qkv.bias", (n,))
            if not all(present):
                return wqkv, None
        else:
            wqkv = fuse_rows(self._qkv_weights(p))
            if not any(present):
                return wqkv, None
        bias = np.concatenate([self.tensor(b, (s,)) if ok else np.zeros(s, np.float32)
                               for b, s, ok in zip(names, sizes, present)])
        return wqkv, bias

    def _build_weights(self) -> Weights:
        E, hd, nh = self.n_embd, self.head_dim, self.n_head
        t = self.tensor
        w = self._embedding_weights()                          # tok_embd, output_norm, [output]
        if self.output_bias and self.has_tensor("output.bias"):
            w["output_b"] = t("output.bias", (int((w["output"] if "output" in w else w["tok_embd"]).shape[0]),))  # [n_vocab]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            w[p + "attn_norm"] = t(p + "attn_norm.weight", (E,))                     # [n_embd]
            wqkv, bqkv = self._qkv(p)
            w[p + "wqkv"] = wqkv                                                     # [(nh+2nkv)*hd, n_embd]
            if bqkv is not None:
                w[p + "bqkv"] = bqkv                                                 # [(nh+2nkv)*hd]
            if self.qk_norm:
                w[p + "q_norm"] = t(p + "attn_q_norm.weight", (hd,))                 # [hd]
                w[p + "k_norm"] = t(p + "attn_k_norm.weight", (hd,))                 # [hd]
            w[p + "wo"] = self.matrix(p + "attn_output.weight", (E, nh * hd))        # [n_embd, nh*hd]
            w[p + "ffn_norm"] = t(p + "ffn_norm.weight", (E,))                       # [n_embd]
            w.update(self._gated_ffn_weights(p))    # wgu [2*n_ff, n_embd], wdown [n_embd, n_ff]
        return w

    def _setup(self) -> None:
        self.rope = RopeTable(self.n_ctx, self.n_rot, self.rope_base, self.rope_scale, dtype=self.dtype,
                                     libm=self.ggml_numerics)
        self.layers = [(self.w[f"blk.{i}.attn_norm"], self.w[f"blk.{i}.wqkv"], self.w.get(f"blk.{i}.bqkv"),
                        self.w.get(f"blk.{i}.q_norm"), self.w.get(f"blk.{i}.k_norm"), self.w[f"blk.{i}.wo"],
                        self.w[f"blk.{i}.ffn_norm"], self.w[f"blk.{i}.wgu"], self.w[f"blk.{i}.wdown"])
                       for i in range(self.n_layer)]

    def _forward_hidden(self, tokens: np.ndarray, batch: AttnBatch, rows: np.ndarray) -> np.ndarray:
        T = tokens.shape[0]                                           # N tokens of every sequence in the step
        nh, nkv, hd = self.n_head, self.n_head_kv, self.head_dim
        nq, nk = nh * hd, nkv * hd
        pos = batch.positions                                         # [T]
        x = self._embed(tokens)                                       # [T, n_embd]
        for il, (attn_norm, wqkv, bqkv, q_norm, k_norm, wo, ffn_norm, wgu, wdown) in enumerate(self.layers):
            h = rms_norm(x, attn_norm, self.eps, self.ggml_numerics)                      # [T, n_embd]
            qkv = linear(h, wqkv)                                     # [T, (nh+2nkv)*hd]
            if bqkv is not None:
                qkv = qkv + bqkv                                      # [T, (nh+2nkv)*hd]
            q = qkv[:, :nq].reshape(T, nh, hd)                        # [T, nh, hd]
            k = qkv[:, nq:nq + nk].reshape(T, nkv, hd)                # [T, nkv, hd]
            v = qkv[:, nq + nk:].reshape(T, nkv, hd)                  # [T, nkv, hd]
            if q_norm is not None and k_norm is not None:  # both or neither (qk_norm)
                q = rms_norm(q, q_norm, self.eps, self.ggml_numerics)                     # [T, nh, hd] per-head RMSNorm
                k = rms_norm(k, k_norm, self.eps, self.ggml_numerics)                     # [T, nkv, hd]
            self.rope.apply_neox(q, pos)                              # [T, nh, hd]
            self.rope.apply_neox(k, pos)                              # [T, nkv, hd]
            x = self._pre_norm_rest(batch, rows, il, x, q, k, v, wo, ffn_norm, wgu, wdown)  # [T, n_embd]
        return rms_norm(x, self.w["output_norm"], self.eps, self.ggml_numerics)           # [T, n_embd]

    def _output(self, h: np.ndarray) -> np.ndarray:
        logits = super()._output(h)                                   # [T, n_vocab]
        b = self.w.get("output_b")
        if b is not None:
            logits += b.astype(logits.dtype, copy=False)
        return logits

"""``llama`` architecture (SmolLM2, Llama 2/3, Mistral-style dense models).

Block (llama.cpp ``src/models/llama.cpp``, ``llm_build_llama``)::

    h = x + Wo . attn(rope(Wq . rms(x)), rope(Wk . rms(x)), Wv . rms(x))
    x = h + Wdown . (silu(Wgate . rms(h)) * Wup . rms(h))
    logits = Wout . rms(x)            # Wout = token_embd when there is no output.weight

RoPE: llama.cpp's ``convert_hf_to_gguf.py`` permutes the rows of Q and K for
arch ``llama`` (``LlamaModel.permute``), so the stored weights expect rotation
of *adjacent* pairs ``(x[2i], x[2i+1])`` (ggml ``LLAMA_ROPE_TYPE_NORM``,
``RopeTable.apply_norm``). Q and K keep the stored order of their head
dimensions: q.k summed in another order rounds differently, and the quantized
path reproduces llama.cpp's flash attention bit for bit (the KV cache holds K in
that order, :data:`~.kv_state.KV_LAYOUT_VERSION` 2).

Hyperparameters (``llama.*``): context_length, embedding_length, block_count,
feed_forward_length, attention.head_count, attention.head_count_kv (default
head_count), attention.layer_norm_rms_epsilon, rope.freq_base (default 10000),
rope.dimension_count (default head_dim), rope.scaling.{type,factor} (linear
only), attention.key_length / value_length (default n_embd / n_head).
Attention scale ``1/sqrt(head_dim)`` (llama-graph ``kq_scale``).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..attention import AttnBatch
from .layers import RopeTable, Weights, fuse_rows, linear, rms_norm
from .model import Model
from .registry import register


@register
class LlamaModel(Model):
    """SmolLM2-style llama model; see the module docstring for the block."""

    arch = "llama"
    layout_version = 2

    def _read_hparams(self, md: dict[str, Any]) -> None:
        self._read_attention_hparams(md, check_embd_divisible=True)
        self.scale = 1.0 / float(np.sqrt(self.head_dim))

    def _build_weights(self) -> Weights:
        E, hd, nh = self.n_embd, self.head_dim, self.n_head
        t = self.tensor
        w = self._embedding_weights()                          # tok_embd, output_norm, [output]
        if self.has_tensor("rope_freqs.weight"):
            w["rope_freqs"] = t("rope_freqs.weight", (self.n_rot // 2,))  # [n_rot/2]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            wq, wk, wv = self._qkv_weights(p)                  # [n_head*hd | n_kv*hd | n_kv*hd, n_embd]
            w[p + "attn_norm"] = t(p + "attn_norm.weight", (E,))                     # [n_embd]
            w[p + "wqkv"] = fuse_rows([wq, wk, wv])                                  # [(nh+2nkv)*hd, n_embd]
            w[p + "wo"] = self.matrix(p + "attn_output.weight", (E, nh * hd))                  # [n_embd, n_head*hd]
            w[p + "ffn_norm"] = t(p + "ffn_norm.weight", (E,))                       # [n_embd]
            w.update(self._gated_ffn_weights(p))    # wgu [2*n_ff, n_embd], wdown [n_embd, n_ff]
        return w

    def _setup(self) -> None:
        self.rope = RopeTable(self.n_ctx, self.n_rot, self.rope_base, self.rope_scale,
                              self.w.get("rope_freqs"), dtype=self.dtype, libm=self.ggml_numerics)
        self.layers = self._layer_weights(("attn_norm", "wqkv", "wo", "ffn_norm", "wgu", "wdown"))

    def _forward_hidden(self, tokens: np.ndarray, batch: AttnBatch, rows: np.ndarray) -> np.ndarray:
        T = tokens.shape[0]                                           # N tokens of every sequence in the step
        nh, nkv, hd = self.n_head, self.n_head_kv, self.head_dim
        nq, nk = nh * hd, nkv * hd
        pos = batch.positions                                         # [T]
        x = self._embed(tokens)                                       # [T, n_embd]
        for il, (attn_norm, wqkv, wo, ffn_norm, wgu, wdown) in enumerate(self.layers):
            h = rms_norm(x, attn_norm, self.eps, self.ggml_numerics)                      # [T, n_embd]
            qkv = linear(h, wqkv)                                         # [T, (nh+2nkv)*hd]
            qk = qkv[:, :nq + nk].reshape(T, nh + nkv, hd)            # [T, nh+nkv, hd] q heads then k heads
            self.rope.apply_norm(qk, pos)                             # [T, nh+nkv, hd] rotated in place
            q = qk[:, :nh]                                            # [T, nh, hd]
            k = qk[:, nh:]                                            # [T, nkv, hd]
            v = qkv[:, nq + nk:].reshape(T, nkv, hd)                  # [T, nkv, hd]
            x = self._pre_norm_rest(batch, rows, il, x, q, k, v, wo, ffn_norm, wgu, wdown)  # [T, n_embd]
        return rms_norm(x, self.w["output_norm"], self.eps, self.ggml_numerics)           # [T, n_embd]

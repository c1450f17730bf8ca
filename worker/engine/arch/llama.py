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

from ..attention import GGML_DECODE_THREADS, AttnBatch, ggml_fa_mode
from ..kernels import quant
from .layers import _PAIRWISE_MAX, RopeTable, Weights, fuse_rows, linear, rms_norm
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
        #: per layer the arguments of the compiled one-token block (``decode_kernels.llama_block_t1``),
        #: or None when a matrix is in a form it does not take (:meth:`_decode_block_args`)
        self.decode_blocks = self._decode_block_args() if self.ggml_numerics else None
        #: the embedding matrix as ``decode_kernels.kq_row`` reads it (a K-quant in its vector form), or None
        self._embd_parts = quant.kquant_matvec_parts(self.w["tok_embd"]) if self.decode_blocks is not None else None

    def _forward_hidden(self, tokens: np.ndarray, batch: AttnBatch, rows: np.ndarray) -> np.ndarray:
        T = tokens.shape[0]                                           # N tokens of every sequence in the step
        if (T == 1 and self.decode_blocks is not None and rows.shape[0] == 1 and len(batch.segments) == 1
                and batch.segments[0].ub_rows == 1):
            return self._decode_one(tokens, batch)                    # [1, n_embd]: one compiled call per block
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

    def _decode_block_args(self) -> list[tuple[Any, ...]] | None:
        """Per layer ``(attn_norm, ffn_norm, wqkv, wo, wgu, wdown)`` as the compiled one-token block
        takes them (norms read-only float32 ``[n_embd]``, matrices :func:`.quant.kquant_matvec_parts`),
        or None when any matrix is in another form (Q4_0, Q8_0, float32, ...; those models decode
        by the NumPy path) or the rows are too long for the RMSNorm kernel."""
        if self.n_embd > _PAIRWISE_MAX or self.dtype != np.float32 or not self.rope.kernel:
            return None
        out = []
        for attn_norm, wqkv, wo, ffn_norm, wgu, wdown in self.layers:
            mats = [quant.kquant_matvec_parts(w) for w in (wqkv, wo, wgu, wdown)]
            if any(m is None for m in mats):
                return None
            norms = []
            for w in (attn_norm, ffn_norm):
                v = np.ascontiguousarray(w, dtype=np.float32).view()
                v.flags.writeable = False
                norms.append(v)
            out.append((*norms, *mats))
        return out

    def _decode_one(self, tokens: np.ndarray, batch: AttnBatch) -> np.ndarray:
        """:meth:`_forward_hidden` of one token of one sequence (``tokens [1]``, its row the output
        row) by one compiled call per block (:func:`.decode_kernels.llama_block_t1`: the same kernels
        in the same order as the NumPy path, the same bits). Returns the final-normed ``[1, n_embd]``.
        Checks the KV entry's capacity first and polls ``batch``'s interrupt around every block."""
        from ..kernels import decode_kernels

        blocks = self.decode_blocks
        assert blocks is not None
        seg = batch.segments[0]
        kv, p = seg.kv, seg.pos0
        kv.claim(p, 1)                                                # the cell every block writes
        pos = np.ascontiguousarray(batch.positions, dtype=np.int64)    # [1]
        mode, n_cells = ggml_fa_mode(1, p + 1)                         # the split-KV or one-row path
        gemm, tiled = quant.gemm_rows(1), quant.tiled_rows(1)
        x = np.empty((1, self.n_embd), np.float32)                    # [1, n_embd]: the token's embedding
        if self._embd_parts is not None:
            decode_kernels.kq_row(self._embd_parts, int(tokens[0]), x[0])
        else:
            x[:] = self._embed(tokens)
        eps, scale = np.float32(self.eps), np.float32(self.scale)
        rope = self.rope
        for il, (attn_norm, ffn_norm, wqkv, wo, wgu, wdown) in enumerate(blocks):
            batch.checkpoint(il)
            decode_kernels.llama_block_t1(x, pos, eps, attn_norm, ffn_norm, wqkv, wo, wgu, wdown, rope.cos, rope.sin,
                                          self.n_rot, self.n_head, self.n_head_kv, self.head_dim, kv.k[il], kv.v[il],
                                          scale, mode, n_cells, GGML_DECODE_THREADS, gemm, tiled, self.n_ff)
            batch.checkpoint(il, count=False)
        return rms_norm(x, self.w["output_norm"], self.eps, self.ggml_numerics)    # [1, n_embd]

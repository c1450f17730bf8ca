"""``gemma3`` architecture (Gemma 3 text models, e.g. Gemma 3 270M).

Block (llama.cpp ``src/models/gemma3.cpp``, ``llm_build_gemma3<iswa=true>``)::

    x0  = token_embd[ids] * sqrt(n_embd)
    q,k = rms_head(Wq . rms(x)), rms_head(Wk . rms(x))      # per-head q/k RMSNorm over head_dim
    sa  = x + post_attn_norm(Wo . attn(rope(q) * 1/sqrt(head_dim), rope(k), Wv . rms(x)))
    x   = sa + post_ffw_norm(Wdown . (gelu_tanh(Wgate . ffn_norm(sa)) * Wup . ffn_norm(sa)))
    logits = token_embd . rms(x)

Facts taken from llama.cpp (llama-model.cpp ``LLM_ARCH_GEMMA3`` hparams):

* The stored norm weights already include Gemma's ``1 + w`` (convert_hf_to_gguf.py
  ``Gemma3Model.modify_tensors`` adds 1): plain RMSNorm.
* head_dim = ``gemma3.attention.key_length`` (256 for 270M, != n_embd / n_head).
* Q is scaled by ``1/sqrt(head_dim)`` before attention and the kq_scale is 1
  (``f_attention_scale``; the 27B rule ``1/sqrt(n_embd/n_head)`` applies only
  to 62-layer models). No attention-logit softcapping.
* Sliding window ``gemma3.attention.sliding_window`` (512); layer il uses it when
  ``il % 6 < 5`` (``set_swa_pattern(6)``), unless a
  ``gemma3.attention.sliding_window_pattern`` key (period int, or per-layer
  bool array) says otherwise. A key at p0 is hidden from a query at p1 when
  ``p1 - p0 >= window``.
* RoPE "NEOX" pairing (no Q/K permutation for Gemma); global layers use
  ``rope.freq_base`` (and rope.scaling), sliding layers use
  ``rope.freq_base_swa`` (default 10000) with scale 1.
* Without a sliding window llama.cpp builds the non-iswa graph, which applies
  final logit softcapping ``tanh(logits / c) * c`` when
  ``gemma3.final_logit_softcapping`` is set; this is reproduced.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..errors import EngineError
from ..attention import AttnBatch, attend
from .layers import FFN_ACTS, RopeTable, Weights, fuse_rows, gated_ffn, gelu_tanh, hp_float, hp_int, linear, rms_norm
from .model import Model
from .registry import register


@register
class Gemma3Model(Model):
    """Gemma 3 text model; see the module docstring for the block."""

    arch = "gemma3"
    layout_version = 1
    ffn_act = "gelu"

    def _read_hparams(self, md: dict[str, Any]) -> None:
        a = self.arch
        self._read_attention_hparams(md, check_embd_divisible=False)
        self.rope_base_swa = hp_float(md, f"{a}.rope.freq_base_swa", 10000.0)
        window = hp_int(md, f"{a}.attention.sliding_window", 0, minimum=0)
        self.window = window or None
        if self.window is None:
            self.swa_layers = [False] * self.n_layer
        else:
            pattern = md.get(f"{a}.attention.sliding_window_pattern", 6)
            if isinstance(pattern, list):
                if len(pattern) != self.n_layer or not all(isinstance(b, (bool, int)) for b in pattern):
                    raise EngineError("invalid_gguf", f"{a}.attention.sliding_window_pattern must list one "
                                      f"bool per layer ({self.n_layer})")
                self.swa_layers = [bool(b) for b in pattern]
            elif isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 1:
                # llama_hparams::set_swa_pattern(n): layer il is SWA when il % n < n - 1
                self.swa_layers = [(il % pattern) < (pattern - 1) for il in range(self.n_layer)]
            else:
                raise EngineError("invalid_gguf", f"bad {a}.attention.sliding_window_pattern: {pattern!r}")
        if self.n_layer == 62:  # 27B (llama.cpp LLM_TYPE_27B)
            self.q_scale = 1.0 / math.sqrt(self.n_embd / self.n_head)
        else:
            self.q_scale = 1.0 / math.sqrt(self.head_dim)
        cap = md.get(f"{a}.final_logit_softcapping")
        self.softcap = float(cap) if self.window is None and isinstance(cap, (int, float)) and cap else None
        self.embd_scale = math.sqrt(self.n_embd)

    def _build_weights(self) -> Weights:
        E, hd, nh = self.n_embd, self.head_dim, self.n_head
        t = self.tensor
        w = self._embedding_weights()                          # tok_embd, output_norm, [output]
        for i in range(self.n_layer):
            p = f"blk.{i}."
            w[p + "attn_norm"] = t(p + "attn_norm.weight", (E,))                    # [n_embd]
            w[p + "wqkv"] = fuse_rows(self._qkv_weights(p))                         # [(nh+2nkv)*hd, n_embd]
            w[p + "q_norm"] = t(p + "attn_q_norm.weight", (hd,))                    # [hd]
            w[p + "k_norm"] = t(p + "attn_k_norm.weight", (hd,))                    # [hd]
            w[p + "wo"] = self.matrix(p + "attn_output.weight", (E, nh * hd))                 # [n_embd, nh*hd]
            w[p + "post_attn_norm"] = t(p + "post_attention_norm.weight", (E,))     # [n_embd]
            w[p + "ffn_norm"] = t(p + "ffn_norm.weight", (E,))                      # [n_embd]
            w.update(self._gated_ffn_weights(p))   # wgu [2*n_ff, n_embd], wdown [n_embd, n_ff]
            w[p + "post_ffw_norm"] = t(p + "post_ffw_norm.weight", (E,))            # [n_embd]
        return w

    def _setup(self) -> None:
        self.rope_global = RopeTable(self.n_ctx, self.n_rot, self.rope_base, self.rope_scale, dtype=self.dtype,
                                     libm=self.ggml_numerics)
        self.rope_swa = RopeTable(self.n_ctx, self.n_rot, self.rope_base_swa, 1.0, dtype=self.dtype,
                                  libm=self.ggml_numerics)
        self.layers = self._layer_weights(("attn_norm", "wqkv", "q_norm", "k_norm", "wo", "post_attn_norm",
                                           "ffn_norm", "wgu", "wdown", "post_ffw_norm"))

    def _forward_hidden(self, tokens: np.ndarray, batch: AttnBatch, rows: np.ndarray) -> np.ndarray:
        T = tokens.shape[0]                                            # N tokens of every sequence in the step
        nh, nkv, hd, nff = self.n_head, self.n_head_kv, self.head_dim, self.n_ff
        nq, nk = nh * hd, nkv * hd
        pos = batch.positions                                          # [T]
        x = self._embed(tokens)                                        # [T, n_embd]
        x *= self.dtype.type(self.embd_scale)                          # [T, n_embd] * sqrt(n_embd)
        for il, (attn_norm, wqkv, q_norm, k_norm, wo, post_attn_norm, ffn_norm, wgu, wdown,
                 post_ffw_norm) in enumerate(self.layers):
            swa = self.swa_layers[il]
            rope = self.rope_swa if swa else self.rope_global
            h = rms_norm(x, attn_norm, self.eps, self.ggml_numerics)                       # [T, n_embd]
            qkv = linear(h, wqkv)                                          # [T, (nh+2nkv)*hd]
            q = rms_norm(qkv[:, :nq].reshape(T, nh, hd), q_norm, self.eps, self.ggml_numerics)          # [T, nh, hd]
            k = rms_norm(qkv[:, nq:nq + nk].reshape(T, nkv, hd), k_norm, self.eps, self.ggml_numerics)  # [T, nkv, hd]
            v = qkv[:, nq + nk:].reshape(T, nkv, hd)                   # [T, nkv, hd]
            rope.apply_neox(q, pos)                                    # [T, nh, hd]
            rope.apply_neox(k, pos)                                    # [T, nkv, hd]
            q *= self.dtype.type(self.q_scale)                         # [T, nh, hd]
            a = attend(batch, il, q, k, v, 1.0, self.window if swa else None, f16=self.ggml_numerics)  # [T, nh*hd]
            o = linear(a, wo)                                          # [T, n_embd]
            if il == self.n_layer - 1:
                x, o = self._keep_output_rows(batch, rows, x, o)       # [R, n_embd]
            sa = x + rms_norm(o, post_attn_norm, self.eps, self.ggml_numerics)             # [T, n_embd]
            h = rms_norm(sa, ffn_norm, self.eps, self.ggml_numerics)                       # [T, n_embd]
            gelu = FFN_ACTS[self.ffn_act] if self.ggml_numerics else gelu_tanh
            x = sa + rms_norm(gated_ffn(h, wgu, wdown, nff, gelu), post_ffw_norm, self.eps, self.ggml_numerics)  # [T, n_embd]
        return rms_norm(x, self.w["output_norm"], self.eps, self.ggml_numerics)            # [T, n_embd]

    def _output(self, h: np.ndarray) -> np.ndarray:
        logits = super()._output(h)                                    # [T, n_vocab]
        if self.softcap is not None:
            c = self.dtype.type(self.softcap)
            logits = np.tanh(logits / c) * c
        return logits

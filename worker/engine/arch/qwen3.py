"""``qwen3`` architecture (Qwen3 dense models).

Block (llama.cpp ``src/models/qwen3.cpp``, ``llama_model_qwen3::graph``): the
``qwen2`` block (:mod:`.qwen2`) with a per-head RMSNorm over head_dim applied to
Q and K after the projection and *before* RoPE::

    q = rope(rms_head(Wq . rms(x)) * q_norm)          # attn_q_norm.weight [head_dim]
    k = rope(rms_head(Wk . rms(x)) * k_norm)          # attn_k_norm.weight [head_dim]

Facts taken from llama.cpp:

* head_dim = ``qwen3.attention.key_length`` (128 for every Qwen3 size, so
  n_head * head_dim may differ from n_embd: Wq ``[n_head*hd, n_embd]``, Wo
  ``[n_embd, n_head*hd]``); kq_scale ``1/sqrt(head_dim)``; head_dim == n_rot asserted.
* RoPE "NEOX" pairing (``LLM_ARCH_QWEN3`` -> ``LLAMA_ROPE_TYPE_NEOX``), no Q/K
  row permutation.
* No biases in real files; ``create_tensor_qkv`` still accepts optional
  ``attn_{q,k,v}.bias`` (handled as in qwen2). No ``output.bias``.
"""

from __future__ import annotations

from .registry import register
from .qwen2 import Qwen2Model


@register
class Qwen3Model(Qwen2Model):
    """Qwen3 dense model; see the module docstring for the block."""

    arch = "qwen3"
    layout_version = 1
    qk_norm = True
    output_bias = False
    square_attention = False

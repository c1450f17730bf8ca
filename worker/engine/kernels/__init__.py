"""Quantized weights and the numba kernels that compute with them as llama.cpp's CPU backend does
(quantized dot products, flash attention, 16-lane SIMD), and the per-pass thread governor.

numba caches the compiled kernels in ``__pycache__`` beside ``quant_kernels.py`` / ``attn_kernels.py``
(or in ``NUMBA_CACHE_DIR``); ``scripts/compile_kernels.py`` fills that cache ahead of time."""

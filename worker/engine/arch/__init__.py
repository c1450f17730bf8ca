"""The network: the :class:`~.model.Model` base with its shared NumPy layers, and one module per
GGUF architecture (``general.architecture``: llama, qwen2, qwen3, gemma3), each one forward pass."""

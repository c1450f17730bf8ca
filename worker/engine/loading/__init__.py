"""Getting a model from its GGUF file into memory: the GGUF reader (metadata, memory-mapped tensors,
the on-disk caches' root) and giving back what the load leaves resident."""

"""Text in and out: the tokenizer built from a GGUF's ``tokenizer.ggml.*`` metadata and the chat
template rendered as Hugging Face renders it."""

"""The API dialects: OpenAI, Anthropic, Responses, Ollama, llama.cpp, and what they share."""

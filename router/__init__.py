"""modelyard's router: the Starlette app clients talk to. HTTP only; speaks to
workers through ``protocol`` and never imports numpy, the engine or ``worker``.

Modules, one concept each:

* ``config``      — config.toml read once into typed records (ConfigError names the key)
* ``errors``      — the ApiError hierarchy and the one mapping to OpenAI-shaped bodies
* ``process``     — one worker OS process + socket; the worker state machine
* ``pool``        — ModelSlot, the one owner of a model's scheduling state; Pool of slots
* ``run``         — one request's passage through one worker (admit, frames, cancel, release)
* ``sse``         — SSE responses and client-disconnect watching
* ``params`` / ``generation`` — request field readers; what the generation routes share
* ``openai_api`` / ``llamacpp_api`` / ``admin`` — the routes
* ``auth``        — bearer keys (pure ASGI)
* ``app`` / ``cli`` — the application and ``modelyard serve``
"""

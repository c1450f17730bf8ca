"""modelyard's router: the Starlette app clients talk to. HTTP only; speaks to
workers through ``protocol`` and never imports numpy, the engine or ``worker``.

Modules, one concept each:

* ``config``      — config.toml read once into typed records (ConfigError names the key)
* ``errors``      — the ApiError hierarchy and the one mapping to OpenAI-shaped bodies
* ``lifecycle``   — the worker state machine (states, transitions, the one mover)
* ``process``     — one worker OS process + socket
* ``pool``        — ModelSlot, the one owner of a model's scheduling state; Pool of slots
* ``placement``   — max_loaded / memory decisions (estimates, LRU eviction, pinning)
* ``backoff``     — crash backoff bookkeeping
* ``access_log``  — one line per request, X-Request-Id
* ``tasks``       — background tasks kept referenced
* ``run``         — one request's passage through one worker (admit, frames, cancel, release)
* ``sse``         — SSE responses and client-disconnect watching
* ``params`` / ``generation`` — request field readers; what the generation routes share
* ``openai_api`` / ``llamacpp_api`` / ``admin`` — the routes
* ``auth``        — bearer keys (pure ASGI)
* ``app`` / ``cli`` / ``cli_args`` — the application, ``modelyard serve`` (bind, banner,
  signals) and its dependency-free argument parser
"""

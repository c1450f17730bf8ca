"""modelyard's router: the Starlette app clients talk to. HTTP only; speaks to
workers through ``protocol`` and never imports numpy, the engine or ``worker``.

Layers (each imports only those below it; ``tests/router/test_layers.py`` checks it, and
``docs/architecture.md`` says where each concern lives):

* ``app`` / ``cli`` — the application (routes table, the one error mapping, the pool's
  lifetime) and the ``modelyard`` command; ``config`` (validated once), ``metrics`` and
  ``router.http`` (errors, SSE, auth, access log, limits) serve every layer below
* ``router.dialects`` — one module per API (OpenAI, Anthropic, Responses, Ollama, llama.cpp):
  a request read in, its events written out; none imports another
* ``router.operator`` — the admin routes and the status page
* ``router.serving`` — the one door the dialects call: a model's ``ModelServer`` owns every
  request's record from admission to release (``Generation``: start, next, close)
* ``router.workers`` — a model's worker: ``ModelSlot`` (the one owner of its state machine) and
  its parts (admission, liveness, loading, placement, CPU share), the pool of slots, and the
  launchers (local child processes with a warm spare; Ray for other hosts)
"""

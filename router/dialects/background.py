"""Background generations: started by one request, read (and cancelled) by id later.

One store serves both conventions that use it: ``POST /v1/decode`` (router.dialects.decode_api:
the body of ``/v1/chat/completions`` or ``/v1/completions``) and OpenAI's background
Responses (``POST /v1/responses`` with ``"background": true``, router.dialects.openai_responses).

How a job runs: the dialect's own streaming handler is called with an internal
request (the client's body with ``"stream": true``, and a receive channel that never
reports a disconnect: nobody is on the other end) in a task the store owns. So the
validation, tools, constraints, logprobs and ``n`` choices are exactly the dialect's,
and every SSE event it produces is kept, in order, as bytes. The client's POST is
answered as soon as the generation is *admitted* to its model's queue
(``router.serving.generation.begin`` calls ``request.state.run_hook``); a request that fails
before that (a 400, a full queue's 503, an unknown model's 404) fails the POST itself
with that status, and never becomes a job.

A :class:`Job`'s ``status``: ``queued`` (admitted, waiting for its worker),
``in_progress`` (its Generate is on a worker: ``worker`` says which, by pid and the
GGUF fingerprint its Ready announced), then ``completed``, ``incomplete`` (stopped by
its token limit), ``failed`` (``error``: the error event's payload) or ``cancelled``.
Readers :meth:`Job.follow` the events from the first one, however late they attach;
any number may read at once, and a reader leaving never cancels the job.
:meth:`BackgroundStore.cancel` does: the task is cancelled, which closes the run (the
worker gets Cancel; its slot is released when it answers).

Bounds of running work (issue 23: ``n: 16`` background choices took every slot of a
model with no client attached): the choices (``n``) of a model's running jobs at most
its ``background_slots`` (0: half its ``parallel``, at least one), else 503
``background_model_busy``; the running jobs of one API key (the credential the POST
presented; keyless clients share one) at most ``background_per_key``, else 503
``background_key_busy``. A running job nobody collects expires: one with no reader
attached (a GET's SSE stream) and no GET for ``background_unread_s`` seconds is cancelled
(its worker gets Cancel) and forgotten — a 404 from then on (one INFO line).

Bounds of what is kept (``[server]`` keys): ``background_max`` jobs (running or finished),
``background_ttl_s`` seconds a finished job is kept after it ended (0: no expiry),
``background_max_mib`` MiB of stored events over all jobs. Making room drops the
oldest finished jobs first; when only running jobs hold the count, a new one is a
503 ``background_store_full``; a running job whose events alone would pass the byte
bound is cancelled and ``failed`` (``background_result_too_large``) and its events
dropped. A dropped, expired or deleted id is gone for good (ids are random and never
reused; a job's task finishing after it was dropped writes nothing back). Lost on
restart. Single-threaded (the router's event loop), no lock.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from router.dialects.background_results import accumulate, event_data
from router.http.errors import ApiError, BadRequest, InternalError, Unavailable, error_payload
from router.serving.server import Generation
from router.http.sse import SSEResponse

log = logging.getLogger("modelyard.background")

#: Job statuses, OpenAI's background-response names.
RUNNING = ("queued", "in_progress")
FINISHED = ("completed", "incomplete", "failed", "cancelled")

Handler = Callable[[Request], Awaitable[Response | SSEResponse]]


def new_job_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex}"


class Job:
    """One background generation. Read its fields; only the store and its task write them.

    ``kind``: the dialect's object (``chat.completion``, ``text_completion``,
    ``response``). ``events``: the SSE events as the streaming endpoint sent them
    (bytes, each ending in a blank line). ``snapshot(status)``: the dialect's current
    object with that status (set by the Responses handler; None for /v1/decode).
    """

    def __init__(self, job_id: str, kind: str, model: str) -> None:
        self.id = job_id
        self.kind = kind
        self.model = model  # the configured name the request resolved to (set at admission)
        self.created_at = time.time()
        self.status = "queued"
        self.worker: dict[str, Any] | None = None  # {"pid", "fingerprint"} once on a worker
        self.events: list[bytes] = []
        self.nbytes = 0
        self.error: dict[str, Any] | None = None
        self.error_in_events = False  # an error event (or response.failed) is among the events
        self.outcome = "completed"  # the status it gets when its stream ends (from the events)
        self.ended_at: float | None = None  # the store's clock, once finished
        self.snapshot: Callable[[str], dict[str, Any]] | None = None
        self.key = "-"  # whose work it is (a digest of the API key the POST presented; "-": none)
        self.model_name = ""  # the configured model it counts against ("": unknown)
        self.n = 1  # the choices it runs
        self.readers = 0  # SSE readers attached now
        self.last_read = 0.0  # the store's clock when it was last collected (created, GET, a reader left)
        self._clock: Callable[[], float] = time.monotonic
        self._gate: Callable[[], None] | None = None  # the store's bounds, checked at admission
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._run: Generation | None = None
        self._admitted: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def running(self) -> bool:
        return self.status in RUNNING

    # -- set by router.serving.generation.begin through request.state.run_hook

    def on_run(self, run: Generation, stage: str) -> None:
        """``stage`` ``admitted`` (the run has its place in the queue; ``run.ready`` is
        set when it got its worker at once) or ``started`` (its Generate was sent)."""
        if stage == "admitted" and self._gate is not None:
            self.model_name = run.model_name
            gate, self._gate = self._gate, None
            gate()  # the bounds of running background work: raises before the job is admitted
        self._run = run
        self.model = run.model_name
        ready = run.ready
        if ready is not None:
            self.worker = {"pid": run.worker_pid, "fingerprint": ready.fingerprint}
            if self.status == "queued":
                self.status = "in_progress"
        if not self._admitted.done():
            self._admitted.set_result(None)
        self._notify()

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    async def follow(self) -> AsyncIterator[bytes]:
        """Every event from the first, then each new one as it comes, until the job ends.
        A reader following it collects it (it never expires unread meanwhile)."""
        i = 0
        self.readers += 1
        try:
            while True:
                while i < len(self.events):
                    yield self.events[i]
                    i += 1
                if not self.running:
                    return
                await self._wake.wait()
        finally:
            self.readers -= 1
            self.last_read = self._clock()

    def describe(self) -> dict[str, Any]:
        """The store's view: id, status, model, worker identity, created_at, error."""
        return {"id": self.id, "object": self.kind, "status": self.status, "model": self.model,
                "created_at": int(self.created_at), "worker": self.worker, "error": self.error}

    # -- the events' meaning

    def result(self) -> dict[str, Any] | None:
        """The dialect's non-streaming answer, once finished (None while running or when
        nothing came): the Responses' final response object, or the completion object
        assembled from its chunks as the OpenAI SDKs assemble a stream."""
        if self.running:
            return None
        data = event_data(self.events)
        if self.kind == "response":
            final: list[dict[str, Any]] = [d["response"] for d in data if isinstance(d.get("response"), dict)
                     and d.get("type") in ("response.completed", "response.incomplete", "response.failed")]
            if final:
                return final[-1]
            return self.snapshot(self.status) if self.snapshot is not None else None
        chunks = [d for d in data if "choices" in d]
        return accumulate(chunks, self.kind) if chunks else None

    def _seen(self, ev: bytes) -> None:
        """The outcome (the status once the stream ends) and error an event tells: an ``error``
        member, or a Responses ``response.completed|incomplete|failed``."""
        for line in ev.split(b"\n"):
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            try:
                d = json.loads(line[6:])
            except ValueError:
                continue
            if not isinstance(d, dict):
                continue
            if "error" in d and "choices" not in d and "type" not in d:
                self.outcome, self.error, self.error_in_events = "failed", d["error"], True
            kind = d.get("type")
            if kind == "response.failed":
                self.outcome, self.error_in_events = "failed", True
                self.error = (d.get("response") or {}).get("error")
            elif kind == "response.incomplete":
                self.outcome = "incomplete"
            elif kind == "response.completed":
                self.outcome = "completed"


class BackgroundStore:
    """The router's one store of background jobs (``app.state.background``)."""

    def __init__(self, max_jobs: int, ttl_s: float, max_bytes: int,
                 clock: Callable[[], float] = time.monotonic, *, per_key: int = 8, unread_s: float = 600.0) -> None:
        self.max_jobs = max_jobs
        self.ttl_s = ttl_s
        self.max_bytes = max_bytes
        self.per_key = per_key
        self.unread_s = unread_s
        self._clock = clock
        self._jobs: OrderedDict[str, Job] = OrderedDict()
        self.nbytes = 0  # events held by all jobs
        self.closed = False

    def __len__(self) -> int:
        self._expire()
        return len(self._jobs)

    def get(self, job_id: str) -> Job | None:
        """The job (None if unknown, deleted or expired); asking for it collects it."""
        self._expire()
        job = self._jobs.get(job_id)
        if job is not None:
            job.last_read = self._clock()
        return job

    # -- bounds of running work

    def _check_running(self, job: Job, config: Any) -> None:
        """Raises Unavailable (503) when ``job`` would pass its key's or its model's bound,
        BadRequest when its ``n`` can never fit its model's background slots. Called once
        the request is valid and admitted (``Job.on_run``), so a bad request keeps its 400."""
        others = [j for j in self._jobs.values() if j.running and j is not job]
        mine = [j for j in others if j.key == job.key]
        if len(mine) >= self.per_key:
            raise Unavailable(f"{len(mine)} background generations of this API key are running "
                              f"(background_per_key={self.per_key}); retry when one has finished",
                              code="background_key_busy", retry_after_s=1)
        m = config.models.get(job.model_name) if config is not None else None
        if m is None:
            return
        bound = m.background_slots or max(1, m.parallel // 2)
        if job.n > bound:
            raise BadRequest(f"n={job.n} background choices can never run on model '{m.name}': it gives background "
                             f"work {bound} of its {m.parallel} KV slots (background_slots)", param="n",
                             code="background_too_large")
        held = sum(j.n for j in others if j.model_name == m.name)
        if held + job.n > bound:
            raise Unavailable(f"model '{m.name}': background generations hold {held} of its {bound} background "
                              f"slots (background_slots; {m.parallel} KV slots in all) and this one needs "
                              f"{job.n}; retry when one has finished", code="background_model_busy", retry_after_s=1)

    def _watch_unread(self, job: Job) -> None:
        """Cancel and forget ``job`` once nobody has collected it for ``unread_s``."""
        if self.unread_s <= 0 or self.closed or self._jobs.get(job.id) is not job or not job.running:
            return
        loop = asyncio.get_running_loop()
        left = self.unread_s - (self._clock() - job.last_read)
        if job.readers > 0 or left > 0:
            loop.call_later(max(left, 0.05) if job.readers == 0 else self.unread_s, self._watch_unread, job)
            return
        log.info("background %s (model %s): nobody collected it for background_unread_s=%g s; cancelled",
                 job.id, job.model, self.unread_s)
        self.cancel(job.id, forget=True)

    # -- bounds

    def _expire(self) -> None:
        if self.ttl_s <= 0:
            return
        limit = self._clock() - self.ttl_s
        for j in [j for j in self._jobs.values() if j.ended_at is not None and j.ended_at <= limit]:
            self._drop(j)

    def _drop(self, job: Job) -> None:
        if self._jobs.pop(job.id, None) is job:
            self.nbytes -= job.nbytes
            job.nbytes = 0

    def _drop_oldest_finished(self, keep: Job | None = None) -> bool:
        for j in self._jobs.values():
            if not j.running and j is not keep:
                self._drop(j)
                return True
        return False

    def _make_room(self) -> None:
        self._expire()
        while len(self._jobs) >= self.max_jobs:
            if not self._drop_oldest_finished():
                raise Unavailable(f"{len(self._jobs)} background generations are running "
                                  f"(background_max={self.max_jobs}); retry when one has finished",
                                  code="background_store_full", retry_after_s=1)

    def _append(self, job: Job, ev: bytes) -> bool:
        """Keep one event of a running job; False when the job must stop (dropped, or past
        the byte bound: then it is failed and its events dropped)."""
        if self._jobs.get(job.id) is not job or not job.running:
            return False  # dropped, deleted or cancelled meanwhile: nothing is written back
        self.nbytes += len(ev)
        job.nbytes += len(ev)
        job.events.append(ev)
        job._seen(ev)
        while self.nbytes > self.max_bytes and self._drop_oldest_finished(keep=job):
            pass
        if self.nbytes > self.max_bytes:  # this running job alone is past the bound
            self.nbytes -= job.nbytes
            job.nbytes = 0
            job.events.clear()
            self._end(job, "failed", error_payload(Unavailable(
                f"the background result exceeds background_max_mib={self.max_bytes / 2**20:g}",
                code="background_result_too_large"))["error"])
            return False
        job._notify()
        return True

    def _end(self, job: Job, status: str, error: dict[str, Any] | None = None) -> None:
        assert status in FINISHED, status
        if not job.running:
            return
        job.status = status
        if error is not None:
            job.error = error
        job.ended_at = self._clock()
        job._notify()
        log.info("background %s (%s, model %s): %s", job.id, job.kind, job.model, status)

    # -- running

    async def start(self, outer: Request, job: Job, handler: Handler, path: str, body: dict[str, Any]) -> Job:
        """Run ``handler`` (a streaming dialect handler) on ``body`` for ``job`` and return
        the job once it is admitted. Raises the handler's ApiError if it fails before (the
        job is then never stored), ServerShuttingDown-like Unavailable when the store is
        closed, and Unavailable(background_store_full) when it is full of running jobs."""
        if self.closed:
            raise Unavailable("the server is shutting down", code="server_shutting_down")
        job.key = key_of(outer)
        n = body.get("n", 1)
        job.n = n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 1
        config = getattr(outer.app.state, "config", None)
        job._gate = lambda: self._check_running(job, config)
        self._make_room()
        job._clock = self._clock
        job.last_read = self._clock()
        self._jobs[job.id] = job
        inner = _inner_request(outer, path, {**body, "stream": True}, job)
        job._task = asyncio.create_task(self._drive(job, handler, inner), name=f"background-{job.id}")
        try:
            await asyncio.wait({job._task, job._admitted}, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:  # the POST's client left before its answer: nobody knows the id
            self.cancel(job.id, forget=True)
            raise
        if job._admitted.done():
            self._watch_unread(job)
            return job
        self._drop(job)  # failed before admission: the POST gets the error, the job never existed
        exc = job._task.exception()
        if isinstance(exc, BaseException):
            raise exc
        raise InternalError("the background request ended before it was admitted")

    async def _drive(self, job: Job, handler: Handler, inner: Request) -> None:
        response: Response | SSEResponse | None = None
        try:
            response = await handler(inner)
            if not isinstance(response, SSEResponse):  # a dialect answered without streaming: a bug here
                raise InternalError(f"background handler answered {type(response).__name__}, not a stream")
            async for ev in response.events:
                if not self._append(job, ev):
                    break
            self._end(job, job.outcome)
        except ApiError as e:
            if not job._admitted.done():
                raise  # start() hands it to the POST
            self._end(job, "failed", error_payload(e)["error"])
        except asyncio.CancelledError:
            self._end(job, "cancelled")
            raise
        except Exception as e:  # a bug: the job fails, the router goes on
            if not job._admitted.done():
                raise
            log.exception("background %s failed", job.id)
            self._end(job, "failed", error_payload(InternalError(f"internal error: {type(e).__name__}"))["error"])
        finally:
            if isinstance(response, SSEResponse):
                aclose = getattr(response.events, "aclose", None)
                if aclose is not None:
                    await aclose()
                response.on_close()
            elif job._run is not None:
                job._run.close()

    def cancel(self, job_id: str, *, forget: bool = False) -> Job | None:
        """Cancel a running job (its run is closed: Cancel to the worker); ``forget`` also
        drops it from the store (DELETE). Returns the job, or None if there is none."""
        job = self.get(job_id)
        if job is None:
            return None
        if job.running:
            self._end(job, "cancelled")
            if job._task is not None:
                job._task.cancel()
        if forget:
            self._drop(job)
        return job

    async def close(self) -> None:
        """The router stops: cancel every running job and wait for their runs to close."""
        self.closed = True
        tasks = [j._task for j in self._jobs.values() if j.running and j._task is not None]
        for j in list(self._jobs.values()):
            if j.running:
                self._end(j, "cancelled")
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.gather(*tasks, return_exceptions=True)


def key_of(request: Request) -> str:
    """Whose background work a request starts: a digest of the API key it presented
    (``Authorization: Bearer``, else ``x-api-key``), or ``"-"`` when it presented none."""
    auth = request.headers.get("authorization", "")
    cred = auth[7:].strip() if auth[:7].lower() == "bearer " else request.headers.get("x-api-key", "")
    return hashlib.sha256(cred.encode()).hexdigest()[:16] if cred else "-"


def store_of(request: Request) -> BackgroundStore:
    store: BackgroundStore = request.app.state.background
    return store


def _inner_request(outer: Request, path: str, body: dict[str, Any], job: Job) -> Request:
    """A request to ``path`` carrying ``body`` that never disconnects, with the job's hook."""
    data = json.dumps(body).encode()
    scope = dict(outer.scope)
    state = {k: v for k, v in (outer.scope.get("state") or {}).items() if k not in ("access", "model")}
    scope.update(state=state, path=path, raw_path=path.encode(), method="POST", query_string=b"",
                 headers=[*((k, v) for k, v in outer.scope.get("headers", [])
                            if k not in (b"content-length", b"content-type", b"transfer-encoding")),
                          (b"content-type", b"application/json"), (b"content-length", str(len(data)).encode())])
    sent = False

    async def receive() -> dict[str, Any]:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": data, "more_body": False}
        await asyncio.Future()  # nobody is on the other end: it never disconnects
        raise AssertionError("unreachable")

    inner = Request(scope, receive)
    inner.state.run_hook = job.on_run
    inner.state.background_job = job
    return inner

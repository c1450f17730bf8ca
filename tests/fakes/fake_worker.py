"""A fake worker speaking the real protocol, so the router's lifecycle is testable without a model.

Run exactly like the real one: ``python -m tests.fakes.fake_worker --model NAME --gguf PATH
--endpoint EP [--n-ctx N] [--chat-template T] --max-queue N --parent-pid PID [--auth-fd FD]``;
it proves its credentials (``--auth-fd``) in Hello and uses their CURVE keys, as the real one.
(the router runs it when ``MODELYARD_WORKER_MODULE=tests.fakes.fake_worker``).

Model-level switches: the JSON file named by ``MODELYARD_FAKE_FILE`` (re-read at
every spawn, so a test can change behaviour between spawns), a map of model name
(or "*") to any of:

    load_delay_s      float  sleep before Ready
    crash_at_load     bool   exit 3 before Ready
    load_error        bool   Error(code="load_failed") then exit 1
    hang_at_load      bool   send Hello, never Ready
    hold_hello        bool   wait before connecting and sending Hello while the hold file exists
    hold_load         bool   wait before Ready while the hold file exists (see below)
    load_steps        int    N: before the hold, LoadProgress reading_gguf 0/1 and 1/1, then
                             preparing_tensors 1/N .. N/N (every step)
    hold_shutdown     bool   on Shutdown, wait while the hold file exists, then exit
    token_delay_s     float  sleep before each token (default 0.005)
    ignore_cancel     bool   keep generating after Cancel
    ignore_shutdown   bool   do not exit on Shutdown
    no_template       bool   has_chat_template False (chat -> no_chat_template)
    n_ctx             int    context size (default --n-ctx or 256)
    length            int    tokens before EOS (default 12)
    max_jobs          int    KV slots: generations run at once (Ready.max_jobs, default 1)
    report_slots      bool   Pong carries its slot list (else slots=[], as today's real worker)
    cache_n           int    prompt tokens reported as reused from the cache (Done.cache_n, capped)
    kv_events         bool   before each Done, a KvEvents frame (BlockStored of the prompt's full
                             blocks of 4 ids, a chat's with BOS first as the real worker's) with the
                             request's id; also with --kv-events-to-router

Warm spare (``--spare``, no --model / --gguf): the switches of the key ``"(spare)"`` apply
until Assign names the model (then the model's, as above): ``spare_delay_s`` (float: the
warm-up before Hello), ``spare_crash`` (exit 4 before Hello), ``spare_hold`` (wait before Hello
while the hold file exists). While waiting it answers Ping, exits 0 on Shutdown and refuses
other requests with Error "busy"; it logs ``spare_hello`` and ``assigned`` (model).

Per-request directives inside the prompt (or any message content):
``[crash]`` exit 9 after the first token; ``[hang]`` freeze the whole process
(no Pong, no Cancel); ``[slow=S]`` S seconds per token; ``[len=N]`` N tokens
before EOS; ``[utf8]`` a two-token "é" (first token ends mid-character);
``[prefill=S]`` the prefill takes S seconds (after Accepted; a Cancel ends it; with
``return_progress`` a PromptProgress at its start and after each chunk of PREFILL_CHUNK tokens);
``[hold]`` before each token, wait while the hold file exists (a Cancel still ends it);
``[hold@N]`` the same from token N on (the first N tokens flow freely);
``[reply64=B]`` the reply is the UTF-8 text whose base64 is B, three bytes a token
(to drive tool-call and JSON parsing).

The hold file is ``$MODELYARD_FAKE_FILE.hold``: tests create it to keep a load or a
generation in progress for exactly as long as they need, instead of racing a sleep.

Generated token k has id 100+k and piece " w<id>"; Detokenize([i]) gives " w<i>".
Decode calls (Pong.n_decode_total): a prompt's prefill is one and each generated token one more;
each counts the generations running at that moment as its busy slots (Pong.n_busy_slots_total).
Every event is appended as a JSON line to ``MODELYARD_FAKE_LOG`` if set.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import json
import os
import re
import sys
import time
import zlib
from typing import Any

import zmq
import zmq.asyncio

from protocol.kv_events import BlockStored, KvEvents, block_hashes, encode_batch
from protocol.limits import WEIGHT_MODES

from protocol import (
    Accepted,
    ApplyTemplate,
    ApplyTemplateResult,
    Assign,
    Cancel,
    Detokenize,
    DetokenizeResult,
    Done,
    Error,
    Generate,
    Hello,
    LoadProgress,
    Message,
    Ping,
    Pong,
    PromptProgress,
    Ready,
    Shutdown,
    Token,
    Tokenize,
    TokenizeResult,
    WorkerCredentials,
    decode,
    encode,
    read_credentials,
)

N_VOCAB = 50_000
#: Prompt tokens per "forward pass" of the fake prefill (its PromptProgress steps).
PREFILL_CHUNK = 8
BOS, EOS = 1, 2


def _switches(model: str) -> dict[str, Any]:
    path = os.environ.get("MODELYARD_FAKE_FILE")
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        data = json.load(f)
    return {**data.get("*", {}), **data.get(model, {})}


def _held() -> bool:
    path = os.environ.get("MODELYARD_FAKE_FILE")
    return bool(path) and os.path.exists(path + ".hold")


def _log(event: str, **kw: Any) -> None:
    path = os.environ.get("MODELYARD_FAKE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), "pid": os.getpid(), "event": event, **kw}) + "\n")


def tokenize(text: str, add_special: bool) -> list[int]:
    ids = [10 + zlib.crc32(w.encode()) % 5000 for w in text.split()]
    return ([BOS] if add_special else []) + ids


def piece(tid: int) -> bytes:
    return f" w{tid}".encode()


def render(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> str:
    out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")


class FakeWorker:
    def __init__(self, args: argparse.Namespace, creds: WorkerCredentials | None) -> None:
        self.args = args
        self.creds = creds
        self.sw = _switches(args.model or "(spare)")
        self.n_ctx = int(self.sw.get("n_ctx", args.n_ctx or 256))
        self.ctx = zmq.asyncio.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 1000)
        if creds is not None and creds.curve:
            self.sock.curve_serverkey = str(creds.server_public).encode()
            self.sock.curve_publickey = str(creds.public).encode()
            self.sock.curve_secretkey = str(creds.secret_key).encode()
        self.max_jobs = int(self.sw.get("max_jobs", 1))
        self.running: dict[str, int] = {}  # request id -> KV slot
        self.held = [0] * self.max_jobs  # tokens each slot's KV holds (kept after a request ends)
        self.cancelled: set[str] = set()
        self.task: asyncio.Task[None] | None = None
        self.n_decode = 0  # "decode calls" (see the module docstring)
        self.n_busy_slots = 0
        self.kv_seq = 0  # KvEvents frames sent

    async def send(self, msg: Message) -> None:
        await self.sock.send(encode(msg))

    async def wait_for_model(self) -> int | None:
        """``--spare``: Hello without a model, then wait for Assign (None) or Shutdown (0)."""
        sw = _switches("(spare)")
        await asyncio.sleep(float(sw.get("spare_delay_s", 0.0)))
        if sw.get("spare_crash"):
            _log("spare_crash")
            os._exit(4)
        while sw.get("spare_hold") and _held():
            await asyncio.sleep(0.01)
        self.sock.connect(self.args.endpoint)
        await self.send(Hello(id="hello", model="", pid=os.getpid(),
                              auth=self.creds.secret if self.creds is not None else ""))
        _log("spare_hello")
        while True:
            msg = decode(await self.sock.recv())
            if isinstance(msg, Assign):
                a = self.args
                a.model, a.gguf, a.n_ctx, a.max_queue = msg.model, msg.gguf, msg.n_ctx, msg.max_queue
                a.kv_events_to_router = msg.kv_events_to_router
                self.sw = _switches(msg.model)
                self.n_ctx = int(self.sw.get("n_ctx", a.n_ctx or 256))
                self.max_jobs = int(self.sw.get("max_jobs", 1))
                self.held = [0] * self.max_jobs
                _log("assigned", model=msg.model, threads=msg.threads, weights=msg.weights)
                return None
            if isinstance(msg, Shutdown):
                _log("shutdown")
                return 0
            if isinstance(msg, Ping):
                await self.send(Pong(id=msg.id, busy=False, queue_len=0, pid=os.getpid()))
            elif not isinstance(msg, Cancel):
                await self.send(Error(id=msg.id, code="busy", message="this worker has no model yet"))

    async def main(self) -> int:
        asyncio.get_running_loop().create_task(self.watch_parent())
        if self.args.spare:
            code = await self.wait_for_model()
            if code is not None:
                return code
        else:
            while self.sw.get("hold_hello") and _held():
                await asyncio.sleep(0.01)
            self.sock.connect(self.args.endpoint)
            await self.send(Hello(id="hello", model=self.args.model, pid=os.getpid(),
                                  auth=self.creds.secret if self.creds is not None else ""))
            _log("hello", model=self.args.model)
        t0 = time.monotonic()
        await asyncio.sleep(float(self.sw.get("load_delay_s", 0.0)))
        if self.sw.get("crash_at_load"):
            _log("crash_at_load")
            os._exit(3)
        if self.sw.get("load_error"):
            await self.send(Error(id="load", code="load_failed", message=f"fake load failure: bad GGUF {os.path.abspath(self.args.gguf)}"))
            await asyncio.sleep(0.05)
            return 1
        if self.sw.get("hang_at_load"):
            await asyncio.sleep(3600)
        if n_steps := int(self.sw.get("load_steps", 0)):
            await self.send(LoadProgress(id="hello", stage="reading_gguf", done=0, total=1))
            await self.send(LoadProgress(id="hello", stage="reading_gguf", done=1, total=1))
            for i in range(1, n_steps + 1):
                await self.send(LoadProgress(id="hello", stage="preparing_tensors", done=i, total=n_steps))
        while self.sw.get("hold_load") and _held():
            await asyncio.sleep(0.01)
        ready = Ready(
            id="ready", model=self.args.model, architecture="fake", gguf_path=self.args.gguf,
            file_size=os.path.getsize(self.args.gguf), fingerprint="f" * 64, n_ctx=self.n_ctx,
            n_ctx_train=4096, n_vocab=N_VOCAB, has_chat_template=not self.sw.get("no_template"),
            pid=os.getpid(), load_ms=(time.monotonic() - t0) * 1000, max_jobs=self.max_jobs,
            kv_budget_tokens=self.max_jobs * self.n_ctx)
        if self.sw.get("late_fingerprint"):  # as a real worker still hashing a never-seen file
            await self.send(dataclasses.replace(ready, fingerprint=""))

            async def fingerprint_later() -> None:
                while _held():
                    await asyncio.sleep(0.01)
                await self.send(ready)
                _log("fingerprint")

            self._late = asyncio.ensure_future(fingerprint_later())
        else:
            await self.send(ready)
        _log("ready", model=self.args.model)
        while True:
            msg = decode(await self.sock.recv())
            if isinstance(msg, Shutdown):
                _log("shutdown")
                if self.sw.get("ignore_shutdown"):
                    continue
                while self.sw.get("hold_shutdown") and _held():
                    await asyncio.sleep(0.01)
                return 0
            await self.handle(msg)

    async def watch_parent(self) -> None:
        parent = self.args.parent_pid
        while True:
            await asyncio.sleep(0.2)
            try:
                os.kill(parent, 0)
            except ProcessLookupError:
                _log("parent_gone")
                os._exit(0)
            if os.getppid() != parent:
                _log("parent_gone")
                os._exit(0)

    def _decoded(self) -> None:
        self.n_decode += 1
        self.n_busy_slots += len(self.running)

    async def handle(self, msg: Message) -> None:
        if isinstance(msg, Ping):
            if msg.threads:
                _log("threads", n=msg.threads)
            by_slot = {slot: rid for rid, slot in self.running.items()}
            slots = [{"id": i, "id_task": by_slot.get(i), "is_processing": i in by_slot, "n_past": self.held[i]}
                     for i in range(self.max_jobs)] if self.sw.get("report_slots") else []
            await self.send(Pong(id=msg.id, busy=bool(self.running), queue_len=0,
                                 running_ids=list(self.running), slots=slots, kv_tokens=sum(self.held),
                                 kv_budget_tokens=self.max_jobs * self.n_ctx, n_decode_total=self.n_decode,
                                 n_busy_slots_total=self.n_busy_slots, pid=os.getpid()))
        elif isinstance(msg, Cancel):
            _log("cancel", id=msg.id)
            if not self.sw.get("ignore_cancel"):
                self.cancelled.add(msg.id)
        elif isinstance(msg, Generate):
            _log("generate", id=msg.id, busy=len(self.running) >= self.max_jobs, max_tokens=msg.max_tokens,
                 temperature=msg.temperature, top_k=msg.top_k, top_p=msg.top_p, min_p=msg.min_p,
                 seed=msg.seed, stop=msg.stop, n_probs=msg.n_probs, messages=msg.messages,
                 prompt=msg.prompt, logit_bias=msg.logit_bias, grammar=msg.grammar,
                 json_schema=msg.json_schema, trace_id=msg.trace_id, chat_template=msg.chat_template, repeat_penalty=msg.repeat_penalty,
                 repeat_last_n=msg.repeat_last_n, presence_penalty=msg.presence_penalty,
                 frequency_penalty=msg.frequency_penalty, tools=msg.tools, template_kwargs=msg.template_kwargs,
                 return_progress=msg.return_progress)
            if len(self.running) >= self.max_jobs:
                await self.send(Error(id=msg.id, code="busy", message="a generation is already running"))
                return
            self.running[msg.id] = min(set(range(self.max_jobs)) - set(self.running.values()))
            self.task = asyncio.get_running_loop().create_task(self.generate(msg))
        elif isinstance(msg, Tokenize):
            ids = tokenize(msg.content, msg.add_special)
            await self.send(TokenizeResult.of(msg.id, ids, [piece(i) for i in ids] if msg.with_pieces else None))
        elif isinstance(msg, Detokenize):
            toks = msg.tokens.tolist()
            bad = [t for t in toks if not 0 <= t < N_VOCAB]
            if bad:
                await self.send(Error(id=msg.id, code="invalid_token", message=f"invalid token id {bad[0]}"))
            else:
                await self.send(DetokenizeResult(id=msg.id, content=b"".join(piece(t) for t in toks)
                                                 .decode("utf-8", "replace")))
        elif isinstance(msg, ApplyTemplate):
            if self.sw.get("no_template"):
                await self.send(Error(id=msg.id, code="no_chat_template", message="model has no chat template"))
            else:
                await self.send(ApplyTemplateResult(id=msg.id, prompt=render(msg.messages, msg.add_generation_prompt)))

    async def generate(self, g: Generate) -> None:
        try:
            await self._generate(g)
        finally:
            self.running.pop(g.id, None)
            self.cancelled.discard(g.id)

    async def _generate(self, g: Generate) -> None:
        if g.messages is not None:
            if self.sw.get("no_template"):
                await self.send(Error(id=g.id, code="no_chat_template",
                                      message="this model has no chat template; configure chat_template"))
                return
            text = render(g.messages)
            prompt_ids = tokenize(text, False)
        elif isinstance(g.prompt, str):
            text = g.prompt
            prompt_ids = tokenize(text, g.add_special)
        else:
            text = ""
            prompt_ids = list(g.prompt or [])
            bad = [t for t in prompt_ids if not 0 <= t < N_VOCAB]
            if bad:
                await self.send(Error(id=g.id, code="invalid_token", message=f"invalid token id {bad[0]}"))
                return
        if not prompt_ids:
            await self.send(Error(id=g.id, code="empty_prompt", message="the prompt is empty"))
            return
        max_tokens = g.max_tokens
        if max_tokens is not None and 0 < self.n_ctx - len(prompt_ids) < max_tokens:
            max_tokens = self.n_ctx - len(prompt_ids)  # clamped to the room left, as the real engine does
        need = len(prompt_ids) + (max_tokens or 0)
        if need > self.n_ctx or len(prompt_ids) >= self.n_ctx:
            await self.send(Error(id=g.id, code="context_length_exceeded", message=(
                f"This model's maximum context length is {self.n_ctx} tokens. However, you requested "
                f"{need} tokens ({len(prompt_ids)} in the prompt, {max_tokens or 0} for the completion)."),
                n_prompt_tokens=len(prompt_ids), n_ctx=self.n_ctx))
            return
        delay = float(self.sw.get("token_delay_s", 0.005))
        m = re.search(r"\[slow=([0-9.]+)\]", text)
        if m:
            delay = float(m.group(1))
        length = int(self.sw.get("length", 12))
        m = re.search(r"\[len=(\d+)\]", text)
        if m:
            length = int(m.group(1))
        crash = "[crash]" in text
        hang = "[hang]" in text
        utf8 = "[utf8]" in text
        m = re.search(r"\[hold(?:@(\d+))?\]", text)
        hold_from = (int(m.group(1) or 0)) if m else None
        slot = self.running[g.id]
        self.held[slot] = len(prompt_ids)
        await self.send(Accepted(id=g.id, prompt_tokens=len(prompt_ids)))  # taken: the prefill starts
        t0 = time.monotonic()
        m = re.search(r"\[prefill=([0-9.]+)\]", text)
        prefill_s = float(m.group(1)) if m else 0.01
        total = len(prompt_ids)
        cache = min(int(self.sw.get("cache_n", 0)), total - 1)
        ends = [*range(cache + PREFILL_CHUNK, total, PREFILL_CHUNK), total]  # the prefill's chunks
        if g.return_progress:
            await self.send(PromptProgress(id=g.id, total=total, cache=cache, processed=cache, time_ms=0.0))
        for k, end in enumerate(ends):  # "prefill"
            while time.monotonic() - t0 < prefill_s * (k + 1) / len(ends) and g.id not in self.cancelled:
                await asyncio.sleep(min(0.01, prefill_s))
            if g.return_progress and g.id not in self.cancelled:
                await self.send(PromptProgress(id=g.id, total=total, cache=cache, processed=end,
                                               time_ms=(time.monotonic() - t0) * 1000))
        prompt_ms = (time.monotonic() - t0) * 1000
        self._decoded()  # the prefill
        t1 = time.monotonic()
        limit = max_tokens if max_tokens is not None else self.n_ctx - len(prompt_ids)
        pieces: list[bytes] = []
        if utf8:
            pieces += [b" \xc3", b"\xa9"]
        m = re.search(r"\[reply64=([A-Za-z0-9+/=]+)\]", text)
        if m:
            raw = base64.b64decode(m.group(1))
            pieces = [raw[i:i + 3] for i in range(0, len(raw), 3)]
            length = len(pieces)
        k = 0
        while len(pieces) < length:
            pieces.append(piece(100 + k))
            k += 1
        full = b""
        sent = 0  # chars of the decoded text already sent
        n = 0
        finish, stop_type, stopping_word = "stop", "eos", ""
        for i, pc in enumerate(pieces):
            if n >= limit:
                finish, stop_type = "length", "limit"
                break
            if g.id in self.cancelled:
                finish, stop_type = "cancelled", "cancelled"
                break
            while hold_from is not None and i >= hold_from and _held() and g.id not in self.cancelled:
                await asyncio.sleep(0.01)
            await asyncio.sleep(delay)
            if g.id in self.cancelled:
                finish, stop_type = "cancelled", "cancelled"
                break
            tid = (200 + i) if utf8 and i < 2 else 100 + (i - (2 if utf8 else 0))
            full += pc
            n += 1
            self.held[slot] += 1
            try:
                text_now = full.decode("utf-8")
            except UnicodeDecodeError:
                text_now = None
            delta = ""
            hit = None
            if text_now is not None:
                for s in g.stop:
                    pos = text_now.find(s)
                    if pos >= 0 and (hit is None or pos < hit[0]):
                        hit = (pos, s)
                if hit is not None:
                    delta = text_now[sent:hit[0]]
                else:
                    safe = len(text_now)
                    for s in g.stop:
                        for j in range(min(len(s) - 1, len(text_now)), 0, -1):
                            if text_now.endswith(s[:j]):
                                safe = min(safe, len(text_now) - j)
                                break
                    delta = text_now[sent:safe]
                sent += len(delta)
            # [id, logprob, piece] as the real worker sends; alternatives of the [utf8]
            # tokens are partial UTF-8 lead bytes too (distinct bytes, same "�" text)
            top = [[tid + j, -0.5 - j,
                    pc if j == 0 else (bytes([0xC3 + j]) if utf8 and i < 2 else piece(tid + j))]
                   for j in range(g.n_probs)]
            if n == 1:
                _log("first_token", id=g.id)
            self._decoded()
            await self.send(Token(id=g.id, text=delta, token_id=tid, piece=pc,
                                  logprob=-0.5 if g.n_probs else None, top_logprobs=top))
            if crash:
                _log("crash", id=g.id)
                await asyncio.sleep(0.1)  # let the Token frame leave before dying (os._exit skips zmq's linger)
                os._exit(9)
            if hang:
                _log("hang", id=g.id)
                time.sleep(3600)
            if hit is not None:
                finish, stop_type, stopping_word = "stop", "word", hit[1]
                break
        tail = ""
        if stop_type != "word":
            tail = full.decode("utf-8", "replace")[sent:]
        _log("done", id=g.id, finish_reason=finish, n=n)
        if self.sw.get("kv_events") or self.args.kv_events_to_router:
            held = ([BOS] if g.messages is not None else []) + prompt_ids  # as the real worker holds a chat: BOS first
            full_ids = held[:len(held) // 4 * 4]
            payload = encode_batch(time.time(), [BlockStored(block_hashes(full_ids, 4), None, full_ids, 4)])
            # the request's id (the real worker's is its own): KvEvents never reach a request's stream
            await self.send(KvEvents(id=g.id, seq=self.kv_seq, payload=payload))
            _log("kv_events", seq=self.kv_seq)
            self.kv_seq += 1
        await self.send(Done(id=g.id, finish_reason=finish, stop_type=stop_type, stopping_word=stopping_word,
                             text=tail, prompt_tokens=len(prompt_ids), completion_tokens=n,
                             prompt_n=len(prompt_ids), prompt_ms=prompt_ms, predicted_n=n,
                             predicted_ms=(time.monotonic() - t1) * 1000,
                             cache_n=min(int(self.sw.get("cache_n", 0)), len(prompt_ids)), id_slot=slot))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=None)
    p.add_argument("--gguf", default=None)
    p.add_argument("--spare", action="store_true")
    p.add_argument("--endpoint", required=True)
    p.add_argument("--n-ctx", type=int, default=None)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--max-queue", type=int, default=8)
    p.add_argument("--threads", type=int, default=None)
    # accepted like the real worker; the fake's slots come from its max_jobs switch instead
    p.add_argument("--parallel", type=int, default=1)
    p.add_argument("--kv-budget-mib", type=float, default=None)
    p.add_argument("--weights", choices=WEIGHT_MODES, default=None)  # accepted like the real worker
    p.add_argument("--kv-events-endpoint", default=None)  # accepted like the real worker (no PUB socket)
    p.add_argument("--kv-events-block-size", type=int, default=16)
    p.add_argument("--kv-events-to-router", action="store_true")
    p.add_argument("--parent-pid", type=int, required=True)
    p.add_argument("--auth-fd", type=int, default=None)
    args = p.parse_args(argv)
    creds = read_credentials(args.auth_fd) if args.auth_fd is not None else None
    _log("start", argv=sys.argv[1:])
    return asyncio.run(FakeWorker(args, creds).main())


if __name__ == "__main__":
    sys.exit(main())

"""A deterministic stand-in for ``worker.engine.Engine`` (docs/ENGINE-API.md), for worker tests.

It follows the facade's contract (same methods, same EngineError codes, the
real ``SamplingParams`` validation and ``EngineInfo``) but its "model" is a
hash: the next token is a function of every token in the (emulated) KV cache,
so output depends on the cache exactly like a real model's would, and a cache
that kept stale tokens would change it.

Knobs (attributes, settable by a test at any time):

    token_delay_s   seconds per decoded token (default 0.002)
    chunk_delay_s   seconds per prefill chunk (default 0.0)
    prefill_chunk   prompt tokens per prefill chunk (default 4)
    length          tokens before the end-of-generation token (default 8)

Holding steps (instead of racing a delay): ``allow(n)`` lets the next ``n`` calls of
``step()`` run and holds the one after, until more are allowed; ``allow(tokens=n)``
holds the first step after ``n`` more tokens were decoded (``allow(None)``: free
running, the default). ``held`` is set while a step waits; ``prepared`` counts the
prompts ``prepare`` has turned into ids (the worker's prep thread). A step held for
30 s raises (a test that forgot to let it go fails instead of hanging).

A text prompt containing the word ``boom`` raises RuntimeError
after the first token: an engine bug, which the worker must survive.

Token ids: 0 unk, 1 BOS, 2 EOS; words are ``10 + crc32(word) % (n_vocab - 10)``;
the piece of id i is ``" w<i>"``.
"""

from __future__ import annotations

from dataclasses import replace

import threading
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from worker.engine import EngineError, EngineInfo, Finished, GenerationResult, SamplingParams, SlotInfo, TokenEvent

BOS, EOS = 1, 2


class _Seq:
    """One sequence of the batch API: its own emulated KV context and decode state."""

    def __init__(self, seq_id: str, ids: list[int], p: SamplingParams, on_token: Any, keep: int,
                 ctx: list[int], slot: int, n_max: int, boom: bool) -> None:
        self.id, self.ids, self.p, self.on_token = seq_id, ids, p, on_token
        self.keep, self.ctx, self.slot, self.n_max, self.boom = keep, ctx, slot, n_max, boom
        self.n_done = keep
        self.tokens: list[int] = []
        self.text = self.sent = ""
        self.finish = self.stop_type = ""
        self.aborted = False
        self.t0 = time.perf_counter()
        self.t1 = 0.0


class FakeEngine:
    def __init__(self, n_ctx: int = 512, n_vocab: int = 1000, has_template: bool = True, parallel: int = 1) -> None:
        self.info = EngineInfo(architecture="fake", name="fake", n_ctx=n_ctx, n_ctx_train=2048, n_vocab=n_vocab,
                               file_size=1234, fingerprint="ab" * 32, has_chat_template=has_template,
                               bos_token="<s>", eos_token="</s>", n_parallel=parallel,
                               kv_budget_tokens=parallel * n_ctx, kv_token_bytes=8)
        self._seqs: dict[str, _Seq] = {}
        self.token_delay_s = 0.002
        self.chunk_delay_s = 0.0
        self.prefill_chunk = 4
        self.length = 8
        self._cache: list[int] = []
        self.generate_calls = 0
        self._budget: int | None = None  # steps allowed before holding (None: free running)
        self._token_limit: int | None = None  # hold once this many tokens were decoded in all
        self._decoded = 0
        self._cond = threading.Condition()
        self.held = threading.Event()  # a step is waiting for allow()
        self.prepared = 0

    @classmethod
    def load(cls, gguf_path: str, n_ctx: int | None = None, chat_template: str | None = None, *,
             parallel: int = 1, kv_budget_mib: float | None = None) -> FakeEngine:
        if "missing" in gguf_path:
            raise EngineError("file_not_found", f"GGUF file not found: {gguf_path}")
        return cls(n_ctx=n_ctx or 512, parallel=parallel)

    # ---------------------------------------------------------------- text

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        if not isinstance(text, str):
            raise EngineError("invalid_params", "text must be a string")
        ids = [10 + zlib.crc32(w.encode()) % (self.info.n_vocab - 10) for w in text.split()]
        return ([BOS] if add_special else []) + ids

    def _check(self, ids: Sequence[int]) -> list[int]:
        for t in ids:
            if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < self.info.n_vocab:
                raise EngineError("invalid_token", f"token id {t!r} is out of the vocabulary [0, {self.info.n_vocab})")
        return list(ids)

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        self._check([token_id])
        if token_id in (BOS, EOS):
            return (b"<s>" if token_id == BOS else b"</s>") if special else b""
        return f" w{token_id}".encode()

    def detokenize(self, ids: Sequence[int]) -> str:
        return b"".join(self.token_bytes(t) for t in self._check(ids)).decode("utf-8", "replace")

    def _render(self, messages: list[dict[str, Any]], add_generation_prompt: bool) -> str:
        if not self.info.has_chat_template:
            raise EngineError("no_chat_template", "model has no chat template")
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages):
            raise EngineError("invalid_params", "messages must be a list of {role, content} objects")
        out = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return out + ("<|im_start|>assistant\n" if add_generation_prompt else "")

    def apply_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                       chat_template: str | None = None) -> str:
        return self._render(messages, add_generation_prompt)

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[Any] | None = None, chat_template: str | None = None,
                      template_kwargs: dict[str, Any] | None = None) -> list[int]:
        text = self._render(messages, add_generation_prompt)  # a request's template: marked, not rendered
        return self.tokenize((f"[{chat_template}]" if chat_template else "") + text, add_special=True)

    # ---------------------------------------------------------------- generate

    def _next(self) -> int:
        h = zlib.crc32(b",".join(str(t).encode() for t in self._cache))
        return 10 + h % (self.info.n_vocab - 10)

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 on_token: Callable[[TokenEvent], bool] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        """One sequence alone: prepare, add, step until it ends (as the real facade)."""
        ids, p = self.prepare(prompt, params)
        self.add("generate", ids, p, on_token)
        while True:
            if should_stop is not None and should_stop():
                self.abort("generate")
            for f in self.step():
                if f.id == "generate":
                    if f.error is not None:
                        raise f.error
                    assert f.result is not None
                    return f.result

    # ---------------------------------------------------------------- batch API (docs/ENGINE-API.md)

    @property
    def sampling_vocab(self) -> int:
        return int(self.info.n_vocab)

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> tuple[list[int], SamplingParams]:
        self.prepared += 1
        p = params.validated(self.sampling_vocab)
        ids = self.tokenize(prompt, p.add_special, p.parse_special) if isinstance(prompt, str) else self._check(prompt)
        if not ids:
            raise EngineError("empty_prompt", "the prompt is empty")
        if p.max_tokens is not None and 0 < self.info.n_ctx - len(ids) < p.max_tokens:
            p = replace(p, max_tokens=self.info.n_ctx - len(ids))  # clamped, as the real engine does
        n_completion = 1 if p.max_tokens is None else p.max_tokens
        if len(ids) + n_completion > self.info.n_ctx:
            raise EngineError("context_length_exceeded", (
                f"This model's maximum context length is {self.info.n_ctx} tokens. However, you requested "
                f"{len(ids) + n_completion} tokens ({len(ids)} in the prompt, {n_completion} for the completion)."))
        if isinstance(prompt, str) and "boom" in prompt.split():
            ids = ids + [3]  # id 3 marks "explode after the first token" (a text-free signal for add)
        return ids, p

    def add(self, seq_id: str, ids: list[int], p: SamplingParams, on_token: Any = None,
            should_stop: Any = None) -> None:  # should_stop: the real engine's mid-pass cancel (not modelled)
        if seq_id in self._seqs:
            raise EngineError("invalid_params", f"sequence id {seq_id!r} is already in use")
        self.generate_calls += 1
        boom = bool(ids) and ids[-1] == 3
        if boom:
            ids = ids[:-1]
        keep = 0
        if p.cache_prompt:
            while keep < min(len(self._cache), len(ids) - 1) and self._cache[keep] == ids[keep]:
                keep += 1
        used = {s.slot for s in self._seqs.values()}
        slot = next(i for i in range(self.info.n_parallel + len(used) + 1) if i not in used)
        n_max = p.max_tokens if p.max_tokens is not None else self.info.n_ctx - len(ids)
        self._seqs[seq_id] = _Seq(seq_id, ids, p, on_token, keep, self._cache[:keep], slot, n_max, boom)

    def cache_n(self, seq_id: str) -> int:
        s = self._seqs.get(seq_id)
        return s.keep if s is not None else 0

    def abort(self, seq_id: str) -> bool:
        s = self._seqs.get(seq_id)
        if s is None:
            return False
        s.aborted = True
        return True

    @property
    def has_work(self) -> bool:
        return bool(self._seqs)

    def slots(self) -> list[SlotInfo]:
        by_slot = {s.slot: s for s in self._seqs.values()}
        return [SlotInfo(i, by_slot[i].id if i in by_slot else None, i in by_slot,
                         len(by_slot[i].ctx) if i in by_slot else 0) for i in range(self.info.n_parallel)]

    @property
    def kv_tokens(self) -> int:
        return len(self._cache) + sum(len(s.ctx) for s in self._seqs.values())

    def allow(self, n: int | None = None, *, tokens: int | None = None) -> None:
        """Let the next ``n`` steps run (or those until ``tokens`` more tokens are decoded),
        then hold; neither: never hold."""
        with self._cond:
            self._budget = n
            self._token_limit = None if tokens is None else self._decoded + tokens
            self._cond.notify_all()

    def _holding(self) -> bool:
        return ((self._budget is not None and self._budget <= 0)
                or (self._token_limit is not None and self._decoded >= self._token_limit))

    def _take_step(self) -> None:
        with self._cond:
            if self._holding():
                self.held.set()
                ok = self._cond.wait_for(lambda: not self._holding(), timeout=30)
                self.held.clear()
                if not ok:
                    raise RuntimeError("fake engine step held for 30 s: the test never let it go")
            if self._budget is not None:
                self._budget -= 1

    def step(self) -> list[Finished]:
        self._take_step()
        live = list(self._seqs.values())
        if any(s.n_done < len(s.ids) for s in live):
            time.sleep(self.chunk_delay_s)
        if any(s.n_done >= len(s.ids) for s in live):
            time.sleep(self.token_delay_s)
        out: list[Finished] = []
        for s in live:
            if s.aborted:
                s.finish, s.stop_type = "cancelled", "cancelled"
            elif s.n_done < len(s.ids):
                chunk = s.ids[s.n_done:s.n_done + self.prefill_chunk]
                s.ctx.extend(chunk)
                s.n_done += len(chunk)
                s.t1 = time.perf_counter()
                continue
            else:
                try:
                    self._decode(s)
                except Exception as e:  # noqa: BLE001
                    del self._seqs[s.id]
                    out.append(Finished(s.id, None, e, s.slot))
                    continue
            if s.finish:
                del self._seqs[s.id]
                self._cache = list(s.ctx)
                t2 = time.perf_counter()
                out.append(Finished(s.id, GenerationResult(
                    text=s.text, tail=s.text[len(s.sent):], tokens=s.tokens, finish_reason=s.finish,
                    stop_type=s.stop_type, stopping_word="", prompt_n=s.n_done - s.keep,
                    prompt_ms=((s.t1 or t2) - s.t0) * 1e3, predicted_n=len(s.tokens),
                    predicted_ms=(t2 - (s.t1 or t2)) * 1e3, cache_n=s.keep, prompt_tokens=len(s.ids)), None, s.slot))
        return out

    def _decode(self, s: _Seq) -> None:
        if len(s.tokens) >= s.n_max:
            s.finish, s.stop_type = "length", "limit"
            return
        h = zlib.crc32(b",".join(str(t).encode() for t in s.ctx))
        tid = EOS if len(s.tokens) >= self.length and not s.p.ignore_eos else 10 + h % (self.info.n_vocab - 10)
        s.tokens.append(tid)
        self._decoded += 1
        s.ctx.append(tid)
        if tid == EOS:
            s.finish, s.stop_type = "stop", "eos"
            return
        piece = self.token_bytes(tid, special=False)
        s.text += piece.decode()
        delta = s.text[len(s.sent):]
        s.sent += delta
        lp = -0.25 if s.p.n_probs else None
        top = [(tid, -0.25)] + [(tid + k, -1.0 - k) for k in range(1, s.p.n_probs)] if s.p.n_probs else []
        keep_going = s.on_token(TokenEvent(tid, delta, piece, lp, top)) if s.on_token is not None else True
        if s.boom:
            raise RuntimeError("fake engine exploded")
        if keep_going is False:
            s.finish, s.stop_type = "cancelled", "cancelled"

    def reset_cache(self) -> None:
        self._cache.clear()

    @property
    def cached_tokens(self) -> list[int]:
        live = [s.ctx for s in self._seqs.values()]
        return list(live[-1]) if live else list(self._cache)

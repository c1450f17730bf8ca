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

A text prompt containing the word ``boom`` raises RuntimeError
after the first token: an engine bug, which the worker must survive.

Token ids: 0 unk, 1 BOS, 2 EOS; words are ``10 + crc32(word) % (n_vocab - 10)``;
the piece of id i is ``" w<i>"``.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

from worker.engine import EngineError, EngineInfo, GenerationResult, SamplingParams, TokenEvent

BOS, EOS = 1, 2


class FakeEngine:
    def __init__(self, n_ctx: int = 512, n_vocab: int = 1000, has_template: bool = True) -> None:
        self.info = EngineInfo(architecture="fake", name="fake", n_ctx=n_ctx, n_ctx_train=2048, n_vocab=n_vocab,
                               file_size=1234, fingerprint="ab" * 32, has_chat_template=has_template,
                               bos_token="<s>", eos_token="</s>")
        self.token_delay_s = 0.002
        self.chunk_delay_s = 0.0
        self.prefill_chunk = 4
        self.length = 8
        self._cache: list[int] = []
        self.generate_calls = 0

    @classmethod
    def load(cls, gguf_path: str, n_ctx: int | None = None, chat_template: str | None = None) -> FakeEngine:
        if "missing" in gguf_path:
            raise EngineError("file_not_found", f"GGUF file not found: {gguf_path}")
        return cls(n_ctx=n_ctx or 512)

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
                       tools: list[Any] | None = None) -> str:
        return self._render(messages, add_generation_prompt)

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[Any] | None = None) -> list[int]:
        return self.tokenize(self._render(messages, add_generation_prompt), add_special=True)

    # ---------------------------------------------------------------- generate

    def _next(self) -> int:
        h = zlib.crc32(b",".join(str(t).encode() for t in self._cache))
        return 10 + h % (self.info.n_vocab - 10)

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 on_token: Callable[[TokenEvent], bool] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        self.generate_calls += 1
        p = params.validated(self.info.n_vocab)
        text_prompt = prompt if isinstance(prompt, str) else ""
        ids = self.tokenize(prompt, p.add_special, p.parse_special) if isinstance(prompt, str) else self._check(prompt)
        if not ids:
            raise EngineError("empty_prompt", "the prompt is empty")
        n_completion = 1 if p.max_tokens is None else p.max_tokens
        if len(ids) + n_completion > self.info.n_ctx:
            raise EngineError("context_length_exceeded", (
                f"This model's maximum context length is {self.info.n_ctx} tokens. However, you requested "
                f"{len(ids) + n_completion} tokens ({len(ids)} in the prompt, {n_completion} for the completion)."))
        boom = "boom" in text_prompt.split()
        # cache reuse: verified common prefix, last prompt token always re-evaluated
        keep = 0
        if p.cache_prompt:
            while keep < min(len(self._cache), len(ids) - 1) and self._cache[keep] == ids[keep]:
                keep += 1
        del self._cache[keep:]
        t0 = time.perf_counter()
        finish, stop_type = "", ""
        evaluated = 0
        for start in range(keep, len(ids), self.prefill_chunk):
            if should_stop is not None and should_stop():
                finish, stop_type = "cancelled", "cancelled"
                break
            time.sleep(self.chunk_delay_s)
            chunk = ids[start:start + self.prefill_chunk]
            self._cache.extend(chunk)
            evaluated += len(chunk)
        t1 = time.perf_counter()
        n_max = p.max_tokens if p.max_tokens is not None else self.info.n_ctx - len(ids)
        tokens: list[int] = []
        text = ""
        sent = ""
        while not finish:
            if len(tokens) >= n_max:
                finish, stop_type = "length", "limit"
                break
            if should_stop is not None and should_stop():
                finish, stop_type = "cancelled", "cancelled"
                break
            time.sleep(self.token_delay_s)
            tid = EOS if len(tokens) >= self.length and not p.ignore_eos else self._next()
            tokens.append(tid)
            self._cache.append(tid)
            if tid == EOS:
                finish, stop_type = "stop", "eos"
                break
            piece = self.token_bytes(tid, special=False)
            text += piece.decode()
            delta = text[len(sent):]
            sent += delta
            lp = -0.25 if p.n_probs else None
            top = [(tid, -0.25)] + [(tid + k, -1.0 - k) for k in range(1, p.n_probs)] if p.n_probs else []
            keep_going = True
            if on_token is not None:
                keep_going = on_token(TokenEvent(tid, delta, piece, lp, top))
            if boom:
                self._cache.clear()
                raise RuntimeError("fake engine exploded")
            if keep_going is False:
                finish, stop_type = "cancelled", "cancelled"
        t2 = time.perf_counter()
        return GenerationResult(text=text, tail=text[len(sent):], tokens=tokens, finish_reason=finish,
                                stop_type=stop_type, stopping_word="", prompt_n=evaluated, prompt_ms=(t1 - t0) * 1e3,
                                predicted_n=len(tokens), predicted_ms=(t2 - t1) * 1e3, cache_n=keep,
                                prompt_tokens=len(ids))

    def reset_cache(self) -> None:
        self._cache.clear()

    @property
    def cached_tokens(self) -> list[int]:
        return list(self._cache)

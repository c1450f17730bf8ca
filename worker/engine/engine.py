"""The engine facade the worker uses (contract: docs/ENGINE-API.md).

An :class:`Engine` owns one loaded GGUF model, its tokenizer, its chat template
and its KV cache. It runs one generation at a time (a lock serialises callers).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .chat_template import ChatTemplate, resolve_template
from .errors import EngineError
from .generate import CacheState, GenerationResult, TokenEvent, check_context, generate
from .sampling import SamplingParams
from .tokenizer import Tokenizer

__all__ = ["Engine", "EngineInfo"]


@dataclass(frozen=True)
class EngineInfo:
    """Identity and sizes of a loaded model."""

    architecture: str  # general.architecture, e.g. "llama", "gemma3"
    name: str  # general.name or the file stem
    n_ctx: int  # KV cache size in tokens
    n_ctx_train: int
    n_vocab: int
    file_size: int  # bytes
    fingerprint: str  # hex digest identifying the file content
    has_chat_template: bool
    bos_token: str | None
    eos_token: str | None


class Engine:
    """One loaded model: tokenizer, chat template, forward pass, KV cache.

    Build with :meth:`load`. Methods raise :class:`EngineError` with a
    ``code`` for every bad input; they never leave the KV cache in a state a
    later request would trust without checking.
    """

    def __init__(self, gguf: Any, model: Any, tokenizer: Tokenizer, template: ChatTemplate | None,
                 info: EngineInfo) -> None:
        self._gguf = gguf
        self._model = model
        self.tokenizer = tokenizer
        self._template = template
        self.info = info
        self._cache = CacheState()
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ load

    @classmethod
    def load(cls, gguf_path: str, n_ctx: int | None = None, chat_template: str | None = None) -> Engine:
        """Load a GGUF file.

        Args:
            gguf_path: path of the ``.gguf`` file.
            n_ctx: KV cache size in tokens; None -> ``min(n_ctx_train, 8192)``.
            chat_template: a Jinja template text or a known name (``"chatml"``,
                ``"gemma"``) replacing / supplying ``tokenizer.chat_template``.

        Raises:
            EngineError: ``file_not_found``, ``invalid_gguf``,
                ``unsupported_architecture``, ``unsupported_tensor_type``,
                ``unsupported_tokenizer``, ``template_error`` (the given or
                embedded template does not compile), ``invalid_params``
                (n_ctx not a positive integer).
        """
        from .gguf_loader import read_gguf
        from .model import load_model  # n_ctx None -> min(n_ctx_train, DEFAULT_MAX_CTX) there

        path = Path(gguf_path)
        if not path.is_file():
            raise EngineError("file_not_found", f"GGUF file not found: {gguf_path}")
        if n_ctx is not None and (isinstance(n_ctx, bool) or not isinstance(n_ctx, int) or n_ctx <= 0):
            raise EngineError("invalid_params", f"n_ctx must be a positive integer, got {n_ctx!r}")
        if chat_template is not None and not isinstance(chat_template, str):
            raise EngineError("invalid_params", "chat_template must be a string")
        gguf = _wrap(read_gguf, str(path))
        md = gguf.metadata
        arch = gguf.architecture
        n_ctx_train = md.get(f"{arch}.context_length")
        if isinstance(n_ctx_train, bool) or not isinstance(n_ctx_train, int) or n_ctx_train <= 0:
            raise EngineError("invalid_gguf", f"GGUF has no valid {arch}.context_length")
        tokenizer = _wrap(Tokenizer.from_metadata, md)
        source = resolve_template(chat_template) if chat_template is not None else md.get("tokenizer.chat_template")
        template = None
        if isinstance(source, str) and source.strip():
            template = ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token,
                                    strip_bos=tokenizer.add_bos, strip_eos=tokenizer.add_eos)
        model = _wrap(load_model, gguf, n_ctx)
        name = md.get("general.name")
        info = EngineInfo(
            architecture=arch,
            name=name if isinstance(name, str) and name else path.stem,
            n_ctx=int(model.n_ctx),
            n_ctx_train=n_ctx_train,
            n_vocab=int(model.n_vocab),
            file_size=int(gguf.file_size),
            fingerprint=str(gguf.fingerprint),
            has_chat_template=template is not None,
            bos_token=tokenizer.bos_token,
            eos_token=tokenizer.eos_token,
        )
        return cls(gguf, model, tokenizer, template, info)

    # ------------------------------------------------------------------ text

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids of ``text`` (llama.cpp semantics, see ``Tokenizer.tokenize``).

        Raises:
            EngineError("invalid_params"): ``text`` is not a string.
        """
        return self.tokenizer.tokenize(text, add_special=bool(add_special), parse_special=bool(parse_special))

    def detokenize(self, ids: Sequence[int]) -> str:
        """Text of ``ids`` (control tokens rendered as their text; invalid UTF-8 -> U+FFFD).

        Raises:
            EngineError("invalid_token"): an id outside ``[0, n_vocab)``.
        """
        if isinstance(ids, (str, bytes)) or not isinstance(ids, Sequence):
            raise EngineError("invalid_params", "ids must be a list of token ids")
        return self.tokenizer.detokenize(ids)

    def token_bytes(self, token_id: int, special: bool = True) -> bytes:
        """Raw bytes of one token's piece; ``special=False`` gives b"" for control
        tokens, as generated text does.

        Raises:
            EngineError("invalid_token"): id outside ``[0, n_vocab)``.
        """
        return self.tokenizer.token_bytes(token_id, special=special)

    def _require_template(self) -> ChatTemplate:
        if self._template is None:
            raise EngineError("no_chat_template", f"model {self.info.name!r} has no chat template; "
                              "configure one (a template text or a name such as 'chatml' or 'gemma')")
        return self._template

    def apply_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       tools: list[Any] | None = None) -> str:
        """The chat prompt text for ``messages`` (OpenAI-style; content a string
        or a list of text parts). A leading BOS text is removed when the
        tokenizer adds BOS itself, like llama.cpp's ``/apply-template``.

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params").
        """
        return self._require_template().render(messages, add_generation_prompt, tools)

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[Any] | None = None) -> list[int]:
        """Prompt ids for ``messages``: template markup is tokenized with special
        parsing, message contents without it (a user typing ``<|im_end|>``
        cannot close a turn); BOS added per the GGUF, exactly once.

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params").
        """
        segments = self._require_template().render_segments(messages, add_generation_prompt, tools)
        return self.tokenizer.tokenize_pieces(segments, add_special=True)

    # ------------------------------------------------------------------ generate

    def generate(self, prompt: str | list[int], params: SamplingParams,
                 on_token: Callable[[TokenEvent], bool] | None = None,
                 should_stop: Callable[[], bool] | None = None) -> GenerationResult:
        """Generate a completion of ``prompt`` (text, tokenized with
        ``params.add_special`` / ``parse_special``, or token ids).

        ``should_stop()`` is polled between prefill chunks and before each
        token; ``on_token`` returning ``False`` also stops; either gives
        finish_reason "cancelled".

        Raises (before any token):
            EngineError("invalid_params"): bad ``params`` or prompt type.
            EngineError("invalid_token"): a prompt id outside the vocabulary.
            EngineError("empty_prompt"): no prompt tokens.
            EngineError("context_length_exceeded"): prompt + max_tokens > n_ctx.
        """
        if not isinstance(params, SamplingParams):
            raise EngineError("invalid_params", "params must be a SamplingParams")
        p = params.validated(min(self.info.n_vocab, self.tokenizer.n_vocab))
        if isinstance(prompt, str):
            ids = self.tokenizer.tokenize(prompt, add_special=p.add_special, parse_special=p.parse_special)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes):
            ids = self.tokenizer.check_ids(prompt)
            limit = self.info.n_vocab
            bad = next((t for t in ids if t >= limit), None)
            if bad is not None:
                raise EngineError("invalid_token", f"token id {bad} is out of the vocabulary [0, {limit})")
        else:
            raise EngineError("invalid_params", "prompt must be a string or a list of token ids")
        if not ids:
            raise EngineError("empty_prompt", "the prompt is empty (it tokenizes to no tokens)")
        check_context(self.info.n_ctx, len(ids), p.max_tokens)
        with self._lock:
            return generate(self._model, self.tokenizer, self._cache, ids, p, on_token, should_stop)

    def reset_cache(self) -> None:
        """Forget the KV cache (the next request evaluates its whole prompt)."""
        with self._lock:
            self._cache.tokens.clear()
            self._model.reset()

    @property
    def cached_tokens(self) -> list[int]:
        """A copy of the token ids whose K/V are valid in the cache."""
        return list(self._cache.tokens)


def _wrap(fn: Callable[..., Any], *args: Any) -> Any:
    """Call a loader; any failure that is not an EngineError becomes ``invalid_gguf``."""
    try:
        return fn(*args)
    except EngineError:
        raise
    except MemoryError:
        raise
    except Exception as e:
        raise EngineError("invalid_gguf", f"cannot load GGUF: {type(e).__name__}: {e}") from e

"""The :class:`~.engine.Engine`'s text methods: tokenize, detokenize, the chat template. They
never touch the KV and may run on any thread."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from .engine_load import EngineInfo
from .errors import EngineError
from .text.builtin_templates import resolve_template
from .text.chat_template import ChatTemplate
from .text.tokenizer import Tokenizer

__all__ = ["EngineText"]


class EngineText:
    """The text methods of :class:`~.engine.Engine` (a base class of it: the attributes below are
    the Engine's)."""

    tokenizer: Tokenizer
    info: EngineInfo
    _template: ChatTemplate | None
    _max_piece_chars: int | None

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

    #: Request templates (``chat_template`` of a request: a preset's) kept compiled, most recent last.
    TEMPLATE_CACHE = 8

    def _template_for(self, chat_template: str | None) -> ChatTemplate:
        """The model's template (``chat_template`` None), else that template text or known name,
        compiled once (the last :attr:`TEMPLATE_CACHE` kept).

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params")."""
        if chat_template is None:
            return self._require_template()
        if not isinstance(chat_template, str) or not chat_template.strip():
            raise EngineError("invalid_params", "chat_template must be a non-empty string")
        cache: dict[str, ChatTemplate] = self.__dict__.setdefault("_request_templates", {})
        t = cache.pop(chat_template, None)
        if t is None:
            tok = self.tokenizer
            t = ChatTemplate(resolve_template(chat_template), tok.bos_token, tok.eos_token,
                             strip_bos=tok.add_bos, strip_eos=tok.add_eos)
            while len(cache) >= self.TEMPLATE_CACHE:
                cache.pop(next(iter(cache)))
        cache[chat_template] = t
        return t

    def apply_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                       tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                       chat_template: str | None = None) -> str:
        """The chat prompt text for ``messages`` (OpenAI-style; content a string
        or a list of text parts; ``template_kwargs``: more template variables, llama.cpp's
        ``chat_template_kwargs``). A leading BOS text is removed when the
        tokenizer adds BOS itself, like llama.cpp's ``/apply-template``. ``chat_template``
        (text or a known name) renders with that template instead of the model's.

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params").
        """
        return self._template_for(chat_template).render(messages, add_generation_prompt, tools, template_kwargs)

    def tokenize_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                      tools: list[Any] | None = None, template_kwargs: dict[str, Any] | None = None,
                      chat_template: str | None = None) -> list[int]:
        """Prompt ids for ``messages``: template markup is tokenized with special
        parsing, message contents without it (a user typing ``<|im_end|>``
        cannot close a turn); BOS added per the GGUF, exactly once. ``chat_template`` (text
        or a known name) renders them with that template instead of the model's;
        ``template_kwargs`` are extra template variables (``chat_template_kwargs``).

        Raises:
            EngineError("no_chat_template" | "template_error" | "invalid_params").
        """
        segments = self._template_for(chat_template).render_segments(messages, add_generation_prompt, tools,
                                                                     template_kwargs)
        self._check_fits(sum(len(text) for text, _ in segments))
        return self.tokenizer.tokenize_pieces(segments, add_special=True)

    def _check_fits(self, n_chars: int) -> None:
        """Refuse, before tokenizing, a text that cannot fit the context whatever its tokens:
        a token covers at most ``max_piece`` characters, so more than ``n_ctx * max_piece``
        characters make more than n_ctx tokens.

        Raises: EngineError("context_length_exceeded").
        """
        n_ctx = self.info.n_ctx
        if n_chars <= n_ctx:
            return
        if self._max_piece_chars is None:
            # the longest token text in UTF-8 bytes bounds every piece's characters (a piece's
            # bytes are at most its text's: SentencePiece's "\u2581" and "<0xNN>", GPT-2's byte
            # alphabet all shrink when decoded): one numpy pass over the vocabulary's compact
            # storage, where decoding 262k pieces took seconds on the first long prompt
            self._max_piece_chars = max(1, int(self.tokenizer.tokens.byte_lengths().max()))
        if n_chars > n_ctx * self._max_piece_chars:
            raise EngineError("context_length_exceeded", (
                f"This model's maximum context length is {n_ctx} tokens. However, the prompt has {n_chars} "
                f"characters, more than {n_ctx} tokens of at most {self._max_piece_chars} characters can hold."))
            # no n_prompt_tokens: not tokenized, the count is unknown (a count_tokens answer takes
            # the figure as exact: router.counting)

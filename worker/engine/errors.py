"""The one exception type the engine raises for expected failures.

Every error the worker may report to a client (bad GGUF file, unsupported
architecture, context overflow, invalid token id, ...) is an
:class:`EngineError` carrying a stable machine-readable ``code`` and a human
readable ``message``. Anything else escaping the engine is a bug.
"""

from __future__ import annotations


class EngineError(Exception):
    """An expected engine failure.

    Args:
        code: stable snake_case identifier, e.g. ``"file_not_found"``,
            ``"invalid_gguf"``, ``"unsupported_tensor_type"``,
            ``"unsupported_architecture"``, ``"context_length_exceeded"``,
            ``"invalid_token"``, ``"invalid_params"``.
        message: human readable explanation (names the offending file, key,
            tensor or value).
    """

    def __init__(self, code: str, message: str, *, n_prompt_tokens: int | None = None,
                 n_ctx: int | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code: str = code
        self.message: str = message
        #: "context_length_exceeded": the prompt's tokens and the context size (llama-server's
        #: exceed_context_size_error fields), when known
        self.n_prompt_tokens = n_prompt_tokens
        self.n_ctx = n_ctx

    def __reduce__(self):  # picklable across processes with (code, message) and the context figures
        return (_rebuild, (self.__class__, self.code, self.message, self.n_prompt_tokens, self.n_ctx))


def _rebuild(cls: type[EngineError], code: str, message: str, n_prompt_tokens: int | None,
             n_ctx: int | None) -> EngineError:
    return cls(code, message, n_prompt_tokens=n_prompt_tokens, n_ctx=n_ctx)

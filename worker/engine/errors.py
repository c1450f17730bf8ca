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

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code: str = code
        self.message: str = message

    def __reduce__(self):  # picklable across processes with (code, message)
        return (self.__class__, (self.code, self.message))

"""Constrained decoding: a per-sequence token mask from a JSON Schema or a Lark grammar.

llguidance (the constraint engine behind llama.cpp's ``%llguidance`` grammars, vLLM
and SGLang) does the parsing; this module gives it our own vocabulary and turns
its answers into what the sampler needs:

* :func:`ll_tokenizer` — an ``llguidance.LLTokenizer`` built from the model's own
  token bytes (``Tokenizer.token_bytes``), so masks are exact for this vocabulary:
  control tokens (and user-defined ``<...>`` tokens) are marked special (a 0xFF
  prefix, as llguidance's llama.cpp binding does) so no text can produce them;
  every end-of-generation id is an EOS the grammar may allow once it accepts.
  Built once per tokenizer (about a second for Gemma's 262k tokens) and cached.
* :func:`grammar_text` — the llguidance grammar of a request (``json_schema`` text,
  compiled with JSON written as ``{"key": value, ...}``; or a ``grammar``: Lark,
  llama.cpp's GBNF — converted by llguidance's ``gbnf_to_lark`` — or llguidance's
  JSON grammar form, which the router uses for custom tools).
* :func:`check` — compile it now (on the prep thread) so an invalid schema or
  grammar is ``EngineError("invalid_grammar")`` before any token.
* compiled once: the compiled matcher (fresh, never advanced) is kept in a small LRU
  keyed by (tokenizer, constraint text); a sequence's :class:`Constraint` is a
  ``deep_copy`` of it. So :func:`check` on the prep thread compiles, the engine
  thread only copies, and a harness that sends the same tools every turn compiles
  their grammar once.
* :class:`Constraint` — one sequence's matcher: :meth:`Constraint.allowed` is the
  boolean mask ``[n_vocab]`` of the next token, :meth:`Constraint.advance` feeds the
  chosen token, :attr:`Constraint.done` says nothing more may follow.

Thread use: one Constraint per sequence, used by the engine thread only; the cached
LLTokenizer and the cached fresh matchers are never advanced, only copied (under a lock).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np

from .errors import EngineError
from .text.tokenizer import ATTR_CONTROL, ATTR_USER_DEFINED, Tokenizer

__all__ = ["Constraint", "JSON_OPTIONS", "check", "grammar_text", "ll_tokenizer", "vocab_bytes"]

#: How schemas are written out: the separators models write themselves, no free whitespace
#: (a greedy small model given free whitespace may write newlines forever).
#: ``lenient``: a schema keyword llguidance cannot enforce (``propertyNames``, ``if``/``then``,
#: ``not``, ``uniqueItems``, ...) is left out — the grammar is loosened to the nearest one it
#: can enforce, a superset of what the schema allows — and reported (:func:`check`'s list),
#: never a failed request: real clients' schemas (Zod's) carry such keywords routinely.
JSON_OPTIONS: dict[str, Any] = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": ",
                                "lenient": True}
#: Longest llguidance message kept in an ``invalid_grammar`` error (it may quote a whole grammar).
MAX_ERROR_CHARS = 600

_cache_lock = threading.Lock()
_cache: dict[tuple[int, int], tuple[Tokenizer, Any]] = {}
#: Compiled matchers, fresh: (id of the LLTokenizer, json_schema, grammar) -> LLMatcher.
_compiled: OrderedDict[tuple[int, str | None, str | None], Any] = OrderedDict()
#: How many compiled constraints are kept (least recently used dropped first).
COMPILED_CACHE_SIZE = 32
#: How many compilations happened (tests and the benchmark read it).
compilations = 0


def vocab_bytes(tok: Tokenizer, n_vocab: int) -> list[bytes]:
    """Each token's bytes as llguidance needs them: the piece's bytes, or 0xFF + its text for
    a control token (and a user-defined ``<...>`` token); ids beyond the tokenizer's
    vocabulary (padding rows of the output matrix) are empty."""
    out: list[bytes] = []
    for i in range(n_vocab):
        if i >= tok.n_vocab:
            out.append(b"")
            continue
        b = tok.token_bytes(i, special=True)
        attr = tok.attrs[i]
        if attr & ATTR_CONTROL or (attr & ATTR_USER_DEFINED and b.startswith(b"<") and b.endswith(b">")):
            b = b"\xff" + b
        out.append(b)
    return out


class _Wrapped:
    """The object ``llguidance.TokenizerWrapper`` reads: tokens, special ids, EOS, and a
    tokenize function (our tokenizer, no special parsing, no BOS)."""

    def __init__(self, tok: Tokenizer, n_vocab: int) -> None:
        self._tok = tok
        self.tokens = vocab_bytes(tok, n_vocab)
        self.special_token_ids = [i for i, b in enumerate(self.tokens) if b.startswith(b"\xff")]
        eog = sorted(t for t in tok.eog_ids if t < n_vocab)
        self.eos_token_id = tok.eos_id if tok.eos_id is not None else (eog[0] if eog else 0)
        self.bos_token_id = tok.bos_id

    def __call__(self, s: str | bytes) -> list[int]:
        text = s.decode("utf-8", errors="replace") if isinstance(s, bytes) else s
        return self._tok.tokenize(text, add_special=False, parse_special=False)


def ll_tokenizer(tok: Tokenizer, n_vocab: int) -> Any:
    """The (cached) ``llguidance.LLTokenizer`` of ``tok`` over ``n_vocab`` ids (the logits' size)."""
    import llguidance

    key = (id(tok), n_vocab)
    with _cache_lock:
        hit = _cache.get(key)
        if hit is not None and hit[0] is tok:
            return hit[1]
        w = _Wrapped(tok, n_vocab)
        eog = sorted(t for t in tok.eog_ids if t < n_vocab) or [w.eos_token_id]
        ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(w), n_vocab=n_vocab, eos_token=eog)
        _cache[key] = (tok, ll)
        return ll


def grammar_text(json_schema: str | None, grammar: str | None) -> str | None:
    """The llguidance grammar for a request's constraint (None: unconstrained).

    Raises:
        EngineError("invalid_grammar"): both given, or ``json_schema`` is not a JSON object.
    """
    import llguidance

    if json_schema is not None and grammar is not None:
        raise EngineError("invalid_grammar", "give at most one of json_schema and grammar")
    if json_schema is not None:
        try:
            schema = json.loads(json_schema)
        except json.JSONDecodeError as e:
            raise EngineError("invalid_grammar", f"json_schema is not valid JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise EngineError("invalid_grammar", "json_schema must be a JSON object (a schema)")
        try:
            return str(llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS))  # type: ignore[arg-type]
        except (ValueError, TypeError) as e:
            raise EngineError("invalid_grammar", f"invalid json_schema: {e}") from None
    if grammar is not None:
        if not grammar.strip():
            raise EngineError("invalid_grammar", "grammar is empty")
        if "::=" in grammar and not grammar.lstrip().startswith("{"):
            from llguidance.gbnf_to_lark import GbnfToLarkError, is_lark_syntax, gbnf_to_lark

            if not is_lark_syntax(grammar):  # llama.cpp's GBNF (root ::= ...): converted to Lark
                try:
                    grammar = gbnf_to_lark(grammar)
                except GbnfToLarkError as e:
                    raise EngineError("invalid_grammar", f"invalid GBNF grammar: {e}") from None
                except Exception as e:  # its rule resolution raises a bare Exception ("Rule 'foo' not
                    # found", "No 'root' rule found"): the client's grammar, not a server fault (was a 500)
                    raise EngineError("invalid_grammar", f"invalid GBNF grammar: {e}") from None
        return str(llguidance.LLMatcher.grammar_from_lark(grammar))
    return None


def _fresh(tok: Tokenizer, n_vocab: int, json_schema: str | None, grammar: str | None) -> Any:
    """The compiled, never-advanced matcher of a constraint (None: unconstrained), from the
    cache or compiled now. Raises EngineError("invalid_grammar") with llguidance's message
    (it names the unsupported schema keyword or the grammar line); a failure is not cached."""
    global compilations
    if json_schema is None and grammar is None:
        return None  # before llguidance's import: an unconstrained request never loads it (~16 ms, ~4 MiB)
    import llguidance

    ll = ll_tokenizer(tok, n_vocab)
    key = (id(ll), json_schema, grammar)
    with _cache_lock:
        hit = _compiled.get(key)
        if hit is not None:
            _compiled.move_to_end(key)
            return hit
    g = grammar_text(json_schema, grammar)
    assert g is not None
    m = llguidance.LLMatcher(ll, g, log_level=0)
    if m.is_error():
        err = str(m.get_error())
        if len(err) > MAX_ERROR_CHARS:
            err = err[:MAX_ERROR_CHARS] + f"... ({len(err) - MAX_ERROR_CHARS} more characters)"
        raise EngineError("invalid_grammar", f"invalid {'json_schema' if json_schema is not None else 'grammar'}: "
                          f"{err}")
    with _cache_lock:
        compilations += 1
        _compiled[key] = m
        _compiled.move_to_end(key)
        while len(_compiled) > COMPILED_CACHE_SIZE:
            _compiled.popitem(last=False)
    return m


def check(tok: Tokenizer, n_vocab: int, json_schema: str | None, grammar: str | None) -> list[str]:
    """Compile the request's constraint now (kept for its sequence, see :func:`_fresh`) and
    return what it set aside: llguidance's warnings, e.g. ``Unimplemented keys:
    ["propertyNames"]`` for a keyword left out (:data:`JSON_OPTIONS` ``lenient``).
    Raises EngineError("invalid_grammar") with llguidance's message (it names the
    grammar line or what cannot compile), cut to :data:`MAX_ERROR_CHARS`."""
    m = _fresh(tok, n_vocab, json_schema, grammar)
    if m is None:
        return []
    return sorted({str(w) for w in m.get_grammar_warnings()})


class Constraint:
    """One sequence's constraint. Build with :meth:`create`.

    ``mask_ms`` accumulates the time spent computing masks (ms) and ``n_masks`` counts
    them, for the benchmark figure "mask cost per token"."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        self._m = matcher
        self.n_vocab = n_vocab
        n_words = (n_vocab + 31) // 32
        self._bits = np.zeros(n_words, dtype=np.int32)
        self.mask_ms = 0.0
        self.n_masks = 0

    @classmethod
    def create(cls, tok: Tokenizer, n_vocab: int, json_schema: str | None, grammar: str | None) -> Constraint | None:
        """The constraint of a request (None when it has none): a copy of the matcher
        :func:`check` compiled (compiled now if it is not cached). Raises EngineError("invalid_grammar")."""
        fresh = _fresh(tok, n_vocab, json_schema, grammar)
        if fresh is None:
            return None
        with _cache_lock:
            m = fresh.deep_copy()
        return cls(m, n_vocab)

    def allowed(self) -> np.ndarray:
        """Boolean ``[n_vocab]``: the tokens the constraint allows next (EOS ids once it accepts)."""
        t0 = time.perf_counter()
        self._m.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)
        mask = np.unpackbits(self._bits.view(np.uint8), bitorder="little")[: self.n_vocab].view(np.bool_)
        self.mask_ms += (time.perf_counter() - t0) * 1000.0
        self.n_masks += 1
        return mask

    def advance(self, token: int) -> None:
        """Feed the chosen token. A token the mask did not allow puts the matcher in its
        error state; :attr:`done` is then True (the sequence ends rather than go on unconstrained)."""
        self._m.consume_token(token)

    @property
    def done(self) -> bool:
        """Nothing may follow: the grammar is complete (or the matcher failed)."""
        return bool(self._m.is_stopped() or self._m.is_error())

    @property
    def error(self) -> str | None:
        return str(self._m.get_error()) if self._m.is_error() else None

"""Constrained decoding: a row's next token kept to what a JSON schema, a regex or a Lark
grammar allows, through llguidance.

A request's grammar is a :data:`GrammarSpec`, ``(kind, text)``: ``("json_schema", schema
JSON)``, ``("json_object", "")`` (any JSON object: OpenAI's JSON mode), ``("regex",
pattern)`` or ``("lark", grammar)``. Every sequence of the request gets its own
:class:`RowGrammar`, a matcher that follows its tokens: before each choice it bars every
token the grammar does not allow next (their logits go to -inf, after the penalties and
before the sampling warpers, as a logits processor), and after each choice it takes the
token. Once the grammar is complete it allows only the end-of-sequence tokens, so the
sequence ends there. Rows join and leave a running batch with their matchers; batch mates
without a grammar pay nothing.

JSON comes out compact (no whitespace between tokens), so that a model cannot fill its
answer with spaces. The tokenizer's llguidance view is built once per tokenizer (about a
second for a 50k vocabulary).

    >>> grammars = Grammars(tokenizer, eos_token_ids={2})
    >>> row = grammars.row(("regex", "[0-9]{2}"))
    >>> scores = row(None, torch.zeros(1, len(tokenizer)))
    >>> allowed = [t for t in range(len(tokenizer)) if scores[0, t] == 0]
    >>> all(tokenizer.decode([t]).isdigit() for t in allowed)
    True
"""

from __future__ import annotations

import json
import threading
import weakref
from typing import AbstractSet, Any, Optional, Tuple

import torch
from transformers import LogitsProcessor

#: ``(kind, text)``: see the module docstring.
GrammarSpec = Tuple[str, str]
KINDS = ("json_schema", "json_object", "regex", "lark")
#: JSON without whitespace between its tokens (llguidance's default allows any amount).
_COMPACT = {"whitespace_flexible": False}
#: Each bit's place in an int32 word of llguidance's bitmask (made once: the mask is
#: unpacked for every constrained row at every step).
_BITS = torch.arange(32, dtype=torch.int32)


class GrammarError(ValueError):
    """A grammar that cannot be used: a schema llguidance cannot compile, a bad regex."""


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar of ``spec``; raises :class:`GrammarError` for a spec that is
    not one (checking the grammar itself is :meth:`Grammars.check`'s).

    >>> json.loads(grammar_text(("regex", "a+")))["grammars"][0]["lark_grammar"]
    'start: /a+/'
    """
    import llguidance

    kind, text = spec
    if kind == "json_schema":
        try:
            schema = json.loads(text) if isinstance(text, str) else text
        except ValueError as error:
            raise GrammarError(f"the JSON schema is not JSON: {error}") from None
        if not isinstance(schema, dict):
            raise GrammarError("the JSON schema must be a JSON object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=_COMPACT)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"},
                                                             defaults=_COMPACT)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(text)
    if kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(text)
    raise GrammarError(f"grammar kind must be one of {', '.join(KINDS)}, got {kind!r}")


class Grammars:
    """The grammars of one model: its tokenizer as llguidance sees it (built on first use,
    once per tokenizer object), and a matcher per row.

    ``eos_token_ids`` are the ids that end a sequence (a complete grammar allows only
    them); ``vocab_size`` the width of the model's logits, which may exceed the tokenizer's
    vocabulary (the extra ids are never allowed).
    """

    _views: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
    _lock = threading.Lock()

    def __init__(self, tokenizer: Any, eos_token_ids: AbstractSet[int] = frozenset(),
                 vocab_size: Optional[int] = None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = sorted(int(i) for i in eos_token_ids)
        self.vocab_size = vocab_size or len(tokenizer)

    def _view(self) -> Any:
        import llguidance.hf

        key = (tuple(self.eos_token_ids), self.vocab_size)
        with self._lock:
            views = self._views.setdefault(self.tokenizer, {})
            if key not in views:
                views[key] = llguidance.hf.from_tokenizer(
                    self.tokenizer, n_vocab=max(self.vocab_size, len(self.tokenizer)),
                    eos_token=self.eos_token_ids or None)
            return views[key]

    def check(self, spec: GrammarSpec) -> None:
        """Raise :class:`GrammarError` with llguidance's words if ``spec`` cannot be used."""
        import llguidance

        error = llguidance.LLMatcher.validate_grammar(grammar_text(spec), self._view())
        if error:
            raise GrammarError(error.strip())

    def row(self, spec: GrammarSpec) -> "RowGrammar":
        """A new matcher for one sequence."""
        import llguidance

        matcher = llguidance.LLMatcher(self._view(), grammar_text(spec), log_level=0)
        if matcher.is_error():
            raise GrammarError(matcher.get_error())
        return RowGrammar(matcher)


class GrammarsUnavailable:
    """What checks grammars where llguidance is not installed: every one is refused, saying
    so (the serve extra installs it; a djl-serving image needs it in requirements.txt)."""

    def check(self, spec: GrammarSpec) -> None:
        raise GrammarError("constrained decoding needs the llguidance package, which this "
                           "server does not have (pip install llguidance)")


class RowGrammar(LogitsProcessor):
    """One sequence's matcher, as a logits processor (it never reads the input ids: the
    matcher follows the tokens through :meth:`advance`)."""

    def __init__(self, matcher: Any) -> None:
        self.matcher = matcher

    def __call__(self, input_ids: Any, scores: torch.Tensor) -> torch.Tensor:
        vocab = scores.shape[-1]
        words = (vocab + 31) // 32
        bitmask = torch.empty(words, dtype=torch.int32)
        self.matcher.unsafe_compute_mask_ptr(bitmask.data_ptr(), words * 4)
        if self.matcher.is_error():
            raise GrammarError(f"the grammar failed: {self.matcher.get_error()}")
        allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).flatten()[:vocab].bool()
        return scores.masked_fill(~allowed.to(scores.device), float("-inf"))

    def advance(self, token_id: int) -> None:
        """The sequence took ``token_id``; raises :class:`GrammarError` if the grammar did
        not allow it (it never does under this processor's mask)."""
        if not self.matcher.consume_token(int(token_id)):
            raise GrammarError(f"token {token_id} broke the grammar: {self.matcher.get_error()}")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and allows nothing more (only the end of the sequence)."""
        return bool(self.matcher.is_stopped() or self.matcher.is_accepting())

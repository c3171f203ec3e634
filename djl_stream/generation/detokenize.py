"""Incremental detokenization: token ids in, text pieces out, one sequence at a time.

Streaming text cannot be ``decode(ids[-1:])`` per token: byte-level tokens split UTF-8
characters (emoji, CJK) across tokens, and SentencePiece-style decoders drop or keep a
leading space depending on what came before. :class:`IncrementalDetokenizer` decodes a
short window of recent tokens and emits only the text that is new and final, so the
pieces always add up to what ``tokenizer.decode`` returns for the whole sequence.

Example::

    >>> detok = IncrementalDetokenizer(tokenizer)
    >>> [detok.step(t) for t in tokenizer.encode("Hello world")]
    ['Hello', ' world']
    >>> detok.finish(), detok.text
    ('', 'Hello world')
"""

from __future__ import annotations

import inspect
import json
import logging
import weakref
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Protocol, Sequence

from tokenizers import Tokenizer

try:
    from tokenizers.decoders import DecodeStream
except ImportError:  # tokenizers < 0.21 (the Neuron image's 0.20)
    DecodeStream = None

logger = logging.getLogger(__name__)


def streams_id_lists(decode_stream: Any) -> bool:
    """Whether ``decode_stream`` is a ``DecodeStream`` this module can drive.

    Byte runs are fed as one list of ids, which ``DecodeStream.step`` accepts from
    tokenizers 0.22 on, the release whose constructor also gained ``ids``; 0.21's takes
    only ``skip_special_tokens`` and single ids. The constructor's signature is what is
    asked, not the version.

    >>> class Old:
    ...     def __init__(self, skip_special_tokens): ...
    >>> streams_id_lists(Old), streams_id_lists(None)
    (False, False)
    """
    if decode_stream is None:
        return False
    try:
        return "ids" in inspect.signature(decode_stream).parameters
    except (TypeError, ValueError):
        return False


#: Whether the installed tokenizers' ``DecodeStream`` is used; without it every tokenizer
#: takes the prefix/read-offset method (over the Rust backend's ``decode`` where there is one).
HAS_DECODE_STREAM = streams_id_lists(DecodeStream)

__all__ = ["IncrementalDetokenizer", "PROMPT_CONTEXT"]

#: Prompt tokens decoded in front of the output. A handful is enough for the decoder to
#: see the word boundary (SentencePiece's "▁"), the byte run or the character that the
#: first generated token continues.
PROMPT_CONTEXT = 6

REPLACEMENT = "\ufffd"


@dataclass(frozen=True)
class _HoldRules:
    """Which ids are fed to the window only together with a later token.

    ``ByteFallback`` decoders (Llama, Mistral) turn a run of ``<0xHH>`` tokens into text
    only if the *whole run* is valid UTF-8, otherwise into one U+FFFD per byte. A byte
    appended later can therefore turn an emoji already decoded into "����", so no text
    of an open run is final before a token that is not a byte ends the run. Tokens that
    decode drops (skipped specials, unknown ids) do not end a run: decode removes them
    before the byte-fallback step sees the run.
    """

    byte_ids: frozenset[int] = frozenset()
    dropped_ids: frozenset[int] = frozenset()
    vocab_size: int | None = None

    def ends_run(self, token_id: int) -> bool:
        if token_id in self.byte_ids or token_id in self.dropped_ids:
            return False
        return self.vocab_size is None or 0 <= token_id < self.vocab_size


_NO_HOLDING = _HoldRules()
_BYTE_TOKENS = tuple(f"<0x{b:02X}>" for b in range(256))


def _decoder_types(state: Any) -> set[str]:
    """All ``type`` names in a serialized decoder (``Sequence`` nests them)."""
    found: set[str] = set()
    if isinstance(state, dict):
        if isinstance(state.get("type"), str):
            found.add(state["type"])
        for value in state.values():
            found |= _decoder_types(value)
    elif isinstance(state, list):
        for value in state:
            found |= _decoder_types(value)
    return found


# Per-tokenizer facts are computed once, not per request; weak keys let tokenizers go.
_RULES_CACHE: weakref.WeakKeyDictionary[Any, dict[bool, _HoldRules]] = weakref.WeakKeyDictionary()


def _rules_for_backend(backend: Tokenizer, skip_special_tokens: bool) -> _HoldRules:
    decoder = backend.decoder
    if decoder is None or "ByteFallback" not in _decoder_types(json.loads(decoder.__getstate__())):
        return _NO_HOLDING
    byte_ids = {
        token_id
        for token in _BYTE_TOKENS + tuple(t.lower() for t in _BYTE_TOKENS)
        if (token_id := backend.token_to_id(token)) is not None
    }
    dropped = (
        {i for i, added in backend.get_added_tokens_decoder().items() if added.special}
        if skip_special_tokens
        else set()
    )
    return _HoldRules(
        frozenset(byte_ids),
        frozenset(dropped),
        backend.get_vocab_size(with_added_tokens=True),
    )


def _rules_for_slow(tokenizer: Any, skip_special_tokens: bool) -> _HoldRules:
    # A Python tokenizer's decoder cannot be inspected; holding its "<0xHH>" pieces is
    # always safe (it only delays them) and exact for SentencePiece byte fallback.
    to_ids = getattr(tokenizer, "convert_tokens_to_ids", None)
    to_tokens = getattr(tokenizer, "convert_ids_to_tokens", None)
    if to_ids is None or to_tokens is None:
        return _NO_HOLDING
    byte_ids = set()
    for token in _BYTE_TOKENS:
        token_id = to_ids(token)
        if isinstance(token_id, int) and to_tokens(token_id) == token:
            byte_ids.add(token_id)
    if not byte_ids:
        return _NO_HOLDING
    dropped = set(getattr(tokenizer, "all_special_ids", ())) if skip_special_tokens else set()
    try:
        vocab_size = len(tokenizer)
    except TypeError:
        vocab_size = None
    return _HoldRules(frozenset(byte_ids), frozenset(dropped), vocab_size)


def _cached_rules(key: Any, skip: bool, compute: Callable[[], _HoldRules]) -> _HoldRules:
    try:
        per_key = _RULES_CACHE.setdefault(key, {})
    except TypeError:  # not weak-referenceable: compute every time
        return compute()
    if skip not in per_key:
        per_key[skip] = compute()
    return per_key[skip]


class _Window(Protocol):
    """Decodes a short window of recent ids and returns only new, final text."""

    def feed(self, ids: int | list[int]) -> str | None: ...

    def decode(self, ids: list[int]) -> str: ...

    def reset(self) -> None: ...


class _StreamWindow:
    """The window kept by ``tokenizers.decoders.DecodeStream`` (Rust, two small decodes
    per token)."""

    def __init__(self, backend: Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = backend
        self._skip = skip_special_tokens
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)

    def feed(self, ids: int | list[int]) -> str | None:
        return self._stream.step(self._backend, ids)

    def decode(self, ids: list[int]) -> str:
        return self._backend.decode(ids, skip_special_tokens=self._skip)

    def reset(self) -> None:
        self._stream = DecodeStream(skip_special_tokens=self._skip)


class _InvalidPrefix(ValueError):
    """The window decoded to text that does not extend the text it already returned."""


class _OffsetWindow:
    """The prefix/read-offset method, for tokenizers without a Rust backend or where the
    installed tokenizers has no usable ``DecodeStream`` (see :func:`streams_id_lists`).

    ``_ids`` is the window: its first ``_read`` ids are the tokens of the last step that
    returned text, decoding to ``_prefix_text``; they are the context the newer ids are
    decoded in, and only what the newer ids add to that text is returned.
    """

    def __init__(self, tokenizer: Any, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip = skip_special_tokens
        self.reset()

    def feed(self, ids: int | list[int]) -> str | None:
        if isinstance(ids, int):
            self._ids.append(ids)
        else:
            self._ids.extend(ids)
        text = self.decode(self._ids)
        if len(text) <= len(self._prefix_text) or text.endswith(REPLACEMENT):
            return None
        if not text.startswith(self._prefix_text):
            raise _InvalidPrefix(f"expected {self._prefix_text!r} at the start of {text!r}")
        piece = text[len(self._prefix_text):]
        # Keep only the tokens of this step as the next context, so the window stays short.
        del self._ids[: self._read]
        self._read = len(self._ids)
        self._prefix_text = self.decode(self._ids)
        return piece

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip)

    def reset(self) -> None:
        self._ids: list[int] = []
        self._read = 0
        self._prefix_text = ""


def _common_prefix_len(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class IncrementalDetokenizer:
    """Turns one sequence's generated token ids into text pieces as they arrive.

    ``tokenizer`` is a transformers tokenizer (its Rust ``backend_tokenizer`` drives
    :class:`tokenizers.decoders.DecodeStream`, or the prefix/offset method where
    :data:`HAS_DECODE_STREAM` is false), a raw :class:`tokenizers.Tokenizer`, or any
    object with ``decode(ids, skip_special_tokens=...)`` (decoded with the prefix/offset
    method). ``prompt_ids``: the last :data:`PROMPT_CONTEXT` of them are decoded in front
    of the output, so the first piece keeps the space a SentencePiece decoder would strip
    at the start of a text.

    Guarantees, for any ids (``decode`` is ``tokenizer.decode(..., skip_special_tokens)``
    without clean-up of spaces, ``tail`` the last :data:`PROMPT_CONTEXT` prompt ids)::

        "".join(step(t) for t in ids) + finish()
            == decode(tail + ids)[k:]  with k = common_prefix_len(decode(tail + ids), decode(tail))

    which is ``decode(ids)`` without a prompt, and ``decode(tail + ids)[len(decode(tail)):]``
    whenever the prompt's text is a prefix of the whole text. Every piece from
    :meth:`step` is final: it never contains a U+FFFD that is only half a character (it is
    held back until the character completes), and later tokens never change it. With
    ``ByteFallback`` decoders a run of ``<0xHH>`` tokens is emitted when the first
    non-byte token after it arrives (or at :meth:`finish`), because one more byte can still
    turn the whole run into U+FFFDs.

    Example::

        >>> detok = IncrementalDetokenizer(tokenizer, prompt_ids=tokenizer.encode("Say hi:"))
        >>> pieces = [detok.step(t) for t in tokenizer.encode(" 👋 hi")]
        >>> "" in pieces, "".join(pieces) + detok.finish()
        (True, ' 👋 hi')
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int] = (),
        skip_special_tokens: bool = True,
    ) -> None:
        backend = tokenizer
        if not isinstance(backend, Tokenizer):
            backend = getattr(tokenizer, "backend_tokenizer", None)
        skip = skip_special_tokens
        self._window: _Window
        if isinstance(backend, Tokenizer):
            self._window = (_StreamWindow(backend, skip) if HAS_DECODE_STREAM
                            else _OffsetWindow(backend, skip))
            self._rules = _cached_rules(backend, skip, lambda: _rules_for_backend(backend, skip))
        else:
            self._window = _OffsetWindow(tokenizer, skip)
            self._rules = _cached_rules(tokenizer, skip, lambda: _rules_for_slow(tokenizer, skip))
        self._prompt = [int(t) for t in prompt_ids[-PROMPT_CONTEXT:]]
        self._ids: list[int] = []
        self._held: list[int] = []
        # The context a restarted window starts from: the last ids given to the window up
        # to the last one that released text, and every id given since (their text is not
        # out yet: a byte of a character, skipped special tokens between, ...; cut to the
        # last few, a restart lost the bytes they held).
        self._recent: deque[int] = deque(maxlen=PROMPT_CONTEXT)
        self._unreleased: list[int] = []
        self._pieces: list[str] = []
        self._text: str | None = ""
        self._finished = False
        self._restarting = False
        self._prompt_text = self._window.decode(self._prompt) if self._prompt else ""
        # Whatever part of the prompt's text is not final yet (a half character, an open
        # byte run) comes out of the window again in front of the new text; ``_echo`` is
        # that part, dropped from the output as far as the new text repeats it.
        self._echo = self._prime(self._prompt)

    @property
    def text(self) -> str:
        """All text emitted so far by :meth:`step` and :meth:`finish`."""
        if self._text is None:
            self._text = "".join(self._pieces)
            self._pieces = [self._text] if self._text else []
        return self._text

    @property
    def finished(self) -> bool:
        """Whether :meth:`finish` was called."""
        return self._finished

    def step(self, token_id: int) -> str:
        """Adds one generated token; returns the text it completes ("" if none yet).

        Example::

            >>> detok = IncrementalDetokenizer(tokenizer)
            >>> [detok.step(t) for t in tokenizer.encode("🙂")]  # two byte-level tokens
            ['', '🙂']
        """
        if self._finished:
            raise RuntimeError("step() after finish()")
        token_id = int(token_id)
        self._ids.append(token_id)
        piece = self._feed(token_id)
        if self._echo and piece:
            piece = self._drop_echo(piece)
        if piece:
            self._pieces.append(piece)
            self._text = None
        return piece

    def finish(self) -> str:
        """Ends the sequence; returns the text still held back (an open byte run, ...).
        Later calls return "".

        A sequence cut off inside a character (by ``max_new_tokens``) would end in U+FFFD
        for the bytes it has of that character; they are not text, so the tail drops
        every trailing U+FFFD, and the text, streamed or not, never ends in one."""
        if self._finished:
            return ""
        self._finished = True
        # One full decode per sequence makes the total exact whatever the window did.
        full = self._window.decode(self._prompt + self._ids) if self._prompt or self._ids else ""
        expected = full[_common_prefix_len(full, self._prompt_text):]
        emitted = self.text
        if not expected.startswith(emitted):
            logger.warning("streamed text %r diverged from the decoded text %r", emitted, expected)
            return ""
        tail = expected[len(emitted):].rstrip(REPLACEMENT)
        if tail:
            self._pieces.append(tail)
            self._text = None
        return tail

    def _prime(self, context: list[int]) -> str:
        """Feeds ``context`` to a fresh window; returns its text that is not final yet."""
        final = "".join(self._feed(t) for t in context)
        text = self._window.decode(context) if context else ""
        return text[len(final):] if text.startswith(final) else text

    def _feed(self, token_id: int) -> str:
        rules = self._rules
        if rules.byte_ids:
            if token_id in rules.byte_ids or (self._held and not rules.ends_run(token_id)):
                self._held.append(token_id)
                return ""
            if self._held:
                batch: int | list[int] = self._held + [token_id]
                self._held = []
            else:
                batch = token_id
        else:
            batch = token_id
        try:
            piece = self._window.feed(batch) or ""
        except Exception as error:  # DecodeStream: "Invalid prefix encountered"
            return self._restart(batch, error)  # feeds (and records) the batch again
        if piece and self._unreleased:  # their text is out now, with this piece
            self._recent.extend(self._unreleased)
            self._unreleased.clear()
        record = self._recent if piece else self._unreleased
        if isinstance(batch, int):
            record.append(batch)
        else:
            record.extend(batch)
        return piece

    def _restart(self, batch: int | list[int], error: Exception) -> str:
        """Starts a fresh window after the last few ids before ``batch`` and feeds it."""
        if self._restarting:
            raise error
        logger.debug("restarting the decode window: %s", error)
        new = [batch] if isinstance(batch, int) else batch
        context = list(self._recent) + self._unreleased
        self._restarting = True
        try:
            self._window.reset()
            self._held = []
            self._recent.clear()
            self._unreleased.clear()
            # What the context leaves unfinished was not emitted yet either, so it is
            # not an echo: the fresh window emits it once it is final, as the old would.
            self._prime(context)
            return "".join(self._feed(t) for t in new)
        except Exception:
            # Start clean without context; finish() still makes the total exact when the
            # text emitted so far is right.
            logger.warning("decode window failed again after a restart", exc_info=True)
            self._window.reset()
            self._held = []
            self._recent.clear()
            self._unreleased.clear()
            self._echo = ""
            return ""
        finally:
            self._restarting = False

    def _drop_echo(self, piece: str) -> str:
        n = _common_prefix_len(piece, self._echo)
        if n == len(self._echo) or n < len(piece):
            self._echo = ""  # the echo is used up or the text went another way
        else:
            self._echo = self._echo[n:]
        return piece[n:]

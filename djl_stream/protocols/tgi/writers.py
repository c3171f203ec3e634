"""TGI's answers: token records, the server-sent events of a stream, the JSON document.

A token record is ``{"id", "text", "logprob", "special"}``. Its ``text`` is what the token
released (:attr:`Generation.text`): ``""`` while a character or a possible stop string is
held back, and never a special token's own spelling, so that the texts of a stream add up
to ``generated_text`` exactly (TGI writes e.g. ``"</s>"`` for the end-of-sequence token,
which clients then filter out by ``special``). ``logprob`` is the log-softmax of the
model's raw logits, ``null`` where the engine reports none.

A stream is one event per generated token, ``data:{json}\\n\\n`` as TGI's router writes
it; the last carries ``generated_text`` and, with ``details``, ``{"finish_reason",
"generated_tokens", "seed", "input_length"}``:

    >>> encoder = TgiStreamEncoder(TgiAnswer("Hi", details=True), input_length=3)
    >>> encoder.step(Step.of([Generation(0, 42, " Paris", logprob=-0.5)]))
    b'data:{"index":1,"token":{"id":42,"text":" Paris","logprob":-0.5,"special":false},"generated_text":null,"details":null}\\n\\n'
    >>> encoder.step(Step.of([Generation(0, 2, "", "eos", logprob=-0.1, special=True)]))[:80]
    b'data:{"index":2,"token":{"id":2,"text":"","logprob":-0.1,"special":true},"genera'
    >>> encoder.generated_text
    ' Paris'
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable, Collection, Dict, List, Optional, Sequence

from djl_stream.generation.step import Generation, Step
from djl_stream.protocols.protocol import StreamEncoder
from djl_stream.protocols.tgi.request import TgiAnswer

#: Our finish reasons in TGI's words.
FINISH_REASONS = {"eos": "eos_token", "length": "length", "stop": "stop_sequence"}
EVENT_STREAM = "text/event-stream"


class Vocabulary:
    """How a token that was *not* chosen is written (``top_tokens``): its own text and
    whether it is special. Built from a tokenizer with :meth:`of`.

    >>> vocabulary = Vocabulary(lambda token_id: f"<{token_id}>", special_ids={2})
    >>> vocabulary.token(2, -1.5)
    {'id': 2, 'text': '<2>', 'logprob': -1.5, 'special': True}
    """

    def __init__(self, decode: Callable[[int], str], special_ids: Collection[int] = ()) -> None:
        self.decode = decode
        self.special_ids = frozenset(special_ids)

    @classmethod
    def of(cls, tokenizer: Any) -> "Vocabulary":
        from djl_stream.generation.sequence import special_token_ids

        def decode(token_id: int) -> str:
            return tokenizer.decode([token_id], skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)

        return cls(decode, special_token_ids(tokenizer))

    def token(self, token_id: int, logprob: Optional[float]) -> Dict[str, Any]:
        return token_record(token_id, self.decode(token_id), logprob,
                            token_id in self.special_ids)


def _finite(value: Optional[float]) -> Optional[float]:
    # -inf is not JSON; a token the model rules out entirely has no useful score anyway.
    return value if value is not None and math.isfinite(value) else None


def token_record(token_id: Optional[int], text: str, logprob: Optional[float],
                 special: bool) -> Dict[str, Any]:
    """TGI's ``Token``.

    >>> token_record(7, "a", None, False)
    {'id': 7, 'text': 'a', 'logprob': None, 'special': False}
    """
    return {"id": token_id, "text": text, "logprob": _finite(logprob), "special": special}


def generation_token(generation: Generation) -> Dict[str, Any]:
    """The token record of the token a :class:`Generation` chose."""
    return token_record(generation.token_id, generation.text, generation.logprob,
                        generation.special)


def top_token_records(generation: Generation, vocabulary: Optional[Vocabulary]
                      ) -> List[Dict[str, Any]]:
    """The most likely alternatives of a token, most likely first (TGI's ``top_tokens``)."""
    if vocabulary is None:
        return []
    return [vocabulary.token(token_id, logprob) for token_id, logprob in generation.top_logprobs]


def json_bytes(value: Any) -> bytes:
    """Compact JSON, UTF-8 unescaped, as TGI's serde_json writes it."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def event(value: Any) -> bytes:
    """One server-sent event, as TGI's router (axum) frames it."""
    return b"data:" + json_bytes(value) + b"\n\n"


def error_record(message: str, error_type: str) -> Dict[str, str]:
    """TGI's ``ErrorResponse``."""
    return {"error": message, "error_type": error_type}


class _Token:
    """One generated token as the writers need it, from a :class:`Generation`, or from a
    step's text alone where the engine reports no tokens (a custom engine's plain lists:
    no id, no score, and no finish reason until the stream ends)."""

    __slots__ = ("record", "top", "finish_reason")

    def __init__(self, record: Dict[str, Any], top: List[Dict[str, Any]],
                 finish_reason: Optional[str]) -> None:
        self.record, self.top, self.finish_reason = record, top, finish_reason

    @classmethod
    def of(cls, step: Step, vocabulary: Optional[Vocabulary], top_n: int) -> Optional["_Token"]:
        generation = step.generations[0] if step.generations else None
        if generation is None:
            text = step[0] if len(step) else ""
            return cls(token_record(None, text, None, False), [], None) if text else None
        top = top_token_records(generation, vocabulary) if top_n else []
        return cls(generation_token(generation), top,
                   FINISH_REASONS.get(generation.finish_reason or "", None))


def _is_stop_string_token(token: _Token) -> bool:
    """The token that completed a stop string and added no text of its own: the stop string
    is no part of the answer, so neither is this token (TGI's details neither list it nor
    count it)."""
    return token.finish_reason == "stop_sequence" and not token.record["text"]


def _guessed_finish_reason(generated: int, max_new_tokens: int) -> str:
    return "length" if generated >= max_new_tokens else "eos_token"


class TgiStreamEncoder(StreamEncoder):
    """One request's ``/generate_stream`` answer: one event per token, the last one with
    ``generated_text`` (and ``details``). See the module docstring.

    Steps of an engine without per-token detail are held back one step, since only the
    end of the stream tells which of them was the last.
    """

    content_type = EVENT_STREAM

    def __init__(self, answer: TgiAnswer, input_length: int, *,
                 vocabulary: Optional[Vocabulary] = None, max_new_tokens: int = 0) -> None:
        self.answer = answer
        self.input_length = input_length
        self.vocabulary = vocabulary
        self.max_new_tokens = max_new_tokens
        self.index = 0
        self.pieces: List[str] = []
        self.finished = False
        self._held: Optional[_Token] = None

    @property
    def generated_text(self) -> str:
        return "".join(self.pieces)

    def step(self, step: Step) -> bytes:
        token = _Token.of(step, self.vocabulary, self.answer.top_n_tokens)
        if token is None or self.finished:
            return b""
        if token.record["id"] is None:  # no per-token detail: hold it until the next step
            held, self._held = self._held, token
            return self._event(held) if held is not None else b""
        return self._event(token)

    def end(self) -> bytes:
        if self._held is not None:
            held, self._held = self._held, None
            held.finish_reason = _guessed_finish_reason(self.index + 1, self.max_new_tokens)
            return self._event(held)
        if not self.finished:
            # TGI's own words for a stream that ended without its last token
            return event(error_record("Incomplete generation stream",
                                      "incomplete_generation_stream"))
        return b""

    def error(self, message: str) -> bytes:
        return event(error_record(message, "generation"))

    def _event(self, token: _Token) -> bytes:
        self.index += 1
        self.pieces.append(token.record["text"])
        record: Dict[str, Any] = {"index": self.index, "token": token.record}
        if token.top:
            record["top_tokens"] = token.top
        last = token.finish_reason is not None
        record["generated_text"] = None
        record["details"] = None
        if last:
            self.finished = True
            text = self.generated_text
            record["generated_text"] = (self.answer.inputs + text
                                        if self.answer.return_full_text else text)
            if self.answer.details:
                # (the event itself must still carry the end; its token is not counted)
                counted = self.index - 1 if _is_stop_string_token(token) else self.index
                record["details"] = {"finish_reason": token.finish_reason,
                                     "generated_tokens": counted,
                                     "seed": self.answer.seed,
                                     "input_length": self.input_length}
        return event(record)


def generate_response(answer: TgiAnswer, steps: Sequence[Step], *,
                      vocabulary: Optional[Vocabulary] = None,
                      max_new_tokens: int = 0) -> Any:
    """``/generate``'s JSON answer from every step of one generation: ``{"generated_text"}``
    and, with ``details``, ``{"finish_reason", "generated_tokens", "seed", "prefill": [],
    "tokens", "top_tokens"?}``; wrapped in a list for ``POST /``.

    >>> steps = [Step.of([Generation(0, 5, "Hello")]), Step.of([Generation(0, 6, "!", "length")])]
    >>> generate_response(TgiAnswer("Hi"), steps)
    {'generated_text': 'Hello!'}
    >>> generate_response(TgiAnswer("Hi", details=True), steps)["details"]["finish_reason"]
    'length'
    """
    tokens = [t for t in (_Token.of(step, vocabulary, answer.top_n_tokens) for step in steps)
              if t is not None]
    text = "".join(t.record["text"] for t in tokens)
    body: Dict[str, Any] = {"generated_text": answer.inputs + text if answer.return_full_text
                            else text}
    if answer.details:
        finish_reason = next((t.finish_reason for t in reversed(tokens) if t.finish_reason),
                             None) or _guessed_finish_reason(len(tokens), max_new_tokens)
        if tokens and _is_stop_string_token(tokens[-1]):
            tokens = tokens[:-1]
        details: Dict[str, Any] = {"finish_reason": finish_reason,
                                   "generated_tokens": len(tokens),
                                   "seed": answer.seed,
                                   "prefill": [],
                                   "tokens": [t.record for t in tokens]}
        if answer.top_n_tokens:
            details["top_tokens"] = [t.top for t in tokens]
        body["details"] = details
    return [body] if answer.as_list else body

"""What OpenAI clients read back: choices built from decode steps, chunks, bodies, errors.

:class:`Choices` follows each choice of one request through the engine's
:class:`~djl_stream.generation.step.Step`\\ s: its text, its token count, why it finished,
and its tokens' log-probabilities. The chat and completions writers
(:mod:`djl_stream.protocols.openai.protocol`) render what it collects in their two shapes.

    >>> from djl_stream.generation.step import Generation, Step
    >>> choices = Choices(1)
    >>> updates = choices.feed(Step.of([Generation(0, 42, " Paris", "eos")]))
    >>> [(u.index, u.text, u.finish_reason) for u in updates]
    [(0, ' Paris', 'stop')]
    >>> choices.usage([7])
    {'prompt_tokens': 7, 'completion_tokens': 1, 'total_tokens': 8}
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import json
import re
import time
import uuid
from typing import Any, Dict, List, Optional, Sequence, Tuple

from djl_stream.generation.step import Generation, Step

#: The engine's finish reasons in OpenAI's words: the model's end of sequence and a stop
#: string are both ``stop``.
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}
#: A log-probability JSON can carry (``-inf`` cannot be written as JSON); vLLM's floor too.
MIN_LOGPROB = -9999.0
SSE_CONTENT_TYPE = "text/event-stream"
SSE_DONE = b"data: [DONE]\n\n"


def new_id(prefix: str) -> str:
    """A fresh answer id, ``chatcmpl-…`` or ``cmpl-…`` as OpenAI's look.

    >>> new_id("cmpl").startswith("cmpl-")
    True
    """
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """OpenAI's ``created``: Unix seconds."""
    return int(time.time())


def sse(record: Any) -> bytes:
    """One server-sent event carrying ``record`` as compact JSON.

    >>> sse({"a": "é"})
    b'data: {"a":"\\xc3\\xa9"}\\n\\n'
    """
    text = json.dumps(record, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    return b"data: " + text.encode("utf-8") + b"\n\n"


# ---------------------------------------------------------------------------------------
# Tokens as text and bytes


class TokenText:
    """Each token id as the text OpenAI's logprobs show (``token``) and its UTF-8 ``bytes``.

    A token can hold part of a character (byte-level BPE splits an emoji over several
    tokens). Its ``bytes`` are then the token's own, read from the byte-level alphabet or a
    SentencePiece byte-fallback piece (``<0xE4>``), so that a client can join the bytes of
    consecutive tokens into the character; and its ``token`` text is written as OpenAI
    writes such a token, ``bytes:`` and the bytes escaped (``bytes:\\xf0\\x9f``), where
    decoding would have given U+FFFD in place of what the token holds.

    >>> from transformers import AutoTokenizer                      # doctest: +SKIP
    >>> text = TokenText(AutoTokenizer.from_pretrained("model"))    # doctest: +SKIP
    >>> text.token(7042), text.bytes(7042)                          # doctest: +SKIP
    (' Paris', [32, 80, 97, 114, 105, 115])
    """

    _BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    @functools.lru_cache(maxsize=65536)
    def token(self, token_id: int) -> str:
        text = self._decoded(token_id)
        if "\ufffd" in text:
            raw = self._raw_bytes(token_id)
            if raw is not None and _not_utf8(raw):
                return "bytes:" + "".join(f"\\x{byte:02x}" for byte in raw)
        return text

    @functools.lru_cache(maxsize=65536)
    def bytes(self, token_id: int) -> List[int]:
        text = self._decoded(token_id)
        if "\ufffd" in text:
            raw = self._raw_bytes(token_id)
            if raw is not None:
                return list(raw)
        return list(text.encode("utf-8"))

    def _decoded(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)

    def _raw_bytes(self, token_id: int) -> Optional[bytes]:
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):
            return None
        match = self._BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match.group(1), 16)])
        byte_of = _byte_level_decoder()
        if all(char in byte_of for char in piece):
            return bytes(byte_of[char] for char in piece)
        return None


def _not_utf8(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> Dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2's: one printable character per byte), reversed."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    return {char: byte for byte, char in bytes_to_unicode().items()}


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """One generated token with its log-probability and the most likely alternatives
    (``(token, bytes, logprob)``, most likely first); ``offset`` is where the token's text
    starts among its choice's tokens (completions' ``text_offset``)."""

    token: str
    bytes: List[int]
    logprob: float
    top: Tuple[Tuple[str, List[int], float], ...] = ()
    offset: int = 0

    @classmethod
    def of(cls, generation: Generation, text: TokenText, offset: int = 0) -> "TokenLogprob":
        return cls(text.token(generation.token_id), text.bytes(generation.token_id),
                   _finite(generation.logprob),
                   tuple((text.token(i), text.bytes(i), _finite(lp))
                         for i, lp in generation.top_logprobs),
                   offset)


def _finite(logprob: Optional[float]) -> float:
    return MIN_LOGPROB if logprob is None else max(float(logprob), MIN_LOGPROB)


# ---------------------------------------------------------------------------------------
# Choices


@dataclasses.dataclass
class Update:
    """What one choice has to send after a step: new ``text``, the log-probabilities of
    the tokens behind it, and ``finish_reason`` once it is done. ``first`` marks the
    choice's first update (chat sends the assistant role with it); ``tool_calls`` holds
    the streamed entries of the tool calls read from the text (chat with tools)."""

    index: int
    text: str
    logprobs: List[TokenLogprob]
    finish_reason: Optional[str]
    first: bool
    tool_calls: List[Dict[str, Any]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class _Choice:
    index: int
    text: str = ""
    tokens: int = 0
    finish_reason: Optional[str] = None
    logprobs: List[TokenLogprob] = dataclasses.field(default_factory=list)
    # Log-probabilities of tokens whose text is still held back (part of a character or
    # of a possible stop string): they go out with the text they belong to.
    pending: List[TokenLogprob] = dataclasses.field(default_factory=list)
    started: bool = False
    pieces: int = 0
    #: the characters the logprobs' tokens have completed so far (a token's text offset),
    #: counted from their bytes: a token's text may hold half a character, or be
    #: ``bytes:...`` (see TokenText)
    characters: int = 0
    utf8: Any = dataclasses.field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")("replace"))


class Choices:
    """The choices of one request, fed step by step.

    ``token_text`` (a :class:`TokenText`) is needed only when the request asked for
    log-probabilities. ``max_new_tokens`` lets a choice whose engine reports no
    per-token detail (plain text lists) still get a finish reason at the end.
    """

    def __init__(self, count: int, token_text: Optional[TokenText] = None,
                 max_new_tokens: Optional[int] = None) -> None:
        self.choices = [_Choice(i) for i in range(count)]
        self.token_text = token_text
        self.max_new_tokens = max_new_tokens

    def feed(self, step: Step) -> List[Update]:
        """The updates of one step: every choice on the first step (so that a stream's
        first chunk always says something), then each choice with new text or a finish."""
        updates = []
        for choice, piece, generation in zip(self.choices, step, step.generations):
            if choice.finish_reason is not None:
                continue
            if piece:
                choice.pieces += 1
            if generation is not None:
                choice.tokens += 1
                if generation.logprob is not None and not generation.special \
                        and self.token_text is not None:
                    entry = TokenLogprob.of(generation, self.token_text, choice.characters)
                    choice.characters += len(choice.utf8.decode(bytes(entry.bytes)))
                    choice.logprobs.append(entry)
                    choice.pending.append(entry)
                if generation.finish_reason is not None:
                    choice.finish_reason = FINISH_REASONS.get(generation.finish_reason, "stop")
            choice.text += piece
            if piece or choice.finish_reason is not None or not choice.started:
                updates.append(self._update(choice, piece))
        return updates

    def finish(self) -> List[Update]:
        """Updates closing the choices the steps never finished (an engine without
        per-token detail): ``length`` when they used every token allowed, else ``stop``."""
        updates = []
        for choice in self.choices:
            if choice.finish_reason is None:
                if not choice.tokens:
                    # Plain text lists: each piece stands for (at least) one token.
                    choice.tokens = choice.pieces
                limit = self.max_new_tokens
                choice.finish_reason = "length" if limit and choice.tokens >= limit else "stop"
                updates.append(self._update(choice, ""))
        return updates

    @staticmethod
    def _update(choice: _Choice, piece: str) -> Update:
        update = Update(choice.index, piece, choice.pending, choice.finish_reason,
                        not choice.started)
        choice.pending = []
        choice.started = True
        return update

    # -- the whole answer --

    def texts(self) -> List[str]:
        return [choice.text for choice in self.choices]

    def finish_reasons(self) -> List[Optional[str]]:
        return [choice.finish_reason for choice in self.choices]

    def logprobs(self, index: int) -> List[TokenLogprob]:
        return self.choices[index].logprobs

    def usage(self, prompt_tokens: Sequence[int]) -> Dict[str, int]:
        """OpenAI's ``usage``: ``prompt_tokens`` counts each prompt once (pass one length
        per prompt, not per choice); ``completion_tokens`` every token generated, the
        end-of-sequence one included, over all choices."""
        prompt = sum(prompt_tokens)
        completion = sum(choice.tokens or choice.pieces for choice in self.choices)
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}


# ---------------------------------------------------------------------------------------
# Log-probabilities in the two shapes


def chat_logprobs(entries: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """Chat's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}]}``.

    >>> chat_logprobs([TokenLogprob("Hi", [72, 105], -0.5, (("Hi", [72, 105], -0.5),))])
    {'content': [{'token': 'Hi', 'logprob': -0.5, 'bytes': [72, 105], 'top_logprobs': [{'token': 'Hi', 'logprob': -0.5, 'bytes': [72, 105]}]}]}
    """
    return {"content": [
        {"token": e.token, "logprob": e.logprob, "bytes": e.bytes,
         "top_logprobs": [{"token": t, "logprob": lp, "bytes": b} for t, b, lp in e.top]}
        for e in entries]}


def completion_logprobs(entries: Sequence[TokenLogprob]) -> Dict[str, Any]:
    """Completions' legacy ``logprobs``: parallel lists ``tokens``, ``token_logprobs``,
    ``top_logprobs`` (per token a ``{token: logprob}`` map of the alternatives, the chosen
    token always among them, as OpenAI's API documents) and ``text_offset`` (where each
    token starts in the choice's text).

    >>> completion_logprobs([TokenLogprob("A", [65], -0.1), TokenLogprob("B", [66], -0.2, offset=1)])
    {'tokens': ['A', 'B'], 'token_logprobs': [-0.1, -0.2], 'top_logprobs': [{'A': -0.1}, {'B': -0.2}], 'text_offset': [0, 1]}
    """
    top = []
    for entry in entries:
        alternatives: Dict[str, float] = {}
        for token, _, logprob in entry.top:
            alternatives.setdefault(token, logprob)
        alternatives.setdefault(entry.token, entry.logprob)
        top.append(alternatives)
    return {"tokens": [e.token for e in entries],
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": top, "text_offset": [e.offset for e in entries]}


# ---------------------------------------------------------------------------------------
# Errors

#: The engine's failure kinds as (HTTP status, reason phrase, OpenAI error type, code).
#: Statuses are djl's routes' own, so a deployment reads them alike on every route; the
#: OpenAI SDK raises BadRequestError for the 400 and retries the 503 and the 507.
ERRORS = {
    "invalid": (400, "Bad Request", "invalid_request_error", None),
    "failed": (424, "Failed Dependency", "server_error", "generation_failed"),
    "out_of_memory": (507, "Insufficient Storage", "server_error", "out_of_memory"),
    "busy": (503, "Service Unavailable", "server_error", "queue_full"),
}


def error_body(message: str, error_type: str, param: Optional[str] = None,
               code: Optional[str] = None) -> Dict[str, Any]:
    """OpenAI's error object.

    >>> error_body("n must be at least 1, got 0", "invalid_request_error", "n")
    {'error': {'message': 'n must be at least 1, got 0', 'type': 'invalid_request_error', 'param': 'n', 'code': None}}
    """
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}

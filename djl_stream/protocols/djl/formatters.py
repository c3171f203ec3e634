"""Output formatters: how one decode step's new text becomes bytes on the wire.

A formatter is any callable ``(List[str]) -> bytes | bytearray | str`` taking the new text
pieces of one decode iteration, one entry per prompt. Two are built in:

- ``"jsonlines"`` (the default): ``{"output_tokens": [...]}`` and a newline,
  content type ``application/jsonlines``;
- ``"sse"``: server-sent events, ``data: {"output_tokens": [...]}`` and a blank line,
  content type ``text/event-stream``;
- ``"jsonlines_details"``: per-token details instead of text, ``{"tokens": [...]}`` and a
  newline (see :func:`tokens_record`), content type ``application/jsonlines``.

Per-token details (``jsonlines_details``, or a request's ``"details": true`` with
``jsonlines`` or ``sse``) are one record per decode step, one entry per prompt, ``null``
where the prompt did not advance (it finished earlier)::

    {"tokens": [{"id": 3681, "text": " Paris", "logprob": -0.31, "special": false}, null]}

``logprob`` is ``null`` where the engine reports none; with ``top_logprobs`` each entry
also has ``"top_logprobs": [{"id", "text", "logprob"}, ...]``, most likely first. The
stream's last record (written by the djl protocol's encoder, which counts) is::

    {"details": [{"finish_reason": "eos_token", "generated_tokens": 7, "prompt_tokens": 12}]}

:class:`StreamFormatter` wraps one so that it also renders a :class:`StreamError`, the item
a stream yields (at most once, last) when generation fails after the first chunk went out;
that is what is passed to ``Output.add_stream_content(stream, output_formatter=...)``.

    >>> fmt = resolve_formatter("jsonlines")
    >>> fmt(["Hel", "Bon"]), fmt(StreamError("out of memory"))
    (b'{"output_tokens": ["Hel", "Bon"]}\\n', b'{"error": "out of memory"}\\n')
"""

from __future__ import annotations

import dataclasses
import json
import math
import types
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Union

FormatterFn = Callable[[List[str]], Union[bytes, bytearray, str]]

JSONLINES_CONTENT_TYPE = "application/jsonlines"
SSE_CONTENT_TYPE = "text/event-stream"
DEFAULT_FORMATTER = "jsonlines"
#: The engine's finish reasons in the words djl-serving's LMI rolling batch (and TGI) use,
#: so that a client reads the same words from LMI and from djl-stream.
FINISH_REASONS: Mapping[str, str] = types.MappingProxyType(
    {"eos": "eos_token", "length": "length", "stop": "stop_sequence"})
#: Writes the text of a token that was not chosen (``top_logprobs``); from the tokenizer.
TokenText = Callable[[int], str]


@dataclasses.dataclass(frozen=True)
class StreamError:
    """Generation failed mid-stream; rendered as an error record instead of raw text.

    Once the first chunk is out the status is 200 whatever happens, so the error has to
    travel inside the stream in a shape the client already parses.
    """

    message: str


def to_bytes(value: Any) -> bytes:
    """Wire bytes for one stream item, by djl's rules.

    ``str`` is UTF-8 encoded, ``bytes``/``bytearray`` pass through, anything else becomes
    one line of JSON.

    >>> to_bytes("é"), to_bytes(bytearray(b"x")), to_bytes({"a": 1})
    (b'\\xc3\\xa9', b'x', b'{"a": 1}\\n')
    """
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    return (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")


def _json(value: Any) -> str:
    # ensure_ascii=False keeps emoji and CJK readable and the chunks small; json.dumps
    # still escapes control characters, so a record never contains a raw newline.
    return json.dumps(value, ensure_ascii=False)


def format_jsonlines(pieces: List[str]) -> bytes:
    """``{"output_tokens": [...]}`` plus a newline: one JSON document per line.

    >>> format_jsonlines(["你好", " 👋"]).decode()
    '{"output_tokens": ["你好", " 👋"]}\\n'
    """
    return (_json({"output_tokens": list(pieces)}) + "\n").encode("utf-8")


def format_sse(pieces: List[str]) -> bytes:
    """One server-sent event per decode step; the blank line ends the event.

    >>> format_sse(["Hi"])
    b'data: {"output_tokens": ["Hi"]}\\n\\n'
    """
    return ("data: " + _json({"output_tokens": list(pieces)}) + "\n\n").encode("utf-8")


def jsonlines_record(value: Any) -> bytes:
    """Any JSON record as one line of a ``jsonlines`` stream.

    >>> jsonlines_record({"details": []})
    b'{"details": []}\\n'
    """
    return (_json(value) + "\n").encode("utf-8")


def sse_record(value: Any) -> bytes:
    """Any JSON record as one event of an ``sse`` stream.

    >>> sse_record({"details": []})
    b'data: {"details": []}\\n\\n'
    """
    return ("data: " + _json(value) + "\n\n").encode("utf-8")


def _finite(value: Optional[float]) -> Optional[float]:
    # -inf (a token the processors ruled out) is not JSON; json.dumps would write -Infinity
    return value if value is not None and math.isfinite(value) else None


def token_record(generation: Any, text: str, *, top_logprobs: int = 0,
                 token_text: Optional[TokenText] = None) -> Dict[str, Any]:
    """One prompt's entry in a ``{"tokens": [...]}`` record: the token a
    :class:`~djl_stream.generation.step.Generation` chose, with the ``text`` it released.

    ``top_logprobs`` adds that many alternatives (as many as the engine reported), their
    texts from ``token_text`` (``null`` without one).

    >>> from djl_stream.generation.step import Generation
    >>> g = Generation(0, 42, " Paris", logprob=-0.5, top_logprobs=((42, -0.5), (7, -1.5)))
    >>> token_record(g, " Paris", top_logprobs=1, token_text=lambda i: f"<{i}>")
    {'id': 42, 'text': ' Paris', 'logprob': -0.5, 'special': False, 'top_logprobs': [{'id': 42, 'text': '<42>', 'logprob': -0.5}]}
    """
    record: Dict[str, Any] = {"id": generation.token_id, "text": text,
                              "logprob": _finite(generation.logprob),
                              "special": bool(generation.special)}
    if top_logprobs:
        record["top_logprobs"] = [
            {"id": token_id, "text": token_text(token_id) if token_text else None,
             "logprob": _finite(logprob)}
            for token_id, logprob in generation.top_logprobs[:top_logprobs]]
    return record


def tokens_record(step: Sequence[str], *, top_logprobs: int = 0,
                  token_text: Optional[TokenText] = None) -> Dict[str, Any]:
    """One decode step as ``{"tokens": [...]}``: per prompt its :func:`token_record`, or
    ``null`` where it did not advance. An engine that yields plain lists (no tokens behind
    the text) gets ``{"id": null, "text": ..., "logprob": null, "special": false}`` where a
    piece is not empty.

    >>> from djl_stream.generation.step import Generation, Step
    >>> tokens_record(Step.of([Generation(0, 5, "Hi"), None]))
    {'tokens': [{'id': 5, 'text': 'Hi', 'logprob': None, 'special': False}, None]}
    >>> tokens_record(["a", ""])
    {'tokens': [{'id': None, 'text': 'a', 'logprob': None, 'special': False}, None]}
    """
    generations = getattr(step, "generations", None) or [None] * len(step)
    entries: List[Optional[Dict[str, Any]]] = []
    for piece, generation in zip(step, generations):
        if generation is not None:
            entries.append(token_record(generation, piece, top_logprobs=top_logprobs,
                                        token_text=token_text))
        elif piece:
            entries.append({"id": None, "text": piece, "logprob": None, "special": False})
        else:
            entries.append(None)
    return {"tokens": entries}


def format_jsonlines_details(pieces: List[str]) -> bytes:
    """``{"tokens": [...]}`` plus a newline (:func:`tokens_record`), for a formatter called
    on its own; the djl protocol writes these lines itself, with the texts of
    ``top_logprobs`` and the closing ``{"details": [...]}`` record.

    >>> from djl_stream.generation.step import Generation, Step
    >>> format_jsonlines_details(Step.of([Generation(0, 2, "", "eos", special=True)]))
    b'{"tokens": [{"id": 2, "text": "", "logprob": null, "special": true}]}\\n'
    """
    return jsonlines_record(tokens_record(pieces))


def jsonlines_error(message: str) -> bytes:
    """``{"error": "..."}`` plus a newline."""
    return (_json({"error": message}) + "\n").encode("utf-8")


def sse_error(message: str) -> bytes:
    """An ``error`` event, which ``EventSource`` clients can listen for apart from data."""
    return ("event: error\ndata: " + _json({"error": message}) + "\n\n").encode("utf-8")


class StreamFormatter:
    """A formatter plus its content type, which also renders mid-stream errors.

    Calling it with a ``List[str]`` applies ``fn``; with a :class:`StreamError` (or an
    exception) it writes an error record in the stream's own framing: an ``error`` event
    for ``text/event-stream``, a ``{"error": ...}`` JSON line for anything else.

    >>> shout = StreamFormatter(lambda pieces: "".join(pieces).upper(), "text/plain")
    >>> shout(["ab", "c"]), shout(StreamError("boom"))
    (b'ABC', b'{"error": "boom"}\\n')
    """

    #: How this formatter frames a JSON record of djl-stream's own (the per-token details),
    #: ``None`` for a custom formatter, whose stream carries only what it writes.
    write_record: Optional[Callable[[Any], bytes]] = None
    #: Whether its stream is per-token details by default (``jsonlines_details``).
    details: bool = False

    def __init__(self, fn: FormatterFn, content_type: str = JSONLINES_CONTENT_TYPE,
                 name: str | None = None, *,
                 write_record: Optional[Callable[[Any], bytes]] = None,
                 details: bool = False) -> None:
        self.fn = fn
        self.content_type = content_type
        self.name = name or getattr(fn, "__name__", "formatter")
        self.write_record = write_record
        self.details = details

    def format_error(self, message: str) -> bytes:
        if self.content_type.split(";")[0].strip().lower() == SSE_CONTENT_TYPE:
            return sse_error(message)
        return jsonlines_error(message)

    def __call__(self, item: Any) -> bytes:
        if isinstance(item, StreamError):
            return self.format_error(item.message)
        if isinstance(item, BaseException):
            return self.format_error(str(item) or type(item).__name__)
        return to_bytes(self.fn(item))

    def __repr__(self) -> str:
        return f"StreamFormatter({self.name!r}, content_type={self.content_type!r})"


BUILTIN_FORMATTERS: Mapping[str, StreamFormatter] = types.MappingProxyType({
    "jsonlines": StreamFormatter(format_jsonlines, JSONLINES_CONTENT_TYPE, "jsonlines",
                                 write_record=jsonlines_record),
    "sse": StreamFormatter(format_sse, SSE_CONTENT_TYPE, "sse", write_record=sse_record),
    "jsonlines_details": StreamFormatter(format_jsonlines_details, JSONLINES_CONTENT_TYPE,
                                         "jsonlines_details", write_record=jsonlines_record,
                                         details=True),
})

_registered: dict[str, StreamFormatter] = {}


def register_formatter(name: str, content_type: str = JSONLINES_CONTENT_TYPE
                       ) -> Callable[[FormatterFn], FormatterFn]:
    """Decorator: make ``fn`` selectable as ``option.output_formatter=<name>``.

    The function is returned unchanged, with a ``content_type`` attribute added.
    Registering a name again replaces it (djl imports ``model.py`` more than once).

    >>> @register_formatter("plain", content_type="text/plain")
    ... def plain(pieces):
    ...     return "".join(pieces)
    >>> resolve_formatter("plain")(["a", "b"])
    b'ab'
    """
    if name in BUILTIN_FORMATTERS:
        raise ValueError(f"{name!r} is a built-in formatter and cannot be replaced")

    def decorate(fn: FormatterFn) -> FormatterFn:
        fn.content_type = content_type  # type: ignore[attr-defined]
        _registered[name] = StreamFormatter(fn, content_type, name)
        return fn

    return decorate


def resolve_formatter(name: str | FormatterFn | None,
                      module: types.ModuleType | None = None) -> StreamFormatter:
    """The formatter ``option.output_formatter`` names.

    A built-in name, a name given to :func:`register_formatter`, or the name of a function
    defined in ``module`` (the user's ``model.py``). A plain function streams as
    ``application/jsonlines`` unless it has a ``content_type`` attribute. ``None`` or an
    empty name gives the default, ``jsonlines``. The function itself is accepted too:
    djl-serving's worker passes one in the ``output_formatter`` property when ``model.py``
    marks it with djl_python's ``@output_formatter`` decorator.

    >>> import types
    >>> model_py = types.ModuleType("model")
    >>> model_py.csv = lambda pieces: ",".join(pieces) + "\\n"
    >>> resolve_formatter("csv", model_py)(["a", "b"])
    b'a,b\\n'
    """
    if callable(name):
        return StreamFormatter(name, getattr(name, "content_type", JSONLINES_CONTENT_TYPE))
    name = (name or DEFAULT_FORMATTER).strip()
    if name in BUILTIN_FORMATTERS:
        return BUILTIN_FORMATTERS[name]
    if name in _registered:
        return _registered[name]
    fn = getattr(module, name, None) if module is not None else None
    if fn is not None and not callable(fn):
        raise ValueError(f"output_formatter {name!r} in model.py is a "
                         f"{type(fn).__name__}, not a function")
    if fn is None:
        builtins = ", ".join(repr(n) for n in BUILTIN_FORMATTERS)
        raise ValueError(f"unknown output_formatter {name!r}: the built-ins are {builtins}, "
                         f"and no function of that name was found in model.py")
    return StreamFormatter(fn, getattr(fn, "content_type", JSONLINES_CONTENT_TYPE), name)

"""``Output``: what a handler returns, shaped like djl_python's.

Properties become HTTP headers; content entries form the body; or, for streaming, an
iterator whose items a formatter turns into chunks.

    >>> out = Output().add_property("content-type", "application/json")
    >>> out = out.add({"generated_text": "Hi"})
    >>> out.code, bytes(out.content.value_at(0))
    (200, b'{\\n  "generated_text":"Hi"\\n}')

JSON bodies are written as djl_python writes them (pretty-printed, :func:`djl_json`), so
``djl-stream serve`` answers byte for byte what the djl-serving container answers.
"""

from __future__ import annotations

import collections.abc
import datetime
import json
from typing import Any, Callable, Iterator

from djl_stream.serving.inputs import PairList


def _json_default(value: Any) -> Any:
    # numpy scalars and arrays without importing numpy: they all have item()/tolist().
    if isinstance(value, (datetime.date, datetime.datetime)):
        return str(value)
    for method in ("tolist", "item"):
        if callable(getattr(value, method, None)):
            return getattr(value, method)()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def djl_json(value: Any) -> bytes:
    """JSON exactly as djl_python's ``Output.add_as_json`` writes it: indented by two, no
    space after ``:``, non-ASCII kept, NaN refused.

    >>> djl_json({"code": 400, "field": "inputs"})
    b'{\\n  "code":400,\\n  "field":"inputs"\\n}'
    """
    return json.dumps(value, ensure_ascii=False, allow_nan=False, indent=2,
                      separators=(",", ":"), default=_json_default).encode("utf-8")


class Output:
    """The answer to one ``handle()`` call.

    Non-streaming: add content with :meth:`add` / :meth:`add_as_json`. Streaming: hand an
    iterator and a formatter to :meth:`add_stream_content`; the server calls
    :meth:`format_stream_item` on each item.

    >>> out = Output().add_stream_content(iter([["a"], ["b"]]), output_formatter=lambda p: p[0])
    >>> [out.format_stream_item(item) for item in out.stream_content]
    [b'a', b'b']
    """

    def __init__(self, code: int = 200, message: str = "OK") -> None:
        self.code = code
        self.message = message
        self.properties: dict[str, str] = {}
        self.content = PairList()
        self.stream_content: Iterator[Any] | None = None
        self.stream_output_formatter: Callable[[Any], Any] | None = None

    def set_code(self, code: int) -> Output:
        self.code = code
        return self

    def set_message(self, message: str) -> Output:
        self.message = message
        return self

    def add_property(self, key: str, value: str) -> Output:
        """Set a response header and return ``self``."""
        self.properties[key] = value
        return self

    def add(self, value: Any, key: str | None = None, batch_index: int | None = None) -> Output:
        """Append a body entry: ``str`` as UTF-8, bytes as they are, anything else as JSON.

        With ``batch_index`` (dynamic batching) the key becomes ``batch_<i>.<key>``, the
        form djl_python's ``Output`` writes for the front end to split the answers.
        """
        if key is not None and not isinstance(key, str):
            key = str(key)
        if batch_index is not None:
            key = f"batch_{batch_index}.{key or ''}"
        if isinstance(value, str):
            data: bytes | bytearray = value.encode("utf-8")
        elif isinstance(value, (bytes, bytearray)):
            data = value
        else:
            data = djl_json(value)
        self.content.add(key, data)
        return self

    def add_as_json(self, value: Any, key: str | None = None,
                    batch_index: int | None = None) -> Output:
        """Append ``value`` JSON-encoded (even a ``str``, which becomes a JSON string)."""
        return self.add(djl_json(value), key=key, batch_index=batch_index)

    def error(self, msg: str, code: int = 424, message: str = "invoke handler failure") -> Output:
        """Turn this output into an error answer with a JSON body.

        The body replaces anything added before, so a half-built answer never leaks.

        >>> out = Output().error("CUDA out of memory", code=507)
        >>> out.code, json.loads(bytes(out.content.value_at(0)))["error"]
        (507, 'CUDA out of memory')
        """
        self.code = code
        self.message = message
        self.content = PairList()
        self.add_property("content-type", "application/json")
        return self.add_as_json({"code": code, "message": message, "error": msg})

    def add_stream_content(self, stream: Iterator[Any],
                           output_formatter: Callable[[Any], Any] | None = None) -> Output:
        """Stream ``stream``'s items, each passed through ``output_formatter``.

        ``stream`` must be an iterator (a generator, or ``iter(list)``): the djl worker
        calls ``next()`` on it and fails late, mid-response, on a list. Refusing it here
        turns that into an error at the line that made it. Without a formatter the items
        go out by the plain rules of :meth:`format_stream_item`; pass one explicitly, as
        djl_python's own default writes a different JSON shape.

        >>> Output().add_stream_content([["a"]])
        Traceback (most recent call last):
        ...
        TypeError: add_stream_content needs an iterator such as a generator, got list; wrap it in iter(...)
        """
        if not isinstance(stream, collections.abc.Iterator):
            raise TypeError("add_stream_content needs an iterator such as a generator, "
                            f"got {type(stream).__name__}; wrap it in iter(...)")
        self.stream_content = stream
        self.stream_output_formatter = output_formatter
        return self

    def format_stream_item(self, item: Any) -> bytes:
        """The bytes to send for one stream item, as djl_python's ``Output.send`` makes them.

        The stored formatter runs first; its result is sent as djl does: ``str`` UTF-8
        encoded, ``bytes``/``bytearray`` as they are, anything else as :func:`djl_json`
        (pretty-printed, no newline).

        >>> Output().add_stream_content(iter([])).format_stream_item({"a": 1})
        b'{\\n  "a":1\\n}'
        """
        if self.stream_output_formatter is not None:
            item = self.stream_output_formatter(item)
        if isinstance(item, str):
            return item.encode("utf-8")
        if isinstance(item, (bytes, bytearray)):
            return bytes(item)
        return djl_json(item)

    def __repr__(self) -> str:
        streaming = ", streaming" if self.stream_content is not None else ""
        return (f"Output(code={self.code}, message={self.message!r}, "
                f"properties={self.properties!r}, content={self.content.get_keys()!r}{streaming})")

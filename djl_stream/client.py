"""A small client for token streams: bytes in any pieces → lines → JSON records.

Streams arrive in chunks that follow the network, not the text: a chunk may end in the
middle of a line or even inside a multi-byte UTF-8 character (SageMaker's payload parts do
exactly that). :class:`LineDecoder` re-assembles lines, :func:`iter_json_lines` parses them,
and :func:`stream` does both over an HTTP response from the local server or djl-serving.

Example::

    >>> decoder = LineDecoder()
    >>> decoder.feed(b'{"output_tokens": ["caf\\xc3'), decoder.feed(b'\\xa9"]}\\n{"out')
    ([], ['{"output_tokens": ["café"]}'])
    >>> list(iter_json_lines([b'{"output_tokens": ["a"]}\\n', b'{"output_tokens": ["b"]}']))
    [{'output_tokens': ['a']}, {'output_tokens': ['b']}]

    for record in stream("http://127.0.0.1:8080/invocations",
                         {"inputs": "Hello", "stream": True}):
        print(record["output_tokens"][0], end="", flush=True)
"""

from __future__ import annotations

import json
from typing import Any, Iterable, Iterator, Mapping, Optional

#: Read timeout between two chunks: djl-serving's ``chunked_read_timeout`` default.
DEFAULT_TIMEOUT = 120.0
#: Server-sent-event fields that carry no data (a stream formatted as ``sse``).
_SSE_FIELDS = ("event:", "id:", "retry:", ":")


class StreamingError(RuntimeError):
    """The server reported an error: an HTTP status ≥ 400 before the stream started, or an
    ``{"error": ...}`` record (or a line that is not JSON) inside the stream.

    ``status_code`` is the HTTP status (200 for an error inside a stream that had already
    started); ``body`` the parsed error record when there was one.

    >>> str(StreamingError("out of memory", status_code=200))
    'out of memory'
    """

    def __init__(self, message: str, *, status_code: Optional[int] = None,
                 body: Any = None) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.body = body


class LineDecoder:
    """Turns byte chunks, split anywhere, into complete text lines.

    Lines are split on ``\\n`` (a trailing ``\\r`` is dropped too) and returned without the
    terminator; empty lines are kept, since server-sent events use them as separators.
    Splitting happens on bytes and each complete line is decoded on its own, so a chunk
    boundary inside a UTF-8 character can never garble it: ``\\n`` is never part of a
    multi-byte sequence. Invalid UTF-8 becomes U+FFFD rather than an exception.

    >>> d = LineDecoder()
    >>> d.feed(b"one\\ntw"), d.feed(b"o\\r\\n\\nthr"), d.flush()
    (['one'], ['two', ''], ['thr'])
    """

    def __init__(self) -> None:
        self._buffer = bytearray()

    def feed(self, chunk: bytes | bytearray) -> list[str]:
        """Add ``chunk``; return the lines it completed (possibly none)."""
        self._buffer += chunk
        end = self._buffer.rfind(b"\n")
        if end < 0:
            return []
        complete = bytes(self._buffer[:end])
        del self._buffer[: end + 1]
        return [self._decode(line) for line in complete.split(b"\n")]

    def flush(self) -> list[str]:
        """The last line when the stream ended without a newline (``[]`` if nothing is left).

        Call it once the input is exhausted; the decoder is empty afterwards.
        """
        if not self._buffer:
            return []
        line = self._decode(bytes(self._buffer))
        self._buffer.clear()
        return [line]

    def __call__(self, chunks: Iterable[bytes]) -> Iterator[str]:
        """All lines of ``chunks``, the unterminated last one included.

        >>> list(LineDecoder()([b"a\\nb", b"c"]))
        ['a', 'bc']
        """
        for chunk in chunks:
            yield from self.feed(chunk)
        yield from self.flush()

    @staticmethod
    def _decode(line: bytes) -> str:
        return line.removesuffix(b"\r").decode("utf-8", errors="replace")


def parse_json_line(line: str) -> Optional[dict]:
    """The JSON object on one line of a stream, or ``None`` for a line without data.

    Accepts JSON lines and server-sent events (``data: {...}``; other SSE fields, blank
    lines and ``data: [DONE]`` carry no record). Raises :class:`StreamingError` for an
    ``{"error": ...}`` record and for text that is not a JSON object — djl-serving appends
    the raw exception text to the stream when a handler without error records fails.

    >>> parse_json_line('data: {"output_tokens": ["x"]}'), parse_json_line("event: x")
    ({'output_tokens': ['x']}, None)
    """
    text = line.strip()
    if text.startswith("data:"):
        text = text[len("data:"):].strip()
        if text == "[DONE]":
            return None
    elif not text or text.startswith(_SSE_FIELDS):
        return None
    try:
        record = json.loads(text)
    except json.JSONDecodeError:
        raise StreamingError(f"stream failed: {text}", status_code=200) from None
    if not isinstance(record, dict):
        raise StreamingError(f"expected a JSON object in the stream, got: {text}",
                             status_code=200)
    if "error" in record:
        raise StreamingError(str(record["error"]), status_code=200, body=record)
    return record


def iter_json_lines(chunks: Iterable[bytes]) -> Iterator[dict]:
    """The JSON records of a stream whose byte chunks may split lines and characters.

    Raises :class:`StreamingError` at an ``{"error": ...}`` record (see
    :func:`parse_json_line`), after yielding every record before it.

    >>> payload = '{"output_tokens": ["你"]}\\n{"error": "boom"}\\n'.encode()
    >>> records = iter_json_lines(payload[i:i + 1] for i in range(len(payload)))
    >>> next(records)
    {'output_tokens': ['你']}
    >>> next(records)
    Traceback (most recent call last):
    ...
    djl_stream.client.StreamingError: boom
    """
    for line in LineDecoder()(chunks):
        record = parse_json_line(line)
        if record is not None:
            yield record


def error_message(body: bytes, status_code: int) -> str:
    """The message of an error response: ``error`` or ``message`` of a JSON body, else the
    text itself.

    >>> error_message(b'{"code": 424, "message": "invoke handler failure", "error": "boom"}', 424)
    'HTTP 424: boom'
    """
    text = body.decode("utf-8", errors="replace").strip()
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        text = str(parsed.get("error") or parsed.get("message") or text)
    return f"HTTP {status_code}: {text or 'no body'}"


def stream(
    url: str,
    payload: Any,
    *,
    timeout: float | Any = DEFAULT_TIMEOUT,
    headers: Optional[Mapping[str, str]] = None,
    client: Any = None,
) -> Iterator[dict]:
    """POST ``payload`` as JSON to ``url`` and yield the records of the streamed answer.

    ``timeout`` bounds connecting and each wait for the next chunk (a float or an
    ``httpx.Timeout``); pass an ``httpx.Client`` as ``client`` to reuse connections.
    Raises :class:`StreamingError` for an HTTP status ≥ 400 (with the message of the JSON
    error body) and for an error record inside the stream. Closing the generator early
    closes the connection, which makes the server stop generating.

    >>> for record in stream("http://127.0.0.1:8080/invocations",
    ...                      {"inputs": "Hi", "stream": True}):  # doctest: +SKIP
    ...     print(record["output_tokens"][0], end="")
    """
    import httpx  # lazily: the decoders above are useful without it

    owned = client is None
    http = httpx.Client(timeout=timeout) if owned else client
    try:
        with http.stream("POST", url, json=payload, headers=dict(headers or {}),
                         timeout=timeout) as response:
            if response.status_code >= 400:
                body = response.read()
                try:
                    parsed = json.loads(body)
                except ValueError:
                    parsed = None
                raise StreamingError(error_message(body, response.status_code),
                                     status_code=response.status_code, body=parsed)
            yield from iter_json_lines(response.iter_bytes())
    finally:
        if owned:
            http.close()

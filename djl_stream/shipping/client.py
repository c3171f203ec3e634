"""A small client for token streams: bytes in any pieces → lines → JSON records.

Streams arrive in chunks that follow the network, not the text: a chunk may end in the
middle of a line or even inside a multi-byte UTF-8 character (SageMaker's payload parts do
exactly that). :class:`LineDecoder` re-assembles lines, :func:`iter_json_lines` parses them,
and :func:`stream` does both over an HTTP response from the local server or djl-serving;
:func:`invoke_stream` does the same over a SageMaker endpoint's response stream. Both
transports end in the same :func:`iter_json_lines`, so a line is a line whichever way it came.

Example::

    >>> decoder = LineDecoder()
    >>> decoder.feed(b'{"output_tokens": ["caf\\xc3'), decoder.feed(b'\\xa9"]}\\n{"out')
    ([], ['{"output_tokens": ["café"]}'])
    >>> list(iter_json_lines([b'{"output_tokens": ["a"]}\\n', b'{"output_tokens": ["b"]}']))
    [{'output_tokens': ['a']}, {'output_tokens': ['b']}]

    for record in stream("http://127.0.0.1:8080/invocations",
                         {"inputs": "Hello", "stream": True}):
        print(record["output_tokens"][0], end="", flush=True)

    runtime = boto3.client("sagemaker-runtime")
    for record in invoke_stream(runtime, "my-endpoint", {"inputs": "Hello"}):
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
    djl_stream.shipping.client.StreamingError: boom
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


# -- SageMaker response streams --

class ModelStreamError(StreamingError):
    """SageMaker reported ``ModelStreamError``: the container's stream broke or timed out
    after the response had started. ``error_code`` is SageMaker's ``ErrorCode`` (e.g.
    ``ModelInvocationTimeExceeded``, ``StreamBroken``) when the event carries it as a
    field; botocore's parser keeps only the message of an exception message, so through
    boto3 it is ``None``.

    >>> error = ModelStreamError("stream broke", error_code="StreamBroken")
    >>> str(error), error.error_code
    ('stream broke', 'StreamBroken')
    """

    def __init__(self, message: str, *, error_code: Optional[str] = None,
                 body: Any = None) -> None:
        super().__init__(message, status_code=200, body=body)
        self.error_code = error_code


class InternalStreamFailure(StreamingError):
    """SageMaker reported ``InternalStreamFailure``: the stream failed inside SageMaker
    rather than in the container.

    >>> str(InternalStreamFailure("internal failure"))
    'internal failure'
    """

    def __init__(self, message: str, *, body: Any = None) -> None:
        super().__init__(message, status_code=200, body=body)


#: Event names of ``InvokeEndpointWithResponseStream`` that end a stream with an error.
_STREAM_ERRORS = {"ModelStreamError": ModelStreamError,
                  "InternalStreamFailure": InternalStreamFailure}


def _stream_error(name: str, fields: Mapping[str, Any]) -> StreamingError:
    message = str(fields.get("Message") or name)
    if name == "ModelStreamError":
        return ModelStreamError(message, error_code=fields.get("ErrorCode"), body=dict(fields))
    return InternalStreamFailure(message, body=dict(fields))


def _translated(error: Exception) -> Optional[StreamingError]:
    """The :class:`StreamingError` for a botocore ``EventStreamError``, else ``None``.

    botocore's parser turns an exception message of the event stream (``:message-type
    exception``) into an ``EventStreamError`` raised mid-iteration, with the event name as
    the error code; duck-typed so that this module never imports botocore.
    """
    response = getattr(error, "response", None)
    if not isinstance(response, Mapping):
        return None
    fields = response.get("Error") or {}
    name = str(fields.get("Code") or "")
    if name in _STREAM_ERRORS:
        return _stream_error(name, fields)
    return StreamingError(f"{name or type(error).__name__}: {fields.get('Message', error)}",
                          body=dict(response))


def iter_sagemaker_payloads(event_stream: Iterable[Mapping[str, Any]]) -> Iterator[bytes]:
    """The bytes of each ``PayloadPart`` of an ``InvokeEndpointWithResponseStream`` body.

    ``ModelStreamError`` and ``InternalStreamFailure`` become :class:`ModelStreamError`
    and :class:`InternalStreamFailure` (whether they arrive as events or, as botocore
    delivers them, as an ``EventStreamError``); other events are skipped.

    >>> parts = [{"PayloadPart": {"Bytes": b"a"}}, {"ModelStreamError": {"Message": "boom"}}]
    >>> payloads = iter_sagemaker_payloads(parts)
    >>> next(payloads)
    b'a'
    >>> next(payloads)
    Traceback (most recent call last):
    ...
    djl_stream.shipping.client.ModelStreamError: boom
    """
    events = iter(event_stream)
    while True:
        try:
            event = next(events)
        except StopIteration:
            return
        except StreamingError:
            raise
        except Exception as error:
            translated = _translated(error)
            if translated is None:
                raise
            raise translated from error
        part = event.get("PayloadPart")
        if part is not None:
            data = part.get("Bytes") or b""
            if data:
                yield bytes(data)
            continue
        for name in _STREAM_ERRORS:
            if name in event:
                raise _stream_error(name, event[name] or {})


def iter_sagemaker_lines(event_stream: Iterable[Mapping[str, Any]]) -> Iterator[str]:
    """The text lines of a SageMaker response stream, whatever its payload parts split.

    Parts are not aligned to lines or to UTF-8 characters; this is :class:`LineDecoder`
    over :func:`iter_sagemaker_payloads`, so a last line without its newline is yielded
    too (the SDK's own ``LineIterator`` waits for it forever).

    >>> body = '{"output_tokens": ["é"]}\\n{"output_tokens": ["!"]}'.encode()
    >>> list(iter_sagemaker_lines({"PayloadPart": {"Bytes": body[i:i + 1]}}
    ...                           for i in range(len(body))))
    ['{"output_tokens": ["é"]}', '{"output_tokens": ["!"]}']
    """
    return LineDecoder()(iter_sagemaker_payloads(event_stream))


def invoke_stream(
    runtime_client: Any,
    endpoint_name: str,
    payload: Any,
    *,
    content_type: str = "application/json",
    **request: Any,
) -> Iterator[dict]:
    """Call ``InvokeEndpointWithResponseStream`` and yield the records of the answer.

    ``runtime_client`` is a ``boto3.client("sagemaker-runtime")``; ``payload`` is sent as
    JSON unless it is already ``bytes`` or ``str``; further keyword arguments (``Accept``,
    ``CustomAttributes``, ``InferenceComponentName``...) go to the API call unchanged.
    Raises :class:`StreamingError` when the endpoint refuses the request (with the
    model's own status and message for a ``ModelError``), :class:`ModelStreamError` or
    :class:`InternalStreamFailure` when the stream fails, and :class:`StreamingError` at
    an ``{"error": ...}`` record. Closing the generator early closes the stream.

    >>> for record in invoke_stream(boto3.client("sagemaker-runtime"), "my-endpoint",
    ...                             {"inputs": "Hi"}):  # doctest: +SKIP
    ...     print(record["output_tokens"][0], end="")
    """
    if isinstance(payload, str):
        body: bytes = payload.encode("utf-8")
    elif isinstance(payload, (bytes, bytearray)):
        body = bytes(payload)
    else:
        body = json.dumps(payload, ensure_ascii=False).encode("utf-8")
    try:
        response = runtime_client.invoke_endpoint_with_response_stream(
            EndpointName=endpoint_name, Body=body, ContentType=content_type, **request)
    except Exception as error:
        raise _refusal(error) from error
    event_stream = response["Body"]
    try:
        yield from iter_json_lines(iter_sagemaker_payloads(event_stream))
    finally:
        close = getattr(event_stream, "close", None)
        if close is not None:
            close()


def _refusal(error: Exception) -> Exception:
    """A botocore ``ClientError`` from before the stream started, as a StreamingError.

    For ``ModelError`` SageMaker relays the container's own answer in ``OriginalStatusCode``
    and ``OriginalMessage`` (djl-serving's 424 JSON, a 400 naming the field...), which is
    what the caller needs to see; anything that is not a ClientError is returned as is.
    """
    response = getattr(error, "response", None)
    if not isinstance(response, Mapping):
        return error
    fields = response.get("Error") or {}
    status = response.get("OriginalStatusCode") or \
        (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    original = response.get("OriginalMessage")
    if original:
        message = error_message(str(original).encode("utf-8"), int(status or 0))
    else:
        message = f"{fields.get('Code', type(error).__name__)}: {fields.get('Message', error)}"
    return StreamingError(message, status_code=int(status) if status else None,
                          body=dict(response))

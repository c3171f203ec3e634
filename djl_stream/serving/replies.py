"""What the service answers, and how each djl-serving worker mode carries it.

:class:`~djl_stream.serving.service.StreamingService` decides *what* to answer: an error with a
status and a JSON body (:class:`ErrorReply`), a JSON document (:class:`JsonReply`), or a
stream of wire chunks whose first chunk already exists (:class:`StreamReply`). How that
travels depends on the worker that called ``handle()``:

- djl-serving's synchronous worker (and ``djl-stream serve``) takes one ``Output``:
  :func:`to_output`;
- the asynchronous worker of djl-serving 0.33 (LMI images with ``SERVING_FEATURES=vllm`` and
  no ``option.entryPoint``) takes ``Output``\\ s whose first content entry is a small binary
  map ``{"data", "last", "code", "error"}``, one per chunk: :func:`to_async_outputs`.

    >>> reply = ErrorReply(400, {"code": 400, "message": "inputs is empty"}, "Bad Request",
    ...                    "inputs is empty")
    >>> to_output(reply).code
    400
    >>> decode_async_map(async_output_map(to_async_output(reply)))["code"]
    '400'
"""

from __future__ import annotations

import asyncio
import dataclasses
import struct
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable, Dict, Iterator, Mapping, Optional

from djl_stream.serving import compat
from djl_stream.serving.outputs import djl_json

JSON_CONTENT_TYPE = "application/json"
#: The attribute of a streamed ``Output`` that holds its :attr:`StreamReply.error_record`
#: (an attribute, not a property: properties become response headers).
ERROR_RECORD_ATTRIBUTE = "djl_stream_error_record"


@dataclasses.dataclass(frozen=True)
class ErrorReply:
    """An error answered before any chunk went out, so its status can still say so.

    ``body`` is the JSON body (None: no body, as djl-serving answers an out-of-memory
    failure); ``message`` the status line's reason phrase (djl's ``Output.message``);
    ``text`` the error in one line, which is all djl-serving's async front end carries.
    """

    code: int
    body: Optional[Any]
    message: str
    text: str


@dataclasses.dataclass(frozen=True)
class JsonReply:
    """A complete JSON answer (a non-streaming generation)."""

    body: Any
    code: int = 200


class StreamReply:
    """A streaming answer whose first chunk was produced before replying.

    Starting generation before the answer goes out is what lets a failure a user can cause
    (a prompt the model cannot prefill, a formatter that raises) be answered with an error
    status: djl-serving's front end sends the 200 head with the first chunk, after which an
    error can only travel inside the stream. Iterating yields the first chunk, then the rest;
    closing stops generation. ``error_record`` renders a message as the stream's own error
    record (an SSE ``error`` event, a JSON line...), for whoever must end the stream where
    the handler no longer can (a front that lost the process generating it).
    """

    def __init__(self, first: Optional[bytes], rest: Iterator[bytes], content_type: str,
                 error_record: Optional[Callable[[str], bytes]] = None) -> None:
        self.first = first
        self.rest = rest
        self.content_type = content_type
        self.error_record = error_record

    def chunks(self) -> Iterator[bytes]:
        """Every chunk, first one included; closing the generator closes the stream."""
        try:
            if self.first is not None:
                yield self.first
            yield from self.rest
        finally:
            self.close()

    def close(self) -> None:
        close = getattr(self.rest, "close", None)
        if close is not None:
            close()


Reply = ErrorReply | JsonReply | StreamReply


def is_out_of_memory(error: BaseException) -> bool:
    """What djl-serving's worker answers 507 for (``torch.cuda.OutOfMemoryError`` and
    friends are recognised by name, without importing torch).

    >>> is_out_of_memory(MemoryError()), is_out_of_memory(ValueError("bad"))
    (True, False)
    """
    return (isinstance(error, MemoryError) or type(error).__name__ == "OutOfMemoryError"
            or "CUDA error: out of memory" in str(error))


# -- the synchronous worker: one Output -----------------------------------------------

def to_output(reply: Reply) -> Any:
    """The ``Output`` (djl_python's in the container) that carries ``reply``."""
    if isinstance(reply, StreamReply):
        out = compat.Output()
        out.add_property("content-type", reply.content_type)
        # The chunks are already bytes: no formatter, so the wire does not depend on which
        # Output class (djl_python's default formatter writes {"outputs": ...}) is in use.
        out.add_stream_content(reply.chunks(), output_formatter=None)
        if reply.error_record is not None:
            setattr(out, ERROR_RECORD_ATTRIBUTE, reply.error_record)
        return out
    out = compat.Output(code=reply.code, message=reply.message if isinstance(reply, ErrorReply) else "OK")
    body = reply.body
    if body is not None:
        out.add_property("content-type", JSON_CONTENT_TYPE)
        out.add(djl_json(body))
    return out


# -- the asynchronous worker (djl-serving 0.33): one Output per chunk ------------------

def encode_async_map(fields: Mapping[str, Any]) -> bytes:
    """The binary map djl-serving's front end reads from an async Output's first content
    entry (``Request.addResponse``): a big-endian count, then each key and ``str(value)``
    as a length-prefixed UTF-8 string.

    >>> encode_async_map({"last": True})
    b'\\x00\\x01\\x00\\x00\\x00\\x04last\\x00\\x00\\x00\\x04True'
    """
    out = bytearray(struct.pack(">h", len(fields)))
    for key, value in fields.items():
        for text in (key, str(value)):
            raw = text.encode("utf-8")
            out += struct.pack(">i", len(raw)) + raw
    return bytes(out)


def decode_async_map(raw: bytes) -> Dict[str, str]:
    """The inverse of :func:`encode_async_map`.

    >>> decode_async_map(encode_async_map({"data": "hé", "last": False}))
    {'data': 'hé', 'last': 'False'}
    """
    (count,), offset, fields = struct.unpack_from(">h", raw), 2, {}
    for _ in range(count):
        pair = []
        for _ in range(2):
            (size,) = struct.unpack_from(">i", raw, offset)
            pair.append(raw[offset + 4: offset + 4 + size].decode("utf-8"))
            offset += 4 + size
        fields[pair[0]] = pair[1]
    return fields


def async_output_map(output: Any) -> bytes:
    """The binary map an async ``Output`` carries (its first content entry)."""
    return bytes(output.content.value_at(0))


def _async_output(data: str, last: bool, content_type: str,
                  code: Optional[int] = None, error: Optional[str] = None) -> Any:
    fields: Dict[str, Any] = {"data": data, "last": last}
    if code is not None:
        fields["code"] = code
        fields["error"] = error or ""
    out = compat.Output()
    out.add_property("content-type", content_type)
    out.add(encode_async_map(fields))
    return out


def to_async_output(reply: ErrorReply | JsonReply) -> Any:
    """The one ``Output`` that carries a complete (non-streaming) reply in async mode.

    The async front end reads an error only from the map's ``code`` and ``error`` fields
    and answers ``{"code": ..., "error": ...}`` with that status, so an :class:`ErrorReply`
    travels as its status and one line of text (which names the field and the limit).
    """
    if isinstance(reply, ErrorReply):
        return _async_output("", True, JSON_CONTENT_TYPE, code=reply.code, error=reply.text)
    return _async_output(djl_json(reply.body).decode("utf-8"), True, JSON_CONTENT_TYPE)


async def to_async_outputs(reply: StreamReply, executor: Executor) -> AsyncIterator[Any]:
    """The ``Output`` of each chunk of ``reply`` for the async worker, then an empty last one.

    Pulling a chunk blocks until the model produced it, so it runs in ``executor``, never
    on the worker's event loop (which every other request shares).
    """
    loop = asyncio.get_running_loop()
    chunks = reply.chunks()
    done = object()
    try:
        while True:
            chunk = await loop.run_in_executor(executor, next, chunks, done)
            if chunk is done:
                break
            # The map carries text; djl-stream's formatters write UTF-8, and a custom one
            # that writes other bytes is decoded leniently rather than failing the stream.
            yield _async_output(chunk.decode("utf-8", errors="replace"), False, reply.content_type)
        yield _async_output("", True, reply.content_type)
    finally:
        await loop.run_in_executor(executor, chunks.close)

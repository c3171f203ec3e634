"""SageMaker's runtime API on the local server, so that code written for an endpoint runs
against ``djl-stream serve`` by setting boto3's ``endpoint_url``.

``POST /endpoints/{name}/invocations`` is ``InvokeEndpoint``;
``POST /endpoints/{name}/invocations-response-stream`` is
``InvokeEndpointWithResponseStream``. Both hand the body to the same ``handle()`` as
``/invocations`` (any endpoint name: there is one model), and answer as the SageMaker
service answers its clients, not as the container answers SageMaker:

- a 2xx answer's bytes as they are, or each chunk of a stream as one ``PayloadPart`` event
  in AWS's event-stream framing (:func:`event_message`), the model's content type in
  ``X-Amzn-SageMaker-Content-Type``;
- any other answer as the ``ModelError`` (424) that SageMaker makes of a container's error:
  ``OriginalStatusCode`` and ``OriginalMessage`` carry the model's status and body, so boto3
  raises ``ModelError`` with the model's message in it.

Example (boto3, no AWS account involved)::

    runtime = boto3.client("sagemaker-runtime", endpoint_url="http://localhost:8080",
                           region_name="us-east-1", aws_access_key_id="local",
                           aws_secret_access_key="local")
    answer = runtime.invoke_endpoint_with_response_stream(
        EndpointName="my-endpoint", ContentType="application/json",
        Body=b'{"inputs": "Hello", "stream": true}')
    for event in answer["Body"]:
        print(event["PayloadPart"]["Bytes"].decode(), end="")
"""

from __future__ import annotations

import binascii
import json
import struct
from typing import Dict, List, Optional, Tuple

from starlette.types import ASGIApp, Message, Receive, Scope, Send

#: The variant a local endpoint reports having answered (SageMaker's default name).
VARIANT = "AllTraffic"
#: The content type of an event stream.
EVENT_STREAM = "application/vnd.amazon.eventstream"
#: Event-stream header value type 7: a UTF-8 string with a 2-byte length.
_STRING = 7


def event_message(headers: Dict[str, str], payload: bytes) -> bytes:
    """One message of AWS's event-stream framing: a prelude (total and headers lengths and
    their CRC32), the headers (each a name, type 7 and a string value), the payload, and the
    CRC32 of everything before it.

    >>> from botocore.eventstream import EventStreamBuffer
    >>> decoder = EventStreamBuffer()
    >>> decoder.add_data(event_message({":event-type": "PayloadPart"}, b"hi"))
    >>> message = next(iter(decoder))
    >>> message.headers, message.payload
    ({':event-type': 'PayloadPart'}, b'hi')
    """
    encoded = b""
    for name, value in headers.items():
        raw_name, raw_value = name.encode("utf-8"), value.encode("utf-8")
        encoded += (struct.pack(">B", len(raw_name)) + raw_name + struct.pack(">B", _STRING)
                    + struct.pack(">H", len(raw_value)) + raw_value)
    total = 12 + len(encoded) + len(payload) + 4
    prelude = struct.pack(">II", total, len(encoded))
    prelude += struct.pack(">I", binascii.crc32(prelude))
    body = prelude + encoded + payload
    return body + struct.pack(">I", binascii.crc32(body))


def payload_part(chunk: bytes) -> bytes:
    """A ``PayloadPart`` event carrying ``chunk``."""
    return event_message({":event-type": "PayloadPart", ":content-type": "application/octet-stream",
                          ":message-type": "event"}, chunk)


def model_error(status: int, body: bytes) -> Tuple[bytes, List[Tuple[bytes, bytes]]]:
    """The 424 ``ModelError`` SageMaker answers when the model answered ``status``:
    its JSON body and headers.

    >>> body, headers = model_error(400, b'{"message": "bad"}')
    >>> json.loads(body)["OriginalStatusCode"], dict(headers)[b"x-amzn-errortype"]
    (400, b'ModelError')
    """
    text = body.decode("utf-8", errors="replace")
    kind = "client" if 400 <= status < 500 else "server"
    document = {"Message": f"Received {kind} error ({status}) from model with message "
                           f"\"{text}\"",
                "OriginalStatusCode": status, "OriginalMessage": text}
    raw = json.dumps(document).encode("utf-8")
    return raw, [(b"content-type", b"application/json"), (b"x-amzn-errortype", b"ModelError"),
                 (b"content-length", str(len(raw)).encode())]


class AsSageMaker:
    """An ASGI response of the local server, answered as SageMaker's runtime would:
    ``stream`` for ``InvokeEndpointWithResponseStream`` (event-stream framing), else
    ``InvokeEndpoint``. A model error is held until its body is complete, then sent as a
    ``ModelError``."""

    def __init__(self, response: ASGIApp, stream: bool) -> None:
        self.response = response
        self.stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        state: Dict[str, object] = {"status": 200, "error": None}

        async def translate(message: Message) -> None:
            if message["type"] == "http.response.start":
                status = int(message["status"])
                state["status"] = status
                if status >= 300:
                    state["error"] = bytearray()
                    return
                await send({**message, "headers": self._headers(message.get("headers", []))})
                return
            if message["type"] != "http.response.body":
                await send(message)
                return
            error: Optional[bytearray] = state["error"]  # type: ignore[assignment]
            more = message.get("more_body", False)
            if error is not None:
                error += message.get("body", b"")
                if not more:
                    body, headers = model_error(int(state["status"]), bytes(error))  # type: ignore[arg-type]
                    await send({"type": "http.response.start", "status": 424, "headers": headers})
                    await send({"type": "http.response.body", "body": body})
                return
            chunk = message.get("body", b"")
            if self.stream and chunk:
                chunk = payload_part(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": more})

        await self.response(scope, receive, translate)

    def _headers(self, headers: List[Tuple[bytes, bytes]]) -> List[Tuple[bytes, bytes]]:
        out = [(b"x-amzn-invoked-production-variant", VARIANT.encode())]
        if not self.stream:
            return out + list(headers)
        out.append((b"content-type", EVENT_STREAM.encode()))
        for name, value in headers:
            if name.lower() == b"content-type":
                out.append((b"x-amzn-sagemaker-content-type", value))
            elif name.lower() != b"content-length":  # the framing changes the length
                out.append((name, value))
        return out

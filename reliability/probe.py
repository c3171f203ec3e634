"""Sending one catalogue case to a server and judging its answer.

    >>> judge(Case("x", "body", 400, field="inputs"), Answer(400, "application/json",
    ...       b'{"code": 400, "type": "RequestError", "field": "inputs", "message": "m"}'))
    Verdict(ok=True, detail='400 RequestError inputs')
"""

from __future__ import annotations

import dataclasses
import json
import socket
from typing import Any, Optional

import httpx

from .catalogue import DJL, OPENAI, TGI, Case

#: How long one case may take to be answered: a deadline, not a measurement.
CASE_TIMEOUT_S = 120.0


@dataclasses.dataclass(frozen=True)
class Answer:
    status: int
    content_type: str
    body: bytes


@dataclasses.dataclass(frozen=True)
class Verdict:
    ok: bool
    detail: str


def send(case: Case, base_url: str) -> Answer:
    """What the server answers ``case`` (raw bytes on a socket for framing cases)."""
    if case.raw is not None:
        return _send_raw(case.raw, base_url)
    body = None if case.method in ("GET", "DELETE") else case.encoded_body()
    headers = {"content-type": "application/json", **case.headers}
    with httpx.Client(base_url=base_url, timeout=CASE_TIMEOUT_S) as client:
        response = client.request(case.method, case.path, content=body, headers=headers)
        return Answer(response.status_code, response.headers.get("content-type", ""),
                      response.content)


def _send_raw(raw: bytes, base_url: str) -> Answer:
    host, port = base_url.split("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=CASE_TIMEOUT_S) as sock:
        try:
            sock.sendall(raw)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server may answer and close before reading everything
        received = b""
        while True:
            try:
                chunk = sock.recv(65536)
            except (ConnectionResetError, socket.timeout):
                break
            if not chunk:
                break
            received += chunk
            head, sep, rest = received.partition(b"\r\n\r\n")
            if sep and _complete(head, rest):
                break
    return _parse_response(received)


def _complete(head: bytes, rest: bytes) -> bool:
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return len(rest) >= int(value.strip())
    return False


def _parse_response(received: bytes) -> Answer:
    head, _, body = received.partition(b"\r\n\r\n")
    lines = head.split(b"\r\n")
    try:
        status = int(lines[0].split()[1])
    except (IndexError, ValueError):
        return Answer(0, "", received)
    content_type = ""
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-type":
            content_type = value.strip().decode("latin-1")
    return Answer(status, content_type, body)


def _json(body: bytes) -> Optional[Any]:
    try:
        return json.loads(body)
    except ValueError:
        return None


def judge(case: Case, answer: Answer) -> Verdict:
    """Whether ``answer`` is what ``case`` must get: its status, and a JSON body in the
    route's error shape naming ``case.field`` (uvicorn's own answers excepted)."""
    if answer.status != case.status:
        return Verdict(False, f"status {answer.status}, expected {case.status}: "
                              f"{answer.body[:200]!r}")
    if case.uvicorn:
        return Verdict(True, f"{answer.status} from uvicorn ({case.note})")
    body = _json(answer.body)
    if case.status == 200:
        if answer.body and body is None and answer.content_type == "application/json":
            return Verdict(False, f"200 with a body that is not JSON: {answer.body[:100]!r}")
        return Verdict(True, "200")
    if not isinstance(body, dict):
        return Verdict(False, f"{answer.status} without a JSON object: {answer.body[:200]!r}")
    if case.shape == DJL:
        if body.get("code") != answer.status or "message" not in body:
            return Verdict(False, f"not djl's error shape: {body}")
        named = body.get("field")
        detail = f"{answer.status} {body.get('type')} {named or ''}".strip()
    elif case.shape == OPENAI:
        error = body.get("error")
        if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
            return Verdict(False, f"not OpenAI's error shape: {body}")
        named = error.get("param")
        detail = f"{answer.status} {error['type']} {named or ''}".strip()
    elif case.shape == TGI:
        if not isinstance(body.get("error"), str) or "error_type" not in body:
            return Verdict(False, f"not TGI's error shape: {body}")
        named = case.field if case.field and case.field in body["error"] else None
        detail = f"{answer.status} {body['error_type']}"
    else:
        raise ValueError(f"unknown shape {case.shape!r}")
    if case.field is not None and named != case.field:
        return Verdict(False, f"names {named!r}, expected {case.field!r}: {body}")
    return Verdict(True, detail)

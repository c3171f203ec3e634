"""The hostile-input catalogue: what a client may send, and what it must get back.

Each :class:`Case` is one request (a JSON body, raw bytes, odd headers, or raw bytes on a
socket for HTTP framing) with the status it must get and the shape of the body: a JSON
error naming the field it was refused for, in the route's own shape (djl-serving's
``{"code", "type", "field", "message"}``, OpenAI's ``{"error": {"message", "type",
"param", "code"}}``, TGI's ``{"error", "error_type"}``), or a 200 where the input is odd but
valid. Malformed HTTP is answered by djl-stream's h11 protocol (``serving/http_limits.py``)
before any route runs, in the same JSON shape; an answer that came from uvicorn itself
would be marked ``uvicorn=True``, the documented exception to "a JSON body".

The limits assumed are those :data:`SERVER_OPTIONS` sets, so that the catalogue means the
same on the tiny model and the embedded one.

    >>> len(CASES) >= 150, len({case.name for case in CASES}) == len(CASES)
    (True, True)
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Dict, List, Mapping, Optional, Tuple

#: Model properties the catalogue's limits assume (``OPTION_<NAME>`` of the server).
SERVER_OPTIONS: Mapping[str, str] = {
    "max_new_tokens_limit": "256",
    "max_input_length": "64",
    "max_rolling_batch_size": "8",
    "default_max_new_tokens": "4",
}
#: Server flags (``djl-stream serve``) the framing cases assume: short timeouts, so that
#: the cases that wait for them are short.
SERVER_FLAGS: Tuple[str, ...] = ("--timeout-header", "2", "--timeout-body", "2")

DJL = "djl"
OPENAI = "openai"
TGI = "tgi"
#: A request small enough to answer at once: every accepted case generates this much.
FEW = {"max_new_tokens": 2}


@dataclasses.dataclass(frozen=True)
class Case:
    """One hostile input and what it must get.

    ``body`` is JSON-encoded unless it is ``bytes``; ``raw`` (bytes) is sent on a socket as
    it is, for HTTP framing; ``field`` is what the error must name (``None``: any, or no
    field for errors that are not about one); ``shape`` the route's error shape.
    """

    name: str
    category: str
    status: int
    body: Any = None
    path: str = "/invocations"
    method: str = "POST"
    headers: Mapping[str, str] = dataclasses.field(default_factory=dict)
    raw: Optional[bytes] = None
    field: Optional[str] = None
    shape: str = DJL
    uvicorn: bool = False
    note: str = ""

    def encoded_body(self) -> bytes:
        if isinstance(self.body, bytes):
            return self.body
        return json.dumps(self.body).encode("utf-8")


def _djl(name: str, body: Any, status: int = 400, field: Optional[str] = None,
         category: str = "body", **more) -> Case:
    return Case(name=name, category=category, status=status, body=body, field=field, **more)


def _param(name: str, value: Any, status: int = 400, field: Optional[str] = None) -> Case:
    parameters = {**FEW, name: value} if name != "max_new_tokens" else {name: value}
    field = field if field is not None else f"parameters.{name}"
    return Case(name=f"parameters.{name}={json.dumps(value)[:40]}", category="parameters",
                status=status, body={"inputs": "Hi", "parameters": parameters, "stream": False},
                field=field if status != 200 else None)


def _body_cases() -> List[Case]:
    deep = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    return [
        _djl("empty body", b"", field="body"),
        _djl("whitespace body", b"  \n ", field="body"),
        _djl("truncated object", b'{"inputs": "Hi"', field="body"),
        _djl("truncated array", b"[1, 2", field="body"),
        _djl("trailing garbage", b'{"inputs": "Hi"} x', field="body"),
        _djl("single quotes", b"{'inputs': 'Hi'}", field="body"),
        _djl("NaN literal", b'{"inputs": "Hi", "parameters": {"temperature": NaN}}', field="body"),
        _djl("Infinity literal", b'{"inputs": "Hi", "parameters": {"top_p": Infinity}}',
             field="body"),
        _djl("invalid UTF-8", b'{"inputs": "\xff\xfe"}', field="body"),
        _djl("UTF-16 body", '{"inputs": "Hi"}'.encode("utf-16"), field="body"),
        _djl("JSON null", b"null", field="body"),
        _djl("JSON array", b"[]", field="body"),
        _djl("JSON string", b'"Hi"', field="body"),
        _djl("JSON number", b"42", field="body"),
        _djl("JSON true", b"true", field="body"),
        _djl("nested 100,000 deep", deep, field="body"),
        _djl("nested 40 deep", b'{"inputs": ' + b"[" * 40 + b"]" * 40 + b"}"),
        _djl("lone surrogate in inputs", b'{"inputs": "x\\ud800y"}', field="inputs"),
        _djl("lone low surrogate in inputs", b'{"inputs": "\\udc00"}', field="inputs"),
        # The key is named escaped: a lone surrogate cannot go into a UTF-8 answer either.
        _djl("lone surrogate in a key", b'{"inputs": "Hi", "\\ud800": 1}', field="\\ud800"),
        _djl("NUL in inputs", {"inputs": "a\u0000b", "parameters": FEW, "stream": False},
             status=200),
        _djl("unknown top-level key", {"inputs": "Hi", "prompts": "x"}, field="prompts"),
        # messages make it an OpenAI chat body (option.chat_protocol=openai), which has no
        # inputs: OpenAI's error shape.
        _djl("inputs and messages", {"inputs": "Hi", "messages": [{"role": "user",
                                                                    "content": "Hi"}]},
             field="inputs", shape=OPENAI),
        _djl("no inputs", {"parameters": FEW}, field="inputs"),
        _djl("inputs null", {"inputs": None}, field="inputs"),
        _djl("inputs number", {"inputs": 5}, field="inputs"),
        _djl("inputs bool", {"inputs": True}, field="inputs"),
        _djl("inputs object", {"inputs": {"text": "Hi"}}, field="inputs"),
        _djl("inputs empty list", {"inputs": []}, field="inputs"),
        _djl("inputs empty string", {"inputs": ""}, field="inputs"),
        _djl("inputs blank", {"inputs": " \n\t "}, field="inputs"),
        _djl("inputs list of number", {"inputs": [1]}, field="inputs[0]"),
        _djl("inputs list of null", {"inputs": [None]}, field="inputs[0]"),
        _djl("inputs nested list", {"inputs": [["Hi"]]}, field="inputs[0]"),
        _djl("inputs second prompt empty", {"inputs": ["Hi", ""]}, field="inputs[1]"),
        _djl("more prompts than the batch", {"inputs": ["Hi"] * 9}, field="inputs"),
        _djl("prompt over max_input_length", {"inputs": "word " * 200}, field="inputs"),
        _djl("one of two prompts too long", {"inputs": ["Hi", "word " * 200]},
             field="inputs[1]"),
        _djl("a megabyte of prompt", {"inputs": "x" * 1_000_000}, field="inputs"),
        _djl("stream string", {"inputs": "Hi", "stream": "yes"}, field="stream"),
        _djl("stream number", {"inputs": "Hi", "stream": 1}, field="stream"),
        _djl("stream null", {"inputs": "Hi", "stream": None, "parameters": FEW}, status=200),
        _djl("parameters null", {"inputs": "Hi", "parameters": None, "stream": False},
             status=200),
        _djl("parameters list", {"inputs": "Hi", "parameters": []}, field="parameters"),
        _djl("parameters string", {"inputs": "Hi", "parameters": "fast"}, field="parameters"),
        _djl("emoji and CJK prompt", {"inputs": "🦩 你好", "parameters": FEW, "stream": False},
             status=200),
        _djl("control characters", {"inputs": "\u0007\u001b[31mHi", "parameters": FEW,
                                    "stream": False}, status=200),
    ]


def _parameter_cases() -> List[Case]:
    cases = []
    for name, values in {
        "max_new_tokens": [0, -1, 257, 10**12, "5", 5.5, True],
        "temperature": [0, -1, 1e-37, 101, "1", True, [1]],
        "top_k": [-1, 1.5, "3", True],
        "top_p": [0, -0.1, 1.01, "0.5", 1e-300 * 0],
        "typical_p": [0, 2, "x"],
        "repetition_penalty": [0, 1e-300, 11, -1, "2"],
        "do_sample": ["yes", 1, [True]],
        "manual_seed": [-1, 2**63, 1.5, "1"],
        "seed": [-1, 2**64, "7"],
        "stop": [[""], "x" * 257, ["."] * 17, [1], {"a": 1}, [None], [["."]]],
        "min_new_tokens": [-1, 3, "1"],
        "ignore_eos": ["yes", 1],
        "logprobs": ["yes", 2],
        "top_logprobs": [21, -1, 1.5],
        "details": ["yes", 0],
        "return_full_text": [1, "true"],
    }.items():
        for value in values:
            field = f"parameters.{name}"
            if name == "stop" and isinstance(value, list) and value and value != ["."] * 17:
                field = "parameters.stop[0]"
            cases.append(_param(name, value, field=field))
    cases += [
        _param("beams", 2),
        _param("max_new_token", 5),
        _param("temprature", 0.5),
        _param("stop", None, status=200),
        _param("do_sample", None, status=200),
        _param("stop", "\\ud800", status=200),  # an escaped backslash: a valid string
        Case("seed and manual_seed", "parameters", 400,
             body={"inputs": "Hi", "parameters": {**FEW, "seed": 1, "manual_seed": 1}},
             field="parameters.seed"),
        Case("top_logprobs with details false", "parameters", 400,
             body={"inputs": "Hi", "parameters": {**FEW, "top_logprobs": 2, "details": False}},
             field="parameters.top_logprobs"),
        Case("greedy with every warper", "parameters", 200,
             body={"inputs": "Hi", "stream": False, "parameters": {
                 **FEW, "temperature": 0.0001, "top_k": 1, "top_p": 1e-9, "typical_p": 1e-9}}),
        Case("sampling at the limits", "parameters", 200,
             body={"inputs": "Hi", "stream": False, "parameters": {
                 **FEW, "do_sample": True, "temperature": 0.0001, "repetition_penalty": 0.01,
                 "top_p": 1e-9, "manual_seed": 2**63 - 1}}),
        Case("sampling hot", "parameters", 200,
             body={"inputs": "Hi", "stream": False, "parameters": {
                 **FEW, "do_sample": True, "temperature": 100, "repetition_penalty": 10}}),
    ]
    return cases


def _message_cases() -> List[Case]:
    def chat(messages: Any, status: int = 400, field: Optional[str] = None, name: str = "") -> Case:
        return Case(name=f"messages: {name or json.dumps(messages)[:50]}", category="messages",
                    status=status, field=field, headers={"djl_stream_protocol": "djl"},
                    body={"messages": messages, "parameters": FEW, "stream": False})

    return [
        chat([], field="messages"),
        chat("Hi", field="messages"),
        chat({"role": "user", "content": "Hi"}, field="messages"),
        chat([{"content": "Hi"}], field="messages[0].role"),
        chat([{"role": "robot", "content": "Hi"}], field="messages[0].role"),
        chat([{"role": "user"}], field="messages[0].content"),
        chat([{"role": "user", "content": 5}], field="messages[0].content"),
        chat([{"role": "user", "content": ""}], field="messages[0].content"),
        chat([{"role": "user", "content": None}], field="messages[0].content"),
        chat([{"role": "user", "content": "Hi", "name": "x"}], field="messages[0].name"),
        chat(["Hi"], field="messages[0]"),
        chat([None], field="messages[0]"),
        chat([{"role": "user", "content": "x" * 5000}], field="messages"),
        chat([{"role": "user", "content": "Hi"}], status=200, name="one user turn"),
        chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
             status=200, name="system and user"),
        Case("messages: lone surrogate", "messages", 400, headers={"djl_stream_protocol": "djl"},
             body=b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
             field="messages[0].content"),
    ]


def _header_cases() -> List[Case]:
    ok = {"inputs": "Hi", "parameters": FEW, "stream": False}
    return [
        Case("batch_size header", "headers", 200, body=ok, headers={"batch_size": "2"}),
        Case("batch_size header 0", "headers", 200, body=ok, headers={"batch_size": "0"}),
        Case("unknown protocol header", "headers", 400, body=ok,
             headers={"djl_stream_protocol": "grpc"}, field="djl_stream_protocol"),
        Case("protocol header tgi", "headers", 200, body=ok,
             headers={"djl_stream_protocol": "tgi-generate"}),
        Case("content-type text/plain", "headers", 200, body=ok,
             headers={"content-type": "text/plain"}),
        Case("content-type form", "headers", 200, body=ok,
             headers={"content-type": "application/x-www-form-urlencoded"}),
        Case("a 4 KB header", "headers", 200, body=ok, headers={"x-padding": "p" * 4096}),
        Case("100 headers", "headers", 200, body=ok,
             headers={f"x-h{i}": str(i) for i in range(100)}),
        Case("requestId header", "headers", 200, body=ok, headers={"requestId": "forged"}),
        Case("sagemaker custom attributes", "headers", 200, body=ok,
             headers={"X-Amzn-SageMaker-Custom-Attributes": "a=1;b=2"}),
    ]


def _request(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode("latin-1") + b"\r\n" + body


def _framing_cases() -> List[Case]:
    ok = json.dumps({"inputs": "Hi", "parameters": FEW, "stream": False}).encode()
    host = "Host: 127.0.0.1\nContent-Type: application/json\n"
    return [
        Case("unknown route", "framing", 404, path="/nope", body={}, field=None),
        Case("GET /invocations", "framing", 405, method="GET"),
        Case("PUT /invocations", "framing", 405, method="PUT", body={}),
        Case("DELETE /ping", "framing", 405, path="/ping", method="DELETE"),
        Case("another model's route", "framing", 404, path="/predictions/other", body={}),
        Case("invalid request line", "framing", 400, raw=b"HELLO\r\n\r\n",
             note="h11 refuses the request line before any application code runs"),
        Case("HTTP/0.9 request", "framing", 400, raw=b"GET /ping\r\n\r\n",
             note="no HTTP version: h11 refuses it"),
        Case("bad chunk size", "framing", 400,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Transfer-Encoding: chunked\n",
                          b"zz\r\n" + ok + b"\r\n0\r\n\r\n"),
             note="h11 refuses the chunk header"),
        Case("content-length and chunked", "framing", 400,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Content-Length: {len(ok)}\n"
                          "Transfer-Encoding: chunked\n", b"0\r\n\r\n"),
             note="h11 refuses a request with both framings (request smuggling)"),
        Case("negative content-length", "framing", 400,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Content-Length: -5\n", ok),
             note="h11 refuses the header"),
        Case("a valid chunked body", "framing", 200,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Transfer-Encoding: chunked\n"
                          "Connection: close\n",
                          b"%x\r\n" % len(ok) + ok + b"\r\n0\r\n\r\n")),
        Case("declared 10 GB body", "framing", 413,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Content-Length: 10000000000\n"
                          "Connection: close\n", b'{"inputs": "'),
             note="refused from its Content-Length, before a byte of the body is read"),
        Case("a 20 MB body", "framing", 413, body={"inputs": "x" * 20_000_000}),
        Case("a body shorter than its content-length", "framing", 408,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Content-Length: 1000\n", ok),
             note="after --timeout-body"),
        Case("a chunked body without its last chunk", "framing", 408,
             raw=_request(f"POST /invocations HTTP/1.1\n{host}Transfer-Encoding: chunked\n",
                          b"%x\r\n" % len(ok) + ok + b"\r\n"),
             note="after --timeout-body"),
        Case("a head that never ends", "framing", 408,
             raw=b"POST /invocations HTTP/1.1\r\nHost: 127.0.0.1\r\n",
             note="after --timeout-header"),
    ]


def _openai_cases() -> List[Case]:
    base = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}

    def chat(name: str, status: int = 400, param: Optional[str] = None, **changes) -> Case:
        body = {**base, **changes}
        return Case(f"chat: {name}", "openai", status, body=body, path="/v1/chat/completions",
                    field=param, shape=OPENAI)

    completion_base = {"model": "m", "prompt": "Hi", "max_tokens": 2}
    return [
        chat("temperature 3", param="temperature", temperature=3),
        chat("temperature -1", param="temperature", temperature=-1),
        chat("temperature 1e-37 is greedy", status=200, temperature=1e-37),
        chat("max_tokens 0", param="max_tokens", max_tokens=0),
        chat("max_tokens over the limit", param="max_tokens", max_tokens=257),
        chat("n 0", param="n", n=0),
        chat("n over the batch", param="n", n=9),
        chat("messages empty", param="messages", messages=[]),
        chat("messages null", param="messages", messages=None),
        chat("tool_choice naming no offered tool", param="tool_choice.function.name",
             tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
             tool_choice={"type": "function", "function": {"name": "g"}}),
        chat("logit_bias 500", param="logit_bias.1", logit_bias={"1": 500}),
        chat("logit_bias beyond the vocabulary", param="logit_bias",
             logit_bias={"99999999": 5}),
        chat("presence_penalty 3", param="presence_penalty", presence_penalty=3),
        chat("17 stop strings", param="stop", stop=["."] * 17),
        chat("top_logprobs without logprobs", param="top_logprobs", top_logprobs=2),
        chat("top_logprobs 21", param="top_logprobs", logprobs=True, top_logprobs=21),
        chat("response_format xml", param="response_format.type",
             response_format={"type": "xml"}),
        chat("response_format schema llguidance refuses",
             param="response_format.json_schema.schema",
             response_format={"type": "json_schema",
                              "json_schema": {"name": "x", "schema": {"type": "wat"}}}),
        chat("stream string", param="stream", stream="yes"),
        chat("unknown key", param="beams", beams=2),
        chat("repetition_penalty 1e-300", param="repetition_penalty",
             repetition_penalty=1e-300),
        chat("content parts", status=200,
             messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]),
        chat("image part", param="messages[0].content[0].type",
             messages=[{"role": "user", "content": [{"type": "image_url",
                                                     "image_url": {"url": "x"}}]}]),
        Case("completion: prompt empty", "openai", 400, path="/v1/completions",
             body={**completion_base, "prompt": ""}, field="prompt", shape=OPENAI),
        Case("completion: prompt ids negative", "openai", 400, path="/v1/completions",
             body={**completion_base, "prompt": [1, -2]}, field="prompt[1]", shape=OPENAI),
        Case("completion: prompt ids beyond the vocabulary", "openai", 400,
             path="/v1/completions", body={**completion_base, "prompt": [1, 99999999]},
             field="prompt", shape=OPENAI),
        Case("completion: echo", "openai", 400, path="/v1/completions",
             body={**completion_base, "echo": True}, field="echo", shape=OPENAI),
        Case("completion: logprobs 21", "openai", 400, path="/v1/completions",
             body={**completion_base, "logprobs": 21}, field="logprobs", shape=OPENAI),
        Case("completion: best_of 2", "openai", 400, path="/v1/completions",
             body={**completion_base, "best_of": 2}, field="best_of", shape=OPENAI),
        Case("completion: not JSON", "openai", 400, path="/v1/completions", body=b"{",
             shape=OPENAI),
    ]


def _tgi_cases() -> List[Case]:
    def generate(name: str, parameters: Dict[str, Any], status: int = 422,
                 field: Optional[str] = None, path: str = "/generate", **body) -> Case:
        payload = {"inputs": "Hi", "parameters": {"max_new_tokens": 2, **parameters}, **body}
        return Case(f"tgi {path}: {name}", "tgi", status, body=payload, path=path, field=field,
                    shape=TGI)

    return [
        generate("top_p 1.5", {"top_p": 1.5}),
        generate("best_of 2", {"best_of": 2}),
        generate("truncate 10", {"truncate": 10}),
        generate("watermark", {"watermark": True}),
        generate("grammar yaml", {"grammar": {"type": "yaml", "value": {}}}),
        generate("grammar regex empty", {"grammar": {"type": "regex", "value": ""}}),
        generate("top_n_tokens 21", {"top_n_tokens": 21}),
        generate("max_new_tokens 0", {"max_new_tokens": 0}),
        generate("temperature 0", {"temperature": 0}),
        generate("unknown parameter", {"beams": 2}),
        generate("details string", {"details": "x"}),
        generate("inputs empty", {}, inputs=""),
        generate("stream true on /generate", {}, stream=True),
        generate("stream false on /generate_stream", {}, path="/generate_stream", stream=False),
        generate("all nulls", {"best_of": None, "truncate": None, "watermark": False,
                               "decoder_input_details": False, "top_n_tokens": None},
                 status=200),
        generate("seed at 2**64-1", {"do_sample": True, "seed": 2**64 - 1}, status=200),
        Case("tgi /: not JSON", "tgi", 422, path="/", body=b"{", field="body", shape=TGI),
    ]


CASES: Tuple[Case, ...] = tuple(
    _body_cases() + _parameter_cases() + _message_cases() + _header_cases()
    + _framing_cases() + _openai_cases() + _tgi_cases())

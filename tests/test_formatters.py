"""Output formatters: each decode step's text pieces -> one chunk of bytes."""

from __future__ import annotations

import json
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from djl_stream.protocols.djl import formatters
from djl_stream.protocols.djl.formatters import (BUILTIN_FORMATTERS, StreamError, StreamFormatter,
                                   register_formatter, resolve_formatter)


@pytest.fixture(autouse=True)
def no_leftover_registrations():
    yield
    formatters._registered.clear()


def model_py(**functions) -> types.ModuleType:
    module = types.ModuleType("model")
    for name, fn in functions.items():
        setattr(module, name, fn)
    return module


def sse_events(chunk: bytes) -> list[dict[str, str]]:
    """Parse server-sent events the way a browser's EventSource does (enough for tests)."""
    text = chunk.decode("utf-8")
    assert text.endswith("\n\n"), "every event ends with a blank line"
    events = []
    for block in text[:-2].split("\n\n"):
        fields = dict(line.split(": ", 1) for line in block.split("\n"))
        events.append(fields)
    return events


# -- jsonlines --------------------------------------------------------------------------


def test_jsonlines_is_the_default_and_writes_one_json_document_per_line():
    fmt = resolve_formatter(None)

    assert fmt is BUILTIN_FORMATTERS["jsonlines"]
    assert fmt.content_type == "application/jsonlines"
    assert fmt(["Hello", " world"]) == b'{"output_tokens": ["Hello", " world"]}\n'


def test_a_whole_jsonlines_stream_parses_line_by_line():
    fmt = resolve_formatter("jsonlines")
    steps = [["Hi", "Yo"], [" there", "\n"], ["\"quoted\"", "\\"], ["", "tab\t"]]
    stream = b"".join(fmt(step) for step in steps)

    lines = stream.decode("utf-8").split("\n")
    assert lines[-1] == "", "the stream ends with a newline"
    assert [json.loads(line)["output_tokens"] for line in lines[:-1]] == steps


def test_jsonlines_keeps_emoji_and_cjk_as_utf8_not_escapes():
    chunk = resolve_formatter("jsonlines")(["你好", "👋🏽"])

    assert "你好".encode("utf-8") in chunk
    assert b"\\u" not in chunk
    assert json.loads(chunk) == {"output_tokens": ["你好", "👋🏽"]}


@given(st.lists(st.text(), max_size=4))
def test_any_text_makes_exactly_one_valid_json_line(pieces):
    chunk = resolve_formatter("jsonlines")(pieces)

    assert chunk.endswith(b"\n")
    assert chunk.count(b"\n") == 1, "newlines inside text are escaped"
    assert json.loads(chunk.decode("utf-8")) == {"output_tokens": pieces}


def test_jsonlines_error_is_a_json_line_with_an_error_key():
    chunk = resolve_formatter("jsonlines")(StreamError("CUDA out of memory"))

    assert chunk.endswith(b"\n")
    assert json.loads(chunk) == {"error": "CUDA out of memory"}


def test_an_exception_item_is_rendered_as_an_error_too():
    assert json.loads(resolve_formatter("jsonlines")(RuntimeError("boom"))) == {"error": "boom"}


# -- sse --------------------------------------------------------------------------------


def test_sse_writes_one_data_event_per_step():
    fmt = resolve_formatter("sse")
    chunk = fmt(["Hi", "😀"])

    assert fmt.content_type == "text/event-stream"
    assert chunk == 'data: {"output_tokens": ["Hi", "😀"]}\n\n'.encode("utf-8")
    [event] = sse_events(chunk)
    assert json.loads(event["data"]) == {"output_tokens": ["Hi", "😀"]}


def test_sse_text_with_newlines_stays_inside_one_data_line():
    [event] = sse_events(resolve_formatter("sse")(["line one\n\nline two"]))
    assert json.loads(event["data"])["output_tokens"] == ["line one\n\nline two"]


def test_sse_error_is_an_error_event():
    [event] = sse_events(resolve_formatter("sse")(StreamError("stopped")))

    assert event["event"] == "error"
    assert json.loads(event["data"]) == {"error": "stopped"}


# -- custom formatters ------------------------------------------------------------------


def test_a_function_in_model_py_is_found_by_name():
    def plain_text(pieces):
        return "".join(pieces)

    fmt = resolve_formatter("plain_text", model_py(plain_text=plain_text))

    assert isinstance(fmt, StreamFormatter)
    assert fmt.name == "plain_text"
    assert fmt(["a", "é"]) == "aé".encode("utf-8")
    assert fmt.content_type == "application/jsonlines"


def test_a_custom_function_may_declare_its_content_type():
    def csv_line(pieces):
        return ",".join(pieces) + "\n"

    csv_line.content_type = "text/csv"

    assert resolve_formatter("csv_line", model_py(csv_line=csv_line)).content_type == "text/csv"


def test_a_custom_function_may_return_bytes_or_anything_json():
    module = model_py(as_bytes=lambda p: bytearray(b"b"), as_dict=lambda p: {"text": p[0]})

    assert resolve_formatter("as_bytes", module)(["x"]) == b"b"
    assert resolve_formatter("as_dict", module)(["x"]) == b'{"text": "x"}\n'


def test_a_custom_function_gets_the_jsonlines_error_line():
    fmt = resolve_formatter("upper", model_py(upper=lambda p: "".join(p).upper()))
    assert json.loads(fmt(StreamError("timed out"))) == {"error": "timed out"}


def test_an_unknown_name_lists_the_builtins_and_blames_model_py():
    with pytest.raises(ValueError) as raised:
        resolve_formatter("jsonline", model_py())

    message = str(raised.value)
    assert "'jsonlines'" in message and "'sse'" in message
    assert "no function of that name was found in model.py" in message


def test_a_name_that_is_not_a_function_is_refused():
    with pytest.raises(ValueError, match="not a function"):
        resolve_formatter("VERSION", model_py(VERSION="1.0"))


def test_register_formatter_makes_a_name_selectable_without_a_module():
    @register_formatter("words", content_type="text/plain")
    def words(pieces):
        return " ".join(pieces)

    fmt = resolve_formatter("words")
    assert words.content_type == "text/plain"
    assert fmt.content_type == "text/plain"
    assert fmt(["a", "b"]) == b"a b"


def test_builtin_names_cannot_be_registered_over():
    with pytest.raises(ValueError, match="built-in"):
        register_formatter("sse")


def test_builtin_formatters_are_read_only():
    with pytest.raises(TypeError):
        BUILTIN_FORMATTERS["mine"] = BUILTIN_FORMATTERS["sse"]  # type: ignore[index]

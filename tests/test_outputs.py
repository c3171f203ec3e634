"""Output: what handle() returns, and how stream items become bytes."""

from __future__ import annotations

import json

import pytest

from djl_stream.protocols.djl.formatters import StreamError, resolve_formatter
from djl_stream.serving.outputs import Output


def body(out: Output, index: int = 0) -> bytes:
    return bytes(out.content.value_at(index))


def test_a_new_output_is_200_ok_with_nothing_in_it():
    out = Output()

    assert (out.code, out.message) == (200, "OK")
    assert out.properties == {}
    assert out.content.is_empty()
    assert out.stream_content is None
    assert out.stream_output_formatter is None


def test_setters_and_properties_chain():
    out = Output().set_code(201).set_message("Created").add_property("x-request-id", "r1")

    assert (out.code, out.message) == (201, "Created")
    assert out.properties == {"x-request-id": "r1"}


def test_add_encodes_text_as_utf8_and_passes_bytes_through():
    out = Output().add("你好 👋").add(b"\x00raw").add(bytearray(b"ba"))

    assert body(out, 0) == "你好 👋".encode("utf-8")
    assert body(out, 1) == b"\x00raw"
    assert body(out, 2) == b"ba"


def test_add_json_encodes_anything_else_as_djl_python_does():
    out = Output().add({"generated_text": "café ☕"}, key="result")

    assert out.content.key_at(0) == "result"
    # djl_python's Output._encode_json: indent=2, separators (",", ":"), non-ASCII kept
    assert body(out) == '{\n  "generated_text":"café ☕"\n}'.encode("utf-8")


def test_add_as_json_encodes_even_a_string():
    out = Output().add_as_json("hi").add_as_json([1, 2.5, None])

    assert json.loads(body(out, 0)) == "hi"
    assert json.loads(body(out, 1)) == [1, 2.5, None]


def test_json_refuses_nan_which_clients_cannot_parse():
    with pytest.raises(ValueError):
        Output().add({"score": float("nan")})


def test_batch_index_prefixes_the_key_as_djl_python_does():
    out = Output().add("a", batch_index=0).add("b", key="data", batch_index=1)

    assert out.content.get_keys() == ["batch_0.", "batch_1.data"]


def test_error_sets_the_code_and_a_json_body():
    out = Output().add("partial answer").error("CUDA out of memory", code=507)

    assert out.code == 507
    assert out.message == "invoke handler failure"
    assert out.properties["content-type"] == "application/json"
    assert out.content.size() == 1, "the error body replaces what was added before"
    assert json.loads(body(out)) == {"code": 507, "message": "invoke handler failure",
                                     "error": "CUDA out of memory"}


def test_error_defaults_to_424():
    out = Output().error("boom")
    assert out.code == 424
    assert json.loads(body(out))["code"] == 424


# -- streaming --------------------------------------------------------------------------


@pytest.mark.parametrize("not_an_iterator", [[["a"]], (["a"],), "abc", None])
def test_add_stream_content_refuses_what_is_not_an_iterator(not_an_iterator):
    # The djl worker would fail mid-response with "'list' object is not an iterator".
    with pytest.raises(TypeError, match="needs an iterator"):
        Output().add_stream_content(not_an_iterator)


def test_add_stream_content_takes_a_generator_and_keeps_the_formatter():
    def pieces():
        yield ["Hel"]
        yield ["lo"]

    formatter = resolve_formatter("jsonlines")
    out = Output().add_stream_content(pieces(), output_formatter=formatter)

    assert out.stream_output_formatter is formatter
    chunks = [out.format_stream_item(item) for item in out.stream_content]
    assert chunks == [b'{"output_tokens": ["Hel"]}\n', b'{"output_tokens": ["lo"]}\n']


def test_an_iter_over_a_list_is_accepted():
    out = Output().add_stream_content(iter([["a"]]))
    assert next(out.stream_content) == ["a"]


@pytest.mark.parametrize("formatted, wire", [
    ("é\n", "é\n".encode("utf-8")),
    (b"raw", b"raw"),
    (bytearray(b"ba"), b"ba"),
    ({"outputs": ["x"]}, b'{\n  "outputs":[\n    "x"\n  ]\n}'),
    (["x", "😀"], '[\n  "x",\n  "😀"\n]'.encode("utf-8")),
])
def test_format_stream_item_sends_the_formatter_result_by_its_type(formatted, wire):
    out = Output().add_stream_content(iter([]), output_formatter=lambda item: formatted)
    chunk = out.format_stream_item(["ignored"])

    assert chunk == wire
    assert isinstance(chunk, bytes)


def test_without_a_formatter_items_go_out_by_the_same_rules():
    out = Output().add_stream_content(iter([]))
    assert out.format_stream_item("text") == b"text"
    assert out.format_stream_item(["a"]) == b'[\n  "a"\n]'


def test_a_stream_error_item_becomes_an_error_line():
    out = Output().add_stream_content(iter([]), output_formatter=resolve_formatter("jsonlines"))
    assert json.loads(out.format_stream_item(StreamError("killed"))) == {"error": "killed"}

"""Output formatters: each decode step's text pieces (or token details) -> one chunk of bytes."""

from __future__ import annotations

import json
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from djl_stream.generation.step import Generation, Step
from djl_stream.protocols.djl import formatters
from djl_stream.protocols.djl.formatters import (BUILTIN_FORMATTERS, FINISH_REASONS, StreamError,
                                                 StreamFormatter, register_formatter,
                                                 resolve_formatter, token_record, tokens_record)


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


# -- per-token details ------------------------------------------------------------------

def test_a_step_with_tokens_behind_it_writes_the_same_text_lines_as_a_plain_list():
    # Steps from the Accelerate engine must not change a byte of the default formats.
    step = Step.of([Generation(0, 42, " Paris", logprob=-0.1, special=False), None])
    for name in ("jsonlines", "sse"):
        assert resolve_formatter(name)(step) == resolve_formatter(name)([" Paris", ""])


def test_jsonlines_details_is_built_in_and_writes_token_records():
    fmt = resolve_formatter("jsonlines_details")
    step = Step.of([Generation(0, 42, " Paris", logprob=-0.25),
                    Generation(1, 2, "", "eos", logprob=-1.5, special=True)])

    assert fmt.content_type == "application/jsonlines" and fmt.details is True
    chunk = fmt(step)
    assert chunk.endswith(b"\n") and chunk.count(b"\n") == 1
    assert json.loads(chunk) == {"tokens": [
        {"id": 42, "text": " Paris", "logprob": -0.25, "special": False},
        {"id": 2, "text": "", "logprob": -1.5, "special": True}]}


def test_a_prompt_that_did_not_advance_is_null():
    step = Step.of([None, Generation(1, 7, "x")])
    assert tokens_record(step)["tokens"][0] is None


def test_plain_lists_keep_their_text_without_a_token_id():
    assert tokens_record(["ab", ""]) == {"tokens": [
        {"id": None, "text": "ab", "logprob": None, "special": False}, None]}


def test_an_impossible_token_has_a_null_logprob_not_invalid_json():
    generation = Generation(0, 5, "a", logprob=float("-inf"),
                            top_logprobs=((5, float("-inf")),))
    chunk = resolve_formatter("jsonlines_details")(Step.of([generation]))
    assert b"Infinity" not in chunk
    assert json.loads(chunk)["tokens"][0]["logprob"] is None
    record = token_record(generation, "a", top_logprobs=1)
    assert record["top_logprobs"] == [{"id": 5, "text": None, "logprob": None}]


def test_top_logprobs_are_written_only_when_asked_with_their_texts():
    generation = Generation(0, 5, "a", logprob=-0.5,
                            top_logprobs=((5, -0.5), (9, -1.25), (3, -2.0)))

    assert "top_logprobs" not in token_record(generation, "a")
    record = token_record(generation, "a", top_logprobs=2, token_text=lambda i: f"<{i}>")
    assert record["top_logprobs"] == [{"id": 5, "text": "<5>", "logprob": -0.5},
                                      {"id": 9, "text": "<9>", "logprob": -1.25}]


def test_only_builtin_formatters_frame_records_of_their_own():
    assert BUILTIN_FORMATTERS["jsonlines"].write_record({"a": 1}) == b'{"a": 1}\n'
    assert BUILTIN_FORMATTERS["sse"].write_record({"a": 1}) == b'data: {"a": 1}\n\n'
    assert resolve_formatter("up", model_py(up=lambda p: p)).write_record is None
    assert not BUILTIN_FORMATTERS["jsonlines"].details and not BUILTIN_FORMATTERS["sse"].details


def test_finish_reasons_are_lmis_words():
    assert dict(FINISH_REASONS) == {"eos": "eos_token", "length": "length",
                                    "stop": "stop_sequence"}


@given(st.lists(st.one_of(st.none(), st.tuples(st.integers(0, 2**20), st.text(),
                                               st.floats(max_value=0), st.booleans())),
                min_size=1, max_size=4))
def test_any_step_makes_exactly_one_valid_details_line(entries):
    generations = [None if e is None else Generation(i, e[0], e[1], logprob=e[2], special=e[3])
                   for i, e in enumerate(entries)]
    chunk = resolve_formatter("jsonlines_details")(Step.of(generations))

    assert chunk.endswith(b"\n") and chunk.count(b"\n") == 1
    tokens = json.loads(chunk.decode("utf-8"))["tokens"]
    assert [t if t is None else (t["id"], t["text"], t["special"]) for t in tokens] == [
        None if e is None else (e[0], e[1], e[3]) for e in entries]

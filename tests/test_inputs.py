"""Input and PairList: what handle() receives outside the djl container; and compat."""

from __future__ import annotations

import sys
import types

import pytest
from hypothesis import given
from hypothesis import strategies as st

from djl_stream.serving import compat
from djl_stream.serving.inputs import Input, PairList


def request(body: str | bytes, content_type: str | None = "application/json") -> Input:
    inp = Input().add("data", body)
    if content_type is not None:
        inp.add_property("content-type", content_type)
    return inp


# -- PairList ---------------------------------------------------------------------------


def test_pairlist_keeps_order_and_encodes_strings_as_utf8():
    pairs = PairList().add("data", "héllo 👋").add("extra", b"\x00\x01").add(None, bytearray(b"x"))

    assert pairs.size() == 3
    assert pairs.get_keys() == ["data", "extra", None]
    assert pairs.value_at(0) == "héllo 👋".encode("utf-8")
    assert pairs.value_at(1) == b"\x00\x01"
    assert isinstance(pairs.value_at(2), bytearray)
    assert pairs.get_values() == [pairs.value_at(i) for i in range(3)]


def test_pairlist_get_returns_the_first_pair_with_that_key_or_none():
    pairs = PairList().add("k", "first").add("k", "second")

    assert pairs.get("k") == b"first"
    assert pairs.get("missing") is None
    assert pairs.key_at(1) == "k"


def test_pairlist_is_empty_until_something_is_added():
    pairs = PairList()
    assert pairs.is_empty()
    assert not pairs.add("a", "b").is_empty()


def test_pairlist_refuses_values_that_are_not_text_or_bytes():
    with pytest.raises(TypeError, match="str, bytes or bytearray"):
        PairList().add("data", 5)


# -- properties -------------------------------------------------------------------------


def test_get_property_ignores_case_like_http_headers():
    inp = Input({"Content-Type": "application/json", "requestId": "abc"})

    assert inp.get_property("content-type") == "application/json"
    assert inp.get_property("CONTENT-TYPE") == "application/json"
    assert inp.get_property("requestid") == "abc"
    assert inp.get_property("x-missing") is None
    assert inp.get_properties() == {"Content-Type": "application/json", "requestId": "abc"}


def test_builders_chain_and_the_init_call_has_no_content():
    init = Input().add_property("model_id", "gpt2").add_property("handler", "handle")

    assert init.is_empty()
    assert init.get_function_name() == "handle"
    assert init.get_as_bytes() is None
    assert init.get_data() is None


# -- content ----------------------------------------------------------------------------


def test_get_as_json_reads_the_data_entry_when_there_is_one():
    inp = Input().add("query", "x=1").add("data", '{"inputs": "hi"}')

    assert inp.get_as_json() == {"inputs": "hi"}
    assert inp.get_as_string("query") == "x=1"


def test_without_a_data_entry_the_first_content_entry_is_the_body():
    inp = Input().add("body", '[1, 2]').add("other", "3")

    assert inp.get_as_json() == [1, 2]
    assert inp.get_as_json("other") == 3


def test_asking_for_a_missing_key_is_a_key_error():
    with pytest.raises(KeyError, match="nope"):
        request("{}").get_as_bytes("nope")


def test_contains_key_looks_at_content_not_properties():
    inp = request("{}")
    assert inp.contains_key("data")
    assert not inp.contains_key("content-type")


def test_utf8_text_round_trips_through_content():
    text = "你好, мир 👋🏽 café"
    inp = request(f'{{"inputs": "{text}"}}')

    assert inp.get_as_json()["inputs"] == text
    assert inp.get_as_bytes() == f'{{"inputs": "{text}"}}'.encode("utf-8")


@pytest.mark.parametrize("content_type, expected", [
    ("application/json", {"a": 1}),
    ("application/json; charset=utf-8", {"a": 1}),
    ("Application/JSON", {"a": 1}),
    ("text/plain", '{"a": 1}'),
    ("application/octet-stream", b'{"a": 1}'),
    (None, b'{"a": 1}'),
])
def test_get_data_decodes_by_content_type(content_type, expected):
    assert request('{"a": 1}', content_type).get_data() == expected


# -- dynamic batching -------------------------------------------------------------------


def merged_batch() -> Input:
    # What the front end builds from two requests with batch_size=2 in serving.properties.
    return (Input({"batch_size": "2",
                   "batch_000_content-type": "application/json",
                   "batch_001_content-type": "text/plain",
                   "batch_001_requestId": "r1"})
            .add("batch_000_data", '{"inputs": "a"}')
            .add("batch_001_data", "plain b")
            .add("batch_001_lang", "fr"))


def test_a_merged_input_is_a_batch_of_its_batch_size():
    merged = merged_batch()
    assert merged.is_batch()
    assert merged.get_batch_size() == 2


def test_get_batches_splits_properties_and_content_by_prefix():
    first, second = merged_batch().get_batches()

    assert first.get_properties() == {"content-type": "application/json"}
    assert first.get_data() == {"inputs": "a"}
    assert second.get_properties() == {"content-type": "text/plain", "requestId": "r1"}
    assert second.get_data() == "plain b"
    assert second.get_as_string("lang") == "fr"
    assert not first.is_batch()


def test_the_separator_after_the_index_is_any_one_character():
    merged = Input({"batch_size": "1"}).add("batch_000.data", "x")
    assert merged.get_batches()[0].get_content().get_keys() == ["data"]


def test_a_plain_input_is_a_batch_of_one():
    inp = request("{}")
    assert not inp.is_batch()
    assert inp.get_batch_size() == 1
    assert inp.get_batches() == [inp]


def test_a_batched_content_key_without_prefix_is_refused():
    merged = Input({"batch_size": "1"}).add("data", "x")
    with pytest.raises(ValueError, match="no batch_NNN_ prefix"):
        merged.get_batches()


def test_an_index_outside_the_batch_is_refused():
    merged = Input({"batch_size": "2"}).add("batch_002_data", "x")
    with pytest.raises(ValueError, match="outside the batch of 2"):
        merged.get_batches()


@given(st.lists(st.text(), min_size=1, max_size=12))
def test_batches_come_back_in_order_with_their_bodies(bodies):
    merged = Input({"batch_size": str(len(bodies))})
    for i, body in enumerate(bodies):
        merged.add(f"batch_{i:03d}_data", body)

    assert [b.get_as_string() for b in merged.get_batches()] == bodies


# -- compat -----------------------------------------------------------------------------


@pytest.fixture
def fresh_compat():
    compat._resolve.cache_clear()
    yield compat
    compat._resolve.cache_clear()


def test_compat_uses_our_classes_when_djl_python_is_absent(fresh_compat, monkeypatch):
    monkeypatch.setitem(sys.modules, "djl_python", None)  # None makes the import fail

    from djl_stream.serving.inputs import Input as OurInput
    from djl_stream.serving.outputs import Output as OurOutput

    assert fresh_compat.Input is OurInput
    assert fresh_compat.Output is OurOutput
    assert fresh_compat.USING_DJL_PYTHON is False


def test_compat_uses_djl_python_inside_the_container(fresh_compat, monkeypatch):
    class DjlInput: ...

    class DjlOutput: ...

    package = types.ModuleType("djl_python")
    inputs_module = types.ModuleType("djl_python.inputs")
    outputs_module = types.ModuleType("djl_python.outputs")
    inputs_module.Input, outputs_module.Output = DjlInput, DjlOutput
    monkeypatch.setitem(sys.modules, "djl_python", package)
    monkeypatch.setitem(sys.modules, "djl_python.inputs", inputs_module)
    monkeypatch.setitem(sys.modules, "djl_python.outputs", outputs_module)

    assert fresh_compat.Input is DjlInput
    assert fresh_compat.Output is DjlOutput
    assert fresh_compat.USING_DJL_PYTHON is True


def test_compat_has_no_other_names():
    with pytest.raises(AttributeError):
        compat.Missing  # noqa: B018

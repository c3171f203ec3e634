"""The streaming client: lines from chunks split anywhere, JSON records, HTTP errors."""

from __future__ import annotations

import json
from typing import Iterator

import httpx
import pytest
from hypothesis import given
from hypothesis import strategies as st

from djl_stream.shipping.client import LineDecoder, StreamingError, iter_json_lines, stream

RECORDS = [{"output_tokens": ["Hello"]}, {"output_tokens": [" 👋🏽"]},
           {"output_tokens": ["你好，世界"]}, {"output_tokens": [" café ñ"]}]
#: JSON lines with emoji and CJK, the last one without its newline.
PAYLOAD = "\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS).encode("utf-8")
LINES = PAYLOAD.decode("utf-8").split("\n")


def decode_all(chunks: list[bytes]) -> list[str]:
    decoder = LineDecoder()
    lines = [line for chunk in chunks for line in decoder.feed(chunk)]
    return lines + decoder.flush()


@pytest.mark.parametrize("cut", range(len(PAYLOAD) + 1))
def test_a_split_at_any_byte_gives_the_same_lines(cut: int) -> None:
    assert decode_all([PAYLOAD[:cut], PAYLOAD[cut:]]) == LINES


def test_one_byte_at_a_time() -> None:
    assert decode_all([PAYLOAD[i:i + 1] for i in range(len(PAYLOAD))]) == LINES


@given(st.lists(st.integers(min_value=0, max_value=len(PAYLOAD)), max_size=12))
def test_any_number_of_splits_gives_the_same_lines(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(PAYLOAD)]
    chunks = [PAYLOAD[a:b] for a, b in zip(bounds, bounds[1:])]
    assert decode_all(chunks) == LINES


@given(st.lists(st.text(alphabet=st.characters(codec="utf-8", exclude_characters="\r\n")), min_size=1))
def test_lines_round_trip(lines: list[str]) -> None:
    data = "\n".join(lines).encode("utf-8")
    expected = lines if lines[-1] else lines[:-1]  # an empty last line is no line at all
    assert decode_all([data[i:i + 3] for i in range(0, len(data), 3)]) == expected


def test_a_line_waits_for_its_newline_and_flush_gives_the_rest() -> None:
    decoder = LineDecoder()
    assert decoder.feed(b'{"a": ') == []
    assert decoder.feed(b'1}\n{"b"') == ['{"a": 1}']
    assert decoder.flush() == ['{"b"']
    assert decoder.flush() == []


def test_crlf_and_empty_lines() -> None:
    assert decode_all([b"data: x\r\n\r\n", b"data: y\n\n"]) == ["data: x", "", "data: y", ""]


def test_invalid_utf8_is_replaced_not_raised() -> None:
    assert decode_all([b"ab\xff\n"]) == ["ab\ufffd"]


def test_iter_json_lines_reads_jsonlines_and_sse() -> None:
    sse = b'data: {"output_tokens": ["a"]}\n\nevent: ping\n\ndata: [DONE]\n\n'
    assert list(iter_json_lines([sse])) == [{"output_tokens": ["a"]}]
    assert list(iter_json_lines([PAYLOAD])) == RECORDS


def test_iter_json_lines_raises_at_an_error_record_after_the_records_before_it() -> None:
    records = iter_json_lines([b'{"output_tokens": ["a"]}\n{"error": "CUDA out of memory"}\n'])
    assert next(records) == {"output_tokens": ["a"]}
    with pytest.raises(StreamingError, match="CUDA out of memory") as raised:
        next(records)
    assert raised.value.status_code == 200


def test_raw_exception_text_in_the_stream_is_an_error() -> None:
    # What djl-serving itself appends when a handler without error records fails.
    with pytest.raises(StreamingError, match="stream failed: Traceback"):
        list(iter_json_lines([b'{"output_tokens": ["a"]}\nTraceback (most recent call last)']))


# -- stream() over HTTP --

def mock_client(status: int, chunks: list[bytes], seen: list[httpx.Request]) -> httpx.Client:
    def respond(request: httpx.Request) -> httpx.Response:
        seen.append(request)

        def body() -> Iterator[bytes]:
            yield from chunks

        return httpx.Response(status, content=body())

    return httpx.Client(transport=httpx.MockTransport(respond))


def test_stream_posts_json_and_yields_records() -> None:
    seen: list[httpx.Request] = []
    chunks = [PAYLOAD[i:i + 5] for i in range(0, len(PAYLOAD), 5)]
    with mock_client(200, chunks, seen) as client:
        records = list(stream("http://model/invocations", {"inputs": "Hi", "stream": True},
                              client=client))
    assert records == RECORDS
    assert json.loads(seen[0].content) == {"inputs": "Hi", "stream": True}
    assert seen[0].headers["content-type"] == "application/json"


def test_stream_raises_with_the_message_of_an_http_error() -> None:
    body = json.dumps({"code": 424, "message": "invoke handler failure",
                       "error": "max_new_tokens must be at most 2048"}).encode()
    with mock_client(424, [body], []) as client:
        with pytest.raises(StreamingError, match="HTTP 424: max_new_tokens must be at most 2048"
                           ) as raised:
            list(stream("http://model/invocations", {}, client=client))
    assert raised.value.status_code == 424
    assert raised.value.body["code"] == 424


def test_stream_raises_for_framework_errors_too() -> None:
    body = b'{"code": 503, "type": "ServiceUnavailableException", "message": "model is loading"}'
    with mock_client(503, [body], []) as client:
        with pytest.raises(StreamingError, match="HTTP 503: model is loading"):
            list(stream("http://model/invocations", {}, client=client))


def test_stream_raises_for_an_error_record_mid_stream() -> None:
    chunks = [b'{"output_tokens": ["a"]}\n', b'{"error": "boom"}\n']
    got: list[dict] = []
    with mock_client(200, chunks, []) as client:
        with pytest.raises(StreamingError, match="boom"):
            for record in stream("http://model/invocations", {}, client=client):
                got.append(record)
    assert got == [{"output_tokens": ["a"]}]

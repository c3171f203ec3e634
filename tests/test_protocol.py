"""EncodedStream: a generation's steps through a protocol's encoder, failures included."""

from __future__ import annotations

import pytest

from djl_stream.generation.step import Generation, Step
from djl_stream.protocols.protocol import EncodedStream, StreamEncoder


class Recorder(StreamEncoder):
    """Writes each step's text, a closing record, and errors, so the tests can see which
    of the encoder's methods the stream called."""

    content_type = "text/plain"

    def __init__(self, fail_on=None):
        self.fail_on = fail_on

    def step(self, step):
        if step[0] == self.fail_on:
            raise ValueError(f"cannot encode {step[0]!r}")
        ids = [g.token_id if g is not None else None for g in step.generations]
        return f"{step[0]}{ids}|".encode()

    def end(self):
        return b"END"

    def error(self, message):
        return f"ERROR({message})".encode()


def steps(*texts, fail_after=None):
    for i, text in enumerate(texts):
        if fail_after is not None and i == fail_after:
            raise RuntimeError("device lost")
        yield Step.of([Generation(0, i, text)])


def test_each_step_then_the_closing_chunk():
    assert list(EncodedStream(steps("a", "b"), Recorder())) == [b"a[0]|", b"b[1]|", b"END"]


def test_plain_lists_from_other_engines_are_steps_without_tokens():
    assert list(EncodedStream(iter([["x"]]), Recorder())) == [b"x[None]|", b"END"]


def test_a_failure_before_the_first_chunk_is_raised_for_an_error_status():
    with pytest.raises(RuntimeError, match="device lost"):
        next(EncodedStream(steps("a", fail_after=0), Recorder()))


def test_a_failure_after_the_first_chunk_is_the_encoders_error_record():
    chunks = list(EncodedStream(steps("a", "b", "c", fail_after=2), Recorder()))
    assert chunks == [b"a[0]|", b"b[1]|", b"ERROR(RuntimeError: device lost)"]


def test_an_encoder_that_raises_midway_ends_the_stream_with_its_error_record():
    chunks = list(EncodedStream(steps("a", "b", "c"), Recorder(fail_on="b")))
    assert chunks == [b"a[0]|", b"ERROR(ValueError: cannot encode 'b')"]


def test_closing_closes_the_generation():
    closed = []

    class Source:
        def __iter__(self):
            return self

        def __next__(self):
            return Step(["a"])

        def close(self):
            closed.append(True)

    stream = EncodedStream(Source(), Recorder())
    next(stream)
    stream.close()
    assert closed == [True] and list(stream) == []

"""Stop strings over streamed text: nothing of a stop string ever reaches the client."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from djl_stream.generation.stopping import StopStringMatcher


def run(stop, pieces):
    """Feeds ``pieces``; returns (emitted pieces, stopped), flushing when not stopped."""
    matcher = StopStringMatcher(stop)
    emitted = []
    for piece in pieces:
        text, stopped = matcher.feed(piece)
        emitted.append(text)
        if stopped:
            assert matcher.feed("more") == ("", True)
            assert matcher.flush() == ""
            return emitted, True
    emitted.append(matcher.flush())
    return emitted, False


def cut_at_first_stop(text: str, stop) -> tuple[str, bool]:
    """The specification, one character at a time: stop as soon as the text read so far
    ends with a stop string, and drop that stop string (the longest, on a tie)."""
    stop = [s for s in stop if s]
    for end in range(1, len(text) + 1):
        found = [s for s in stop if text[:end].endswith(s)]
        if found:
            return text[: end - max(map(len, found))], True
    return text, False


# --- examples -----------------------------------------------------------------------


def test_text_before_the_stop_string_is_emitted():
    assert run(["END"], ["Hello END world"]) == (["Hello "], True)


def test_stop_string_split_across_pieces_is_caught():
    assert run(["<|end|>"], ["answer<", "|en", "d|>", "ignored"]) == (["answer", "", ""], True)


def test_possible_start_is_held_back_then_released():
    matcher = StopStringMatcher(["\nUser:"])
    assert matcher.feed("Hi\n") == ("Hi", False)
    assert matcher.pending == "\n"
    assert matcher.feed("Us") == ("", False)
    assert matcher.feed("ed to it") == ("\nUsed to it", False)
    assert matcher.flush() == ""


def test_flush_returns_held_text_at_eos():
    matcher = StopStringMatcher(["###"])
    assert matcher.feed("title #") == ("title ", False)
    assert matcher.flush() == "#"
    assert not matcher.stopped


def test_earliest_completed_stop_string_wins():
    matcher = StopStringMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", True)
    assert matcher.matched == "lo w"


def test_longest_stop_string_is_cut_when_two_end_together():
    assert run(["b", "ab"], ["xab"]) == (["x"], True)


def test_stop_string_at_the_very_start():
    assert run(["Q:"], ["Q", ": next"]) == (["", ""], True)


def test_no_stop_strings_pass_text_through_without_holding():
    matcher = StopStringMatcher([])
    assert matcher.feed("a<") == ("a<", False)
    assert matcher.pending == ""
    assert StopStringMatcher([""]).feed("x") == ("x", False)  # empty ones are ignored


def test_emoji_and_cjk_stop_strings():
    assert run(["🛑"], ["go 🟢 ", "then 🛑 stop"]) == (["go 🟢 ", "then "], True)
    assert run(["结束"], ["你好结", "束了"]) == (["你好", ""], True)


# --- the property -------------------------------------------------------------------

# A small alphabet makes stop strings, and near misses, common.
alphabet = st.sampled_from(list("ab<|>\n é") + ["🛑", "中"])
texts = st.text(alphabet, max_size=40)
stop_lists = st.lists(st.text(alphabet, min_size=1, max_size=5), max_size=3)


@st.composite
def split_text(draw) -> list[str]:
    text = draw(texts)
    cuts = sorted(draw(st.lists(st.integers(0, len(text)), max_size=10)))
    bounds = [0, *cuts, len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


@settings(max_examples=500, deadline=None)
@given(pieces=split_text(), stop=stop_lists)
def test_emitted_text_is_the_text_before_the_first_stop(pieces, stop):
    text = "".join(pieces)
    emitted, stopped = run(stop, pieces)
    assert ("".join(emitted), stopped) == cut_at_first_stop(text, stop)
    so_far = ""
    for piece in emitted:
        so_far += piece
        assert not any(s in so_far for s in stop)


@settings(max_examples=300, deadline=None)
@given(pieces=split_text(), stop=st.text(alphabet, min_size=1, max_size=5))
def test_single_stop_string_cuts_at_its_first_occurrence(pieces, stop):
    text = "".join(pieces)
    emitted, stopped = run([stop], pieces)
    where = text.find(stop)
    assert stopped == (where >= 0)
    assert "".join(emitted) == (text[:where] if where >= 0 else text)


@settings(max_examples=300, deadline=None)
@given(pieces=split_text(), stop=stop_lists)
def test_held_back_text_is_only_ever_a_possible_start(pieces, stop):
    matcher = StopStringMatcher(stop)
    for piece in pieces:
        _, stopped = matcher.feed(piece)
        if stopped:
            break
        held = matcher.pending
        assert held == "" or any(s.startswith(held) and s != held for s in stop)

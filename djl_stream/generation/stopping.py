"""Stop strings over streamed text.

A stop string can arrive split over several pieces ("<|", "end", "|>"), so text that might
be the start of one is held back until the next piece decides. Neither a stop string nor
any part of one ever reaches the client.

Example::

    >>> matcher = StopStringMatcher(["\\nUser:"])
    >>> matcher.feed("Sure.\\n")
    ('Sure.', False)
    >>> matcher.feed("Use")
    ('', False)
    >>> matcher.feed("r: hi")
    ('', True)
"""

from __future__ import annotations

from typing import Sequence

__all__ = ["StopStringMatcher"]


class StopStringMatcher:
    """Cuts streamed text at the first stop string, holding back possible beginnings of one.

    :meth:`feed` takes the next piece of text and returns ``(text safe to emit, stopped)``.
    The stream stops as soon as a stop string is complete; the text emitted is everything
    before that occurrence (when several stop strings end at the same character, the
    longest is cut). After that, feeds return ``("", True)``. When the sequence ends for
    another reason (eos, length), :meth:`flush` returns the text still held back.

    So the concatenation of all emitted text is the shortest prefix of the whole text that
    contains a stop string, minus that stop string (the whole text if none occurs), and no
    emitted prefix ever contains a stop string. Empty stop strings are ignored; with none
    left the matcher passes text through without holding anything.

    Example::

        >>> matcher = StopStringMatcher(["###"])
        >>> matcher.feed("a #"), matcher.feed("# b"), matcher.flush()
        (('a ', False), ('## b', False), '')
    """

    def __init__(self, stop: Sequence[str]) -> None:
        if isinstance(stop, str):
            stop = [stop]
        self._stop = tuple(dict.fromkeys(s for s in stop if s))
        # Every proper prefix of a stop string: the only suffixes worth holding back.
        self._prefixes = frozenset(s[:k] for s in self._stop for k in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self._stop), default=0)
        self._pending = ""
        self._matched: str | None = None

    @property
    def stop(self) -> tuple[str, ...]:
        """The (non-empty, de-duplicated) stop strings."""
        return self._stop

    @property
    def stopped(self) -> bool:
        """Whether a stop string was found."""
        return self._matched is not None

    @property
    def matched(self) -> str | None:
        """The stop string that ended the stream, if any."""
        return self._matched

    @property
    def pending(self) -> str:
        """Text held back because it may be the start of a stop string."""
        return self._pending

    def feed(self, piece: str) -> tuple[str, bool]:
        """Adds ``piece``; returns the text that is safe to emit and whether to stop.

        Example::

            >>> matcher = StopStringMatcher(["</s>"])
            >>> matcher.feed("done</"), matcher.feed("s> trailing")
            (('done', False), ('', True))
        """
        if self._matched is not None:
            return "", True
        if not self._stop:
            return piece, False
        text = self._pending + piece
        cut = self._first_match(text)
        if cut is not None:
            start, self._matched = cut
            self._pending = ""
            return text[:start], True
        hold = self._held_suffix_len(text)
        self._pending = text[len(text) - hold:] if hold else ""
        return text[: len(text) - hold], False

    def flush(self) -> str:
        """Returns the held-back text when the sequence ends without a stop string."""
        text, self._pending = self._pending, ""
        return "" if self._matched is not None else text

    def _first_match(self, text: str) -> tuple[int, str] | None:
        # Earliest end wins, because a stream has to stop as soon as one stop string is
        # complete; at the same end the longest (earliest start) is cut.
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start < 0:
                continue
            key = (start + len(stop), start, stop)
            if best is None or key < best:
                best = key
        return None if best is None else (best[1], best[2])

    def _held_suffix_len(self, text: str) -> int:
        for size in range(min(len(text), self._max_hold), 0, -1):
            if text[len(text) - size:] in self._prefixes:
                return size
        return 0

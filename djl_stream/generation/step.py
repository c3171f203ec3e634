"""What a decode step produced: per sequence a :class:`Generation`, per request a :class:`Step`.

Plain data, importable without torch: the protocols that write answers read it, and
``model.py`` must import cheaply.
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, List, Optional, Sequence, Tuple

#: Why a sequence finished: the model ended it, it reached ``max_new_tokens``, or it
#: produced one of its stop strings.
FINISH_REASONS = ("eos", "length", "stop")


@dataclasses.dataclass(frozen=True)
class Generation:
    """What one decode step produced for one sequence.

    ``text`` is what the step releases (``""`` while a character or a possible stop string
    is held back). ``logprob`` and ``top_logprobs`` (``(token_id, logprob)`` pairs, most
    likely first) are filled only for a sequence asked for them, from the model's own
    distribution before any sampling processor; ``special`` marks a special token (such as
    the end-of-sequence one), which adds no text.

    ``error`` says why the sequence failed this step (its own parameters made its scores
    unusable, say): it carries no token then, and the request it belongs to ends with
    that error while the batch goes on.
    """

    request_id: Hashable
    token_id: int
    text: str
    finish_reason: Optional[str] = None
    logprob: Optional[float] = None
    top_logprobs: Tuple[Tuple[int, float], ...] = ()
    special: bool = False
    error: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None or self.error is not None


class Step(list):
    """One decode step of one request, as stream generators yield it.

    It *is* the ``List[str]`` the ``StreamingUtils`` contract promises (the new text of each
    prompt, ``""`` where nothing was released), so formatters and callers that expect a
    plain list keep working; ``generations`` adds, per prompt, the :class:`Generation`
    behind that text, or ``None`` where the prompt did not advance this step (it finished
    earlier, or an engine has no per-token detail).

    >>> step = Step.of([Generation(0, 42, " Paris"), None])
    >>> list(step), step.generations[0].token_id
    ([' Paris', ''], 42)
    """

    def __init__(self, pieces: Iterable[str] = (),
                 generations: Optional[Sequence[Optional[Generation]]] = None) -> None:
        super().__init__(pieces)
        self.generations: List[Optional[Generation]] = (
            list(generations) if generations is not None else [None] * len(self))

    @classmethod
    def of(cls, generations: Sequence[Optional[Generation]]) -> "Step":
        return cls([g.text if g is not None else "" for g in generations], generations)



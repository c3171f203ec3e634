"""Pydantic building blocks that every protocol's request schema shares.

The limits a request meets are the engine's, not the protocol's: a stop string or a
repetition penalty is refused at the same bound on djl's, OpenAI's and TGI's routes, so
each protocol's schema builds on these types instead of restating them.

    >>> from pydantic import BaseModel
    >>> class Body(BaseModel):
    ...     prompt: Prompt
    ...     stop: StopList = None
    >>> Body(prompt="Hi", stop="\\n").stop
    ['\\n']
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

#: Stop strings one request may give, and the longest one.
MAX_STOP_SEQUENCES = 16
MAX_STOP_LENGTH = 256
#: The range of temperature and repetition penalty: the scores are divided by them, so
#: values near 0 overflow to infinity (and one request's NaNs used to fail its whole
#: batch); 1e-4 keeps a float32 logit of 1e4 finite, and is greedy in all but name. The
#: upper bounds lie far beyond any useful value.
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 100.0
MIN_REPETITION_PENALTY = 0.01
MAX_REPETITION_PENALTY = 10.0

#: Field options for a float a client sends: NaN and infinities are refused.
FINITE = dict(allow_inf_nan=False)


class Closed(BaseModel):
    """A request object that is strict (``"5"`` is not an integer) and closed (an unknown
    key is refused, so a misspelt parameter is never silently ignored)."""

    model_config = ConfigDict(strict=True, extra="forbid")


def one_or_many(value: Any) -> Any:
    """A lone string as a one-item list (``"stop": "\\n"`` means ``["\\n"]``)."""
    return [value] if isinstance(value, str) else value


def _not_blank(text: str) -> str:
    if not text.strip():
        raise PydanticCustomError("blank", "must not be empty or whitespace only")
    return text


#: A prompt or message content: a string with something in it besides whitespace.
Prompt = Annotated[str, AfterValidator(_not_blank)]
#: One stop string.
Stop = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
#: ``stop``: one string or a list of them, at most :data:`MAX_STOP_SEQUENCES`.
#: (The length bound sits inside ``Optional``: around it, pydantic applies it to ``None``
#: and raises a TypeError for ``"stop": null``.)
StopList = Annotated[Optional[Annotated[list[Stop], Field(max_length=MAX_STOP_SEQUENCES)]],
                     BeforeValidator(one_or_many)]

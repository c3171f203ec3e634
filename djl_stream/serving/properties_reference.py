"""The properties reference, ``docs/properties.md``, written from :class:`ModelProperties`.

Each property's line comes from its field (its meaning, its default as a user writes it,
the topic page that explains it), so the page cannot drift from the code: the test suite
renders it again and compares. Regenerate it after changing a property with
``python -m djl_stream.serving.properties_reference docs/properties.md``.

>>> page = render_reference()
>>> "| `option.dtype` | `auto` |" in page
True
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path
from typing import Any, List, Optional

from djl_stream.serving.properties import ModelProperties

#: djl-serving's own keys that a djl-stream user sets: its front end reads them, not
#: djl-stream. Key, default, meaning.
DJL_SERVING_KEYS = (
    ("engine", "`Python` in `model/`",
     "djl-serving's engine; djl-stream's handler runs on `Python` (or `MPI`)"),
    ("option.entryPoint", "`model.py` in `model/`",
     "the handler file; without it djl-serving 0.33's LMI image starts its async worker"),
    ("option.async_mode", "unset",
     "djl-serving 0.33: `true` starts the async worker, where concurrent requests share "
     "decode steps ([worker modes](deployment.md#the-two-worker-modes))"),
    ("option.rolling_batch", "`disable` in `model/`",
     "keeps LMI's own rolling batch out of the way: djl-stream batches requests itself"),
    ("option.predict_timeout", "240 s in the images",
     "how long djl-serving waits for a request's first answer; with the sync worker it "
     "includes the stream before it"),
    ("option.model_loading_timeout", "240 s",
     "how long djl-serving waits for the model to load (the decode step compiles after it)"),
)

INTRODUCTION = """\
# Properties

Set a property in the model directory's `serving.properties` as `option.<name>=<value>`, or
as the environment variable `OPTION_<NAME>` (how SageMaker passes configuration).
`serving.properties` wins over the environment, as in djl-serving; `djl-stream serve` and
`djl-stream check` warn about a variable it overrides. An unknown property is logged with
the closest valid name, and a badly typed one fails the load with a message naming it.

This page is generated from `djl_stream/serving/properties.py`
(`python -m djl_stream.serving.properties_reference docs/properties.md`); a test fails when
the two disagree.
"""


def _default(field: dataclasses.Field) -> str:
    shown = field.metadata.get("shown")
    if shown is not None:
        return shown
    value = field.default
    if isinstance(value, bool):
        value = str(value).lower()
    return f"`{value}`"


def _meaning(field: dataclasses.Field) -> str:
    meaning = field.metadata["meaning"]
    see = field.metadata.get("see")
    return f"{meaning} ([more]({see}))" if see else meaning


def property_rows() -> List[tuple]:
    """``(key, default, meaning)`` of each property a user sets, in the class's order."""
    rows = []
    for field in dataclasses.fields(ModelProperties):
        if not field.metadata.get("listed", True):
            continue
        key = field.metadata.get("key") or f"option.{field.name}"
        rows.append((key, _default(field), _meaning(field)))
    return rows


def _table(rows) -> str:
    lines = ["| property | default | meaning |", "|---|---|---|"]
    lines += [f"| `{key}` | {default} | {meaning} |" for key, default, meaning in rows]
    return "\n".join(lines)


def render_reference() -> str:
    """The whole page, as ``docs/properties.md`` holds it."""
    return "\n".join([
        INTRODUCTION,
        "## djl-stream's properties\n",
        _table(property_rows()),
        "",
        "## djl-serving's keys\n",
        "djl-serving's front end reads these itself; they shape how it runs `model.py`.\n",
        _table(DJL_SERVING_KEYS),
        "",
    ])


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m djl_stream.serving.properties_reference [PATH]``: write the page to
    ``PATH``, or print it."""
    args: List[Any] = list(sys.argv[1:] if argv is None else argv)
    page = render_reference()
    if args:
        Path(args[0]).write_text(page, encoding="utf-8")
    else:
        sys.stdout.write(page)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

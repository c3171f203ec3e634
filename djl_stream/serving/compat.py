"""``Input`` and ``Output``: djl_python's inside the djl-serving container, ours elsewhere.

The worker hands ``handle()`` its own ``djl_python.inputs.Input`` and sends back only its
own ``Output`` class, so a ``model.py`` must build answers with whichever is running.
Nothing is imported until a name is first used, because djl imports ``model.py`` (and so
this module) several times at start-up.

    >>> from djl_stream.serving.compat import Output, USING_DJL_PYTHON
    >>> Output().add("hi").code
    200
"""

from __future__ import annotations

import functools
import importlib
import logging
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["Input", "Output", "USING_DJL_PYTHON"]


@functools.lru_cache(maxsize=None)
def _resolve() -> tuple[type, type, bool]:
    try:
        djl_inputs = importlib.import_module("djl_python.inputs")
        djl_outputs = importlib.import_module("djl_python.outputs")
        return djl_inputs.Input, djl_outputs.Output, True
    except ImportError as err:
        # Expected outside the container; a *broken* djl_python is worth a line in the log.
        if getattr(err, "name", None) not in ("djl_python", "djl_python.inputs",
                                                "djl_python.outputs"):
            logger.warning("djl_python is present but failed to import (%s); using "
                           "djl_stream's Input/Output", err)
    from djl_stream.serving.inputs import Input
    from djl_stream.serving.outputs import Output
    return Input, Output, False


def __getattr__(name: str) -> Any:
    # PEP 562: resolved on first access, so importing this module costs nothing.
    if name == "Input":
        return _resolve()[0]
    if name == "Output":
        return _resolve()[1]
    if name == "USING_DJL_PYTHON":
        return _resolve()[2]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])

"""Conformance: djl-stream against the real djl-serving, not our picture of it.

Everything here reads or runs the real sources in ``DJL_SERVING_SRC`` (default
``../shared/djl-serving``, one folder per release branch). Without them the suite does not
pass quietly: collection stops with an error that says what is missing.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
#: The release branches djl-stream ships on: 0.33 is the LMI (GPU) image's, 0.30 the Neuron one's.
BRANCHES = ("0.33.0-dlc", "0.30.0-dlc")

# The unit suite's helpers (tiny model, server process) are shared rather than copied.
sys.path.insert(0, str(REPO / "tests"))


@pytest.fixture(scope="session", autouse=True)
def _programs_compile_into_the_session_s_cache(tmp_path_factory):
    """The workers and servers this suite starts compile their decode programs into a
    folder of the session's own, not the machine's cache."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJL_STREAM_CACHE_DIR", str(tmp_path_factory.mktemp("djl-stream-cache")))
        yield


def djl_serving_src() -> Path:
    """The folder holding one copy of djl-serving's sources per branch in :data:`BRANCHES`."""
    return Path(os.environ.get("DJL_SERVING_SRC", REPO.parent / "shared" / "djl-serving")).resolve()


def pytest_configure(config: pytest.Config) -> None:
    root = djl_serving_src()
    missing = [branch for branch in BRANCHES if not (root / branch).is_dir()]
    if missing:
        raise pytest.UsageError(
            f"conformance needs djl-serving's sources: {', '.join(missing)} not found in {root}; "
            "set DJL_SERVING_SRC to a folder holding 0.33.0-dlc/ and 0.30.0-dlc/")


@pytest.fixture(scope="session")
def djl_src() -> Path:
    return djl_serving_src()


MODEL_DIR = REPO / "model"

#: Appended to model/model.py in the tiny model directory: a custom formatter, and a stream
#: engine that wraps Accelerate and fails where the prompt asks ("fail at N": before the
#: N-th decode step's item), so failures happen at chosen points of a real generation.
TINY_MODEL_PY_EXTRA = '''

import re as _re

from djl_stream import StreamingUtils, register_engine


def upper_lines(pieces):
    """A custom output formatter: each prompt's new text upper-cased, a line each."""
    return "".join(piece.upper() + "\\n" for piece in pieces)


upper_lines.content_type = "text/plain"


@register_engine("FailsOnCue")
def fails_on_cue(model, tokenizer, inputs, **parameters):
    stream = StreamingUtils.get_stream_generator("Accelerate")(model, tokenizer, inputs, **parameters)
    cue = _re.search(r"fail at (\\d+)", " ".join(inputs))
    return _failing(stream, int(cue.group(1))) if cue else stream


def _failing(stream, step):
    try:
        for index, pieces in enumerate(stream):
            if index == step:
                raise RuntimeError(f"injected failure at step {step}")
            yield pieces
    finally:
        stream.close()
'''

TINY_PROPERTIES = """engine=Python
option.entryPoint=model.py
option.rolling_batch=disable
option.dtype=fp32
option.default_max_new_tokens=16
option.max_new_tokens_limit=256
option.max_input_length=64
option.apply_chat_template=false
option.stream_engine=FailsOnCue
"""


def _unit_test_helpers():
    """tests/conftest.py as a plain module (its name clashes with this conftest's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("unit_conftest", REPO / "tests" / "conftest.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def embedded_dir() -> Path:
    if not (MODEL_DIR / "config.json").is_file():
        pytest.fail("the embedded model is missing from model/: run `make model` first")
    return MODEL_DIR


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, embedded_dir) -> Path:
    """A model directory with a tiny random Llama, the real SmolLM2 tokenizer, model/'s
    model.py plus :data:`TINY_MODEL_PY_EXTRA`, and :data:`TINY_PROPERTIES`."""
    import shutil

    from transformers import AutoTokenizer

    directory = tmp_path_factory.mktemp("tiny-model")
    tokenizer = AutoTokenizer.from_pretrained(str(embedded_dir))
    _unit_test_helpers().build_tiny_llama(len(tokenizer)).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    shutil.copy(embedded_dir / "model.py", directory / "model.py")
    with open(directory / "model.py", "a") as f:
        f.write(TINY_MODEL_PY_EXTRA)
    (directory / "serving.properties").write_text(TINY_PROPERTIES)
    return directory

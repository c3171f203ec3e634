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

"""A description of the machine and software a run measured, for the report.

Example::

    >>> "cpu" in describe()
    True
"""

from __future__ import annotations

import platform
from importlib import metadata
from pathlib import Path
from typing import Dict

from djl_stream.runtime.cpu_info import cpu_fields, usable_cores


def cpu_model() -> str:
    """The CPU's model name, as ``/proc/cpuinfo`` gives it (else what ``platform`` knows)."""
    named = (cpu_fields(("model name",)) or {}).get("model name")
    return named or platform.processor() or platform.machine()


def _memory_total() -> str:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return f"{int(line.split()[1]) / 2**20:.1f} GiB"
    except OSError:
        pass
    return "unknown"


def _version(package: str) -> str:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def describe() -> Dict[str, str]:
    """Machine and versions, as ``name -> text``."""
    import torch

    gpu = "none"
    if torch.cuda.is_available():
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        gpu = ", ".join(names) + f" (CUDA {torch.version.cuda})"
    return {
        "cpu": f"{cpu_model()}, {usable_cores()} usable cores",
        "memory": _memory_total(),
        "gpu": gpu,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": _version("transformers"),
        "djl-stream": _version("djl-stream"),
        "httpx": _version("httpx"),
    }

"""What ``/proc/cpuinfo`` says of this CPU, read in one place: the compiled decode step's
cache key names the instruction-set flags (:mod:`~djl_stream.runtime.decode_program`),
``option.quantize=w8a8`` looks for int8 dot-product instructions among them
(:mod:`~djl_stream.runtime.quantization`) and ``option.dtype=bf16`` for bfloat16
arithmetic (:mod:`~djl_stream.runtime.loading`), both through :func:`lacks_x86_flags`.
:func:`usable_cores` counts the cores this process may run on.

Example::

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w") as f:
    ...     _ = f.write("processor\\t: 0\\nflags\\t\\t: fpu avx2\\nprocessor\\t: 1\\nflags\\t\\t: fpu\\n")
    ...     f.flush()
    ...     cpu_fields(("flags", "model name"), f.name)
    {'flags': 'fpu avx2'}
"""

from __future__ import annotations

import os
from typing import Dict, Iterable, Optional


def cpu_fields(wanted: Iterable[str], cpuinfo: str = "/proc/cpuinfo") -> Optional[Dict[str, str]]:
    """The first value of each field named in ``wanted`` that ``cpuinfo`` holds (the
    first processor's: the file repeats them per processor), or ``None`` where the file
    cannot be read (not Linux)."""
    wanted = set(wanted)
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as lines:
            seen: Dict[str, str] = {}
            for line in lines:
                key, _, value = line.partition(":")
                if key.strip() in wanted:
                    seen.setdefault(key.strip(), value.strip())
            return seen
    except OSError:
        return None


def lacks_x86_flags(flags: Iterable[str], cpuinfo: str = "/proc/cpuinfo") -> bool:
    r"""Whether this is an x86 CPU whose flags name none of ``flags`` (``False`` where
    ``cpuinfo`` cannot be read or has no x86 flags: another architecture is not judged).

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix="cpuinfo") as f:
    ...     _ = f.write("flags\t\t: fpu sse2 avx2 fma\n"); f.flush()
    ...     lacks_x86_flags({"avx512_vnni", "avx_vnni"}, f.name), lacks_x86_flags({"fma"}, f.name)
    (True, False)
    """
    present = (cpu_fields(("flags",), cpuinfo) or {}).get("flags")
    return present is not None and not (set(present.split()) & set(flags))


def usable_cores() -> int:
    """How many cores this process may run on: its CPU affinity where the platform has
    one (a container's or ``taskset``'s limit), else every core (macOS).

    >>> usable_cores() >= 1
    True
    """
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1

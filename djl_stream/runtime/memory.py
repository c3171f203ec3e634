"""How freed memory is kept for reuse and given back: glibc's ``malloc`` under PyTorch's
CPU tensors, PyTorch's caching allocator on a GPU.

On a CPU, a tensor's memory comes from ``malloc`` and goes back to it when the tensor is
freed. By default glibc returns memory to the system as soon as more than its *trim
threshold* is free at the top of a heap (a few megabytes, adjusted as it goes), and
serves blocks above its *mmap threshold* with mappings of their own, unmapped when freed;
either way, the next allocation maps pages again, and every page is a fault and is zeroed
by the kernel. A forward pass over prompts allocates and frees its activations layer after
layer, tens to hundreds of megabytes a pass, and whether those pages are faulted in again
at every pass depends on how the heap happens to be laid out in that process: the same
prefill pass can cost a sixth more in one process than in another, all of it in page
faults.

:func:`keep_freed_memory` raises glibc's trim threshold so that freed memory stays in the
process for the next pass, and fixes its mmap threshold at glibc's largest (32 MB), which
its own adjustment would reach too: activations come from the heap and go back to it.
:func:`release_cached_memory` gives what was kept back (``malloc_trim``) when the decode
loop has nothing to do; the loop calls it then. Where the user tuned glibc's allocator
(``MALLOC_*`` variables or ``GLIBC_TUNABLES``) or preloaded another allocator, their
settings stand: :func:`keep_freed_memory` then changes nothing.

Example::

    >>> keep_freed_memory(environ={"MALLOC_TRIM_THRESHOLD_": "1000000"})
    AllocatorSettings(applied=False, reason='the allocator is tuned by MALLOC_TRIM_THRESHOLD_')
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import sys
from typing import Mapping, Optional

# mallopt(3)'s parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Freed memory kept at the top of a heap, at most: more than any forward pass of a model
#: served on a CPU allocates at once. It goes back when the server is idle.
TRIM_THRESHOLD = 1 << 30
#: Blocks above this size get a mapping of their own (faulted in at every use): glibc's
#: largest allowed value on 64-bit Linux (half its 64 MB heap size).
MMAP_THRESHOLD = 32 << 20


@dataclasses.dataclass(frozen=True)
class AllocatorSettings:
    """What :func:`keep_freed_memory` did: ``applied``, or the ``reason`` it did not."""

    applied: bool
    reason: str = ""


def _load_libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 - glibc only (not musl)
        libc.mallopt  # noqa: B018
        return libc
    except (OSError, AttributeError):
        return None


_LIBC = _load_libc()


def _tuned_by(environ: Mapping[str, str]) -> Optional[str]:
    """The environment variable through which the user set the allocator up, if any."""
    for name in sorted(environ):
        if name.startswith("MALLOC_"):  # glibc's (MALLOC_ARENA_MAX, ..._), jemalloc's MALLOC_CONF
            return name
    if "glibc.malloc." in environ.get("GLIBC_TUNABLES", ""):
        return "GLIBC_TUNABLES"
    if any(other in environ.get("LD_PRELOAD", "") for other in ("jemalloc", "tcmalloc", "mimalloc")):
        return "LD_PRELOAD"
    return None


def keep_freed_memory(environ: Optional[Mapping[str, str]] = None) -> AllocatorSettings:
    """Have glibc keep freed memory for the next allocation rather than return it at
    once (see the module's docstring). Process-wide; calling it again changes nothing
    more. Nothing changes where the user set the allocator up or the C library is not
    glibc.
    """
    tuned_by = _tuned_by(os.environ if environ is None else environ)
    if tuned_by is not None:
        return AllocatorSettings(False, f"the allocator is tuned by {tuned_by}")
    if _LIBC is None:
        return AllocatorSettings(False, "the C library is not glibc")
    # mallopt returns 1 when it took the value; setting either ends glibc's adjustments.
    if not (_LIBC.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
            and _LIBC.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)):
        return AllocatorSettings(False, "glibc refused the thresholds")
    return AllocatorSettings(True)


def release_cached_memory(*, keep_gpu_blocks: bool = False) -> None:
    """Give freed memory back to the system: the decode loop calls it once its batch is
    empty.

    On a CPU, glibc keeps freed blocks in the decode thread's heap (the more so after
    :func:`keep_freed_memory`), so the server's resident size would stay at its peak
    after a burst; ``malloc_trim`` returns them. On a GPU, PyTorch's caching allocator
    holds them until ``empty_cache``, which runs unless ``keep_gpu_blocks``: decode steps
    replayed from CUDA graphs are kept under their KV cache's addresses, and the next
    batch of the same shape can get the same addresses from the allocator's cache; given
    back to the driver, its blocks may come back elsewhere, and every graph would be
    captured again.
    """
    try:
        import torch

        if torch.cuda.is_available() and not keep_gpu_blocks:
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass
    if _LIBC is not None:
        _LIBC.malloc_trim(0)

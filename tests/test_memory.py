"""glibc keeps freed memory for the next forward pass, unless the user set the allocator up."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from djl_stream.runtime import memory as allocators
from djl_stream.runtime.memory import keep_freed_memory

REPO = Path(__file__).resolve().parent.parent

# Allocate and free 24 MB in blocks of 600 KB, five times over, after glibc adapted its
# thresholds to a freed 1 MB block (as it does to a forward pass's activations): by
# default it gives the 24 MB back each time, and the next round faults every page in again.
ROUNDS_OF_ALLOCATIONS = textwrap.dedent("""
    import resource, sys
    sys.path.insert(0, {repo!r})
    from djl_stream.runtime.memory import keep_freed_memory
    if {keep}:
        assert keep_freed_memory(environ={{}}).applied
    faults = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    bytearray(1 << 20)
    blocks = [bytearray(600_000) for _ in range(40)]
    del blocks
    before = faults()
    for _ in range(5):
        blocks = [bytearray(600_000) for _ in range(40)]
        del blocks
    print(faults() - before)
""")


def page_faults_of_rounds(keep: bool) -> int:
    """Page faults of the rounds above in a fresh process (its own heap and thresholds)."""
    script = ROUNDS_OF_ALLOCATIONS.format(repo=str(REPO), keep=keep)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True)
    return int(done.stdout.strip())


@pytest.mark.skipif(allocators._LIBC is None, reason="glibc's allocator only")
def test_freed_memory_is_kept_for_the_next_allocations():
    pages = 5 * 40 * 600_000 // 4096
    kept = page_faults_of_rounds(keep=True)
    assert kept < pages // 20, (kept, pages)
    # (what it saves: glibc's own thresholds give most of it back between rounds)
    assert page_faults_of_rounds(keep=False) > pages // 2


@pytest.mark.parametrize("environ, name", [
    ({"MALLOC_ARENA_MAX": "2", "PATH": "/bin"}, "MALLOC_ARENA_MAX"),
    ({"MALLOC_TRIM_THRESHOLD_": "1"}, "MALLOC_TRIM_THRESHOLD_"),
    ({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"}, "GLIBC_TUNABLES"),
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD"),
])
def test_an_allocator_the_user_set_up_is_left_alone(environ, name):
    settings = keep_freed_memory(environ=environ)
    assert not settings.applied and settings.reason == f"the allocator is tuned by {name}"


def test_other_tunables_and_preloads_do_not_count_as_setting_the_allocator_up():
    environ = {"GLIBC_TUNABLES": "glibc.rtld.optional_static_tls=2000",
               "LD_PRELOAD": "/opt/lib/libfoo.so", "MALLOC": "x"}
    assert allocators._tuned_by(environ) is None

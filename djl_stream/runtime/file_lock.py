"""An exclusive lock on a file, held by one process (or thread) at a time: what keeps two
processes from building the same cache entry at once (a compiled decode program,
:mod:`djl_stream.runtime.decode_program`; the conformance suite's image environments).

Example::

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "entry.lock"
    >>> with exclusive_lock(path):
    ...     path.exists()
    True
"""

from __future__ import annotations

import contextlib
import fcntl
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def exclusive_lock(path: Path, *, wait: bool = True) -> Iterator[bool]:
    """Hold an exclusive ``flock`` on ``path`` (created, with its folder) for the block;
    another holder waits until it is released. Each ``open`` is a lock of its own, so
    threads of one process wait for each other too.

    With ``wait=False`` the block runs at once either way: it gets ``True`` if it holds
    the lock, ``False`` if someone else did (and then it must leave what the lock guards
    alone).

    >>> import tempfile, pathlib
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "entry.lock"
    >>> with exclusive_lock(path), exclusive_lock(path, wait=False) as held:
    ...     held
    False
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX if wait else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

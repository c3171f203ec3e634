"""Sections of ``BENCHMARKS.md`` that other commands than ``make bench`` write.

``make bench`` rewrites the file; ``make bench-peers`` (``benchmarks.peers``) and
``python -m benchmarks.quantization`` each own a section between two HTML comments,
``<!-- name -->`` and ``<!-- /name -->``, which they replace in place and ``make bench``
keeps (at the end, in the order found). So is the ``gpu`` section, written from what
``benchmarks/on_a_gpu.sh`` measured on a machine this one is not.

Example::

    >>> import pathlib, tempfile
    >>> path = pathlib.Path(tempfile.mkdtemp()) / "BENCHMARKS.md"
    >>> _ = path.write_text("# Benchmarks\\n")
    >>> write_section(path, "peers", "## Peers\\n\\nfigures")
    >>> kept_sections(path)
    ['<!-- peers -->\\n## Peers\\n\\nfigures\\n<!-- /peers -->']
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

#: The sections ``make bench`` keeps, by name.
KEPT = ("peers", "architectures", "quantization", "grammar", "gpu")


def markers(name: str) -> tuple:
    """The comments that open and close section ``name``."""
    return f"<!-- {name} -->", f"<!-- /{name} -->"


def section(path: Path, name: str) -> Optional[str]:
    """Section ``name`` of ``path`` (markers included), or ``None``."""
    if not path.is_file():
        return None
    text = path.read_text(encoding="utf-8")
    begin, end = markers(name)
    if begin not in text or end not in text:
        return None
    return begin + text.split(begin, 1)[1].split(end, 1)[0] + end


def write_section(path: Path, name: str, body: str) -> None:
    """Put ``body`` into ``path`` as section ``name``, in place of the one there, or at
    the end."""
    begin, end = markers(name)
    block = f"{begin}\n{body.strip(chr(10))}\n{end}"
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text, encoding="utf-8")


def kept_sections(path: Path) -> List[str]:
    """The sections of :data:`KEPT` that ``path`` holds, in the order they appear there,
    for a run that rewrites the rest of the file."""
    found = [(name, section(path, name)) for name in KEPT]
    text = path.read_text(encoding="utf-8") if path.is_file() else ""
    present = [(text.index(markers(name)[0]), block) for name, block in found if block]
    return [block for _, block in sorted(present)]

"""A model's weights on transparent huge pages, on a CPU.

A decode step of few rows reads every weight once, straight from memory, and little else:
the step is as fast as memory can stream them. With the kernel's 4 KB pages that stream
crosses a page boundary every 4 KB, and every page is one more translation the processor
looks up (in a virtual machine, through the host's page tables as well); with 2 MB pages
it crosses one every 2 MB. transformers leaves weights loaded from a ``safetensors`` file
on the file's mapping (the page cache, mapped with small pages), and weights it made
itself (a dtype converted, int8 quantized) lie wherever the allocator put them.

:func:`move_weights_to_huge_pages` copies the model's parameters into anonymous memory
advised for huge pages (``madvise(MADV_HUGEPAGE)``) where the kernel's setting
(``/sys/kernel/mm/transparent_hugepage/enabled``) is ``always`` or ``madvise``: with
``never`` a copy would change nothing. The values, the parameters (the same
``nn.Parameter`` objects, so tied weights stay tied) and each parameter's storage of its
own (``save_pretrained`` tells tensors apart by their storage) are unchanged; only where
the numbers lie is. The copies lie side by side in one mapping, so weights smaller than a
huge page share one; it starts on a huge-page boundary.

What it costs: the weights are this process's memory, no longer the file's page cache,
so two processes serving the same file hold a copy each; the file's pages stay cached
until the kernel needs the memory, as any file read does. While they are copied the
weights are held twice (a checkpoint's mapping is let go when its last weight has left
it), so they move only where they take at most half of the memory available. A model
whose layers were replaced at load (int8) gains memory as well: its embedding and norms
were what kept the whole checkpoint's mapping resident.

Example::

    >>> model = torch.nn.Linear(2048, 1024)   # 8 MB of weights
    >>> moved = move_weights_to_huge_pages(model, mode="never")
    >>> moved.bytes, moved.reason
    (0, "the kernel's transparent huge pages are off (never)")
"""

from __future__ import annotations

import dataclasses
import mmap
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from djl_stream.runtime.packed_linear import available_memory

#: The kernel's switch for transparent huge pages, and the size of one.
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")
THP_SIZE = Path("/sys/kernel/mm/transparent_hugepage/hpage_pmd_size")
#: Each weight starts on a multiple of this (a cache line, and every vector width).
WEIGHT_ALIGNMENT = 64


@dataclasses.dataclass(frozen=True)
class MovedWeights:
    """What :func:`move_weights_to_huge_pages` did: ``bytes`` of weights moved, or the
    ``reason`` it moved none."""

    bytes: int
    reason: str = ""


def huge_page_mode(setting: Path = THP_SETTING) -> Optional[str]:
    """The kernel's transparent huge page setting (``always``, ``madvise`` or ``never``),
    ``None`` where it has none (not Linux, or a kernel without them).

    The file lists every choice with the one in force in brackets:

    >>> import tempfile
    >>> with tempfile.NamedTemporaryFile("w", suffix="enabled") as file:
    ...     _ = file.write("always [madvise] never\\n"); file.flush()
    ...     huge_page_mode(Path(file.name))
    'madvise'
    """
    try:
        text = setting.read_text(encoding="ascii")
    except OSError:
        return None
    chosen = [word[1:-1] for word in text.split() if word.startswith("[")]
    return chosen[0] if chosen else None


def huge_page_size(setting: Path = THP_SIZE) -> int:
    """Bytes in one transparent huge page, as the kernel says (2 MB where it does not)."""
    try:
        return int(setting.read_text(encoding="ascii"))
    except (OSError, ValueError):
        return 2 << 20


def _movable(tensor: torch.Tensor) -> bool:
    # (a plain dense tensor only: a quantized tensor subclass or oneDNN's opaque layout
    # keeps its own memory)
    return (type(tensor) is torch.Tensor and tensor.device.type == "cpu"
            and tensor.layout == torch.strided and tensor.is_contiguous()
            and tensor.numel() > 0)


def move_weights_to_huge_pages(model: torch.nn.Module, mode: Optional[str] = None,
                               available: Optional[int] = None) -> MovedWeights:
    """Copy ``model``'s CPU parameters onto memory advised for transparent huge pages
    (see the module docstring); ``mode`` is the kernel's setting and ``available`` the
    memory available in bytes (each read off the system where not given). Returns how
    many bytes moved, or why none did.

    >>> move_weights_to_huge_pages(torch.nn.Linear(2048, 1024), "madvise", available=10 << 20)
    MovedWeights(bytes=0, reason='the weights (8 MB) take more than half of the memory available (10 MB)')
    """
    mode = huge_page_mode() if mode is None else mode
    if mode not in ("always", "madvise"):
        return MovedWeights(0, f"the kernel's transparent huge pages are off ({mode})"
                            if mode else "this system has no transparent huge pages")
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return MovedWeights(0, "this Python cannot advise memory for huge pages")
    parameters: List[torch.nn.Parameter] = []
    seen = set()
    for parameter in model.parameters(recurse=True):
        if id(parameter) not in seen and _movable(parameter.data):
            seen.add(id(parameter))
            parameters.append(parameter)
    # (parameters that are views of one another's memory, moved once and viewed alike)
    sources: Dict[Tuple, torch.Tensor] = {}
    for parameter in parameters:
        data = parameter.data
        sources.setdefault((data.data_ptr(), data.dtype, tuple(data.shape)), data)
    page = huge_page_size()
    sizes = [t.numel() * t.element_size() for t in sources.values()]
    total = sum(-(-size // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT for size in sizes)
    if total < page:
        return MovedWeights(0, f"the weights ({total} bytes) are smaller than one huge page")
    available = available_memory() if available is None else available
    if available is None or 2 * total > available:
        return MovedWeights(0, f"the weights ({total / 2**20:.0f} MB) take more than half of "
                            f"the memory available ({available / 2**20:.0f} MB)"
                            if available is not None else "the memory available is unknown")
    try:
        # (mapped a page longer than needed, so that the weights can start on a boundary)
        region = mmap.mmap(-1, total + page, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        region.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as error:
        return MovedWeights(0, f"no memory advised for huge pages ({error})")
    start = torch.frombuffer(region, dtype=torch.uint8, count=1).data_ptr()
    offset = -start % page
    copies: Dict[Tuple, torch.Tensor] = {}
    with torch.no_grad():
        for key, data in sources.items():
            size = data.numel() * data.element_size()
            # (a storage per weight, each holding the mapping: it is unmapped with the last)
            copy = torch.frombuffer(region, dtype=torch.uint8, count=size, offset=offset)
            copy = copy.view(data.dtype).view(data.shape)
            copy.copy_(data)
            copies[key] = copy
            offset += -(-size // WEIGHT_ALIGNMENT) * WEIGHT_ALIGNMENT
        for parameter in parameters:
            data = parameter.data
            parameter.data = copies[(data.data_ptr(), data.dtype, tuple(data.shape))]
    return MovedWeights(sum(sizes))

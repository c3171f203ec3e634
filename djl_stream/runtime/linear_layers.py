"""What every replacement of a model's ``nn.Linear`` layers shares: finding the layers, the
weights they must not take over, and the product a compiled decode step of few rows
multiplies by.

A decode step multiplies a few rows (one per running sequence) by every weight of the
model, so on a CPU its time is the time it takes to read the weights. A matrix library
is built for many rows per weight, and with one row it reads the weights well below the
speed of memory. Written as a reduction (:func:`streamed_product`), the same product
becomes one loop of the compiler's own: each output feature reads its row of the weight
once, contiguously, and multiplies it by every input row while that weight row is in the
first-level cache, so one row runs at the speed of memory. It has no blocking of its own
(each multiply-add loads its weight again from that cache), so with many rows a blocked
product is faster: a library's kernels, which keep loaded weights in registers across
rows, or :func:`blocked_product`, the same reduction written so that the compiler keeps
a block of output features' sums in registers. How many rows stream follows from the
weights' width (:func:`streamed_rows`).

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> [name for _, name, _ in linear_layers(model)]
    ['0', '2']
"""

from __future__ import annotations

import contextlib
import math
import threading
from typing import Iterator, Optional

import torch

#: The most rows a decode step multiplies through :func:`streamed_product` where a blocked
#: product is at hand too, for float32 weights. The reduction reads each weight once and
#: does one multiply-add per row for every weight it reads, each with a load of its own
#: from the first-level cache; an x86 core loads two vectors a cycle while memory delivers
#: a vector of float32 weights in several cycles, so up to four rows the step stays bound
#: by memory, where the reduction reads at its full speed. More rows make those loads the
#: bound, where a blocked kernel that reuses each loaded weight across rows in registers
#: wins. Narrower weights arrive as many more per cycle: :func:`streamed_rows`.
STREAMED_ROWS = 4
#: The vector registers a blocked product may fill with its running sums, the block's
#: weight vectors and a row vector (x86's AVX-512 has 32; AVX2, and what is assumed
#: elsewhere, 16): two are left to the compiler for addresses and conversions.
SPARE_REGISTERS = 2


def streamed_rows(weight_dtype: torch.dtype) -> int:
    """The most rows a compiled decode step streams through weights of ``weight_dtype``:
    :data:`STREAMED_ROWS` for float32, fewer for narrower weights. Memory delivers twice
    as many bfloat16 weights, or four times as many int8 ones, a cycle, while each row
    costs the same loads and multiply-adds per weight (and a conversion too), so the step
    stops being bound by memory at proportionally fewer rows.

    >>> streamed_rows(torch.float32), streamed_rows(torch.bfloat16), streamed_rows(torch.int8)
    (4, 2, 1)
    """
    width = torch.empty((), dtype=weight_dtype).element_size()
    return max(1, STREAMED_ROWS * width // 4)


def linear_layers(model: torch.nn.Module):
    """Every ``(parent, name, layer)`` of ``model`` whose layer is a plain ``nn.Linear``."""
    return [(parent, name, child) for parent in model.modules()
            for name, child in parent.named_children() if type(child) is torch.nn.Linear]


def weights_used_beyond_linear_layers(model: torch.nn.Module) -> set:
    """The ids of ``model``'s parameters that a module other than a plain ``nn.Linear``
    holds (a tied input embedding): a linear layer's replacement copies such a weight
    rather than taking it over, and says so."""
    return {id(p) for module in model.modules() if type(module) is not torch.nn.Linear
            for p in module.parameters(recurse=False)}


def streamed_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` (``rows`` ``(n, in)``, ``weight`` ``(out, in)`` of any dtype,
    turned into ``rows``' as it is read) written for a compiler: output features
    outermost, so each row of the weight is read once for all ``n`` rows (see the module
    docstring).

    >>> rows = torch.randn(3, 8)
    >>> weight = torch.randint(-127, 128, (5, 8), dtype=torch.int8)
    >>> torch.allclose(streamed_product(rows, weight), rows @ weight.float().T, atol=1e-4)
    True
    """
    # The compiler lays tensors out as it likes. Left to it, the rows would arrive here
    # in the layout of the previous product's result (features first), the reduction
    # would be vectorised over the rows instead of along the weight, and a norm before it
    # would be recomputed for every output feature: the rows come in, and the result goes
    # out, in the row-major layout the model's code around the product expects.
    rows = row_major(rows)
    by_feature = (weight[:, None, :].to(rows.dtype) * rows[None, :, :]).sum(-1)
    return row_major(by_feature.t())


def row_major(matrix: torch.Tensor) -> torch.Tensor:
    """``matrix`` (2-D) as a row-major tensor that a compiler keeps as one (PyTorch's
    ``prims.copy_strided``, which fixes the layout its compiler gives the result; plain
    ``contiguous()`` where this PyTorch lacks it, which a compiler may see through).

    >>> row_major(torch.ones(2, 3).t()).stride()
    (2, 1)
    """
    copy_strided = getattr(getattr(torch.ops, "prims", None), "copy_strided", None)
    if copy_strided is None:
        return matrix.contiguous()
    return copy_strided(matrix, (matrix.shape[1], 1))


def features_in_a_block(vector_registers: Optional[int] = None) -> int:
    """How many output features :func:`blocked_product` computes together: the most (a
    power of two) whose running sums and weight vectors fit in the CPU's vector
    registers beside one row vector, less :data:`SPARE_REGISTERS`.
    ``vector_registers``: 32 where this PyTorch runs AVX-512 code, else 16.

    >>> features_in_a_block(32), features_in_a_block(16)
    (8, 4)
    """
    if vector_registers is None:
        capability = torch.backends.cpu.get_cpu_capability()
        vector_registers = 32 if capability.upper().startswith("AVX512") else 16
    room = vector_registers - SPARE_REGISTERS
    features = 1
    while (features * 2) * 2 + 1 <= room:  # (twice the sums and weight vectors, one row)
        features *= 2
    return features


def blocked_product(rows: torch.Tensor, weight: torch.Tensor,
                    features: Optional[int] = None) -> torch.Tensor:
    """``rows @ weight.T`` as :func:`streamed_product` computes it, written so that a
    compiler computes ``features`` output features at once for each row
    (:func:`features_in_a_block` where not given; the largest part of it that divides
    the layer's output features).

    The streamed reduction keeps one running sum: each multiply-add waits for the one
    before it, so with many rows the step is bound by that wait rather than by memory.
    Here the block is spelled out as ``features`` reductions over the same loop, which
    the compiler fuses into one kernel with a running sum each: independent
    multiply-adds that the core overlaps, sharing each load of the row. Every sum is the
    one the streamed reduction computes, in the same order, so a row's result does not
    depend on the rows beside it. The rows are left whole (an exporter keeps their count
    dynamic); only the fixed output features are split.

    >>> rows = torch.randn(3, 8)
    >>> weight = torch.randint(-127, 128, (6, 8), dtype=torch.int8)
    >>> torch.allclose(blocked_product(rows, weight), rows @ weight.float().T, atol=1e-4)
    True
    """
    out_features, width = weight.shape
    block = math.gcd(out_features, features or features_in_a_block())
    groups = out_features // block
    rows = row_major(rows)
    by_group = weight.view(groups, block, width)
    sums = [(by_group[:, None, feature, :].to(rows.dtype) * rows[None, :, :]).sum(-1)
            for feature in range(block)]
    # sums[feature][group, row] is the product's entry [row, group * block + feature]
    by_row = torch.stack(sums).permute(2, 1, 0).reshape(rows.shape[0], out_features)
    return row_major(by_row)


#: Whether this thread's linear layers, being compiled, stream their products.
_THREAD = threading.local()


@contextlib.contextmanager
def streaming_products() -> Iterator[None]:
    """Within this block, linear layers being compiled by this thread multiply through
    :func:`streamed_product` (a packed layer through the float weight it kept): how the
    program for steps of few rows is exported. Outside it they multiply as they do for
    many rows (a packed layer through oneDNN, an int8 one through
    :func:`blocked_product`).

    >>> with streaming_products():
    ...     products_stream()
    True
    >>> products_stream()
    False
    """
    previous = getattr(_THREAD, "streaming", False)
    _THREAD.streaming = True
    try:
        yield
    finally:
        _THREAD.streaming = previous


def products_stream() -> bool:
    """Whether this thread is inside :func:`streaming_products`."""
    return getattr(_THREAD, "streaming", False)

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
(each multiply-add loads its weight again from that cache), so with many rows a library's
blocked kernels, which keep loaded weights in registers across rows, are faster: see
:data:`STREAMED_ROWS`.

Example::

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> [name for _, name, _ in linear_layers(model)]
    ['0', '2']
"""

from __future__ import annotations

import torch

#: The most rows a decode step multiplies through :func:`streamed_product` where a blocked
#: product is at hand too. The reduction reads each weight once and does one multiply-add
#: per row for every weight it reads, each with a load of its own from the first-level
#: cache; an x86 core loads two vectors a cycle while memory delivers a vector of weights
#: in several cycles, so up to four rows the step stays bound by memory, where the
#: reduction reads at its full speed. More rows make those loads the bound, where a
#: blocked kernel that reuses each loaded weight across rows in registers wins.
STREAMED_ROWS = 4


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

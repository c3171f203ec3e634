"""What every replacement of a model's ``nn.Linear`` layers shares: finding the layers, the
weights they must not take over, the layers that must stay as they are, and the product a
compiled decode step of few rows multiplies by.

A replacement (int8 weights, weights reordered for oneDNN) serves what the layer's own
forward serves, and nothing else: a model whose code reads a layer's weight itself
(Mamba's mixer multiplies by ``dt_proj.weight``; some models cast their activations to
``layer.weight.dtype``) would read int8 numbers or no weight at all. Such layers are found
by running the model once and watching what reads their weights
(:func:`linear_layers_read_elsewhere`), and keep their ``nn.Linear``.

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
import logging
import math
import threading
from typing import Collection, Dict, Iterator, List, Optional

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

logger = logging.getLogger(__name__)

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


def linear_layers(model: torch.nn.Module, leaving_out: Collection[str] = ()):
    """Every ``(parent, name, layer)`` of ``model`` whose layer is a plain ``nn.Linear``, but
    those whose qualified names (``model.layers.0.mlp.down_proj``) ``leaving_out`` holds."""
    skipped = set(leaving_out)
    return [(parent, name, child) for prefix, parent in model.named_modules()
            for name, child in parent.named_children()
            if type(child) is torch.nn.Linear and _qualified(prefix, name) not in skipped]


def linear_layer_names(model: torch.nn.Module) -> Dict[int, str]:
    """The qualified name of each plain ``nn.Linear`` of ``model``, by the layer's ``id``.

    >>> inner = torch.nn.Sequential(torch.nn.Linear(8, 2))
    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), inner)
    >>> sorted(linear_layer_names(model).values())
    ['0', '1.0']
    """
    return {id(child): _qualified(prefix, name) for prefix, parent in model.named_modules()
            for name, child in parent.named_children() if type(child) is torch.nn.Linear}


def _qualified(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name


#: What a replacement's weight still says as the float weight did: reading these is no use
#: of the float numbers (a ``dtype`` read is: the activations would be cast to int8).
_PROPERTIES_KEPT = frozenset({"shape", "device", "ndim", "layout", "requires_grad", "is_cpu",
                              "is_cuda", "is_meta"})


def linear_layers_read_elsewhere(model: torch.nn.Module) -> List[str]:
    """The qualified names of ``model``'s plain ``nn.Linear`` layers whose weight or bias its
    forward uses other than through the module that holds it (see the module docstring):
    found by running the forward on two tokens while watching every torch function it
    calls. A linear layer may use its weight in its product only; a module that holds
    the same weight too (an input embedding tied to the LM head) may use it as it likes.
    Empty, logged, where the forward fails.

    >>> class ReadsAWeight(torch.nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.used, self.read = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)
    ...     def forward(self, input_ids, **kwargs):
    ...         x = torch.ones(1, 4, dtype=self.used.weight.dtype)  # (a read too)
    ...         return self.used(x) + x @ self.read.weight.T
    >>> linear_layers_read_elsewhere(ReadsAWeight())
    ['read', 'used']
    """
    names = linear_layer_names(model)
    layer_of = {}  # each watched tensor's linear layer, by the tensor's id
    for _, _, layer in linear_layers(model):
        for tensor in (layer.weight, layer.bias):
            if tensor is not None:
                layer_of[id(tensor)] = layer
    if not layer_of:
        return []
    holders = [module for module in model.modules()
               if any(id(p) in layer_of for p in module.parameters(recurse=False))]
    running: List[torch.nn.Module] = []
    read = set()

    def held_by_the_running_module(tensor: torch.Tensor, func) -> bool:
        if not running or not any(p is tensor for p in running[-1].parameters(recurse=False)):
            return False
        return type(running[-1]) is not torch.nn.Linear or func is torch.nn.functional.linear

    class WatchWeights(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            for value in tree_flatten((args, kwargs))[0]:
                layer = layer_of.get(id(value)) if isinstance(value, torch.Tensor) else None
                if layer is None or held_by_the_running_module(value, func):
                    continue
                if getattr(getattr(func, "__self__", None), "__name__", None) \
                        not in _PROPERTIES_KEPT:
                    read.add(names[id(layer)])
            return func(*args, **kwargs)

    def enter(module, _inputs) -> None:
        running.append(module)

    def leave(*_) -> None:  # (a hook that returned something would replace the output)
        running.pop()

    hooks = [handle for module in holders for handle in (
        module.register_forward_pre_hook(enter),
        module.register_forward_hook(leave, always_call=True))]
    device = next(model.parameters()).device
    try:
        with torch.no_grad(), WatchWeights():
            model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=device),
                  use_cache=False)
    except Exception as error:  # noqa: BLE001 - whatever fails, nothing was learnt
        logger.warning("could not watch which linear weights the model's code reads (its "
                       "forward failed: %s: %s); every linear layer may be replaced",
                       type(error).__name__, error)
        return []
    finally:
        for handle in hooks:
            handle.remove()
    return sorted(read)


def weights_used_beyond_linear_layers(model: torch.nn.Module) -> set:
    """The ids of ``model``'s parameters that a module other than a plain ``nn.Linear``
    holds (a tied input embedding): a linear layer's replacement copies such a weight
    rather than taking it over, and says so."""
    return {id(p) for module in model.modules() if type(module) is not torch.nn.Linear
            for p in module.parameters(recurse=False)}


def layers_that_stay_float(model, replacement: str) -> List[str]:
    """The names of ``model``'s linear layers that keep their float weights because its
    code reads them beyond the layers' own products (:func:`linear_layers_read_elsewhere`),
    said once where there are any (``replacement``: what the others get)."""
    kept = linear_layers_read_elsewhere(model)
    if kept:
        logger.info("%d linear layers keep their float weights instead of %s: the model's "
                    "code reads them beyond the layers' own products (%s)", len(kept),
                    replacement, ", ".join(kept[:3]) + (", ..." if len(kept) > 3 else ""))
    return kept


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

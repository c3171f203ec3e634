"""Linear layers whose weights are laid out once for oneDNN's matrix product, on a CPU.

A decode step's time on a CPU is mostly its linear layers. PyTorch's default product
(``torch.nn.functional.linear``) multiplies by the weight as it is stored, row after row,
and leaves the blocking to the BLAS library at every call; oneDNN's product can instead
take a weight reordered once, at load, into the blocked layout its kernels read
(``torch.ops.mkldnn._reorder_linear_weight``). The reordered weight serves every number
of rows, and a step of several rows, which does more arithmetic for each weight it
reads, gains most (``python -m benchmarks.linear_products`` times both on the machine
at hand). :class:`PackedLinear` replaces ``nn.Linear`` wherever a model has one: it knows
nothing of the architecture around it, and the reordered weight replaces the float one
(no second copy; a weight tied to the input embedding is reordered as a copy).

The operators are PyTorch's private oneDNN ones, so they are reached here alone, and only
where :func:`packing_unavailable` finds them working (an x86 build of PyTorch with
oneDNN); elsewhere layers stay ``nn.Linear``.

With one row, oneDNN reads the reordered weight well below the speed of memory, where the
compiler's own streamed reduction over the float weight reads it at full speed
(:func:`~djl_stream.runtime.linear_layers.streamed_product`). So where memory allows
(:func:`float_weights_fit_twice`: both copies in at most half of the memory available at
load), a packed layer also keeps the float weight it replaced, and a runner compiles a
second decode step for steps of few rows that multiplies through it
(:func:`~djl_stream.runtime.linear_layers.streaming_products`). Where it does not, the
packed weight is the only copy.

The compiled decode step (:mod:`djl_stream.runtime.decode_program`) cannot hold a
reordered weight: AOTInductor takes plain tensors as constants. So inside an exported
program a packed layer is one call of the operator ``djl_stream::packed_linear`` with the
layer's index, and the program's caller says whose weights the indices name
(:func:`packed_weights`): a program compiled once serves any model of the same shapes.

Example::

    >>> layer = torch.nn.Linear(16, 8)
    >>> x = torch.randn(3, 16)
    >>> expected = layer(x)
    >>> packed = PackedLinear.from_linear(layer, index=0)
    >>> packed is None or bool(torch.allclose(packed(x), expected, atol=1e-5))
    True
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Collection, Iterator, List, Optional, Sequence

import torch

from djl_stream.runtime.linear_layers import (linear_layers, products_stream, streamed_product,
                                              weights_used_beyond_linear_layers)

logger = logging.getLogger(__name__)


def packing_unavailable(dtype: torch.dtype = torch.float32) -> Optional[str]:
    """Why this PyTorch cannot reorder linear weights of ``dtype`` for oneDNN on this CPU,
    or ``None`` where it can (checked once per dtype on a small product).

    >>> packing_unavailable() is None or isinstance(packing_unavailable(), str)
    True
    """
    return _packing_check(dtype)


@functools.lru_cache(maxsize=None)
def _packing_check(dtype: torch.dtype) -> Optional[str]:
    if not torch.backends.mkldnn.is_available():
        return "this PyTorch has no oneDNN"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(24, 40, generator=generator).to(dtype)
    x = torch.randn(3, 40, generator=generator).to(dtype)
    try:
        got = _product(x, _reorder(weight), None, 24)
    except (AttributeError, RuntimeError, NotImplementedError) as error:
        return f"oneDNN's packed product fails here ({type(error).__name__}: {error})"
    expected = torch.nn.functional.linear(x.float(), weight.float())
    if not torch.allclose(got.float(), expected, rtol=2e-2, atol=2e-2):
        return "oneDNN's packed product disagrees with torch.nn.functional.linear here"
    return None


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    # (no row count: oneDNN lays the weight out for any number of rows)
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def _product(x: torch.Tensor, packed: torch.Tensor, bias: Optional[torch.Tensor],
             out_features: int) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows, packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out_features)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``torch.nn.functional.linear(x, weight)`` (``x`` 2-D, ``weight`` a plain float
    matrix, no bias) through oneDNN's product where :func:`packing_unavailable` finds it
    working for ``weight``'s dtype, and through ``torch.nn.functional.linear`` elsewhere:
    for a weight made afresh for one product (an int8 layer's block of weights turned
    into floats), which oneDNN multiplies without a reordering kept between calls.

    >>> x, weight = torch.randn(5, 16), torch.randn(8, 16)
    >>> torch.allclose(onednn_linear(x, weight), x @ weight.T, atol=1e-5)
    True
    """
    if x.device.type != "cpu" or packing_unavailable(weight.dtype) is not None:
        return torch.nn.functional.linear(x, weight)
    return _product(x, weight, None, weight.shape[0])


class PackedLinear(torch.nn.Module):
    """``nn.Linear`` with its weight reordered for oneDNN (see the module docstring),
    and its float ``weight`` (the layer's own parameter) where it was kept.

    ``index`` numbers the model's packed layers in the order they were packed: an
    exported program names a layer's weight by it. A layer made for export only has no
    reordered weight (:meth:`empty_like`)."""

    def __init__(self, packed: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                 in_features: int, out_features: int, index: int,
                 weight: Optional[torch.nn.Parameter] = None) -> None:
        super().__init__()
        self.packed = packed  # (not a buffer: the reordered layout is no plain tensor)
        self.weight = weight
        self.bias = None if bias is None else torch.nn.Parameter(bias.detach(),
                                                                 requires_grad=False)
        self.in_features = in_features
        self.out_features = out_features
        self.index = index

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, index: int,
                    keep_float_weight: bool = False) -> Optional["PackedLinear"]:
        """The packed layer of ``linear`` (keeping its float weight where asked), or
        ``None`` where its weight cannot be packed (not on the CPU, or a dtype oneDNN
        cannot multiply here)."""
        weight = linear.weight
        if weight.device.type != "cpu" or not weight.dtype.is_floating_point:
            return None
        if packing_unavailable(weight.dtype) is not None:
            return None
        return cls(_reorder(weight), linear.bias, linear.in_features, linear.out_features,
                   index, weight if keep_float_weight else None)

    @classmethod
    def empty_like(cls, linear: torch.nn.Linear, index: int,
                   keep_float_weight: bool = False) -> "PackedLinear":
        """The layer's structure without a reordered weight, for a model that is only
        exported (with its float weight where the served layer keeps one)."""
        return cls(None, linear.bias, linear.in_features, linear.out_features, index,
                   linear.weight if keep_float_weight else None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        # (saved as the nn.Linear it replaced: save_pretrained writes a loadable checkpoint)
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if self.weight is None and self.packed is not None:
            destination[prefix + "weight"] = self.packed.to_dense()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        weight = state_dict.get(prefix + "weight")
        if self.weight is None:
            state_dict.pop(prefix + "weight", None)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if weight is not None:
            self.packed = _reorder(weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None and not torch.compiler.is_compiling():
            return _product(x, self.packed, self.bias, self.out_features)
        if self.weight is not None and products_stream():
            rows = x.reshape(-1, self.in_features)
            out = streamed_product(rows, self.weight)
            if self.bias is not None:
                out = out + self.bias
            return out.view(*x.shape[:-1], self.out_features)
        return torch.ops.djl_stream.packed_linear(x, self.bias, self.index, self.out_features)

    def extra_repr(self) -> str:
        kept = ", float weight kept" if self.weight is not None else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, weight reordered for oneDNN{kept}")


def float_weights_fit_twice(model: torch.nn.Module,
                            available: Optional[int] = None) -> bool:
    """Whether ``model``'s float linear weights, held twice (float and reordered), take at
    most half of the memory ``available`` (in bytes; read off the system where not given,
    and ``False`` where it cannot be read): the rule that decides whether packed layers
    keep their float weights (see the module docstring).

    >>> model = torch.nn.Sequential(torch.nn.Linear(1024, 1024))  # 4 MB of weights
    >>> float_weights_fit_twice(model, available=16 << 20)
    True
    >>> float_weights_fit_twice(model, available=8 << 20)
    False
    """
    if available is None:
        available = available_memory()
    if available is None:
        return False
    weight_bytes = sum(layer.weight.numel() * layer.weight.element_size()
                       for _, _, layer in linear_layers(model))
    return 2 * weight_bytes <= available // 2


def available_memory() -> Optional[int]:
    """Bytes of memory the system can give without swapping (``MemAvailable``), or
    ``None`` where it does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def pack_linear_layers(model: torch.nn.Module, keep_float_weights: bool = False,
                       leaving_out: Collection[str] = ()) -> int:
    """Replace each plain float ``nn.Linear`` of ``model`` on the CPU (but those
    ``leaving_out`` names: see
    :func:`~djl_stream.runtime.linear_layers.linear_layers_read_elsewhere`) by its
    :class:`PackedLinear`, one at a time; returns how many were replaced. Layers already
    packed stay as they are. ``keep_float_weights``: each keeps its float weight too
    (see :func:`float_weights_fit_twice`); otherwise each float weight is let go before
    the next is reordered.

    Where float weights were let go, the model's other CPU parameters and buffers are
    copied into memory of their own. A checkpoint's weights are usually views into one
    memory mapping of its file, which stays mapped while any of them lives (an input
    embedding, a norm), and reordering read every page of it: those pages would stay
    resident beside the reordered copies, the weights counted twice.
    """
    count = _replace(model, functools.partial(PackedLinear.from_linear,
                                              keep_float_weight=keep_float_weights),
                     leaving_out)
    if count and not keep_float_weights:
        with torch.no_grad():
            for tensor in list(model.parameters()) + list(model.buffers()):
                if tensor.device.type == "cpu" and not tensor.is_mkldnn:
                    tensor.data = tensor.data.clone()
    return count


def pack_structure(model: torch.nn.Module, keep_float_weights: bool = False,
                   leaving_out: Collection[str] = ()) -> int:
    """Put :class:`PackedLinear` layers without reordered weights where
    :func:`pack_linear_layers` puts packed ones, with the same indices (and float weights
    where the served model keeps them): the structure a compiling process exports."""
    return _replace(model, functools.partial(PackedLinear.empty_like,
                                             keep_float_weight=keep_float_weights),
                    leaving_out)


def is_packed(model: torch.nn.Module) -> bool:
    """Whether ``model`` has packed linear layers."""
    return any(isinstance(module, PackedLinear) for module in model.modules())


def keeps_float_weights(model: torch.nn.Module) -> bool:
    """Whether ``model``'s packed layers kept their float weights."""
    return any(isinstance(m, PackedLinear) and m.weight is not None for m in model.modules())


def _replace(model: torch.nn.Module, make, leaving_out: Collection[str] = ()) -> int:
    start = sum(1 for m in model.modules() if isinstance(m, PackedLinear))
    # A weight another module still uses is packed as a copy, which says so: the model's
    # weights are not counted twice.
    kept = weights_used_beyond_linear_layers(model)
    count = 0
    for parent, name, layer in linear_layers(model, leaving_out):
        replacement = make(layer, start + count)
        if replacement is None:
            continue
        replacement.duplicates_a_weight = id(layer.weight) in kept
        setattr(parent, name, replacement)
        count += 1
    return count


def packed_weight_count(model: torch.nn.Module, leaving_out=()) -> int:
    """How many numbers ``model``'s packed weights hold where they are a layer's only
    copy (they are not among its parameters), leaving out the layers ``leaving_out``
    names. A layer that kept its float weight counts among the parameters already.

    >>> packed_weight_count(torch.nn.Linear(4, 2))
    0
    """
    skipped = {id(m) for m in leaving_out}
    return sum(m.in_features * m.out_features for m in model.modules()
               if isinstance(m, PackedLinear) and m.weight is None and id(m) not in skipped)


def weights_of(model: torch.nn.Module) -> List[torch.Tensor]:
    """``model``'s packed weights by index: what a program's indices name."""
    layers = sorted((m for m in model.modules() if isinstance(m, PackedLinear)),
                    key=lambda m: m.index)
    return [layer.packed for layer in layers]


#: What this thread's packed layers read: ``weights`` (the operator's).
_THREAD = threading.local()


@contextlib.contextmanager
def _for_this_thread(name: str, value) -> Iterator[None]:
    previous = getattr(_THREAD, name, None)
    setattr(_THREAD, name, value)
    try:
        yield
    finally:
        setattr(_THREAD, name, previous)


def packed_weights(weights: Sequence[torch.Tensor]):
    """Within this block, ``djl_stream::packed_linear`` called by this thread (from a
    compiled program) reads ``weights`` (:func:`weights_of` the model it runs)."""
    return _for_this_thread("weights", weights)


# The operator is defined with torch.library's plain registration, not ``custom_op``: a
# compiled step calls it once per linear layer, and ``custom_op``'s wrapper (an aliasing
# check and a dynamo guard at every call) is a tenth of a small model's float32 step.
_LIBRARY = torch.library.Library("djl_stream", "DEF")
_LIBRARY.define("packed_linear(Tensor x, Tensor? bias, int index, int out_features) -> Tensor")


def _packed_linear(x: torch.Tensor, bias: Optional[torch.Tensor], index: int,
                   out_features: int) -> torch.Tensor:
    weights = getattr(_THREAD, "weights", None)
    if weights is None:
        raise RuntimeError("djl_stream::packed_linear ran outside packed_weights(...): "
                           "nothing says whose weights its index names")
    return _product(x, weights[index], bias, out_features)


_LIBRARY.impl("packed_linear", _packed_linear, "CPU")


@torch.library.register_fake("djl_stream::packed_linear")
def _packed_linear_shape(x, bias, index, out_features):
    return x.new_empty((*x.shape[:-1], out_features))

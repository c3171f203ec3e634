"""Linear layers with int8 weights on a CPU (``option.quantize=int8`` and ``w8a8``).

A decode step on a CPU streams every weight once, so reading int8 weights instead of
float32 ones reads a quarter of the bytes. Both layers here store a linear layer's weight
once as int8 with one float32 scale per output row (symmetric, ``scale = max|w| / 127``),
the float32 original freed, and replace ``nn.Linear`` wherever a model has one: they know
nothing of the architecture around them.

* :class:`Int8WeightOnlyLinear` (``int8``) multiplies in the activations' own precision:
  the int8 weight is turned into the activations' dtype and multiplied, the row scales
  applied to the result. The activations are not rounded, so a row computes what it
  computes alone, and greedy text stays close to float32's. A compiled decode step turns
  each weight into a float as it reads it, from int8 vectors or from 32-bit words as the
  CPU's vector code loads them best (:func:`loads_int8_directly`).
* :class:`Int8Linear` (``w8a8``) rounds each input row to int8 too, with a scale of its
  own (dynamic, per token), and multiplies int8 by int8 into int32 with PyTorch's
  ``torch._int_mm`` (oneDNN; AVX512-VNNI, AVX-VNNI or AMX make it fast). This is what
  torchao calls ``Int8DynamicActivationInt8Weight`` and vLLM "W8A8 INT8, dynamic
  per-token". Integer sums are exact and a row's scale is its own, so batching never
  changes a request's text; rounding the activations makes it lossier than ``int8``
  (``make bench-quantization`` measures both).

A tied output embedding (SmolLM2's LM head shares the input embedding's weight) is
quantized as a copy: the embedding keeps its float32 rows.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(64, 32, bias=False)
    >>> x = torch.randn(3, 64)
    >>> for kind in (Int8WeightOnlyLinear, Int8Linear):
    ...     quantized = kind.from_linear(layer)
    ...     if quantized is not None:
    ...         error = (quantized(x) - layer(x)).abs().max() / layer(x).abs().max()
    ...         assert error < 0.05, (kind, error)
"""

from __future__ import annotations

import functools
import logging
import sys
from typing import Callable, Collection, Optional

import torch

from djl_stream.runtime.linear_layers import (blocked_product, linear_layers, products_stream,
                                              row_major, streamed_product,
                                              weights_used_beyond_linear_layers)
from djl_stream.runtime.packed_linear import onednn_linear

logger = logging.getLogger(__name__)

#: The largest magnitude of a symmetric int8 value (-127..127: -128 is left out so that
#: a value and its negation both fit).
INT8_MAX = 127
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)


def int8_matmul_unavailable() -> Optional[str]:
    """Why this PyTorch cannot multiply int8 matrices on a CPU, or ``None`` if it can.

    >>> int8_matmul_unavailable() is None or isinstance(int8_matmul_unavailable(), str)
    True
    """
    if not hasattr(torch, "_int_mm"):
        return "this PyTorch has no torch._int_mm"
    return _int_mm_fails_on_this_cpu()


@functools.lru_cache(maxsize=None)
def _int_mm_fails_on_this_cpu() -> Optional[str]:
    """Why a tiny ``torch._int_mm`` raises here, or ``None``; tried once per process
    (:func:`Int8Linear.from_linear` asks for every layer)."""
    try:
        probe = torch.ones(1, 8, dtype=torch.int8)
        torch._int_mm(probe, probe.t())
    except RuntimeError as error:
        return f"torch._int_mm does not run on this CPU ({error})"
    return None


def hold_int8_weight(layer: torch.nn.Module, weight: torch.Tensor, weight_scale: torch.Tensor,
                     bias: Optional[torch.Tensor]) -> None:
    """Give ``layer`` an int8 layer's parameters: ``weight`` (int8, ``(out, in)``),
    ``weight_scale`` (one per row) and ``bias`` (float32, or ``None``), none trained, and
    its ``out_features`` and ``in_features``."""
    layer.out_features, layer.in_features = weight.shape
    layer.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer.weight_scale = torch.nn.Parameter(weight_scale, requires_grad=False)
    layer.bias = None if bias is None else torch.nn.Parameter(bias.detach().float(),
                                                             requires_grad=False)


def quantize_rows(matrix: torch.Tensor):
    """``matrix`` (rows, columns) as int8 and one float32 scale per row, symmetric:
    ``matrix ≈ int8 * scale[:, None]``.

    >>> q, scale = quantize_rows(torch.tensor([[1.0, -2.0], [0.5, 0.25]]))
    >>> q.tolist(), [round(s * 127, 3) for s in scale.tolist()]
    ([[64, -127], [127, 64]], [2.0, 0.5])
    """
    matrix = matrix.float()
    scale = matrix.abs().amax(-1, keepdim=True).clamp_(min=torch.finfo(torch.float32).tiny)
    scale = scale.div_(INT8_MAX)
    return torch.round(matrix / scale).to(torch.int8), scale.squeeze(-1)


class _Int8Weights(torch.nn.Module):
    """An int8 weight ``(out, in)`` and its per-row scales, both parameters (so that a count
    of the model's parameters or bytes stays true). Where the original weight lives on
    (tied to an input embedding), the int8 one is a copy and says so:
    ``weight.duplicates_a_weight`` is ``True``."""

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]):
        super().__init__()
        hold_int8_weight(self, weight, weight_scale, bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear):
        """The int8 twin of ``linear``, or ``None`` where there cannot be one (not a plain
        float CPU weight, or a product this PyTorch cannot run)."""
        weight = linear.weight
        if (cls.unavailable() is not None or type(weight) not in _PLAIN_TENSORS
                or weight.device.type != "cpu" or weight.dim() != 2
                or not weight.dtype.is_floating_point):
            return None
        with torch.no_grad():
            quantized, scale = quantize_rows(weight.detach())
        return cls(quantized, scale, linear.bias)

    @classmethod
    def empty_like(cls, linear: torch.nn.Linear):
        """A layer of this kind with ``linear``'s shapes and weights left unwritten (the
        structure of a quantized model, for a compiler that needs shapes only)."""
        out_features, in_features = linear.weight.shape
        return cls(torch.empty((out_features, in_features), dtype=torch.int8),
                   torch.empty(out_features), linear.bias)

    @staticmethod
    def unavailable() -> Optional[str]:
        return None

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


#: How much of a weight :func:`dequantized_product` turns into floats at a time. A whole
#: large matrix (an LM head of 50k rows) as floats is a fresh allocation each pass, every
#: page of it faulted in; a block of this size is reused from the allocator and cache,
#: and still large enough that one product per block costs little.
DEQUANTIZE_BLOCK_BYTES = 4 << 20


def dequantized_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` for an int8 ``weight`` (no scales applied), in ``rows``' dtype:
    the weight turned into floats a block of output features at a time (see
    :data:`DEQUANTIZE_BLOCK_BYTES`), each block multiplied through oneDNN where it works
    here (:func:`~djl_stream.runtime.packed_linear.onednn_linear`: oneDNN picks its
    kernels by the CPU's instruction sets, which PyTorch's default BLAS does not do for
    every vendor's CPU), by ``torch.nn.functional.linear`` elsewhere.

    Rows of small whole numbers make every product and sum exact in float32, so the result
    is the same whichever order oneDNN sums in:

    >>> rows = torch.randint(-8, 8, (2, 8)).float()
    >>> weight = torch.randint(-127, 128, (5, 8), dtype=torch.int8)
    >>> torch.equal(dequantized_product(rows, weight), rows @ weight.float().T)
    True
    """
    out_features, in_features = weight.shape
    block = max(1, DEQUANTIZE_BLOCK_BYTES // (in_features * rows.element_size()))
    if block >= out_features:
        return _whole_product(rows, weight)
    return torch.cat([_whole_product(rows, weight[start:start + block])
                      for start in range(0, out_features, block)], dim=-1)


def _whole_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return onednn_linear(rows, weight.to(rows.dtype))


#: int8 weights in one 32-bit word (:func:`word_product`).
WEIGHTS_PER_WORD = 4


def loads_int8_directly(capability: Optional[str] = None) -> bool:
    """Whether a compiled int8 product reads the int8 weights as they are
    (:func:`~djl_stream.runtime.linear_layers.streamed_product`,
    :func:`~djl_stream.runtime.linear_layers.blocked_product`) rather than four at a time
    as 32-bit words (:func:`word_product`): where PyTorch's vector code for the CPU
    (``capability``: ``torch.backends.cpu.get_cpu_capability()`` where not given) is
    AVX-512.

    The compiler vectorises a product at the width of a vector of floats, so it loads an
    int8 weight vector a quarter full. PyTorch's AVX-512 code loads that quarter directly;
    its AVX2 code (and its generic code) copies it into a full vector on the stack first,
    and the load that follows waits for the copy to land: every weight costs a stall, and
    a one-row step takes several times a float32 one. Its float loads are direct on every
    CPU, so elsewhere the weights are read as float words and taken apart in registers.
    A big-endian CPU keeps the int8 reads: a word's bytes would be in the other order.

    >>> loads_int8_directly("AVX512"), loads_int8_directly("AVX2"), loads_int8_directly("DEFAULT")
    (True, False, False)
    """
    if capability is None:
        capability = torch.backends.cpu.get_cpu_capability()
    return capability.upper().startswith("AVX512") or sys.byteorder != "little"


def word_product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows @ weight.T`` for an int8 ``weight`` whose rows are a whole number of 32-bit
    words wide, written for a compiler: the weight is read as float32 words (four weights
    each, a view of the same bytes, loaded as floats: see :func:`loads_int8_directly`),
    and each weight is taken out of its word by integer shifts, as an int32 vector in
    registers, and turned into a float there.

    Byte ``k`` of word ``j`` is column ``4 * j + k``, so the rows' columns are first
    gathered by byte (a copy of the rows, not of the weight): each of the four bytes of a
    vector of words then multiplies a contiguous slice of the rows. As in
    :func:`~djl_stream.runtime.linear_layers.streamed_product`, each output feature reads
    its words once for every row, and a row's sums never depend on the rows beside it.

    >>> rows = torch.randn(3, 8)
    >>> weight = torch.randint(-127, 128, (5, 8), dtype=torch.int8)
    >>> torch.allclose(word_product(rows, weight), rows @ weight.float().T, atol=1e-4)
    True
    """
    out_features, width = weight.shape
    per_byte = width // WEIGHTS_PER_WORD
    count = rows.shape[0]
    words = weight.view(torch.float32).view(torch.int32)  # (out, per_byte)
    by_byte = row_major(rows.reshape(count, per_byte, WEIGHTS_PER_WORD).transpose(1, 2)
                        .reshape(count, width)).view(count, WEIGHTS_PER_WORD, per_byte)
    terms = None
    for k in range(WEIGHTS_PER_WORD):
        # byte k, sign-extended: shifted to the top of the word, then arithmetically down
        byte = words >> 24 if k == WEIGHTS_PER_WORD - 1 else (words << (24 - 8 * k)) >> 24
        term = byte.to(rows.dtype)[:, None, :] * by_byte[None, :, k, :]
        terms = term if terms is None else terms + term
    return row_major(terms.sum(-1).t())


def _reads_words(weight: torch.Tensor) -> bool:
    return (weight.shape[1] % WEIGHTS_PER_WORD == 0
            and weight.storage_offset() % WEIGHTS_PER_WORD == 0 and not loads_int8_directly())


class Int8WeightOnlyLinear(_Int8Weights):
    """``nn.Linear``'s forward through an int8 weight, in the input's precision
    (``option.quantize=int8``): see the module docstring."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if torch.compiler.is_compiling():
            # A compiled decode step has a few rows (one per running sequence), and reads
            # each int8 weight once, turning it into a float in registers (oneDNN would
            # need the whole weight as floats first: four times the bytes, written and
            # read again at every step). One row streams the weight at the speed of
            # memory; more rows make the step bound by arithmetic, where the blocked
            # product keeps several output features' sums going at once (see
            # linear_layers). Where int8 vectors are not loaded directly, the words are
            # read instead, for any rows (loads_int8_directly). Prompts, of many rows
            # each, run eagerly: see dequantized_product.
            if _reads_words(self.weight):
                product = word_product
            else:
                product = streamed_product if products_stream() else blocked_product
            out = product(rows, self.weight)
        else:
            out = dequantized_product(rows, self.weight)
        return self._finish(out * self.weight_scale.to(out.dtype), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights")


class Int8Linear(_Int8Weights):
    """``nn.Linear``'s forward through int8 weights and per-row int8 activations
    (``option.quantize=w8a8``): see the module docstring."""

    @staticmethod
    def unavailable() -> Optional[str]:
        return int8_matmul_unavailable()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # no row to scale (amax of nothing is an error)
            return x.new_zeros(*x.shape[:-1], self.out_features)
        quantized, scale = quantize_rows(rows)
        # (rows, out) int32 sums; ``weight.t()`` is a view that oneDNN reads in place
        sums = torch._int_mm(quantized, self.weight.t())
        return self._finish((sums * self.weight_scale).mul_(scale.unsqueeze(-1)), x)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights and per-row int8 activations")


def replace_linear_layers(model: torch.nn.Module, make: Callable,
                          leaving_out: Collection[str] = ()) -> int:
    """Replace each plain ``nn.Linear`` of ``model`` by ``make(layer)`` (``None`` leaves it),
    but those ``leaving_out`` names (see
    :func:`~djl_stream.runtime.linear_layers.linear_layers_read_elsewhere`), one at a time,
    so that each float weight is let go before the next is made; returns how many were
    replaced. A weight another module still uses (a tied input embedding) is replaced by a
    copy that says so (``weight.duplicates_a_weight``).

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> replace_linear_layers(model, Int8WeightOnlyLinear.from_linear)
    2
    """
    kept = weights_used_beyond_linear_layers(model)
    count = 0
    for parent, name in [(parent, name) for parent, name, _ in linear_layers(model, leaving_out)]:
        layer = getattr(parent, name)
        replacement = make(layer)
        if replacement is None:
            continue
        replacement.weight.duplicates_a_weight = id(layer.weight) in kept
        setattr(parent, name, replacement)
        count += 1
    return count


#: The layer each CPU int8 method puts in place of ``nn.Linear``.
LAYERS = {"int8": Int8WeightOnlyLinear, "w8a8": Int8Linear}


def quantized_method(model: torch.nn.Module) -> Optional[str]:
    """Which of :data:`LAYERS` ``model``'s linear layers were replaced by, if any."""
    kinds = {type(module) for module in model.modules()}
    return next((method for method, layer in LAYERS.items() if layer in kinds), None)


def quantize_structure(model: torch.nn.Module, method: str,
                       leaving_out: Collection[str] = ()) -> int:
    """Put ``method``'s layers in place of ``model``'s (but those ``leaving_out`` names),
    their weights unwritten (see :meth:`_Int8Weights.empty_like`)."""
    return replace_linear_layers(model, LAYERS[method].empty_like, leaving_out)


def quantize_weights_only(model: torch.nn.Module, leaving_out: Collection[str] = ()) -> int:
    """``option.quantize=int8`` on a CPU: every plain float ``nn.Linear`` (but those
    ``leaving_out`` names) by its :class:`Int8WeightOnlyLinear`; how many were replaced."""
    return replace_linear_layers(model, Int8WeightOnlyLinear.from_linear, leaving_out)


def quantize_linear_layers(model: torch.nn.Module, leaving_out: Collection[str] = ()) -> int:
    """``option.quantize=w8a8`` on a CPU: every plain float ``nn.Linear`` (but those
    ``leaving_out`` names) by its :class:`Int8Linear`; how many were replaced (none,
    logged, where this PyTorch cannot multiply int8 on a CPU)."""
    unavailable = int8_matmul_unavailable()
    if unavailable is not None:
        logger.warning("int8 linear layers unavailable: %s", unavailable)
        return 0
    return replace_linear_layers(model, Int8Linear.from_linear, leaving_out)

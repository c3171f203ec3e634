"""Linear layers that multiply in int8 on a CPU (``option.quantize=w8a8``).

A decode step on a CPU streams every weight once, so reading int8 weights instead of
float32 ones should make it up to four times faster; what decides whether it does is the
kernel that reads them. torchao's ``Int8WeightOnlyConfig`` (what ``option.quantize=int8``
loaded on a CPU until djl-stream's own :mod:`~djl_stream.generation.int8_weights`)
turns int8 weights back into float32 every step in eager mode (its step is slower than
float32's on this project's CPU), and ``Int8DynamicActivationInt8WeightConfig`` spends
hundreds of microseconds per layer choosing quantization parameters in eager mode: its
211 products of a one-row SmolLM2 step took 87 ms. PyTorch's own integer matrix product,
``torch._int_mm`` (oneDNN, AVX512-VNNI where the CPU has it), multiplies int8 by int8 into
int32 at the bandwidth of the int8 weights: the same 211 products in 7 ms.

So :class:`Int8Linear` is that product with the least around it:

* the weight is stored once as int8 with one float32 scale per output row (symmetric,
  ``scale = max|w| / 127``), its float32 original freed;
* each call quantizes the input per row (per token) the same way, ``torch._int_mm``
  multiplies, and the int32 sums are scaled back by the row's and the weight row's scales.

This is W8A8 with dynamic per-token activation scales, what torchao calls
``Int8DynamicActivationInt8Weight`` and vLLM "W8A8 INT8, dynamic per-token". Integer sums
are exact and each row's scale depends on that row only, so a row's result does not
depend on its batch mates: batching still never changes a request's text. It is lossier
than weight-only int8 (the activations are rounded too): see ``make bench-quantization``.

Measured on this project's 2-core EPYC (AVX512-VNNI), the 211 products of a SmolLM2 step
with their quantization (``python -m benchmarks.linear_packing`` has the float32 ones):

=====  =====================  ==================
rows   float32, prepacked     :class:`Int8Linear`
=====  =====================  ==================
1      29 ms                  13 ms
4      28 ms                  18 ms
16     39 ms                  27 ms
=====  =====================  ==================

A tied output embedding (SmolLM2's LM head shares the input embedding's weight) is
quantized as a copy, as :mod:`~djl_stream.generation.packed_linear` packs it: the
embedding keeps its float32 rows (a quarter of the embedding's size again in memory).

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(64, 32, bias=False)
    >>> quantized = Int8Linear.from_linear(layer)
    >>> x = torch.randn(3, 64)
    >>> error = (quantized(x) - layer(x)).abs().max() / layer(x).abs().max()
    >>> bool(error < 0.05)
    True
"""

from __future__ import annotations

import functools
import logging
from typing import Optional, Sequence

import torch

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


class Int8Linear(torch.nn.Module):
    """``nn.Linear``'s forward (float32 in, float32 out) through int8 weights and per-row
    int8 activations: see the module docstring.

    ``weight`` is the int8 matrix ``(out, in)`` and ``weight_scale`` its per-row scales,
    both parameters (so a count of the model's parameters or bytes stays true). Where the
    original weight lives on (tied to an input embedding), the int8 one is a copy and
    says so: ``weight.duplicates_a_weight`` is ``True``.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]):
        super().__init__()
        hold_int8_weight(self, weight, weight_scale, bias)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Optional["Int8Linear"]:
        """The int8 twin of ``linear``, or ``None`` where there cannot be one (not a plain
        float CPU weight, or no integer product in this PyTorch)."""
        weight = linear.weight
        if (int8_matmul_unavailable() is not None or type(weight) not in _PLAIN_TENSORS
                or weight.device.type != "cpu" or weight.dim() != 2
                or not weight.dtype.is_floating_point):
            return None
        with torch.no_grad():
            quantized, scale = quantize_rows(weight.detach())
        return cls(quantized, scale, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] == 0:  # no row to scale (amax of nothing is an error)
            return x.new_zeros(*x.shape[:-1], self.out_features)
        quantized, scale = quantize_rows(rows)
        # (rows, out) int32 sums; ``weight.t()`` is a view that oneDNN reads in place
        sums = torch._int_mm(quantized, self.weight.t())
        out = (sums * self.weight_scale).mul_(scale.unsqueeze(-1))
        if self.bias is not None:
            out = out.add_(self.bias)
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights and per-row int8 activations")


def fuse(layers: Sequence[Int8Linear]) -> Optional[Int8Linear]:
    """One :class:`Int8Linear` that computes what ``layers`` compute of the same input,
    their outputs side by side in their order; afterwards each of ``layers`` reads its
    rows of the fused weight and scales (views: no memory of their own). ``None``, and
    ``layers`` left alone, where they cannot be fused (fewer than two, a bias, another
    layer type, different input widths).

    The fused product is the same arithmetic as the separate ones: the input is rounded
    to int8 with the same per-row scale, each output's int32 sum is exact, and it is
    scaled by its own weight row's scale; what it saves is the calls, one integer
    product and one rounding of the input instead of three (query, key and value) or two
    (gate and up): 12.7 ms against 13.7 for the products of a one-row SmolLM2 step on this
    project's 2-core Xeon.

    >>> q, k = (Int8Linear.from_linear(torch.nn.Linear(8, n, bias=False)) for n in (4, 2))
    >>> if q is not None:
    ...     x = torch.randn(3, 8)
    ...     before = torch.cat([q(x), k(x)], dim=-1)
    ...     qk = fuse([q, k])
    ...     assert torch.equal(qk(x), before) and torch.equal(q(x), before[:, :4])
    ...     assert q.weight.data_ptr() == qk.weight.data_ptr()
    """
    if (len(layers) < 2 or any(type(layer) is not Int8Linear or layer.bias is not None
                               for layer in layers)
            or len({layer.in_features for layer in layers}) != 1):
        return None
    with torch.no_grad():
        fused = Int8Linear(torch.cat([layer.weight for layer in layers]),
                           torch.cat([layer.weight_scale for layer in layers]), None)
        start = 0
        for layer in layers:
            rows = slice(start, start + layer.out_features)
            layer.weight = torch.nn.Parameter(fused.weight[rows], requires_grad=False)
            layer.weight_scale = torch.nn.Parameter(fused.weight_scale[rows],
                                                    requires_grad=False)
            start = rows.stop
    return fused


def quantize_linear_layers(model: torch.nn.Module) -> int:
    """Replace every float CPU ``nn.Linear`` in ``model`` by its :class:`Int8Linear`, in
    place, and return how many were replaced (none where this PyTorch cannot multiply
    int8 on a CPU: then the model is left as it was, logged).

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> quantize_linear_layers(model) in (0, 2)
    True
    """
    from djl_stream.generation.packed_linear import install_replacements

    unavailable = int8_matmul_unavailable()
    if unavailable is not None:
        logger.warning("int8 linear layers unavailable: %s", unavailable)
        return 0
    # one layer at a time: each float weight let go before the next is quantized
    return install_replacements(model, [], then=lambda name, layer: Int8Linear.from_linear(layer))

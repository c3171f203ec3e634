"""Int8 weight-only linear layers on a CPU (``option.quantize=int8``), stored for the
compiled decode programs' int8 products.

A decode step streams every weight once, so int8 weights should make it up to four times
faster than float32's where the int8 is turned into floats inside the loop that reads
it. torchao's ``Int8WeightOnlyConfig`` turns the whole weight back into float32 at every
call instead (on this project's 2-core AMD EPYC a one-row SmolLM2 step took 114 ms against
float32's 28), and ``w8a8``'s integer products
(:mod:`~djl_stream.generation.int8_linear`) are fast only where the CPU has int8
dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX). So :class:`Int8WeightOnlyLinear`
keeps the int8 weight with one float32 scale per output row (symmetric, as ``w8a8``'s
weights: :func:`~djl_stream.generation.int8_linear.quantize_rows`) and the compiled
programs multiply it with :class:`Int8WeightProduct`, a reduction that Inductor compiles
into one vectorized loop over the int8 bytes with AVX2 alone.

Two things make that loop fast, both about how Inductor's CPU code reads memory:

* the weight is handed to the program as 32-bit *words*, four int8 weights each
  (:attr:`Int8WeightOnlyLinear.words`, a view of the same bytes) and each weight taken
  out of its word with integer shifts. The words' type follows the vector instructions
  Inductor compiles for (:func:`words_dtype`): its AVX2 code loads an integer vector
  through a copy on the stack (PyTorch 2.13's ``Vectorized<int32_t>::loadu(ptr, count)``),
  which stalls every load, where a float vector is loaded directly (SmolLM2's LM head on
  the AMD EPYC: 6.4 ms a one-row product through integer loads, 1.6 ms through float
  ones, float32's own 4.0), so there the words are float32 and turned into integers in
  registers; its AVX-512 code loads integer vectors directly (a masked load) but turns
  float words into integers one by one through the stack, so there the words are int32
  (the LM head on the Intel Xeon of 2026-11-28: 1.1 ms a one-row product from int32
  words, 3.4-6.9 from float32 words, float32's own 2.9 with MKL);
* the columns are stored interleaved, byte ``k`` of word ``j`` holding column
  ``k * in / 4 + j``, so that the four weights of a word multiply four contiguous slices
  of the input (the plain order would read the input with a stride of four: 7.9 ms for
  the LM head).

The eager forward (prompts, and batches larger than the programs take) turns the weight
into floats at every call and multiplies the input's columns taken in the stored order:
slower than float32's products (SmolLM2's layers at 16 rows: 125 ms against 65), the
price of a quarter of the weight memory where no program runs.

The activations stay float32, so a row's result does not depend on its batch mates, and
int8 weight-only rounding is the more faithful of the two int8 modes.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(64, 32, bias=False)
    >>> quantized = Int8WeightOnlyLinear.from_linear(layer)
    >>> x = torch.randn(3, 64)
    >>> error = (quantized(x) - layer(x)).abs().max() / layer(x).abs().max()
    >>> bool(error < 0.02)
    True
    >>> torch.allclose(Int8WeightProduct(quantized)(x), quantized(x), atol=1e-5)
    True
"""

from __future__ import annotations

import functools
from typing import Optional

import torch

from djl_stream.generation.int8_linear import _PLAIN_TENSORS, hold_int8_weight, quantize_rows

#: int8 weights per float32 word.
WEIGHTS_PER_WORD = 4


@functools.lru_cache(maxsize=None)
def words_dtype() -> torch.dtype:
    """The type of the words :class:`Int8WeightProduct` reads (module docstring): int32
    where Inductor vectorizes a CPU's loops with AVX-512, whose integer vectors it loads
    directly, float32 elsewhere (AVX2, whose float loads are the direct ones; without a
    C++ compiler no program reads the words).

    >>> words_dtype() in (torch.int32, torch.float32)
    True
    """
    try:
        from torch._inductor import cpu_vec_isa

        isa = cpu_vec_isa.pick_vec_isa()
    except Exception:  # noqa: BLE001 - no compiler: no program will read the words
        return torch.float32
    return torch.int32 if isa and isa.bit_width() >= 512 else torch.float32


def interleaved_columns(in_features: int) -> torch.Tensor:
    """The original column each stored column holds: stored column ``4 * j + k`` (byte
    ``k`` of word ``j``) holds column ``k * in_features / 4 + j``.

    >>> interleaved_columns(8).tolist()
    [0, 2, 4, 6, 1, 3, 5, 7]
    """
    words = in_features // WEIGHTS_PER_WORD
    return torch.arange(in_features).view(WEIGHTS_PER_WORD, words).t().reshape(-1)


class Int8WeightOnlyLinear(torch.nn.Module):
    """``nn.Linear``'s forward (float32 in, float32 out) over int8 weights with one scale
    per output row: see the module docstring.

    ``weight`` is the int8 matrix ``(out, in)`` with its columns interleaved
    (:func:`interleaved_columns`), ``weight_scale`` the per-row scales, both parameters
    (so a count of the model's parameters or bytes stays true). Where the original weight
    lives on (tied to an input embedding), the int8 one is a copy and says so:
    ``weight.duplicates_a_weight`` is ``True``.
    """

    def __init__(self, weight: torch.Tensor, weight_scale: torch.Tensor,
                 bias: Optional[torch.Tensor]):
        super().__init__()
        hold_int8_weight(self, weight, weight_scale, bias)
        # (not a buffer: the programs take the input as it is, the words interleaved)
        self.column_order = interleaved_columns(self.in_features)

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear) -> Optional["Int8WeightOnlyLinear"]:
        """The int8 weight-only twin of ``linear``, or ``None`` where there cannot be one
        (not a plain float CPU weight, or an input width that is not a multiple of 4)."""
        weight = linear.weight
        if (type(weight) not in _PLAIN_TENSORS or weight.device.type != "cpu"
                or weight.dim() != 2 or not weight.dtype.is_floating_point
                or weight.shape[1] % WEIGHTS_PER_WORD):
            return None
        with torch.no_grad():
            quantized, scale = quantize_rows(weight.detach())
            rows, columns = quantized.shape
            stored = (quantized.view(rows, WEIGHTS_PER_WORD, columns // WEIGHTS_PER_WORD)
                      .transpose(1, 2).contiguous().view(rows, columns))
        return cls(stored, scale, linear.bias)

    @property
    def words(self) -> torch.Tensor:
        """The weight's bytes as 32-bit words ``(out, in / 4)``, four int8 weights each,
        of :func:`words_dtype` (a view, no copy): what :class:`Int8WeightProduct`
        reads."""
        return self.weight.view(words_dtype())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.weight.to(x.dtype)
        out = torch.nn.functional.linear(x[..., self.column_order], weight)
        out = out * self.weight_scale.to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, int8 weights (one scale per row), float "
                "activations")


class Int8WeightProduct(torch.nn.Module):
    """An :class:`Int8WeightOnlyLinear`'s product for a compiled program, for one row or a
    few: a reduction over the layer's int8 weights read as 32-bit words (the layer's own
    bytes and scales, no copies), each weight taken out of its word by shifts.

    Its loop reads each word once for all the rows, the weight's rows outermost, and
    hands on the sums as a contiguous ``(rows, outputs)`` tensor whose layout
    ``as_strided`` pins (as
    :class:`~djl_stream.generation.compiled_decode.FewRowsProduct` does, and for the same
    reason). The words' conversion is paid once per row: a batch costs about a row's
    conversions more for each row (SmolLM2's 211 products in one compiled graph on the
    2-core AMD EPYC: about 9 ms at 1 row, 14 at 2, 54 at 8, 102 at 16).
    """

    def __init__(self, linear: Int8WeightOnlyLinear):
        super().__init__()
        self.register_buffer("words", linear.words)
        self.weight_scale = linear.weight_scale
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # float words become integers in registers; int32 ones are read as they are
        words = self.words.view(torch.int32)
        outputs, per_byte = words.shape
        rows = x.reshape(-1, per_byte * WEIGHTS_PER_WORD)
        parts = rows.view(rows.shape[0], WEIGHTS_PER_WORD, per_byte)  # byte k's columns
        terms = None
        for k in range(WEIGHTS_PER_WORD):
            # byte k, sign-extended: shifted to the top, then arithmetically back down
            byte = (words >> 24) if k == 3 else ((words << (24 - 8 * k)) >> 24)
            term = parts[:, k].unsqueeze(0) * byte.to(torch.float32).unsqueeze(1)
            terms = term if terms is None else terms + term
        sums = terms.sum(-1)  # (outputs, rows)
        products = torch.as_strided(sums.t().contiguous(), (rows.shape[0], outputs),
                                    (outputs, 1)) * self.weight_scale
        if self.bias is not None:
            products = products + self.bias
        return products.view(*x.shape[:-1], outputs)


def quantize_weights_only(model: torch.nn.Module) -> int:
    """Replace every float CPU ``nn.Linear`` in ``model`` whose input width is a multiple
    of 4 by its :class:`Int8WeightOnlyLinear`, in place; how many were replaced.

    >>> model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    >>> quantize_weights_only(model)
    2
    """
    from djl_stream.generation.packed_linear import install_replacements

    # one layer at a time: each float weight let go before the next is quantized
    return install_replacements(
        model, [], then=lambda name, layer: Int8WeightOnlyLinear.from_linear(layer))


def holds_int8_weights(module: torch.nn.Module) -> bool:
    """Whether ``module`` (a model or a graph) holds int8 weight-only layers or products."""
    return any(isinstance(inner, (Int8WeightOnlyLinear, Int8WeightProduct))
               for inner in module.modules())

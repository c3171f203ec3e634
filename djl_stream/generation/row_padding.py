"""A decode step's matrix products of 10 to 15 rows, run at 16 where that is faster.

A decode step multiplies every weight by a few rows, one per running request. MKL's
single-precision GEMM (what ``nn.Linear`` calls on a CPU with PyTorch's Intel builds)
takes those rows three at a time below 16 and reads the weight once for each three, then
switches to a kernel that reads it once for all. On this project's 2-core Intel Xeon, one
product by SmolLM2's LM head (49152 x 576, 113 MB; ``python -m benchmarks.row_padding``,
the fastest of 7 calls):

=====  ===  =======  =======  =========  =========  ===  ===  ===
rows   1-3  4-6      7-9      10-12      13-15      16   24   32
ms     2.4  5.1-5.8  7.8-8.4  10.7-11.5  13.2-14.2  6.4  7.5  8.6
=====  ===  =======  =======  =========  =========  ===  ===  ===

and with a 7B model's shapes, the same steps (``--shapes 11008x4096,32000x4096``, random
weights: an MLP weight, 11008 x 4096, 5.6 ms at 1-3 rows, 20-21 at 10-12, 25-27 at 13-15,
16 at 16; the LM head, 32000 x 4096, 70-73 at 10-12, 90 at 13-15, 54 at 16). From 10
rows (four reads) the 16-row product is the cheaper one on every shape measured; at 7 to 9
it is about even. Where a weight stays in the cache, reading it again costs little and
nothing changes (SmolLM2's 576 x 1536: 0.1 ms at every row count). A whole decode step of
SmolLM2 with 13 to 15 rows took 74-79 ms, 16 rows 66.

:func:`padding_trial` checks, once at load, each weight shape of the step of
:data:`MIN_WEIGHT_BYTES` or more: if 15 rows cost :data:`FEW_ROWS_PENALTY` times what
16 do or more (SmolLM2's LM head: 2.2-2.6x; a weight without the few-row kernel: about
1x), products of that shape with :data:`PADDED_FROM` to 15 rows are padded to
:data:`PADDED_ROWS` (once one padded product has given its real rows what the unpadded
one gives them): :class:`RowPaddedLinear` appends zero rows and returns the real ones. A
yes or no with a wide margin, rather than a threshold per row count, so that the
choice holds from one start to the next (at 7-9 rows the ratio sits near any threshold).
Each row's result is the one a 16-row batch gives it: a GEMM's output row depends on its
own input row only, and batches of 16 already run that kernel.

Example::

    >>> import torch
    >>> layer = torch.nn.Linear(8, 4, bias=False)
    >>> padded = RowPaddedLinear(layer, frozenset({3}))
    >>> x = torch.randn(3, 8)
    >>> bool(torch.allclose(padded(x), layer(x), atol=1e-6))
    True
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Callable, Dict, FrozenSet, List, Optional, Tuple

import torch

from djl_stream.generation.packed_linear import agrees_on_probe

#: The row count that products of :data:`PADDED_FROM` to 15 rows are padded up to: where
#: MKL's single-precision GEMM leaves its few-row kernel.
PADDED_ROWS = 16
#: The fewest rows padded: from four reads of the weight (10 rows) the 16-row product is
#: cheaper on every shape measured.
PADDED_FROM = 10
#: The row count the trial sets against :data:`PADDED_ROWS`: the few-row kernel's worst.
FEW_ROWS = PADDED_ROWS - 1
#: A shape is padded where its product of 15 rows costs this many times what 16 rows cost,
#: or more: the few-row kernel's five reads against one (2.2-2.6x on SmolLM2's LM head,
#: 1.6-1.7x on a 7B model's MLP weight), far from a kernel without it (about 1x).
FEW_ROWS_PENALTY = 1.3
#: Weights below this size are not tried: the smaller a weight, the more of it a cache
#: holds when it is read again (SmolLM2's 3.5 MB MLP weights: no difference at any row
#: count), and the more the trial times noise. A 7B model's smallest, 4096 x 4096 in
#: bfloat16, is this size.
MIN_WEIGHT_BYTES = 32 << 20
#: Calls per timing in the trial (the fastest counts: another process on the same cores
#: only ever slows a call).
REPETITIONS = 5
#: Timings of each row count in the trial, taking turns with the other count: right after
#: loading, a machine ran the same product 40 % slower for a second or so.
ROUNDS = 3


class RowPaddedLinear:
    """``layer``'s product, run with zero rows appended up to :data:`PADDED_ROWS` when the
    input has a number of rows in ``padded``, else as it is. Not a module: it lives in the
    decode step's list of layers, not in the model.

    >>> layer = torch.nn.Linear(4, 2)
    >>> RowPaddedLinear(layer, frozenset({2}))(torch.ones(2, 4)).shape
    torch.Size([2, 2])
    """

    def __init__(self, layer, padded: FrozenSet[int]):
        self.layer = layer
        self.padded = padded

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        if rows not in self.padded:
            return self.layer(x)
        wide = with_zero_rows(x.reshape(rows, x.shape[-1]), PADDED_ROWS)
        return self.layer(wide)[:rows].reshape(*x.shape[:-1], -1)

    def __repr__(self) -> str:
        return f"RowPaddedLinear({self.layer!r}, rows {sorted(self.padded)})"


@dataclasses.dataclass(frozen=True)
class ShapeTrial:
    """One weight shape's trial: the fastest call at 15 and at 16 rows, and the row counts
    padded (none, or :data:`PADDED_FROM` to 15)."""

    shape: Tuple[int, int]
    seconds: Dict[int, float]
    padded: FrozenSet[int]

    def __str__(self) -> str:
        if not self.padded:
            return f"{self.shape[0]}x{self.shape[1]}: not padded"
        return (f"{self.shape[0]}x{self.shape[1]}: {min(self.padded)}-{max(self.padded)} rows "
                f"padded ({FEW_ROWS} rows {self.seconds[FEW_ROWS] * 1e3:.1f} ms, "
                f"{PADDED_ROWS} rows {self.seconds[PADDED_ROWS] * 1e3:.1f} ms)")


def with_zero_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """``x`` with zero rows appended (along its first dimension) up to ``rows``; ``x``
    itself where it has them already.

    >>> with_zero_rows(torch.ones(2, 3), 4).tolist()
    [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    if x.shape[0] == rows:
        return x
    return torch.cat([x, x.new_zeros(rows - x.shape[0], *x.shape[1:])])


def _weight_bytes(layer) -> int:
    weight = layer.weight
    return weight.shape[0] * weight.shape[1] * weight.element_size()


def fastest_call(layer, rows: int, dtype: torch.dtype, repetitions: int = REPETITIONS) -> float:
    """Seconds of ``layer``'s fastest call (of ``repetitions``, after one untimed: the
    kernel's first call may set itself up) on ``rows`` random rows of ``dtype``.

    >>> fastest_call(torch.nn.Linear(8, 8), 3, torch.float32) > 0
    True
    """
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        layer(x)
        fastest = math.inf
        for _ in range(repetitions):
            started = time.perf_counter()
            layer(x)
            fastest = min(fastest, time.perf_counter() - started)
    return fastest


def shape_trial(layer, dtype: torch.dtype,
                time_call: Optional[Callable[[object, int], float]] = None) -> ShapeTrial:
    """Time ``layer`` at 15 rows and at :data:`PADDED_ROWS`, :data:`ROUNDS` times each in
    turns, and pad :data:`PADDED_FROM` to 15 rows where the fastest 15-row time is
    :data:`FEW_ROWS_PENALTY` times the fastest 16-row time or more. ``time_call(layer,
    rows)`` gives a call's seconds (by default the fastest of :data:`REPETITIONS` real
    calls).

    >>> timings = {16: 5.5, 15: 13.2}  # SmolLM2's LM head, ms
    >>> trial = shape_trial(torch.nn.Linear(4, 4), torch.float32,
    ...                     time_call=lambda layer, rows: timings[rows])
    >>> sorted(trial.padded)
    [10, 11, 12, 13, 14, 15]
    """
    if time_call is None:
        def time_call(layer, rows):
            return fastest_call(layer, rows, dtype)
    seconds = {PADDED_ROWS: math.inf, FEW_ROWS: math.inf}
    for _ in range(ROUNDS):
        for rows in (PADDED_ROWS, FEW_ROWS):
            seconds[rows] = min(seconds[rows], time_call(layer, rows))
    pays = seconds[FEW_ROWS] >= FEW_ROWS_PENALTY * seconds[PADDED_ROWS]
    padded = frozenset(range(PADDED_FROM, PADDED_ROWS)) if pays else frozenset()
    if padded and not _pads_faithfully(layer, dtype, padded):
        padded = frozenset()
    return ShapeTrial((layer.out_features, layer.in_features), seconds, padded)


def _pads_faithfully(layer, dtype: torch.dtype, padded: FrozenSet[int]) -> bool:
    """Whether ``layer``'s padded product gives its real rows what the unpadded one
    does (another kernel: another summation order), as a packed layer is held to
    (:func:`~djl_stream.generation.packed_linear.agrees_on_probe`). A layer whose rows
    depend on their batch mates (activations quantized per tensor, say) would not."""
    return agrees_on_probe(layer, RowPaddedLinear(layer, padded), layer.in_features, dtype,
                           rows=max(padded))


def padding_trial(layers: List, dtype: torch.dtype,
                  time_call: Optional[Callable[[object, int], float]] = None
                  ) -> Dict[Tuple[str, int, int], ShapeTrial]:
    """:func:`shape_trial` for the first of ``layers`` of each kind and weight shape of
    :data:`MIN_WEIGHT_BYTES` or more, keyed by :func:`shape_key`.

    >>> padding_trial([torch.nn.Linear(8, 8)], torch.float32)  # too small to try
    {}
    """
    trials = {}
    with torch.inference_mode():
        for layer in layers:
            key = shape_key(layer)
            if key not in trials and _weight_bytes(layer) >= MIN_WEIGHT_BYTES:
                trials[key] = shape_trial(layer, dtype, time_call)
    return trials


def shape_key(layer) -> Tuple[str, int, int]:
    """What a layer's trial holds for: its kind (its kernel) and its weight's shape."""
    return type(layer).__name__, layer.out_features, layer.in_features


def padded_layer(layer, trials: Dict[Tuple[str, int, int], ShapeTrial]):
    """``layer``, wrapped in a :class:`RowPaddedLinear` where its shape's trial pads some
    row counts."""
    trial = trials.get(shape_key(layer))
    return RowPaddedLinear(layer, trial.padded) if trial is not None and trial.padded else layer

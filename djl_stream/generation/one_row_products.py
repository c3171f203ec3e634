"""Which way the one-row program multiplies on this CPU: ATen's matrix products, or
reductions that Inductor compiles into loops of its own.

A one-row decode step is a chain of matrix-vector products that read every weight once,
so its speed is the speed at which they read memory. Inductor compiles a product written
as a reduction (:class:`~djl_stream.generation.compiled_decode.OneRowProduct`) into a
vectorized loop over the weight's rows that reads them about as fast as a plain sum over
them does; ATen's one-row product (MKL's) is much slower than that on some CPUs and a
little faster on others:

- on the 2-core AMD EPYC (Zen 3, AVX2) of 2026-11-27, MKL read SmolLM2's 538 MB of
  weights at 12.9 GB/s with one row (41.7 ms for the 211 products) while the machine
  streams them at 23-27 GB/s: a one-row step of the program took 24 ms with reductions
  against 47 with matrix products;
- on the 2-core Intel Xeon (AVX-512) of 2026-11-28, MKL read them at 25.4 GB/s (21.2 ms)
  and a plain sum over each weight took 24.8 ms: the program took 22.3 ms a step with
  matrix products against 24.8 with reductions (medians of 5 rounds of 64 steps taken in
  turns, a ``/tmp`` script).

So before the one-row program is built, the load times one row through each float32
layer with ATen and a sum over each layer's weight (the speed at which the reduction's
loop reads it), in turns (:func:`one_row_trial`), and the program keeps ATen's products
where they took no longer than the sums (:attr:`OneRowTrial.matrix_products_pay`). The
trial reads the whole model's weights each way, under a second for SmolLM2.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    >>> one_row_trial(model) is None  # (weights too few to time: reductions)
    True
    >>> OneRowTrial(matrix_seconds=0.0206, sum_seconds=0.0231).matrix_products_pay  # a Xeon
    True
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Optional

import torch

logger = logging.getLogger(__name__)

#: How many times a plain sum's time ATen's one-row products may take for the one-row
#: program to keep them (:attr:`OneRowTrial.matrix_products_pay`). The two CPUs measured
#: sit far on either side: the Xeon's products took 0.85 times the sums, the EPYC's about
#: 1.9 times (module docstring); where they are level, the two programs are too.
MATRIX_PRODUCTS_WITHIN = 1.0
#: The fewest bytes of float32 weights worth timing: below, a model's weights stay in the
#: CPU's caches from one call to the next, the trial would time those rather than the
#: memory, and its calls last microseconds, so the program keeps its reductions (as for
#: the tiny models of the tests, whose programs then do not depend on the machine).
TRIAL_MIN_BYTES = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class OneRowTrial:
    """One row through every float32 layer with ATen's product, and a sum over each
    layer's weight: each layer's fastest call, summed, each way (:func:`one_row_trial`)."""

    matrix_seconds: float
    sum_seconds: float

    @property
    def matrix_products_pay(self) -> bool:
        """Whether the one-row program should keep ATen's matrix products: they read the
        weights no slower than a sum over them (:data:`MATRIX_PRODUCTS_WITHIN`)."""
        return self.matrix_seconds <= self.sum_seconds * MATRIX_PRODUCTS_WITHIN

    def __str__(self) -> str:
        return (f"one row through the layers: {self.matrix_seconds * 1e3:.1f} ms with "
                f"ATen's matrix products, {self.sum_seconds * 1e3:.1f} ms to sum their "
                "weights")


class _WeightSum:
    """A call that reads ``weight`` once (its sum), whatever it is given: the stand-in for
    the reduction's loop in :func:`one_row_trial`."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def __call__(self, _: torch.Tensor) -> torch.Tensor:
        return self.weight.sum()


def one_row_trial(model: torch.nn.Module, repetitions: int = 7) -> Optional[OneRowTrial]:
    """Time one row through each of ``model``'s plain float32 layers with ATen's product
    and a sum over each one's weight, all the layers one way then all the other,
    ``repetitions`` times in turns, each layer's fastest call kept (the packing trial's
    way, :func:`~djl_stream.generation.packed_linear.packing_trial`, so that another
    process on the same cores, which slows some calls, does not decide it); ``None``
    where their weights are fewer than :data:`TRIAL_MIN_BYTES` (or none)."""
    from djl_stream.generation.packed_linear import packing_trial, plain_linear_layers

    layers = [layer for _, _, layer in plain_linear_layers(model)
              if layer.weight.dtype == torch.float32]
    if sum(layer.weight.nbytes for layer in layers) < TRIAL_MIN_BYTES:
        return None
    timed = packing_trial([(layer, _WeightSum(layer.weight)) for layer in layers],
                          repetitions=repetitions)
    return OneRowTrial(timed.plain_seconds, timed.packed_seconds)


def matrix_products_pay(model: torch.nn.Module) -> bool:
    """Whether ``model``'s one-row program should multiply with ATen's matrix products
    on this CPU (:func:`one_row_trial`; logged), ``False`` (reductions) where the model
    has too few float32 weights to time."""
    trial = one_row_trial(model)
    if trial is None:
        return False
    logger.info("the one-row program's products: %s (%s)",
                "ATen's matrix products" if trial.matrix_products_pay else "reductions",
                trial)
    return trial.matrix_products_pay

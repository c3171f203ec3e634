"""Quantized weights (``option.quantize``): which library quantizes them, and how it is asked.

``int8``
    Int8 weight-only: each linear layer's weight is stored as int8 with one scale per
    output channel and multiplied in the activations' own precision, through torchao's
    ``Int8WeightOnlyConfig`` handed to transformers as a ``TorchAoConfig``. It works on a
    CPU and on a GPU, and it does not change what a row computes with its batch mates (the
    activations are not quantized), so batching still never changes a request's text.
    Weights take a quarter of their float32 size; the LM head stays unquantized
    (transformers keeps a tied output embedding as it is). Needs ``pip install torchao``.
``bitsandbytes8`` / ``bitsandbytes4``
    bitsandbytes' LLM.int8() and 4-bit NF4, djl-serving's own names for them (its
    deprecated ``option.load_in_8bit=true`` / ``option.load_in_4bit=true`` mean the
    same, as there), through transformers' ``BitsAndBytesConfig``: what the Llama-2
    tutorials load with ``load_in_8bit=True``. Made for CUDA GPUs; bitsandbytes 0.45 and
    later also run on a CPU (``python -m benchmarks.quantization`` compares them with
    float32 there: on this project's 2-core CPU ``bitsandbytes8`` took twice float32's
    decode step, and ``bitsandbytes4`` was faster but the least faithful). Needs
    ``pip install bitsandbytes``.

The library is imported only when asked for, so neither is a dependency of the package.

Example::

    >>> quantization_kwargs(None, on_gpu=False)
    {}
    >>> quantization_kwargs("int4", on_gpu=False)
    Traceback (most recent call last):
    ...
    ValueError: unknown quantization method 'int4'; expected one of int8, bitsandbytes8, bitsandbytes4
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

logger = logging.getLogger(__name__)

#: What ``option.quantize`` accepts.
QUANTIZE_METHODS = ("int8", "bitsandbytes8", "bitsandbytes4")
#: Methods made for CUDA GPUs (their CPU kernels are a fallback).
MADE_FOR_CUDA = frozenset({"bitsandbytes8", "bitsandbytes4"})


class QuantizationUnavailable(RuntimeError):
    """The method's library is not installed; the message says what to do."""


def quantization_kwargs(method: Optional[str], *, on_gpu: bool,
                        compute_dtype: Any = None) -> Dict[str, Any]:
    """``from_pretrained`` keyword arguments that load the weights quantized by
    ``method`` (one of :data:`QUANTIZE_METHODS`, or ``None`` for none).

    ``compute_dtype`` is the dtype bitsandbytes' 4-bit layers compute in (the model's
    ``dtype``). Raises :class:`QuantizationUnavailable` when the method's library is
    not installed.
    """
    if method is None:
        return {}
    if method not in QUANTIZE_METHODS:
        raise ValueError(f"unknown quantization method {method!r}; "
                         f"expected one of {', '.join(QUANTIZE_METHODS)}")
    if method in MADE_FOR_CUDA and not on_gpu:
        logger.warning("option.quantize=%s on a CPU: bitsandbytes' CPU kernels stand in for "
                       "its CUDA ones (see the README for how they compare with float32 and "
                       "int8 there)", method)
    if method == "int8":
        return {"quantization_config": _torchao_int8_weight_only()}
    return {"quantization_config": _bitsandbytes(method, compute_dtype)}


def _torchao_int8_weight_only():
    try:
        from torchao.quantization import Int8WeightOnlyConfig
    except ImportError as error:
        raise QuantizationUnavailable(
            "option.quantize=int8 needs torchao: pip install torchao "
            f"(or add it to the model directory's requirements.txt) ({error})") from error
    from transformers import TorchAoConfig

    return TorchAoConfig(quant_type=Int8WeightOnlyConfig())


def _bitsandbytes(method: str, compute_dtype: Any):
    try:
        import bitsandbytes  # noqa: F401 - transformers needs it installed, not imported here
    except ImportError as error:
        raise QuantizationUnavailable(
            f"option.quantize={method} needs bitsandbytes: pip install bitsandbytes "
            f"(or add it to the model directory's requirements.txt) ({error})") from error
    from transformers import BitsAndBytesConfig

    if method == "bitsandbytes8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                              bnb_4bit_compute_dtype=compute_dtype)

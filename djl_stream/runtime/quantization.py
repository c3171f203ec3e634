"""Quantized weights (``option.quantize``): which library quantizes them, and how it is asked.

``int8``
    Int8 weight-only: each linear layer's weight is stored as int8 with one scale per
    output channel and multiplied in the activations' own precision. It does not change
    what a row computes with its batch mates (the activations are not quantized), so
    batching still never changes a request's text. On a CPU this is djl-stream's
    :class:`~djl_stream.runtime.int8.Int8WeightOnlyLinear` (no extra library;
    the weights load in float32 and are quantized after, the LM head too, as a copy
    where it is tied to the input embedding): the int8 mode for a CPU without int8
    dot-product instructions. On a GPU,
    torchao's ``Int8WeightOnlyConfig`` handed to transformers as a ``TorchAoConfig``
    (the LM head stays unquantized there); needs ``pip install torchao``.
``w8a8``
    Int8 weights *and* activations: each linear layer's weight as int8 with one scale per
    output channel, each input row quantized to int8 as it arrives (dynamic, per token),
    the product in integers. On a CPU this is djl-stream's
    :class:`~djl_stream.runtime.int8.Int8Linear` on PyTorch's own ``torch._int_mm``
    (no extra library; the weights load in float32 and are quantized after): the fast
    int8 mode where the CPU has int8 dot-product instructions (AVX512-VNNI, AVX-VNNI, AMX), but
    rounding the activations too makes it less faithful to float32 than ``int8`` (see
    ``make bench-quantization``). The LM head is quantized too. A row's scales are its
    own, so batching does not change a request's text. Where its integer products are
    slow it serves ``int8`` instead, with a warning, since ``int8`` stores the same int8
    weights: on a GPU, where torchao's ``Int8DynamicActivationInt8WeightConfig``, the same
    arithmetic, runs eagerly with a host synchronization per input feature, many times
    slower than weight-only ``int8`` (BENCHMARKS.md); and on an x86 CPU without int8
    dot-product instructions, where PyTorch's integer product runs at about a scalar
    loop's speed, slower than float32 at every batch size (BENCHMARKS.md). So a model
    directory set up for one CPU's ``w8a8`` goes to a GPU or to another CPU without an
    edit.
``bitsandbytes8`` / ``bitsandbytes4``
    bitsandbytes' LLM.int8() and 4-bit NF4, djl-serving's own names for them (its
    deprecated ``option.load_in_8bit=true`` / ``option.load_in_4bit=true`` mean the
    same, as there), through transformers' ``BitsAndBytesConfig``: what the Llama-2
    tutorials load with ``load_in_8bit=True``. Made for CUDA GPUs; bitsandbytes 0.45 and
    later also run on a CPU (``python -m benchmarks.quantization`` compares them with
    float32 there). Needs
    ``pip install bitsandbytes``.

The library is imported only when asked for, so neither is a dependency of the package.

Example::

    >>> quantization_kwargs(None, on_gpu=False)
    {}
    >>> quantization_kwargs("int4", on_gpu=False)
    Traceback (most recent call last):
    ...
    ValueError: unknown quantization method 'int4'; expected one of int8, w8a8, bitsandbytes8, bitsandbytes4
    >>> quantization_kwargs("w8a8", on_gpu=False)  # quantized after loading: see quantize_after_load
    {}
"""

from __future__ import annotations

import logging
from typing import Any, Dict, Optional

from djl_stream.runtime.cpu_info import lacks_x86_flags

logger = logging.getLogger(__name__)

#: What ``option.quantize`` accepts.
QUANTIZE_METHODS = ("int8", "w8a8", "bitsandbytes8", "bitsandbytes4")
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
                       "its CUDA ones (BENCHMARKS.md's quantization section compares them "
                       "with float32 and int8 there)", method)
    if method in ("int8", "w8a8") and not on_gpu:
        return {}  # djl-stream's own int8 layers, after loading (quantize_after_load)
    if method == "int8":
        return {"quantization_config": _torchao("int8", "Int8WeightOnlyConfig")}
    if method == "w8a8":
        logger.warning("option.quantize=w8a8 on a GPU: serving int8 weight-only weights "
                       "(option.quantize=int8) instead, the same int8 weight memory: "
                       "torchao's int8 products with dynamically quantized activations "
                       "run eagerly on a GPU, many times slower than weight-only int8 "
                       "(BENCHMARKS.md)")
        return {"quantization_config": _torchao("w8a8", "Int8WeightOnlyConfig")}
    return {"quantization_config": _bitsandbytes(method, compute_dtype)}


def quantize_after_load(model, method: Optional[str], *, on_gpu: bool) -> int:
    """Quantize what ``from_pretrained`` loaded unquantized for ``method``: on a CPU,
    ``int8``'s linear layers
    (:func:`~djl_stream.runtime.int8.quantize_weights_only`) or ``w8a8``'s
    (:func:`~djl_stream.runtime.int8.quantize_linear_layers`); returns how many
    layers were quantized (0 for every other method, which :func:`quantization_kwargs`
    hands to ``from_pretrained``). ``w8a8`` on an x86 CPU without int8 dot-product
    instructions gets ``int8``'s layers, logged (see the module docstring).

    Layers whose weights the model's code reads beyond their own product keep their float
    weights, logged (:func:`~djl_stream.runtime.linear_layers.linear_layers_read_elsewhere`).

    Raises :class:`QuantizationUnavailable` where ``int8`` or ``w8a8`` was asked for and
    no layer could be quantized (the message says why), rather than serve float32
    silently.
    """
    if on_gpu or method not in ("int8", "w8a8"):
        return 0
    # (imported here: importing model.py must not import torch, and this module's callers
    # import it at the top)
    from djl_stream.runtime.linear_layers import layers_that_stay_float

    kept = layers_that_stay_float(model, "int8 weights")
    if method == "w8a8" and lacks_int8_dot_products():
        logger.warning("option.quantize=w8a8 on a CPU without int8 dot-product instructions "
                       "(AVX512-VNNI, AVX-VNNI or AMX), where PyTorch's integer products are "
                       "many times slower than float32's: serving int8 weight-only weights "
                       "instead (option.quantize=int8: the same int8 weights, float "
                       "activations)")
        method = "int8"
    if method == "int8":
        from djl_stream.runtime.int8 import quantize_weights_only

        quantized = quantize_weights_only(model, leaving_out=kept)
        if not quantized:
            raise QuantizationUnavailable(
                "option.quantize=int8: no linear layer could be quantized (the model has "
                "no float32 nn.Linear on the CPU whose input width is a multiple of 4)")
        logger.info("quantized %d linear layers to int8 weights (int8 weight-only)", quantized)
        return quantized
    from djl_stream.runtime.int8 import int8_matmul_unavailable, quantize_linear_layers

    quantized = quantize_linear_layers(model, leaving_out=kept)
    if not quantized:
        raise QuantizationUnavailable(
            "option.quantize=w8a8: no linear layer could be quantized: "
            f"{int8_matmul_unavailable() or 'the model has no float32 nn.Linear on the CPU'}")
    logger.info("quantized %d linear layers to int8 weights and activations (w8a8)",
                quantized)
    return quantized


#: x86 flags of the instructions that multiply int8 by int8 into int32 sums, which oneDNN's
#: integer products (``torch._int_mm``) are fast with.
INT8_DOT_PRODUCT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})


def lacks_int8_dot_products(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this is an x86 CPU whose flags name none of :data:`INT8_DOT_PRODUCT_FLAGS`
    (:func:`~djl_stream.runtime.cpu_info.lacks_x86_flags`)."""
    return lacks_x86_flags(INT8_DOT_PRODUCT_FLAGS, cpuinfo)


def _torchao(method: str, config_name: str):
    try:
        from torchao import quantization as torchao_quantization
    except ImportError as error:
        raise QuantizationUnavailable(
            f"option.quantize={method} needs torchao: pip install torchao "
            f"(or add it to the model directory's requirements.txt) ({error})") from error
    from transformers import TorchAoConfig

    return TorchAoConfig(quant_type=getattr(torchao_quantization, config_name)())


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

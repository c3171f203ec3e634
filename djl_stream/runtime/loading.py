"""Loading a model and its tokenizer, as a set of load options describes them.

The options are any object with the attributes of :class:`LoadOptions` (the serving
layer's ``ModelProperties`` has them).

On a GPU machine the model goes to the GPU djl assigned (``device_id``), or is spread over
``tensor_parallel_degree`` GPUs with accelerate's ``device_map="balanced"`` and an equal
``max_memory`` budget on each; on CPU it stays on the CPU. ``dtype=auto`` means half
precision on GPU (bf16 where the model was trained in it) and fp32 on CPU, where half
precision is slow.

Example::

    props = ModelProperties.from_init_properties({"model_dir": "model"})
    model, tokenizer = load_model_and_tokenizer(props)
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import os
from pathlib import Path
from typing import Any, Callable, Dict, MutableMapping, Optional, Protocol, Tuple, TypeVar

from djl_stream.runtime.cpu_info import lacks_x86_flags
from djl_stream.runtime.memory import keep_freed_memory
from djl_stream.runtime.quantization import (QuantizationUnavailable, quantization_kwargs,
                                             quantize_after_load)

logger = logging.getLogger(__name__)

#: x86 flags of the instructions that multiply bfloat16 numbers, which oneDNN's bfloat16
#: products are fast with; without them a product of several rows converts every weight.
BFLOAT16_ARITHMETIC_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})

T = TypeVar("T")


class LoadOptions(Protocol):
    """What loading reads of its options."""

    model_id: Optional[str]
    model_dir: str
    dtype: str
    quantize: Optional[str]
    trust_remote_code: bool
    tensor_parallel_degree: Optional[int]
    device_id: int

    def weights_location(self) -> str: ...


class ModelLoadError(RuntimeError):
    """The weights or tokenizer could not be loaded; the message says where from and why."""


def torch_dtype(props: LoadOptions, on_gpu: bool):
    import torch

    if props.dtype == "fp32":
        return torch.float32
    if props.dtype == "fp16":
        return torch.float16
    if props.dtype == "bf16":
        return torch.bfloat16
    if not on_gpu:
        return torch.float32
    return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16


def dtype_keyword() -> str:
    """The ``from_pretrained`` keyword for the weights' dtype: ``dtype`` where transformers
    has it (4.56 on, where ``torch_dtype`` is a deprecated alias), ``torch_dtype`` before.

    Older releases take an unknown ``dtype=`` as a config override and load in float32
    without a word, so the name must be right. The rename turned the config's
    ``torch_dtype`` into a property aliasing ``dtype``; that property is what is asked
    for here rather than a version number.
    """
    from transformers import PretrainedConfig

    renamed = isinstance(getattr(PretrainedConfig, "torch_dtype", None), property)
    return "dtype" if renamed else "torch_dtype"


def placement(props: LoadOptions) -> Dict[str, Any]:
    """``from_pretrained`` keyword arguments that place the model: nothing on CPU, one
    GPU for a degree of 1, a balanced ``device_map`` over N GPUs otherwise."""
    import torch

    if not torch.cuda.is_available():
        return {}
    available = torch.cuda.device_count()
    degree = props.tensor_parallel_degree or available
    if degree > available:
        raise ModelLoadError(
            f"option.tensor_parallel_degree is {degree} but only {available} GPU(s) are visible"
        )
    if degree == 1:
        return {"device_map": {"": max(props.device_id, 0)}}
    first = max(props.device_id, 0)
    gpus = list(range(first, first + degree)) if first + degree <= available else list(range(degree))
    # An equal budget per GPU (the smallest free memory, less headroom for activations and
    # the KV cache) makes accelerate spread the layers evenly instead of filling GPU 0.
    budget = min(torch.cuda.mem_get_info(i)[0] for i in gpus)
    budget_gib = max(int(budget * 0.85) // 2**20, 1)
    return {
        "device_map": "balanced",
        "max_memory": {i: f"{budget_gib}MiB" for i in gpus},
    }


def _is_local(location: str) -> bool:
    return Path(location).exists()


#: How many oneDNN operators (one per linear layer shape and row count) PyTorch keeps ready
#: on a CPU: see :func:`bound_onednn_caches`.
ONEDNN_CACHE_ENTRIES = 128
#: The two caches that hold them: ideep's (PyTorch's oneDNN wrapper) and oneDNN's own.
ONEDNN_CACHE_ENVS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """On a CPU, keep at most :data:`ONEDNN_CACHE_ENTRIES` oneDNN operators ready, in both
    caches that hold them, unless the environment already sets a size; returns the sizes.

    An int8 linear layer runs a oneDNN operator made for its weight's shape *and the
    number of rows*, with its own JIT-compiled code and buffers, and keeps it for the next
    call of that size: about half a megabyte each, 1,024 by default in each cache. A server
    sees ever new row counts (every prefill chunk, every mixed pass), so without a bound
    its resident memory grows for as long as new ones come (``malloc_trim`` gives none of
    it back). Making an operator again costs about a millisecond a shape (a decode step
    keeps its few operators in use, so they stay). Both variables are read when the first
    oneDNN operator runs, so this is called before the model loads.

    >>> environment = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    >>> bound_onednn_caches(environment)
    {'LRU_CACHE_CAPACITY': '128', 'ONEDNN_PRIMITIVE_CACHE_CAPACITY': '1024'}
    """
    environ = os.environ if environ is None else environ
    for name in ONEDNN_CACHE_ENVS:
        environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))
    return {name: environ[name] for name in ONEDNN_CACHE_ENVS}


def load_model_and_tokenizer(props: LoadOptions) -> Tuple[Any, Any]:
    """Load ``props.weights_location()`` as a causal LM and its tokenizer, in eval mode,
    in a thread that ends with the load (:func:`in_passing_thread`).

    A hub id that cannot be fetched (no network, no such model, gated) raises
    :class:`ModelLoadError` that says what was tried and what to do instead.
    """
    return in_passing_thread(_load_model_and_tokenizer, props)


def in_passing_thread(function: Callable[..., T], *args: Any) -> T:
    """``function(*args)`` run in a new thread that ends once it returns; its result, or
    its exception, comes back to the caller.

    Why: the first parallel region a thread runs gives it a GNU OpenMP thread pool (the
    OpenMP of PyTorch's CPU wheels), which lives as long as the thread. Loading runs
    PyTorch's CPU kernels (quantizing, the runtime's probe), and decode steps run later in
    the scheduler's thread, with a pool of its own. While two pools are alive, GNU OpenMP
    manages more threads than there are cores and cuts the time its idle workers spin
    before they sleep (its throttled spin count), so every one of a step's hundreds of
    parallel regions waits for a worker to wake: a step's products can take a fifth longer.
    djl-serving's Python worker loads in its main thread (or its async executor's), which
    lives on: so the load's pool must go with a thread of its own.

    >>> import threading
    >>> in_passing_thread(lambda: threading.current_thread()) is threading.current_thread()
    False
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="djl-stream-load") as pool:
        return pool.submit(function, *args).result()  # the pool's thread ends on leaving


def _load_model_and_tokenizer(props: LoadOptions) -> Tuple[Any, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    location = props.weights_location()
    local = _is_local(location)
    if not props.model_id and not (Path(location) / "config.json").is_file():
        raise ModelLoadError(
            f"no model in {location}: set option.model_id to a local path or hub id, or "
            "put a Hugging Face model folder (config.json, weights, tokenizer) there"
            " (for the embedded default: djl-stream embed MODEL_DIR)"
        )
    on_gpu = torch.cuda.is_available()
    if not on_gpu:
        bound_onednn_caches()
        allocator = keep_freed_memory()
        if allocator.applied:
            logger.info("freed memory is kept for the next forward pass (glibc's malloc "
                        "thresholds raised; given back when idle)")
        else:
            logger.info("malloc left as it is: %s", allocator.reason)
    dtype = torch_dtype(props, on_gpu)
    if not on_gpu and dtype == torch.bfloat16 and lacks_x86_flags(BFLOAT16_ARITHMETIC_FLAGS):
        logger.warning("option.dtype=bf16 on a CPU without bfloat16 arithmetic (AVX512-BF16 "
                       "or AMX): one stream reads half of float32's bytes, but products of "
                       "several rows run many times slower than float32's, so many clients "
                       "are served faster with option.dtype=fp32")
    try:
        quantization = quantization_kwargs(props.quantize, on_gpu=on_gpu, compute_dtype=dtype)
    except QuantizationUnavailable as error:
        raise ModelLoadError(str(error)) from error
    kwargs = dict(
        **{dtype_keyword(): dtype},
        trust_remote_code=props.trust_remote_code,
        **placement(props),
        **quantization,
    )
    logger.info("loading %s (%s) with %s", location, "local" if local else "hub", kwargs)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            location, trust_remote_code=props.trust_remote_code
        )
        model = AutoModelForCausalLM.from_pretrained(location, **kwargs)
    except OSError as error:
        if local:
            raise ModelLoadError(f"could not load the model in {location}: {error}") from error
        offline = os.environ.get("HF_HUB_OFFLINE") == "1"
        raise ModelLoadError(
            f"could not load option.model_id={location!r}: it is not a local path, and "
            f"fetching it from the Hugging Face hub failed{' (HF_HUB_OFFLINE=1)' if offline else ''}"
            f" ({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}). "
            "Check the id and network access, or download the weights into the model "
            "directory and leave option.model_id unset."
        ) from error
    model.eval()
    try:
        quantize_after_load(model, props.quantize, on_gpu=on_gpu)
    except QuantizationUnavailable as error:
        raise ModelLoadError(str(error)) from error
    return model, tokenizer

"""Loading a model and its tokenizer from :class:`~djl_stream.serving.properties.ModelProperties`.

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
from typing import Any, Callable, Dict, MutableMapping, Optional, Tuple, TypeVar

from djl_stream.generation.allocators import keep_freed_memory
from djl_stream.generation.quantization import (QuantizationUnavailable, quantization_kwargs,
                                                quantize_after_load)
from djl_stream.serving.properties import ModelProperties

logger = logging.getLogger(__name__)

T = TypeVar("T")


class ModelLoadError(RuntimeError):
    """The weights or tokenizer could not be loaded; the message says where from and why."""


def torch_dtype(props: ModelProperties, on_gpu: bool):
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


def placement(props: ModelProperties) -> Dict[str, Any]:
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


#: transformers' switch that lets torch's SDPA read a grouped-query model's key/value
#: heads in place (``enable_gqa``) even when an attention mask is given.
FORCE_GQA_ENV = "TRANSFORMERS_SDPA_FORCE_GQA"


def read_grouped_heads_in_place(environ: Optional[MutableMapping[str, str]] = None) -> bool:
    """On a CPU, have transformers' SDPA attention read grouped key/value heads in place
    rather than copy them once per query head; returns whether it is on.

    Without a mask (one prompt, nothing padded) transformers already does; with one (a
    prompt chunk after its cached columns, a batch of left-padded prompts) it first copies
    every layer's whole KV cache 3 times over for SmolLM2 (9 query heads, 3 key/value
    heads), because on CUDA a masked grouped call falls back to a slow kernel. On a CPU the
    masked grouped call is the fast one: a 16-column chunk at the end of a 4,000-token
    prompt took 135 ms instead of 203 ms (median) on this project's 2-core machine, and
    greedy text was the same (logits within 1e-4). transformers releases without the
    switch ignore it; a value already set in the environment (``0`` to turn it off) wins.

    >>> environment = {}
    >>> read_grouped_heads_in_place(environment), environment
    (True, {'TRANSFORMERS_SDPA_FORCE_GQA': '1'})
    >>> read_grouped_heads_in_place({FORCE_GQA_ENV: "0"})
    False
    """
    environ = os.environ if environ is None else environ
    environ.setdefault(FORCE_GQA_ENV, "1")
    return environ[FORCE_GQA_ENV] == "1"


#: How many oneDNN operators (one per linear layer shape and row count) PyTorch keeps ready
#: on a CPU: see :func:`bound_onednn_caches`.
ONEDNN_CACHE_ENTRIES = 128
#: The two caches that hold them: ideep's (PyTorch's oneDNN wrapper) and oneDNN's own.
ONEDNN_CACHE_ENVS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")


def bound_onednn_caches(environ: Optional[MutableMapping[str, str]] = None) -> Dict[str, str]:
    """On a CPU, keep at most :data:`ONEDNN_CACHE_ENTRIES` oneDNN operators ready, in both
    caches that hold them, unless the environment already sets a size; returns the sizes.

    A prepacked linear layer (or an int8 one) runs a oneDNN operator made for its weight's
    shape *and the number of rows*, with its own JIT-compiled code and buffers, and keeps
    it for the next call of that size: about 0.45 MB each, 1,024 by default in each cache.
    A server sees ever new row counts (every prefill chunk, every mixed pass of a chunk
    beside the running rows), so its resident memory grew for as long as new ones came:
    the 4 layer shapes of a SmolLM2 layer run at 100 row counts added 248 MB that stayed
    (``malloc_trim`` gives none of it back), at 300 row counts 478 MB; with 128 entries in
    each cache, 300 row counts added 57 MB. Making an operator again costs about 1 ms a
    shape (a decode step keeps its few operators in use, so they stay). Both variables are
    read when the first oneDNN operator runs, so this is called before the model loads.

    >>> environment = {"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "1024"}
    >>> bound_onednn_caches(environment)
    {'LRU_CACHE_CAPACITY': '128', 'ONEDNN_PRIMITIVE_CACHE_CAPACITY': '1024'}
    """
    environ = os.environ if environ is None else environ
    for name in ONEDNN_CACHE_ENVS:
        environ.setdefault(name, str(ONEDNN_CACHE_ENTRIES))
    return {name: environ[name] for name in ONEDNN_CACHE_ENVS}


def load_model_and_tokenizer(props: ModelProperties) -> Tuple[Any, Any]:
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
    PyTorch's CPU kernels (prepacking, the decode step's probes, compiling), and decode
    steps run later in the scheduler's thread, with a pool of its own. While two pools are
    alive, GNU OpenMP manages more threads than there are cores and cuts the time its idle
    workers spin before they sleep (its throttled spin count), so every one of a step's
    hundreds of parallel regions waits for a worker to wake. Measured on the 2-core CPU
    this project is measured on: the linear layers of a 16-row step took 61-68 ms in a
    second thread while the loading thread's pool was alive, against 49-52 ms once it was
    gone. djl-serving's Python worker loads in its main thread (or its async executor's),
    which lives on: so the load's pool must go with a thread of its own.

    >>> import threading
    >>> in_passing_thread(lambda: threading.current_thread()) is threading.current_thread()
    False
    """
    with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="djl-stream-load") as pool:
        return pool.submit(function, *args).result()  # the pool's thread ends on leaving


def _load_model_and_tokenizer(props: ModelProperties) -> Tuple[Any, Any]:
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
        read_grouped_heads_in_place()
        bound_onednn_caches()
        allocator = keep_freed_memory()
        if allocator.applied:
            logger.info("freed memory is kept for the next forward pass (glibc's malloc "
                        "thresholds raised; given back when idle)")
        else:
            logger.info("malloc left as it is: %s", allocator.reason)
    dtype = torch_dtype(props, on_gpu)
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
    prepare_for_decoding(model, tokenizer, props, on_gpu=on_gpu)
    return model, tokenizer


def prepare_for_decoding(model, tokenizer, props: ModelProperties, *, on_gpu: bool):
    """What follows loading: on a CPU, prepack ``model``'s linear layers
    (:func:`prepack_for_cpu`); then attach djl-stream's Llama decode step
    (:func:`attach_decode_step`). With ``option.decode_step=compiled`` (or ``auto``, for a
    model the programs run), the one-row program
    is loaded from its cache or compiled
    (:func:`~djl_stream.generation.compiled_decode.compile_one_row`) from the plain layers,
    before they are packed, its products ATen's or reductions as a trial finds them faster
    here (:mod:`~djl_stream.generation.one_row_products`): by default
    (``option.compiled_weights=shared``) it reads the plain weights themselves; with
    ``option.prepack_weights`` unset the layers are packed beside them only where packed
    copies multiply a batch much faster (:func:`_packed_beside_the_programs`). Either way a program for steps of 2 to
    :data:`~djl_stream.generation.compiled_decode.FEW_ROWS` rows reads the plain weights
    (:func:`~djl_stream.generation.compiled_decode.compile_few_rows`); steps of 7 to
    :data:`~djl_stream.generation.compiled_decode.BATCH_ROWS` rows run a program with a
    copy of its own where the layers were packed (:func:`_batch_program_of_its_own`), and
    one that reads the plain weights where they were left plain
    (:func:`~djl_stream.generation.compiled_decode.compile_batch`). With ``copy`` the
    one-row program holds a copy of its own. A program the model directory ships
    (``djl-stream compile``) comes first where it was compiled for this CPU and PyTorch.
    Returns the step or ``None``."""
    programs = _prepare_for_a_cpu(model, props) if not on_gpu else CpuPrograms()
    return attach_decode_step(model, tokenizer, props, one_row=programs.one_row,
                              batch_program=programs.batch, few_rows=programs.few_rows,
                              cuda_graphs=on_gpu and props.decode_step in ("auto", "compiled"))


@dataclasses.dataclass
class CpuPrograms:
    """The compiled programs a CPU load gives the decode step (any of them ``None``): the
    one-row program, the batch program and the few-rows program."""

    one_row: Any = None
    batch: Any = None
    few_rows: Any = None


def _prepare_for_a_cpu(model, props: ModelProperties) -> CpuPrograms:
    """:func:`prepare_for_decoding`'s CPU part: the layers packed or not, and the
    programs."""
    from djl_stream.generation import compiled_decode, one_row_products
    from djl_stream.generation.int8_weights import holds_int8_weights
    from djl_stream.generation.packed_linear import BATCH_HINT

    share = props.compiled_weights == "shared"
    shipped = Path(props.model_dir) / compiled_decode.SHIPPED_FOLDER
    if not _compiles_on_a_cpu(model, props):
        prepack_for_cpu(model, props)
        return CpuPrograms()
    one_row = compiled_decode.compile_one_row(
        model, share_weights=share, shipped=shipped,
        matrix_products=one_row_products.matrix_products_pay(model))
    if one_row is not None and share and holds_int8_weights(model):
        # option.quantize=int8: the few-rows program multiplies every batch of up to 16
        # rows (no float32 weights to pack; the eager step turns them into floats)
        return CpuPrograms(one_row, few_rows=compiled_decode.compile_few_rows(
            model, shipped=shipped))
    if one_row is not None and share and not props.prepack_weights:
        # built over the plain layers before they may be packed: it keeps reading them
        # (2 to FEW_ROWS rows, whether the layers are packed or not)
        few_rows = (compiled_decode.compile_few_rows(compiled_decode.FewRowsGraph(model),
                                                     shipped=shipped)
                    if compiled_decode.FewRowsGraph.unsupported_reason(model) is None
                    else None)
        # (the one-row program runs the model: so does the batch program)
        batch_graph = compiled_decode.BatchGraph(model, compiled_decode.BATCH_ROWS)
        if props.prepack_weights is None and _packed_beside_the_programs(model):
            # the eager step multiplies prompts, and batches of more rows than the batch
            # program's, with the packed layers
            return CpuPrograms(one_row, _batch_program_of_its_own(batch_graph, shipped),
                               few_rows=few_rows)
        logger.info("linear layers left unpacked: the compiled one-row step reads their "
                    "weights (option.compiled_weights=shared)")
        # (a program reads plain weights: not where the layers are packed)
        return CpuPrograms(one_row, compiled_decode.compile_batch(batch_graph, shipped=shipped),
                           few_rows=few_rows)
    # Where a program runs the one-row steps (with a copy of its own, or the model's plain
    # weights kept for it by option.prepack_weights=true), the layers serve batches and
    # prompts only, so the trial times a batch (on the Xeon, packing slows one row but
    # gave a compiled server 15 % more tokens/s at 4 clients).
    prepack_for_cpu(model, props, trial_rows=1 if one_row is None else BATCH_HINT)
    return CpuPrograms(one_row)


#: The rows the trial after the one-row program times (:func:`_packed_beside_the_programs`):
#: the batches no program runs (2 to 6 rows; the batch program takes 7 to 16), where MKL
#: multiplies plain weights slowest on an AMD EPYC.
BESIDE_TRIAL_ROWS = 4
#: How many times faster oneDNN's packed layers must multiply :data:`BESIDE_TRIAL_ROWS`
#: rows than the plain ones for ``option.decode_step=auto`` to pack them beside the plain
#: weights its one-row program reads (memory for the weights again: 538 MB for SmolLM2,
#: its tied LM head's copy included). On the 2-core AMD EPYC (Zen 3) of 2026-11-27, 4
#: rows' products took 87 ms plain against 49 packed (1.8x; 2 rows 1.9x, 16 rows 1.3x:
#: ``python -m benchmarks.linear_packing``), and with the layers plain 4 clients got no
#: more tokens/s than one (34.4 against 35.3, medians of 2 over HTTP); on the 2-core
#: Intel Xeon 37 against 32 (1.15x), where the batch program over the plain weights
#: serves instead (it saves the step's work between its products, 58 against 66 ms at 16
#: rows).
PACKED_BESIDE_SPEEDUP = 1.4


def _packed_beside_the_programs(model) -> bool:
    """With ``option.prepack_weights`` unset, after the one-row program that reads the
    plain weights loaded: time :data:`BESIDE_TRIAL_ROWS` rows
    through the layers plain and packed, and where packed ones are
    :data:`PACKED_BESIDE_SPEEDUP` times faster or more, and their copies fit in half the
    memory available, put them in place for the eager step (batches, prompts), the plain
    weights held on by the program. Returns whether they were packed (logged either way)."""
    import torch

    from djl_stream.generation.packed_linear import pack_linear_layers, plain_linear_layers

    copies = sum(layer.weight.nbytes for _, _, layer in plain_linear_layers(model)
                 if layer.weight.dtype == torch.float32)
    if not copies:  # (w8a8's int8 layers: the batch program multiplies those)
        return False
    if _crowds_the_memory(copies, "linear layers left unpacked: packed copies beside the "
                          "plain weights the compiled one-row step reads"):
        return False
    packed = pack_linear_layers(model, only_where_it_pays=True, trial_rows=BESIDE_TRIAL_ROWS,
                                speedup_wanted=PACKED_BESIDE_SPEEDUP)
    if packed:
        logger.info("prepacked %d linear layers for batches and prompts, beside the plain "
                    "weights the compiled one-row step reads (%.0f MB more)", packed,
                    copies / 1e6)
    return packed > 0


def _batch_program_of_its_own(graph, shipped: Path):
    """Where the layers were packed beside the plain weights (an AMD EPYC's case), the
    batch program of ``graph`` (built before the packing) with a copy of the weights of
    its own, frozen (Inductor's C++ GEMM template multiplies it:
    :func:`~djl_stream.generation.compiled_decode.compile_batch`), which runs the steps of
    7 to 16 rows in place of the eager step over packed layers; ``None`` where a third
    copy of the weights would take more than half the memory available (logged)."""
    from djl_stream.generation import compiled_decode

    copy = sum(tensor.nbytes for tensor in compiled_decode.model_weights(graph).values())
    if _crowds_the_memory(copy, f"no {graph.rows}-row decode program: its copy of the "
                          "weights"):
        return None
    return compiled_decode.compile_batch(graph, share_weights=False, shipped=shipped)


def _crowds_the_memory(nbytes: int, what: str) -> bool:
    """Whether ``nbytes`` more would take over half the memory available now (logged as
    ``what`` would take so much); ``False`` where the system does not say."""
    available = _memory_available()
    if available is None or 2 * nbytes <= available:
        return False
    logger.info("%s would take %.0f MB, over half the %.0f MB available", what, nbytes / 1e6,
                available / 1e6)
    return True


def _memory_available() -> Optional[int]:
    """Bytes of memory the system can give without swapping (``MemAvailable``), or
    ``None`` where ``/proc/meminfo`` does not say (not Linux)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _compiles_on_a_cpu(model, props: ModelProperties) -> bool:
    """Whether the compiled programs are wanted for ``model`` on a CPU: always with
    ``option.decode_step=compiled`` (a model they cannot run is then a warning, from
    :func:`~djl_stream.generation.compiled_decode.compile_one_row`); with ``auto``, where
    the model is one they run (else its eager step or forward serves it, said at info)."""
    from djl_stream.generation.compiled_decode import OneRowGraph

    if props.decode_step == "compiled":
        return True
    if props.decode_step != "auto":
        return False
    reason = OneRowGraph.unsupported_reason(model)
    if reason:
        logger.info("no compiled decode steps (option.decode_step=auto): %s", reason)
        return False
    return True


def attach_decode_step(model, tokenizer, props: ModelProperties, one_row=None,
                       batch_program=None, few_rows=None, cuda_graphs: bool = False):
    """Give ``model`` djl-stream's Llama decode step unless ``option.decode_step`` is
    ``forward`` (or the model is not one it runs: then its forward runs, logged); with
    ``one_row`` (``option.decode_step=compiled``: see :func:`prepare_for_decoding`), its
    one-row steps run that program, with ``batch_program`` its steps of most of that
    program's rows, with ``few_rows`` its steps of 2 rows up to that program's; with ``cuda_graphs`` (``auto`` or ``compiled`` on a GPU), its steps
    are replayed from CUDA graphs. Returns the step or ``None``."""
    from djl_stream.generation import llama_decode

    if props.decode_step == "forward":
        return None
    return llama_decode.attach(model, tokenizer, one_row=one_row, batch_program=batch_program,
                               few_rows=few_rows, cuda_graphs=cuda_graphs)


def prepack_for_cpu(model, props: ModelProperties, trial_rows: int = 1) -> int:
    """Prepack ``model``'s float32 linear layers for this CPU
    (:mod:`djl_stream.generation.packed_linear`): with ``option.prepack_weights=true``
    always, unset where a trial at load finds packing does not slow ``trial_rows`` rows'
    products on this CPU (:func:`~djl_stream.generation.packed_linear.pack_linear_layers`),
    never where it is false; how many were packed. Quantized layers keep their own
    kernels."""
    from djl_stream.generation.packed_linear import pack_linear_layers, packing_unavailable

    if props.prepack_weights is False:
        return 0
    packed = pack_linear_layers(model, only_where_it_pays=props.prepack_weights is None,
                                trial_rows=trial_rows)
    if packed:
        logger.info("prepacked %d linear layers for this CPU (oneDNN)", packed)
    elif props.prepack_weights:
        logger.warning("option.prepack_weights=true, but nothing was packed: %s",
                       packing_unavailable() or "no float32 linear layer to pack")
    return packed

"""The "transformers-neuronx" engine: models compiled for AWS Inferentia2 / Trainium.

transformers-neuronx compiles a model for one batch size and one longest sequence
(``n_positions``), and generates with ``model.sample(...)``, which blocks until the whole
batch is done and reports each step to a *streamer*. This engine turns that into the same
stream as the Accelerate engine, one ``List[str]`` per decode step with ``""`` for a prompt
that is done:

- the prompts are left-padded (pad = eos) up to the compiled batch size, with
  ``start_ids`` telling the model where each row's real tokens begin; padding rows are
  dropped from the output;
- ``sample()`` runs in a background thread; a :class:`TokenQueueStreamer` hands each
  step's token row to the returned :class:`NeuronGenerationStream`, which runs every row
  through a :class:`~djl_stream.generation.sequence.GenerationSequence` (incremental detokenizer,
  stop strings, every eos id of the checkpoint, ``max_new_tokens``);
- closing the stream, or the last real row finishing, makes the streamer's next ``put()``
  raise a private exception that unwinds ``sample()``; an exception inside ``sample()`` is
  raised by the stream instead of leaving it waiting forever.

One generation runs on a model at a time (its KV cache is the model's state); later calls
wait for the model in their sampling thread.

Compiled graphs never go into the model directory unless ``option.compiled_graph_path``
says so (it is read-only on SageMaker): by default they are cached under
``$DJL_CACHE_DIR/djl-stream/neuronx-graphs/<key>`` (``/tmp/.djl.ai/...`` in djl-serving's
Neuron image; the system temp directory when ``DJL_CACHE_DIR`` is unset or read-only),
``<key>`` naming the model and every setting the graphs depend on, so a restarted worker
loads them instead of compiling again. A relative ``option.compiled_graph_path`` is
relative to the model directory (as in djl-serving's own Neuron loader): the place for
graphs compiled ahead of time and shipped with the model. The compiler runs in a writable
scratch directory (see :func:`working_directory`); a place that can neither provide graphs
nor keep new ones fails the load before anything compiles (:func:`check_graph_place`).

Example::

    props = ModelProperties.from_init_properties({
        "model_dir": "/opt/ml/model", "stream_engine": "transformers-neuronx", "dtype": "bf16",
        "tensor_parallel_degree": "1", "max_rolling_batch_size": "4", "n_positions": "2048"})
    model, tokenizer = load_neuron_model(props)
    gen = StreamingUtils.get_stream_generator("transformers-neuronx")
    for pieces in gen(model, tokenizer, ["The capital of France is"], max_new_tokens=8):
        print(pieces[0], end="", flush=True)

The real package is not on PyPI (see :func:`import_transformers_neuronx`); it is imported
only when a model is loaded, so importing this module needs nothing but torch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import inspect
import json
import logging
import os
import queue
import re
import shutil
import tempfile
import threading
import weakref
from pathlib import Path
from typing import (AbstractSet, Any, Dict, FrozenSet, Iterator, List, Mapping, Optional,
                    Sequence, Tuple)

import torch

from djl_stream.generation.errors import RequestError
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.step import Generation, Step
from djl_stream.generation.streaming_utils import register_engine
from djl_stream.generation.engines.accelerate import DEFAULT_MAX_NEW_TOKENS, encode_prompts

logger = logging.getLogger(__name__)

ENGINE = "transformers-neuronx"
NEURON_PIP_INSTALL = (
    "pip install transformers-neuronx --extra-index-url=https://pip.repos.neuron.amazonaws.com"
)
#: ``option.dtype`` -> the ``amp`` argument of transformers-neuronx; ``auto`` is half
#: precision, the usual choice on Neuron cores.
AMP = {"fp16": "f16", "bf16": "bf16", "fp32": "f32", "auto": "f16"}

_PARAMETERS = frozenset({
    "max_new_tokens", "stop", "do_sample", "temperature", "top_k", "top_p", "typical_p",
    "repetition_penalty", "manual_seed", "min_new_tokens", "ignore_eos", "logprobs",
    "top_logprobs",
})
#: What ``eos_token_override`` is set to for ``ignore_eos``: the sampler marks a row done
#: when its token equals the eos id, then feeds it eos; no token id is -1.
NO_EOS = -1


# ---------------------------------------------------------------------------------------
# The package


class NeuronUnavailableError(ImportError):
    """transformers-neuronx cannot be imported; the message says how to install it."""


def import_transformers_neuronx():
    """The ``transformers_neuronx`` module, or :class:`NeuronUnavailableError`.

    PyPI's ``transformers-neuronx`` is a placeholder whose import raises ``ImportError``,
    so "pip install transformers-neuronx" alone never gives a working package.

    >>> import sys; sys.modules["transformers_neuronx"] = None   # as if not installed
    >>> import_transformers_neuronx()  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    djl_stream.generation.engines.neuronx.NeuronUnavailableError: the transformers-neuronx engine needs ...
    >>> del sys.modules["transformers_neuronx"]
    """
    try:
        return importlib.import_module("transformers_neuronx")
    except ImportError as error:
        raise NeuronUnavailableError(
            "the transformers-neuronx engine needs the transformers_neuronx package, which "
            f"could not be imported ({type(error).__name__}: {error}). The transformers-neuronx "
            "package on PyPI is only a placeholder whose import fails; install the real one "
            "from AWS's Neuron pip repository, inside a Neuron SDK environment (or use the "
            f"djl-serving Neuron container image): {NEURON_PIP_INSTALL}"
        ) from error


def _auto_model_class(neuronx):
    found = getattr(neuronx, "NeuronAutoModelForCausalLM", None)
    if found is None:  # releases that export it only from its own module
        found = importlib.import_module("transformers_neuronx.modeling_auto").NeuronAutoModelForCausalLM
    return found


# ---------------------------------------------------------------------------------------
# Loading and compiling


@dataclasses.dataclass(frozen=True)
class NeuronCompilation:
    """The shapes a model was compiled for, and the ids that end its sequences.

    >>> NeuronCompilation(batch_size=4, n_positions=2048).batch_size
    4
    """

    batch_size: int
    n_positions: int
    eos_token_ids: FrozenSet[int] = frozenset()


# Kept beside the model rather than set on the library's object; a model loaded by other
# code falls back to what its neuron config says (see compilation_of).
_compilations: "weakref.WeakKeyDictionary[Any, NeuronCompilation]" = weakref.WeakKeyDictionary()
_model_locks: "weakref.WeakKeyDictionary[Any, threading.Lock]" = weakref.WeakKeyDictionary()
_registry_lock = threading.Lock()


def from_pretrained_kwargs(props) -> Dict[str, Any]:
    """Keyword arguments of ``NeuronAutoModelForCausalLM.from_pretrained`` for ``props``.

    The compiled batch size is ``option.max_rolling_batch_size``, as in djl-serving's LMI
    Neuron images: it is also the most prompts a request may send.

    >>> from djl_stream.serving.properties import ModelProperties
    >>> from_pretrained_kwargs(ModelProperties(dtype="bf16", tensor_parallel_degree=2,
    ...                                        max_rolling_batch_size=4, n_positions=1024))
    {'batch_size': 4, 'tp_degree': 2, 'amp': 'bf16', 'n_positions': 1024}
    """
    from djl_stream.runtime.loading import ModelLoadError

    if props.tensor_parallel_degree is None:
        raise ModelLoadError(
            "option.tensor_parallel_degree=max is not supported by the transformers-neuronx "
            "engine: set it to the number of NeuronCores to shard the model over "
            "(2 per Inferentia2 device)"
        )
    kwargs: Dict[str, Any] = dict(
        batch_size=props.max_rolling_batch_size,
        tp_degree=props.tensor_parallel_degree,
        amp=AMP[props.dtype],
        n_positions=props.n_positions,
    )
    estimate = props.context_length_estimate
    if estimate:
        kwargs["context_length_estimate"] = estimate[0] if len(estimate) == 1 else list(estimate)
    return kwargs


#: Where compiled graphs go when ``option.compiled_graph_path`` is unset, under the first
#: writable of ``$DJL_CACHE_DIR`` (``/tmp/.djl.ai`` in djl-serving's Neuron image) and the
#: system temp directory.
GRAPH_CACHE = Path("djl-stream") / "neuronx-graphs"


@dataclasses.dataclass(frozen=True)
class GraphPlace:
    """Where one model's compiled Neuron graphs are read from and written to.

    ``configured`` is true for ``option.compiled_graph_path`` and false for the automatic
    cache; ``work_root`` is a writable directory for the compiler's work files (it runs
    with a fresh directory under it as its current directory).

    >>> GraphPlace(Path("/tmp/g"), configured=True, work_root=Path("/tmp")).directory
    PosixPath('/tmp/g')
    """

    directory: Path
    configured: bool
    work_root: Path

    @property
    def source(self) -> str:
        return "option.compiled_graph_path" if self.configured else "the graph cache"


def graph_cache_roots(environ: Optional[Mapping[str, str]] = None) -> List[Path]:
    """Candidate parents of the graph cache, best first: ``$DJL_CACHE_DIR/djl-stream/
    neuronx-graphs`` (when set), then ``<temp dir>/djl-stream/neuronx-graphs``.

    >>> graph_cache_roots({"DJL_CACHE_DIR": "/tmp/.djl.ai"})[0]
    PosixPath('/tmp/.djl.ai/djl-stream/neuronx-graphs')
    """
    environ = os.environ if environ is None else environ
    roots = []
    if environ.get("DJL_CACHE_DIR"):
        roots.append(Path(environ["DJL_CACHE_DIR"]) / GRAPH_CACHE)
    roots.append(Path(tempfile.gettempdir()) / GRAPH_CACHE)
    return roots


def _library_versions(neuronx) -> Dict[str, Optional[str]]:
    # Graphs compiled by another compiler or library release may not load: part of the key.
    versions: Dict[str, Optional[str]] = {
        "transformers-neuronx": getattr(neuronx, "__version__", None)}
    try:
        versions["neuronx-cc"] = importlib.metadata.version("neuronx-cc")
    except importlib.metadata.PackageNotFoundError:
        versions["neuronx-cc"] = None
    return versions


def graph_cache_key(props, location: str, versions: Mapping[str, Optional[str]]) -> str:
    """The cache folder name for ``props``: readable shapes, then a digest of everything
    the graphs depend on.

    The graphs are compiled from the model's architecture (its ``config.json``) and the
    shapes (tensor parallel degree, batch size, ``n_positions``, ``amp``,
    ``context_length_estimate``) by one release of the library and compiler. They hold no
    weights (``from_pretrained`` reads those at every start); the model's location is part
    of the key all the same, so two model directories never share graphs.

    >>> from djl_stream.serving.properties import ModelProperties
    >>> props = ModelProperties(tensor_parallel_degree=1, max_rolling_batch_size=4,
    ...                         n_positions=2048, dtype="bf16")
    >>> graph_cache_key(props, "/nowhere/SmolLM2", {})[:34]
    'SmolLM2-tp1-bs4-n2048-bf16-cleauto'
    """
    kwargs = from_pretrained_kwargs(props)
    config = Path(location) / "config.json"
    architecture = config.read_bytes() if config.is_file() else b""
    estimate = kwargs.get("context_length_estimate", "auto")
    if isinstance(estimate, list):
        estimate = "_".join(str(e) for e in estimate)
    identity = json.dumps({"location": str(location), "shapes": kwargs,
                           "config.json": hashlib.sha256(architecture).hexdigest(),
                           "versions": dict(versions)}, sort_keys=True)
    name = re.sub(r"[^A-Za-z0-9._-]+", "_", Path(str(location).rstrip("/")).name)[:48] or "model"
    shapes = (f"tp{kwargs['tp_degree']}-bs{kwargs['batch_size']}-n{kwargs['n_positions']}-"
              f"{kwargs['amp']}-cle{estimate}")
    return f"{name}-{shapes}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def writable_directory(path: Path) -> bool:
    """Whether files can be created in ``path`` (made if missing), found out by creating
    one: the only answer that holds alike for read-only mounts, permission bits and root,
    whom permission bits do not stop."""
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
        return True
    except OSError:
        return False


def compiled_graph_dir(props, *, environ: Optional[Mapping[str, str]] = None,
                       versions: Optional[Mapping[str, Optional[str]]] = None) -> GraphPlace:
    """Where ``props``' compiled graphs are loaded from, or saved to after compiling.

    - ``option.compiled_graph_path`` set: that directory; a relative path is relative to
      the model directory, as in djl-serving's own Neuron loader, so that graphs compiled
      ahead of time can ship inside the model directory (read-only on SageMaker).
    - unset: ``<root>/<key>`` in the first writable of :func:`graph_cache_roots`, ``key``
      from :func:`graph_cache_key`, so that a restarted worker finds its graphs again.

    The compiler's work files go under the first writable cache root either way.
    Raises :class:`~djl_stream.runtime.loading.ModelLoadError` when no candidate is writable.
    """
    from djl_stream.runtime.loading import ModelLoadError

    roots = graph_cache_roots(environ)
    work_root = next((root for root in roots if writable_directory(root)), None)
    if work_root is None:
        raise ModelLoadError(
            "the transformers-neuronx engine needs a writable directory for the Neuron "
            f"compiler and its graph cache; none of {', '.join(map(str, roots))} is "
            "writable: set DJL_CACHE_DIR to a writable directory")
    if props.compiled_graph_path:
        if "://" in props.compiled_graph_path:
            raise ModelLoadError(
                f"option.compiled_graph_path={props.compiled_graph_path}: only local "
                "directories are supported; download the graphs into the model directory "
                "and give their relative path")
        path = Path(props.compiled_graph_path).expanduser()
        if not path.is_absolute():
            path = Path(props.model_dir) / path
        return GraphPlace(path, configured=True, work_root=work_root)
    key = graph_cache_key(props, props.weights_location(), versions or {})
    return GraphPlace(work_root / key, configured=False, work_root=work_root)


def has_compiled_artifacts(directory: Optional[Path]) -> bool:
    """Whether ``directory`` holds artifacts written by ``model.save()`` (``*.neff`` files,
    one per compiled graph)."""
    return directory is not None and directory.is_dir() and any(directory.glob("*.neff"))


def check_graph_place(place: GraphPlace) -> str:
    """``"load"`` when ``place`` holds compiled graphs, ``"compile"`` when it can take
    them; :class:`~djl_stream.runtime.loading.ModelLoadError` (before any compiling) when it holds
    none and cannot be written, e.g. a relative ``option.compiled_graph_path`` in a
    read-only ``/opt/ml/model`` that was shipped without its graphs."""
    from djl_stream.runtime.loading import ModelLoadError

    if has_compiled_artifacts(place.directory):
        return "load"
    if writable_directory(place.directory):
        return "compile"
    raise ModelLoadError(
        f"{place.source}: {place.directory} holds no compiled graphs (*.neff) and is not "
        "writable, so the graphs compiled now could not be kept there. Ship "
        "the graphs in that directory (compile once where it is writable, e.g. "
        "djl-stream serve on an Inferentia host), point option.compiled_graph_path at a "
        "writable directory, or unset it to use the graph cache under $DJL_CACHE_DIR")


# os.chdir changes the directory of the whole process, not of one thread.
_cwd_lock = threading.Lock()


@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[Path]:
    """Run the block with ``path`` as the current directory, then go back.

    The Neuron compiler writes work files into the current directory, and djl-serving
    starts the worker in the model directory, which is read-only on SageMaker (djl's own
    Neuron loader does ``os.chdir("/tmp")`` for the same reason). The current directory
    belongs to the process: while the block runs, *every* thread resolves relative paths
    against ``path``. Model loading is the only thing running in djl-serving's worker at
    that point (the init call comes before any request); under ``djl-stream serve`` the
    model loads in a thread while the server answers ``/ping``, which uses no relative
    path. A lock keeps two such blocks in this process from interleaving.
    """
    with _cwd_lock:
        previous = os.getcwd()
        os.chdir(path)
        try:
            yield path
        finally:
            os.chdir(previous)


class _StaleGraphs(Exception):
    """Graphs in the automatic cache that this model cannot use."""


def save_compiled(model, directory: Path) -> None:
    """``model.save()`` into a fresh sibling of ``directory``, then rename it into place,
    so that a reader never sees half the graphs and two workers compiling the same model
    at once (djl-serving starts one per NeuronCore group) do not mix their files; the
    second one keeps the graphs the first one published."""
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.", dir=directory.parent))
    except OSError:  # a directory we may write in but not beside (a mount point)
        model.save(str(directory))
        return
    try:
        model.save(str(staging))
        if directory.is_dir() and not any(directory.iterdir()):
            directory.rmdir()  # an empty directory made for us: take its place
        try:
            os.rename(staging, directory)
        except OSError:
            if not has_compiled_artifacts(directory):
                raise
            logger.info("compiled graphs for %s were saved by another worker first", directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def compile_or_load(model, place: GraphPlace) -> str:
    """Make ``model`` ready to run; return ``"loaded"`` or ``"compiled"``.

    transformers-neuronx's order: ``model.load(dir)`` *before* ``model.to_neuron()`` makes
    ``to_neuron()`` take the saved graphs instead of compiling; ``model.save(dir)`` after
    ``to_neuron()`` writes them. So with artifacts in ``place`` we load them, and
    otherwise compile (refusing first, with :class:`~djl_stream.runtime.loading.ModelLoadError`,
    a place that could not keep the result: see :func:`check_graph_place`) and save them
    there for the next start. Either way ``to_neuron()`` runs in a fresh directory under
    ``place.work_root`` (see :func:`working_directory`), removed afterwards unless the
    compiler failed, when it keeps the compiler's logs.
    """
    from djl_stream.runtime.loading import ModelLoadError

    action = check_graph_place(place)
    work = Path(tempfile.mkdtemp(prefix="compile-", dir=place.work_root))
    try:
        with working_directory(work):
            if action == "load":
                model.load(str(place.directory))
                try:
                    model.to_neuron()
                except FileNotFoundError as error:
                    if not place.configured:
                        raise _StaleGraphs(str(error)) from error
                    raise ModelLoadError(
                        f"the compiled artifacts in {place.directory} do not match this model "
                        "and its settings (option.max_rolling_batch_size, option.n_positions, "
                        "option.tensor_parallel_degree, option.dtype, "
                        "option.context_length_estimate); empty the directory or point "
                        f"option.compiled_graph_path elsewhere to recompile ({error})"
                    ) from error
            else:
                model.to_neuron()
    except BaseException:
        if action == "compile":
            logger.error("compiling failed; the Neuron compiler's work files are in %s", work)
        else:
            shutil.rmtree(work, ignore_errors=True)
        raise
    shutil.rmtree(work, ignore_errors=True)
    if action == "load":
        return "loaded"
    try:
        save_compiled(model, place.directory)
    except OSError as error:  # a full disk after compiling: serve, recompile next time
        logger.warning("could not save the compiled model to %s: %s", place.directory, error)
    return "compiled"


def load_neuron_model(props) -> Tuple[Any, Any]:
    """Load ``props.weights_location()`` with transformers-neuronx, compile it (or load
    the compiled graphs found in :func:`compiled_graph_dir`), and return
    ``(model, tokenizer)``.

    Nothing is written into the model directory unless ``option.compiled_graph_path``
    points there; the log says where the graphs come from or go. Raises
    :class:`NeuronUnavailableError` when the package is missing and
    :class:`~djl_stream.runtime.loading.ModelLoadError` for settings it cannot honour, before
    the weights are read when it can tell.
    """
    neuronx = import_transformers_neuronx()
    from transformers import AutoTokenizer

    location = props.weights_location()
    kwargs = from_pretrained_kwargs(props)
    place = compiled_graph_dir(props, versions=_library_versions(neuronx))
    check_graph_place(place)
    tokenizer = AutoTokenizer.from_pretrained(location, trust_remote_code=props.trust_remote_code)
    logger.info("loading %s with transformers-neuronx, %s", location, kwargs)
    model = _auto_model_class(neuronx).from_pretrained(location, **kwargs)
    try:
        how = compile_or_load(model, place)
    except _StaleGraphs as error:
        logger.warning("the cached graphs in %s do not fit this model (%s); compiling again",
                       place.directory, error)
        shutil.rmtree(place.directory, ignore_errors=True)
        model = _auto_model_class(neuronx).from_pretrained(location, **kwargs)
        how = compile_or_load(model, place)
    logger.info("neuron model %s: graphs %s %s (%s)", how,
                "loaded from" if how == "loaded" else "saved to", place.directory, place.source)
    with _registry_lock:
        _compilations[model] = NeuronCompilation(
            batch_size=props.max_rolling_batch_size,
            n_positions=props.n_positions,
            eos_token_ids=_checkpoint_eos_ids(location),
        )
    return model, tokenizer


def _checkpoint_eos_ids(location: str) -> FrozenSet[int]:
    # The generation config may list more end ids than config.json (SmolLM2's
    # <|im_end|>, Llama 3's <|eot_id|>); the Neuron sampler only knows config.json's.
    try:
        from transformers import GenerationConfig

        configured = GenerationConfig.from_pretrained(location).eos_token_id
    except (OSError, ValueError):
        return frozenset()
    return frozenset(_as_ids(configured))


def _as_ids(value) -> List[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def compilation_of(model) -> NeuronCompilation:
    """What ``model`` was compiled for: recorded by :func:`load_neuron_model`, else read
    from the neuron config (``model.config.batch_size`` and ``n_positions``)."""
    recorded = _compilations.get(model)
    if recorded is not None:
        return recorded
    config = getattr(model, "config", None)
    batch_size = getattr(config, "batch_size", None)
    n_positions = getattr(config, "n_positions", None)
    if batch_size is None or n_positions is None:
        raise ValueError(
            "cannot tell the compiled batch size and n_positions of this model; load it "
            "with djl_stream.generation.engines.neuronx.load_neuron_model"
        )
    if isinstance(batch_size, (list, tuple)):  # compiled for several: the largest fits all
        batch_size = max(batch_size)
    return NeuronCompilation(int(batch_size), int(n_positions))


def _model_lock(model) -> threading.Lock:
    with _registry_lock:
        lock = _model_locks.get(model)
        if lock is None:
            lock = _model_locks[model] = threading.Lock()
        return lock


# ---------------------------------------------------------------------------------------
# One request's batch


@dataclasses.dataclass(frozen=True)
class NeuronBatch:
    """The arguments of ``model.sample()`` for one request.

    ``input_ids`` is ``(batch_size, width)``: the prompts, left-padded with ``pad_token_id``,
    then rows holding one pad token up to the compiled batch size. ``start_ids[i]`` is where
    row ``i``'s real tokens begin, which is how transformers-neuronx is told about left
    padding (its ``HuggingFaceGenerationModelAdapter`` derives the same numbers from an
    attention mask). ``sequence_length`` is the total: ``width + max_new_tokens``.

    >>> batch = NeuronBatch.from_prompts([[5, 6, 7], [8]], batch_size=3, n_positions=16,
    ...                                  max_new_tokens=4, pad_token_id=2)
    >>> batch.input_ids.tolist(), batch.start_ids.tolist(), batch.sequence_length
    ([[5, 6, 7], [2, 2, 8], [2, 2, 2]], [0, 2, 2], 7)
    """

    input_ids: torch.Tensor
    start_ids: torch.Tensor
    sequence_length: int
    n_prompts: int

    @classmethod
    def from_prompts(
        cls,
        prompt_ids: Sequence[Sequence[int]],
        *,
        batch_size: int,
        n_positions: int,
        max_new_tokens: int,
        pad_token_id: int,
    ) -> "NeuronBatch":
        """Pad ``prompt_ids`` to the compiled shapes; :class:`RequestError` when they
        cannot fit (more prompts than the batch size, or a sequence beyond n_positions)."""
        n = len(prompt_ids)
        check_batch_size(n, batch_size)
        for i, ids in enumerate(prompt_ids):
            if len(ids) >= n_positions:
                name = f"inputs[{i}]" if n > 1 else "inputs"
                raise RequestError(
                    name,
                    f"{name} is {len(ids)} tokens long; the model is compiled for "
                    f"{n_positions} positions, prompt and new tokens together "
                    f"(option.n_positions)",
                )
        width = max(len(ids) for ids in prompt_ids)
        total = width + max_new_tokens
        if total > n_positions:
            raise RequestError(
                "parameters.max_new_tokens",
                f"the longest prompt ({width} tokens) + parameters.max_new_tokens "
                f"({max_new_tokens}) is {total} tokens; the limit (option.n_positions) is "
                f"{n_positions}",
            )
        rows = [list(ids) for ids in prompt_ids] + [[pad_token_id]] * (batch_size - n)
        input_ids = torch.full((batch_size, width), pad_token_id, dtype=torch.long)
        start_ids = torch.empty(batch_size, dtype=torch.int32)
        for row, ids in enumerate(rows):
            input_ids[row, width - len(ids):] = torch.tensor(ids, dtype=torch.long)
            start_ids[row] = width - len(ids)
        return cls(input_ids, start_ids, total, n)


def check_batch_size(n_prompts: int, batch_size: int) -> None:
    """Refuse more prompts than the compiled batch size.

    >>> check_batch_size(5, 4)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: inputs has 5 prompts; the model is compiled for a batch of 4 (option.max_rolling_batch_size)
    """
    if n_prompts > batch_size:
        raise RequestError(
            "inputs",
            f"inputs has {n_prompts} prompts; the model is compiled for a batch of "
            f"{batch_size} (option.max_rolling_batch_size)",
        )


def _sample_parameters(model) -> FrozenSet[str]:
    try:
        return frozenset(inspect.signature(model.sample).parameters)
    except (TypeError, ValueError):  # no signature to read: assume the Llama family's
        return frozenset({"top_k", "top_p", "temperature", "eos_token_override"})


def sample_options(
    parameters: Dict[str, Any],
    *,
    vocab_size: int,
    accepted: AbstractSet[str] = frozenset({"top_k", "top_p", "temperature"}),
) -> Dict[str, Any]:
    """``top_k``, ``top_p``, ``temperature`` (and ``eos_token_override``) for
    ``model.sample()``.

    Greedy decoding (``do_sample`` false) is ``top_k=1``. ``top_p`` and ``temperature`` are
    Python floats, as the Neuron sampler checks; ``top_k=0`` (off) becomes ``vocab_size``.
    Options ``sample()`` does not take (``accepted``: GPT-2-style classes sample with
    ``top_k`` only) are left out, or refused when the request sets them.

    The Neuron sampler has no repetition penalty, typical-p or seed, so a request that sets
    one to a value that would change its output gets a :class:`RequestError` rather than
    silently different results (a greedy request may carry ``typical_p`` and
    ``manual_seed``: they change nothing there, as in the Accelerate engine). It hands out
    no per-token scores and cannot bar a token, so ``logprobs``, ``top_logprobs`` and
    ``min_new_tokens`` are refused the same way.

    ``ignore_eos`` becomes ``eos_token_override=-1`` (:data:`NO_EOS`): the sampler compares
    every token with that id to mark a row done (and then feeds it eos to the end), and no
    token is -1, so every row runs to ``sequence_length``; the end-of-sequence tokens it
    still produces add no text (the :class:`GenerationSequence` is told ``ignore_eos``).
    A ``sample()`` without ``eos_token_override`` (``accepted``) refuses ``ignore_eos``.

    >>> sample_options({"do_sample": False, "temperature": 0.5}, vocab_size=100)
    {'top_k': 1, 'top_p': 1.0, 'temperature': 1.0}
    >>> sample_options({"do_sample": True, "top_k": 0, "top_p": 1}, vocab_size=100)
    {'top_k': 100, 'top_p': 1.0, 'temperature': 1.0}
    >>> sample_options({"repetition_penalty": 1.2}, vocab_size=100)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: parameters.repetition_penalty is not supported by the transformers-neuronx engine (the Neuron sampler has no repetition penalty); leave it 1
    >>> sample_options({"ignore_eos": True}, vocab_size=100,
    ...                accepted={"top_k", "top_p", "temperature", "eos_token_override"})
    {'top_k': 1, 'top_p': 1.0, 'temperature': 1.0, 'eos_token_override': -1}
    """
    if parameters.get("logprobs"):
        raise _unsupported("logprobs", "false", "the Neuron sampler reports no per-token scores")
    if parameters.get("top_logprobs"):
        raise _unsupported("top_logprobs", "0", "the Neuron sampler reports no per-token scores")
    if parameters.get("min_new_tokens"):
        raise _unsupported("min_new_tokens", "0", "the Neuron sampler cannot keep the "
                           "end-of-sequence token from being chosen")
    repetition_penalty = parameters.get("repetition_penalty")
    if repetition_penalty is not None and repetition_penalty != 1.0:
        raise _unsupported("repetition_penalty", "1")
    if parameters.get("do_sample"):
        typical_p = parameters.get("typical_p")
        if typical_p is not None and typical_p < 1.0:
            raise _unsupported("typical_p", "1")
        if parameters.get("manual_seed") is not None:
            raise _unsupported("manual_seed", "unset")
        top_k = parameters.get("top_k") or 0
        options = {"top_k": int(top_k) if top_k > 0 else int(vocab_size),
                   "top_p": float(parameters.get("top_p") or 1.0),
                   "temperature": float(parameters.get("temperature") or 1.0)}
    else:
        options = {"top_k": 1, "top_p": 1.0, "temperature": 1.0}
    for name in ("top_p", "temperature"):
        if name not in accepted:
            if options[name] != 1.0:
                raise _unsupported(name, "1", f"this model's sample() has no {name}")
            del options[name]
    if parameters.get("ignore_eos"):
        if "eos_token_override" not in accepted:
            raise _unsupported("ignore_eos", "false", "this model's sample() has no "
                               "eos_token_override, so its sampler always ends a row at the "
                               "end-of-sequence token")
        options["eos_token_override"] = NO_EOS
    return options


def _unsupported(name: str, default: str, why: str = "") -> RequestError:
    field = f"parameters.{name}"
    why = why or f"the Neuron sampler has no {name.replace('_', ' ')}"
    return RequestError(field, f"{field} is not supported by the transformers-neuronx engine "
                               f"({why}); leave it {default}")


# ---------------------------------------------------------------------------------------
# Streaming out of sample()


class _GenerationCancelled(BaseException):
    """Raised from :meth:`TokenQueueStreamer.put` to unwind ``sample()``.

    A ``BaseException`` (like ``GeneratorExit``) so that no ``except Exception`` on the way
    out of the library can swallow it and keep generating."""


_END = object()


@dataclasses.dataclass(frozen=True)
class _Failure:
    error: BaseException


class TokenQueueStreamer:
    """A transformers-neuronx streamer that queues each step's tokens for another thread.

    ``sample()`` calls :meth:`put` once per step with a ``(batch, 1)`` tensor (never the
    prompt) and :meth:`end` once at the end. After :meth:`cancel`, the next :meth:`put`
    raises, which stops ``sample()`` at that step.

    >>> streamer = TokenQueueStreamer()
    >>> streamer.put(torch.tensor([[11], [2]])); streamer.end()
    >>> streamer.get(timeout=1), streamer.get(timeout=1) is TokenQueueStreamer.END
    ([11, 2], True)
    """

    END = _END

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._cancelled = threading.Event()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()

    def put(self, value: torch.Tensor) -> None:
        if self._cancelled.is_set():
            raise _GenerationCancelled()
        # The last column is the new token, whatever the tensor's width.
        self._queue.put(value.reshape(value.shape[0], -1)[:, -1].tolist())

    def end(self) -> None:
        self._queue.put(_END)

    def fail(self, error: BaseException) -> None:
        """Queue ``error`` for the reading thread to raise."""
        self._queue.put(_Failure(error))

    def cancel(self) -> None:
        self._cancelled.set()

    def get(self, timeout: float) -> Any:
        """The next step's token ids, :attr:`END`, or a failure; ``queue.Empty`` after
        ``timeout`` seconds."""
        return self._queue.get(timeout=timeout)


def _run_sample(model, lock: threading.Lock, streamer: TokenQueueStreamer,
                batch: NeuronBatch, options: Dict[str, Any]) -> None:
    # The stream itself is not referenced here, so dropping it unread closes it (__del__).
    try:
        while not lock.acquire(timeout=0.05):
            if streamer.cancelled:
                return
        try:
            if not streamer.cancelled:
                model.sample(batch.input_ids, batch.sequence_length, start_ids=batch.start_ids,
                             streamer=streamer, **options)
        finally:
            lock.release()
    except _GenerationCancelled:
        pass
    except BaseException as error:  # noqa: BLE001 - the reader raises it
        streamer.fail(error)
    finally:
        streamer.end()


class NeuronGenerationStream:
    """Iterator over one request's decode steps; see the module docstring.

    Each item is a :class:`~djl_stream.generation.step.Step` with one entry per prompt
    (its ``generations`` carry the token, ``special`` and the finish reason; the Neuron
    sampler gives no log-probabilities). The stream ends when every prompt is done (the
    sampling thread is then stopped at its next step), when ``sample()`` returns, or with
    ``sample()``'s own exception. :meth:`close` stops the generation at its next step.
    ``thread`` is the sampling thread; ``eos_token_id`` is the id the sampler ends rows
    with.
    """

    POLL_SECONDS = 0.1

    def __init__(self, model, sequences: Sequence[GenerationSequence], batch: NeuronBatch,
                 options: Dict[str, Any], eos_token_id: Optional[int] = None) -> None:
        self.sequences = list(sequences)
        self.eos_token_id = eos_token_id
        self.streamer = TokenQueueStreamer()
        self._done = False
        self.thread = threading.Thread(
            target=_run_sample, args=(model, _model_lock(model), self.streamer, batch, options),
            name="neuronx-sample", daemon=True,
        )
        self.thread.start()

    def __iter__(self) -> "NeuronGenerationStream":
        return self

    def __next__(self) -> Step:
        if self._done:
            raise StopIteration
        item = self._next_item()
        if isinstance(item, _Failure):
            self.close()
            raise item.error
        if item is _END:
            self.close()
            generations = self._flush_unfinished()
            if not any(generations):
                raise StopIteration
            return Step.of(generations)
        generations: List[Optional[Generation]] = [None] * len(self.sequences)
        for row, sequence in enumerate(self.sequences):
            if not sequence.finished:
                generations[row] = sequence.append(int(item[row]))
        if all(sequence.finished for sequence in self.sequences):
            self.close()
        return Step.of(generations)

    def close(self) -> None:
        """Stop generating; the sampling thread leaves ``sample()`` at its next step."""
        self._done = True
        self.streamer.cancel()

    def __del__(self) -> None:
        streamer = getattr(self, "streamer", None)
        if streamer is not None:
            streamer.cancel()

    def _next_item(self) -> Any:
        while True:
            try:
                return self.streamer.get(timeout=self.POLL_SECONDS)
            except queue.Empty:
                if self.thread.is_alive():
                    continue
            # The thread always queues END last, so an empty queue after it ended means
            # it died in a way no except clause saw; never wait on it forever.
            try:
                return self.streamer.get(timeout=0)
            except queue.Empty:
                return _Failure(RuntimeError("the sampling thread ended without finishing"))

    def _flush_unfinished(self) -> List[Optional[Generation]]:
        # sample() stopped before a row reached our own end (every row produced the
        # sampler's eos, or sequence_length): end it as the model did, releasing the text
        # still held back for an incomplete character or a possible stop string. end(),
        # not append(eos): with ignore_eos an appended eos would not end the row.
        generations: List[Optional[Generation]] = [None] * len(self.sequences)
        for row, sequence in enumerate(self.sequences):
            if not sequence.finished:
                eos = self.eos_token_id
                if eos is None:
                    eos = min(sequence.eos_token_ids) if sequence.eos_token_ids else 0
                generations[row] = sequence.end(eos, "eos")
        return generations


def _eos_ids(model, tokenizer, compilation: NeuronCompilation) -> FrozenSet[int]:
    ids = set(compilation.eos_token_ids)
    ids.update(_as_ids(getattr(getattr(model, "config", None), "eos_token_id", None)))
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return frozenset(ids)


def _sampler_eos_id(model, tokenizer) -> int:
    # Pad with the id the sampler itself ends rows with (config.json's eos).
    configured = _as_ids(getattr(getattr(model, "config", None), "eos_token_id", None))
    if configured:
        return configured[0]
    if getattr(tokenizer, "eos_token_id", None) is not None:
        return int(tokenizer.eos_token_id)
    raise ValueError("the model and tokenizer define no eos token to pad with")


@register_engine(ENGINE)
def neuronx_stream_generator(
    model, tokenizer, inputs: List[str], **parameters: Any
) -> NeuronGenerationStream:
    """Stream the continuation of every prompt in ``inputs``, one list per decode step.

    ``parameters`` as for the Accelerate engine: ``max_new_tokens`` (default 50),
    ``do_sample``, ``temperature``, ``top_k``, ``top_p``, ``stop``, ``ignore_eos``;
    ``typical_p``, ``repetition_penalty``, ``manual_seed``, ``min_new_tokens``,
    ``logprobs`` and ``top_logprobs`` only at values that change nothing (see
    :func:`sample_options`). Raises :class:`~djl_stream.protocols.validation.RequestError` at once
    (before any generation) for more prompts than the compiled batch size, a prompt plus
    ``max_new_tokens`` beyond ``n_positions``, or an unsupported sampling option.
    """
    if isinstance(inputs, str):
        inputs = [inputs]
    unknown = set(parameters) - _PARAMETERS
    if unknown:
        raise ValueError(
            f"unknown generation parameter(s) {sorted(unknown)}; known: {sorted(_PARAMETERS)}"
        )
    compilation = compilation_of(model)
    vocab_size = getattr(getattr(model, "config", None), "vocab_size", None) or len(tokenizer)
    options = sample_options(parameters, vocab_size=vocab_size, accepted=_sample_parameters(model))
    check_batch_size(len(inputs), compilation.batch_size)  # before tokenizing in vain
    max_new_tokens = parameters.get("max_new_tokens") or DEFAULT_MAX_NEW_TOKENS
    prompt_ids = encode_prompts(tokenizer, inputs)
    sampler_eos = _sampler_eos_id(model, tokenizer)
    batch = NeuronBatch.from_prompts(
        prompt_ids,
        batch_size=compilation.batch_size,
        n_positions=compilation.n_positions,
        max_new_tokens=max_new_tokens,
        pad_token_id=sampler_eos,
    )
    stop = parameters.get("stop") or ()
    if isinstance(stop, str):
        stop = (stop,)
    eos_ids = _eos_ids(model, tokenizer, compilation)
    sequences = [
        GenerationSequence(i, ids, tokenizer, max_new_tokens=max_new_tokens,
                           eos_token_ids=eos_ids, stop=tuple(stop),
                           ignore_eos=bool(parameters.get("ignore_eos")))
        for i, ids in enumerate(prompt_ids)
    ]
    return NeuronGenerationStream(model, sequences, batch, options, eos_token_id=sampler_eos)

"""The decode step compiled ahead of time: the model's own forward over a block of rows,
exported with ``torch.export`` and compiled by AOTInductor into a package kept on disk.

A decode step of ``n`` running rows is the same computation at every step but for ``n``
and the columns attended, so it is compiled once with both as dynamic sizes
(:class:`DecodeStep`): the whole forward, every architecture's own code, becomes one C++
function with no Python between its operators. The package holds no weights
(``aot_inductor.package_constants_in_so`` off): the program reads the served model's own
parameters (``load_constants(..., user_managed=True)``), so it costs no memory beyond its
code, and a program serves any weights of the same shapes. The weights small enough for
the compiler to write into the code as literals are inputs of the program instead
(:func:`small_parameters`).

Compiling takes minutes on a small CPU, so it never happens in the serving process:
:class:`ProgramBuilder` starts ``python -m djl_stream.runtime.decode_program SPEC`` in a
process of its own (a crash there cannot take the server down) while the server answers
with the model's eager forward, and the runner switches to the program between two steps
once it has checked that the program gives the eager step's logits
(:meth:`~djl_stream.runtime.runner.AttentionRunner.run`). The compiling process builds the
model's structure from its config with weights left unwritten (the program only needs
their shapes) and the served model's buffers, so it reads no checkpoint.

A model whose packed linear layers kept their float weights, or whose weights are int8,
gets a second program, for steps of few rows (:func:`~djl_stream.runtime.linear_layers.
streamed_rows` of its weights' dtype), whose products stream the weights
(:func:`~djl_stream.runtime.linear_layers.streaming_products`): with few rows a step is
bound by reading the weights, which that reduction does at the speed of memory. It
compiles first (a lone stream gains the most from it), then the program of every row
count. The runner runs each step on the program made for its row count, once that one is
ready and checked.

Programs are cached under :func:`cache_root`, keyed by what decides the compiled code
(:func:`program_key`): the model's config, dtype and layer types, the cache's geometry,
the versions of torch, transformers and djl-stream's runtime, and the CPU's instruction
sets. Nothing measured decides it, so a second start finds the program its first start
compiled. A process that finds another compiling the same program waits for it (and says
so) rather than compiling it again.

Example::

    builder = ProgramBuilder(model, runner.geometry())
    builder.start()                        # returns at once; compiles in the background
    program = builder.result(timeout=0)    # a DecodeProgram once ready, else None
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from djl_stream.runtime.attention import AttentionLayout, forward_with_layout
from djl_stream.runtime.file_lock import exclusive_lock

logger = logging.getLogger(__name__)

#: Where programs are kept: ``$DJL_STREAM_CACHE_DIR``, else ``$DJL_CACHE_DIR/djl-stream``
#: (djl-serving's cache), else ``~/.cache/djl-stream``.
CACHE_VARIABLE = "DJL_STREAM_CACHE_DIR"
#: What the load log says when decode steps start running the compiled program, and when
#: the eager forward goes on serving instead: lines a harness may wait for.
SWITCHED = "decode steps now run the compiled program"
NOT_USED = "the eager forward goes on serving"
#: The compiling process's parent's id, in the compiling process's environment.
PARENT_VARIABLE = "DJL_STREAM_COMPILING_FOR"
#: x86 flags that decide which vector code the compiler writes.
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
             "avx512_fp16", "avx512_vnni", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")
#: Config keys the program key leaves out: the class, the parameters and the versions in
#: the key say them (a config saved and loaded again may add them).
CONFIG_KEYS_SAID_ELSEWHERE = frozenset({"architectures", "dtype", "torch_dtype",
                                        "transformers_version"})
#: Bumped when the exported step changes in a way the versions do not show.
FORMAT = 1


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """The shapes of the KV cache a program reads: ``rows`` (the spare row included),
    ``columns``, and per layer ``(heads, key_dim, value_dim)`` and its sliding window
    (``layer_windows``); ``windows`` are the distinct ones, in the order the
    program takes their masks; ``dtype`` of the cache."""

    rows: int
    columns: int
    layers: Tuple[Tuple[int, int, int], ...]
    layer_windows: Tuple[Optional[int], ...]
    dtype: str

    @property
    def windows(self) -> Tuple[Optional[int], ...]:
        return distinct_windows(self.layer_windows)

    def as_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: Dict[str, Any]) -> "CacheGeometry":
        return cls(data["rows"], data["columns"], tuple(tuple(x) for x in data["layers"]),
                   tuple(data["layer_windows"]), data["dtype"])


def small_parameters(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Parameter]]:
    """``model``'s parameters of at most one dimension and at most 8 values, by name.

    The compiler writes a constant that small into the code as literals (Inductor inlines
    them), and the program is compiled over a structural twin whose weights are
    placeholders: such a weight would keep the placeholders' values, whatever the served
    model's are (gpt-oss's sinks over a few heads, a router's bias over a few experts). So
    the program takes them as inputs (:class:`DecodeStep`'s ``small``) instead.

    >>> layer = torch.nn.Linear(4, 3)
    >>> [name for name, _ in small_parameters(layer)]
    ['bias']
    """
    return [(name, parameter) for name, parameter in model.named_parameters()
            if parameter.dim() <= 1 and parameter.numel() <= 8]


class DecodeStep(torch.nn.Module):
    """A decode step of rows ``[0, n)`` of the cache, one token each, as a module over the
    model: ``(input_ids (1, n), position_ids (1, n), rows (n,), masks, keys, values,
    small) -> logits (n, vocab)``. ``rows`` says where each token's keys and values are
    written (a padding row writes into the spare row); ``masks`` holds one block mask per
    window of :attr:`windows` (the distinct ones of ``layer_windows``, each layer's);
    ``small`` holds the model's :func:`small_parameters` (empty: the model's own)."""

    def __init__(self, model: torch.nn.Module, layer_windows: Sequence[Optional[int]]) -> None:
        super().__init__()
        self.model = model
        self.layer_windows = tuple(layer_windows)
        self.windows = distinct_windows(self.layer_windows)
        self.small_names = [name for name, _ in small_parameters(model)]

    def forward(self, input_ids, position_ids, rows, masks, keys, values, small=()):
        layout = AttentionLayout(
            rows=rows, positions=position_ids[0], keys=list(keys), values=list(values),
            layer_windows=self.layer_windows, block_start=0, block_rows=input_ids.shape[1],
            block_masks=dict(zip(self.windows, masks)))
        no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=input_ids.device)
        model = self.model
        if small:  # (the model with these tensors in place of its small parameters)
            replaced = dict(zip(self.small_names, small))

            def model(**kwargs):
                return torch.func.functional_call(self.model, replaced, (), kwargs)

        outputs = forward_with_layout(model, layout, input_ids=input_ids,
                                      position_ids=position_ids, attention_mask=no_mask,
                                      use_cache=False)
        return outputs.logits[0]


class DecodeProgram:
    """A compiled :class:`DecodeStep` reading ``model``'s own parameters."""

    def __init__(self, path: Path, model: torch.nn.Module) -> None:
        from djl_stream.runtime import packed_linear  # (registers the operator it calls)

        self.path = path
        self._packed = packed_linear.weights_of(model)
        self._program = torch._inductor.aoti_load_package(str(path))
        wrapper = DecodeStep(model, ())
        self._small = tuple(parameter for _, parameter in small_parameters(model))
        constants = dict(wrapper.named_parameters(remove_duplicate=False))
        constants.update(wrapper.named_buffers(remove_duplicate=False))
        wanted = self._program.get_constant_fqns()
        missing = [name for name in wanted if name not in constants]
        if missing:
            raise ValueError(f"the program wants constants the model lacks: {missing[:3]}")
        self._program.load_constants({name: constants[name] for name in wanted},
                                     check_full_update=True, user_managed=True)

    def __call__(self, input_ids, position_ids, rows, masks, keys, values) -> torch.Tensor:
        from djl_stream.runtime.packed_linear import packed_weights

        with packed_weights(self._packed):
            return self._program(input_ids, position_ids, rows, tuple(masks), tuple(keys),
                                 tuple(values), self._small)


def distinct_windows(layer_windows: Sequence[Optional[int]]) -> Tuple[Optional[int], ...]:
    """The sliding windows of ``layer_windows``, each once, full attention (``None``) first.

    >>> distinct_windows([4096, None, 4096, None])
    (None, 4096)
    """
    return tuple(sorted(set(layer_windows), key=lambda window: (window is not None, window or 0)))


def cache_root(environ: Optional[Dict[str, str]] = None) -> Path:
    """Where compiled programs are kept (see :data:`CACHE_VARIABLE`).

    >>> cache_root({"DJL_STREAM_CACHE_DIR": "/srv/cache"})
    PosixPath('/srv/cache/decode-programs')
    >>> cache_root({"DJL_CACHE_DIR": "/tmp/.djl.ai"})
    PosixPath('/tmp/.djl.ai/djl-stream/decode-programs')
    """
    environ = os.environ if environ is None else environ
    if environ.get(CACHE_VARIABLE):
        root = Path(environ[CACHE_VARIABLE])
    elif environ.get("DJL_CACHE_DIR"):
        root = Path(environ["DJL_CACHE_DIR"]) / "djl-stream"
    else:
        root = Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "djl-stream"
    return root / "decode-programs"


def cpu_instruction_sets() -> List[str]:
    """The instruction sets the compiler may use here: PyTorch's own reading of the CPU
    and the :data:`ISA_FLAGS` ``/proc/cpuinfo`` lists."""
    from djl_stream.runtime.cpu_info import cpu_fields

    flags = set(((cpu_fields(("flags",)) or {}).get("flags") or "").split())
    return [torch.backends.cpu.get_cpu_capability()] + sorted(flags & set(ISA_FLAGS))


def program_key(model: torch.nn.Module, geometry: CacheGeometry,
                streamed_rows: Optional[int] = None) -> str:
    """What decides a program's code, hashed: see the module docstring (``streamed_rows``:
    the program of steps of up to that many rows, its products streamed)."""
    import transformers

    layers = sorted({f"{type(m).__module__}.{type(m).__name__}" for m in model.modules()})
    parameters = sorted((name, str(p.dtype), tuple(p.shape))
                        for name, p in model.named_parameters(remove_duplicate=False))
    # (not where the model was loaded from, nor what the class, the parameters' dtypes and
    # the versions below say already, which a config may or may not repeat)
    config = {key: value for key, value in model.config.to_dict().items()
              if not key.startswith("_") and key not in CONFIG_KEYS_SAID_ELSEWHERE}
    described = {
        "format": FORMAT,
        "config": config,
        "class": f"{type(model).__module__}.{type(model).__name__}",
        "modules": layers,
        "parameters": parameters,
        "geometry": geometry.as_dict(),
        "streamed_rows": streamed_rows,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "runtime": _runtime_source_hash(),
        "cpu": cpu_instruction_sets(),
    }
    text = json.dumps(described, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def _runtime_source_hash() -> str:
    """The source of the modules whose code the program holds (attention and this one)."""
    digest = hashlib.sha256()
    for name in ("attention.py", "decode_program.py", "int8.py", "linear_layers.py",
                 "packed_linear.py"):
        digest.update((Path(__file__).parent / name).read_bytes())
    return digest.hexdigest()[:16]


def example_inputs(geometry: CacheGeometry, device="cpu", n: int = 2):
    """Inputs of an ``n``-row step (at most 2) over empty buffers of ``geometry``: what
    export traces."""
    dtype = getattr(torch, geometry.dtype)
    span = 4
    keys = tuple(torch.empty((geometry.rows, h, geometry.columns, k), dtype=dtype, device=device)
                 for h, k, _ in geometry.layers)
    values = tuple(torch.empty((geometry.rows, h, geometry.columns, v), dtype=dtype,
                               device=device) for h, _, v in geometry.layers)
    masks = tuple(torch.ones((n, 1, 1, span), dtype=torch.bool, device=device)
                  for _ in geometry.windows)
    ids = torch.ones((1, n), dtype=torch.long, device=device)
    positions = torch.tensor([[span - 1, span - 2][:n]], device=device)
    return (ids, positions, torch.arange(n, device=device), masks, keys, values)


#: How the programs' C++ is compiled. A product is a chain of multiply-adds, and the C++
#: compiler may fuse each multiply with its add (``-ffp-contract=fast``): one rounding
#: instead of two, and one vector instruction instead of two, which counts where a product
#: is bound by instructions rather than by memory (int8 weights, each turned into a float
#: before it is multiplied).
CODE_SETTINGS = {"cpp.enable_floating_point_contract_flag": "fast"}
#: How they are packaged: the weights stay out of the shared library (the served model's
#: own tensors are handed to it).
PACKAGE_SETTINGS = {"aot_inductor.package_constants_in_so": False}


def export_and_compile(model: torch.nn.Module, geometry: CacheGeometry, target: Path,
                       streamed_rows: Optional[int] = None) -> Path:
    """Export :class:`DecodeStep` over ``model`` (rows 1 to the cache's rows, or to
    ``streamed_rows`` with its products streamed; columns 2 to one less than the cache's
    columns: dynamic) and compile it into the package ``target``."""
    from djl_stream.runtime.linear_layers import streaming_products

    most = streamed_rows or geometry.rows
    # (a program of one row has a fixed row count: export takes a size of one as fixed)
    rows = torch.export.Dim("rows", min=1, max=most) if most > 1 else None
    span = torch.export.Dim("span", min=2, max=geometry.columns - 1)
    small = tuple(parameter.detach() for _, parameter in small_parameters(model))
    shapes = ({1: rows}, {1: rows}, {0: rows}, tuple({0: rows, 3: span} for _ in geometry.windows),
              tuple(None for _ in geometry.layers), tuple(None for _ in geometry.layers),
              tuple(None for _ in small))
    step = DecodeStep(model, geometry.layer_windows)
    started = time.perf_counter()
    # (not inference tensors: the compiler writes them)
    inputs = example_inputs(geometry, n=min(2, most)) + (small,)
    streaming = streaming_products() if streamed_rows else contextlib.nullcontext()
    with torch.inference_mode(), streaming:
        exported = torch.export.export(step, inputs, dynamic_shapes=shapes, strict=False)
    logger.info("exported the decode step in %.1f s", time.perf_counter() - started)
    logger.info("compiling it to C++ (most of the time)")
    started = time.perf_counter()
    path = torch._inductor.aoti_compile_and_package(
        exported, package_path=str(target), inductor_configs={**CODE_SETTINGS, **PACKAGE_SETTINGS})
    logger.info("compiled the decode step in %.1f s", time.perf_counter() - started)
    return Path(path)


class ProgramBuilder:
    """Gets the decode program of ``model`` for ``geometry``: from the cache, or compiled by
    a process of its own in the background (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, geometry: CacheGeometry, *,
                 root: Optional[Path] = None, streamed_rows: Optional[int] = None) -> None:
        from djl_stream.runtime.int8 import quantized_method
        from djl_stream.runtime.linear_layers import linear_layer_names
        from djl_stream.runtime.packed_linear import is_packed, keeps_float_weights

        self.model = model
        self.geometry = geometry
        self.streamed_rows = streamed_rows
        self.quantize = quantized_method(model)
        self.packed = is_packed(model)
        self.float_weights = keeps_float_weights(model)
        # (layers no replacement took: the model's code reads their weights itself)
        self.plain_layers = sorted(linear_layer_names(model).values())
        self.key = program_key(model, geometry, streamed_rows)
        self.folder = (root or cache_root()) / self.key
        self.path = self.folder / "program.pt2"
        self._result: Optional[DecodeProgram] = None
        self._error: Optional[str] = None
        self._done = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._process: Optional[subprocess.Popen] = None
        self._stopped = False

    def start(self) -> None:
        """Load the cached program, or start compiling it; returns at once."""
        _LIVE_BUILDERS.add(self)
        logger.info("getting the compiled decode step%s (%s)", self.rows_said,
                    "from the cache" if self.path.is_file() else "compiling it in the background")
        self._thread = threading.Thread(target=self._build, name="djl-stream-compile",
                                        daemon=True)
        self._thread.start()

    def result(self, timeout: Optional[float] = None) -> Optional[DecodeProgram]:
        """The program once ready (``None`` before, or where it failed: :attr:`error`)."""
        self._done.wait(timeout)
        return self._result

    @property
    def finished(self) -> bool:
        return self._done.is_set()

    def stop(self) -> None:
        """Give up: end the compiling process, if one runs (the engine shuts down)."""
        self._stopped = True
        process = self._process
        if process is not None and process.poll() is None:
            process.terminate()

    @property
    def error(self) -> Optional[str]:
        return self._error

    @property
    def rows_said(self) -> str:
        """How the load log names this program's rows (nothing for the one of every row
        count)."""
        return f" of up to {self.streamed_rows} rows" if self.streamed_rows else ""

    def _build(self) -> None:
        try:
            if not self.path.is_file():
                self._compile()
            self._result = DecodeProgram(self.path, self.model)
        except Exception as error:  # noqa: BLE001 - the eager step goes on serving
            self._error = f"{type(error).__name__}: {error}"
            logger.warning("no compiled decode step%s (%s): %s", self.rows_said, self._error,
                           NOT_USED)
        finally:
            self._done.set()
            _LIVE_BUILDERS.discard(self)

    def _compile(self) -> None:
        lock = self.folder.with_suffix(".lock")
        with exclusive_lock(lock, wait=False) as held:
            if not held:
                logger.info("another process is compiling this decode step%s (%s); waiting "
                            "for it, serving with the eager forward meanwhile", self.rows_said,
                            self.folder)
        with exclusive_lock(lock):
            if self.path.is_file():  # (the other process finished it)
                logger.info("the decode step another process compiled is ready")
                return
            started = time.perf_counter()
            estimate = last_compile_seconds(self.folder.parent)
            logger.info("compiling the decode step%s in the background (a process of its "
                        "own%s); serving with the eager forward meanwhile", self.rows_said,
                        f"; the last compile here took {estimate:.0f} s" if estimate else "")
            self._run_compiler()
            seconds = time.perf_counter() - started
            logger.info("compiled the decode step%s in %.0f s into %s", self.rows_said, seconds,
                        self.folder)
            _record_compile_seconds(self.folder.parent, seconds)

    def _run_compiler(self) -> None:
        self.folder.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=self.folder.parent, prefix=".compiling-") as work:
            work_dir = Path(work)
            spec = {
                "config": self.model.config.to_dict(),
                "dtype": str(next(self.model.parameters()).dtype).replace("torch.", ""),
                "quantize": self.quantize,
                "packed": self.packed,
                "float_weights": self.float_weights,
                "plain_layers": self.plain_layers,
                "streamed_rows": self.streamed_rows,
                "geometry": self.geometry.as_dict(),
                "target": str(work_dir / "program.pt2"),
            }
            (work_dir / "spec.json").write_text(json.dumps(spec, default=str))
            torch.save({name: buffer.detach().cpu() for name, buffer
                        in self.model.named_buffers(remove_duplicate=False)},
                       work_dir / "buffers.pt")
            if self._stopped:
                raise RuntimeError("stopped before compiling")
            self._process = subprocess.Popen(
                [sys.executable, "-m", "djl_stream.runtime.decode_program", str(work_dir)],
                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **{PARENT_VARIABLE: str(os.getpid())}))
            output = []
            for line in self._process.stdout:  # (its stages are the load log's progress)
                output.append(line.rstrip())
                if line.startswith(STAGE_LINES):
                    logger.info("compiling process: %s", line.strip())
            status = self._process.wait()
            if status != 0 or not (work_dir / "program.pt2").is_file():
                tail = "\n".join(output[-5:])
                raise RuntimeError(f"the compiling process ended with status {status}: {tail}")
            self.folder.mkdir(parents=True, exist_ok=True)
            os.replace(work_dir / "program.pt2", self.path)


class ProgramBuilds:
    """A model's decode programs, one :class:`ProgramBuilder` each (``plans``: each one's
    ``streamed_rows``, ``None`` for the one of every row count, which there must be), got
    one after the other in the order of ``plans`` in the background, so that two compiles
    never share the CPU."""

    def __init__(self, model: torch.nn.Module, geometry: CacheGeometry,
                 plans: Sequence[Optional[int]], *, root: Optional[Path] = None) -> None:
        if None not in plans:
            raise ValueError("the programs a model gets include the one of every row count")
        self.builders = {rows: ProgramBuilder(model, geometry, root=root, streamed_rows=rows)
                         for rows in plans}
        self._taken: set = set()
        self._stopped = False
        self._thread: Optional[threading.Thread] = None

    def start(self) -> None:
        """Start getting the programs; returns at once."""
        self._thread = threading.Thread(target=self._build_in_turn, name="djl-stream-programs",
                                        daemon=True)
        self._thread.start()

    def _build_in_turn(self) -> None:
        for builder in self.builders.values():
            if self._stopped:
                break
            builder.start()
            builder.result()

    def take(self, rows: Optional[int]):
        """The program of ``rows`` (a plan) once ready, handed out once; ``None`` before, or
        where it failed."""
        builder = self.builders.get(rows)
        if builder is None or rows in self._taken or not builder.finished:
            return None
        self._taken.add(rows)
        return builder.result()

    def result(self, timeout: Optional[float] = None) -> Optional[DecodeProgram]:
        """The program of every row count, once every program is got (``None`` before, or
        where it failed: :attr:`error`)."""
        if self._thread is None:
            return None
        self._thread.join(timeout)
        if self._thread.is_alive():
            return None
        return self.builders[None].result(timeout=0)

    @property
    def finished(self) -> bool:
        return all(builder.finished for builder in self.builders.values())

    @property
    def error(self) -> Optional[str]:
        errors = [f"{b.rows_said.strip() or 'every row count'}: {b.error}"
                  for b in self.builders.values() if b.error]
        return "; ".join(errors) or None

    def stop(self) -> None:
        """Give up every program not yet got (the engine shuts down)."""
        self._stopped = True
        for builder in self.builders.values():
            builder.stop()


#: The compiling process's lines that say how far it got (the rest go to its error tail).
STAGE_LINES = ("exported the decode step", "compiling it to C++", "compiled the decode step")
#: Where the cache keeps how long its last compile took: the estimate a start logs.
LAST_COMPILE = "last-compile.json"


def last_compile_seconds(root: Path) -> Optional[float]:
    """How long the last compile into ``root`` took, or ``None`` where none is recorded.

    >>> last_compile_seconds(Path("/nowhere"))
    """
    try:
        return float(json.loads((root / LAST_COMPILE).read_text())["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _record_compile_seconds(root: Path, seconds: float) -> None:
    try:
        (root / LAST_COMPILE).write_text(json.dumps({"seconds": round(seconds, 1)}))
    except OSError:  # (a read-only cache still serves its programs)
        pass


#: Builders at work: their compiling processes end with this one (:func:`_stop_builders`).
_LIVE_BUILDERS: "set[ProgramBuilder]" = set()


@atexit.register
def _stop_builders() -> None:
    for builder in list(_LIVE_BUILDERS):
        builder.stop()


def structural_twin(config_dict: Dict[str, Any], dtype: str, quantize: Optional[str],
                    buffers: Dict[str, torch.Tensor], packed: bool = False,
                    float_weights: bool = False,
                    plain_layers: Sequence[str] = ()) -> torch.nn.Module:
    """The served model's structure from its config, its weights allocated but never
    written (the program only needs their shapes), its buffers the served model's;
    ``packed``: its linear layers packed as the served model's are (without reordered
    weights; with float weights where ``float_weights``). The linear layers
    ``plain_layers`` names stay ``nn.Linear``, as the served model's did."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    config_dict = dict(config_dict)
    model_type = config_dict.pop("model_type")
    config = AutoConfig.for_model(model_type, **config_dict)
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    for module in model.modules():
        for name, parameter in list(module.named_parameters(recurse=False)):
            if parameter.device.type == "meta":
                setattr(module, name, torch.nn.Parameter(
                    torch.empty(parameter.shape, dtype=parameter.dtype), requires_grad=False))
    model.tie_weights()
    if quantize:
        from djl_stream.runtime.int8 import quantize_structure

        quantize_structure(model, quantize, leaving_out=plain_layers)
    if packed:
        from djl_stream.runtime.packed_linear import pack_structure

        pack_structure(model, keep_float_weights=float_weights, leaving_out=plain_layers)
    own = dict(model.named_buffers(remove_duplicate=False))
    for name, value in buffers.items():
        if name in own:
            own[name].copy_(value)
    return model.eval()


def _end_with_the_parent() -> None:
    """Exit when the process that started this one is gone: a server that was killed
    leaves no compiler behind. The parent names itself in :data:`PARENT_VARIABLE`: a
    parent that died while this process was still importing torch has already handed it
    to another, and its own parent id would look like the one to watch."""
    parent = int(os.environ.get(PARENT_VARIABLE) or os.getppid())

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main(argv: Optional[List[str]] = None) -> int:
    """The compiling process: ``python -m djl_stream.runtime.decode_program WORK_DIR``."""
    from djl_stream.runtime.attention import use_attention

    _end_with_the_parent()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    work = Path((argv or sys.argv[1:])[0])
    spec = json.loads((work / "spec.json").read_text())
    buffers = torch.load(work / "buffers.pt")
    model = structural_twin(spec["config"], spec["dtype"], spec["quantize"], buffers,
                            spec.get("packed", False), spec.get("float_weights", False),
                            spec.get("plain_layers", ()))
    use_attention(model)
    export_and_compile(model, CacheGeometry.from_dict(spec["geometry"]), Path(spec["target"]),
                       spec.get("streamed_rows"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

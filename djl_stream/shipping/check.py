"""``djl-stream check``: is a model directory ready to ship to djl-serving or SageMaker?

Everything here is found out on the machine you ship from, in seconds, instead of in a
container log minutes after an endpoint started. One :class:`Finding` per check:

- ``serving.properties`` parses; its framework keys (``engine``, ``job_queue_size``,
  ``batch_size``...) are djl-serving's and well typed;
- djl-serving's engine is ``Python``: ``engine`` in ``serving.properties``, else
  ``OPTION_ENGINE`` (what djl-serving uses then); a stream engine's name there, or in
  ``option.engine`` (djl-stream's old name for the choice), fails with a pointer to
  ``option.stream_engine``;
- every ``option.*`` key (and ``OPTION_*`` variable) is one djl-stream knows, with a value
  of the right type and range — a typo names the closest valid key;
- ``option.rolling_batch=disable``: djl-serving's LMI images otherwise switch on their own
  continuous batching, and ``handle()`` would receive LMI's batched requests;
- the entry point exists and imports cheaply in a fresh interpreter (djl imports it three
  times while the worker starts): judged by what the import does, never by how long it
  took on this machine. It must not pull in torch or transformers, read weight files,
  touch the network, start processes or leave threads running: that work belongs in the
  init call. It defines ``handle``;
- ``option.entryPoint`` is set: without it the LMI 0.33 image starts its worker in async
  mode (``SERVING_FEATURES=vllm``) instead of the synchronous one djl-stream is tested in;
- ``option.output_formatter`` and ``option.stream_engine`` resolve;
- there are weights: a Hugging Face folder in the directory (config, weights, tokenizer),
  or an ``option.model_id`` that is an existing path, a well-formed S3 URI or a hub id;
- the image's transformers reads that folder as it was written (see
  :mod:`djl_stream.shipping.model_files`): ``rope_theta`` beside ``rope_parameters``, a
  ``tokenizer_class`` that release has, a chat template it can find;
- on Neuron (``option.stream_engine=transformers-neuronx``, or ``--image neuron``):
  ``option.n_positions``, ``option.max_rolling_batch_size`` and
  ``option.tensor_parallel_degree`` are set, rather than left to the image's smart
  defaults (see :mod:`djl_stream.shipping.smart_defaults`): they are the compiled shapes.

The image checks run against every image in :data:`djl_stream.shipping.images.IMAGES`, or the ones
named (``images=["lmi"]``, ``djl-stream check --image lmi``).

Example::

    $ djl-stream check model/
    djl-stream check model/
      ✓ serving.properties  12 keys
      ✓ engine              engine=Python: djl-serving's Python engine runs the entry point
      ...
    OK: ready to ship (1 warning)

    >>> report = check_model_dir("model/", environ={})   # doctest: +SKIP
    >>> report.ok, [f.subject for f in report.failures]  # doctest: +SKIP
    (True, [])
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from djl_stream.shipping.images import IMAGES, ContainerImage
from djl_stream.shipping.model_files import model_file_problems
from djl_stream.shipping.sagemaker import WEIGHT_SUFFIXES
from djl_stream.serving.properties import (
    DJL_KEYS,
    DJL_PYTHON_ENGINES,
    DEFAULT_ENTRY_POINT,
    ModelProperties,
    PropertyError,
    configured_entry_point,
    djl_init_properties,
    read_serving_properties,
    shadowed_variables,
)
from djl_stream.shipping.smart_defaults import INF2_XLARGE_CORES, NEURON_SMART_DEFAULTS, neuron_smart_defaults

OK, WARN, FAIL = "OK", "WARN", "FAIL"
SYMBOLS = {OK: "✓", WARN: "!", FAIL: "✗"}

#: How long the probe waits for the import at all: a hang, not a slow machine.
PROBE_TIMEOUT_SECONDS = 120.0

#: Modules whose import at module level means the model is being set up at import time.
HEAVY_MODULES = ("torch", "transformers", "accelerate", "vllm", "tensorflow", "jax",
                 "torch_neuronx", "transformers_neuronx", "tensorrt_llm")

#: djl-serving's model-level keys (no ``option.`` prefix) and how their values parse.
FRAMEWORK_KEYS: Mapping[str, str] = {
    "engine": "str", "job_queue_size": "int", "batch_size": "int", "max_batch_delay": "int",
    "max_idle_time": "int", "minWorkers": "int", "maxWorkers": "int",
    "gpu.minWorkers": "int", "gpu.maxWorkers": "int", "cpu.minWorkers": "int",
    "cpu.maxWorkers": "int", "neuron.minWorkers": "int", "neuron.maxWorkers": "int",
    "load_on_devices": "str", "translatorFactory": "str", "log_request_metric": "bool",
    "metrics_aggregation": "int", "required_memory_mb": "int",
    "gpu.required_memory_mb": "int", "reserved_memory_mb": "int",
    "gpu.reserved_memory_mb": "int", "retry_threshold": "int",
}
#: ``option.*`` keys that only djl-serving's front end reads; djl-stream passes them by.
SERVER_OPTION_KEYS = frozenset({"pythonExecutable", "enable_venv", "max_output_size",
                                "mpi_mode", "async_mode", "model_name", "s3url"}) | DJL_KEYS

#: The stream engine whose shapes are compiled in (see _check_neuron_shapes).
NEURON_ENGINE = "transformers-neuronx"

WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")
_HUB_ID = re.compile(r"^(?:[A-Za-z0-9][\w.\-]*/)?[A-Za-z0-9][\w.\-]*$")


@dataclasses.dataclass(frozen=True)
class Finding:
    """The outcome of one check: ``status`` (OK, WARN or FAIL), what was checked, why."""

    status: str
    subject: str
    message: str

    def render(self, width: int = 20, symbols: bool = True) -> str:
        mark = SYMBOLS[self.status] if symbols else f"{self.status:<4}"
        return f"  {mark} {self.subject:<{width}} {self.message}"


@dataclasses.dataclass
class CheckReport:
    """Every :class:`Finding` for one model directory; ``ok`` when none failed.

    >>> report = CheckReport("model/", [Finding(OK, "engine", "engine=Python"),
    ...                                 Finding(WARN, "option.rolling_batch", "unset")])
    >>> report.ok, len(report.warnings)
    (True, 1)
    >>> print(report.render(symbols=False).splitlines()[-1])
    OK: ready to ship (1 warning)
    """

    model_dir: str
    findings: list[Finding] = dataclasses.field(default_factory=list)

    def add(self, status: str, subject: str, message: str) -> None:
        self.findings.append(Finding(status, subject, message))

    @property
    def failures(self) -> list[Finding]:
        return [f for f in self.findings if f.status == FAIL]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.status == WARN]

    @property
    def ok(self) -> bool:
        return not self.failures

    def render(self, symbols: bool = True) -> str:
        width = max((len(f.subject) for f in self.findings), default=10)
        lines = [f"djl-stream check {self.model_dir}"]
        lines += [f.render(width, symbols) for f in self.findings]
        warned = len(self.warnings)
        suffix = f" ({warned} warning{'s' if warned != 1 else ''})" if warned else ""
        if self.ok:
            lines.append(f"OK: ready to ship{suffix}")
        else:
            failed = len(self.failures)
            lines.append(f"FAIL: {failed} check{'s' if failed != 1 else ''} failed{suffix}")
        return "\n".join(lines)


def check_model_dir(
    model_dir: str | os.PathLike[str],
    *,
    environ: Optional[Mapping[str, str]] = None,
    python: str = sys.executable,
    images: Optional[Sequence[str]] = None,
    base_image: Optional[str] = None,
) -> CheckReport:
    """Run every check on ``model_dir`` and return the report (never raises for the
    directory's problems).

    ``environ`` supplies ``OPTION_*`` variables as djl-serving would see them (default: this
    process's environment); ``python`` is the interpreter the entry point is imported
    with, in a subprocess so that its imports and timing are those of a fresh worker;
    ``images`` names the djl-serving images to check against (keys of
    :data:`~djl_stream.shipping.images.IMAGES`; default: all of them). Their pins are
    those of the release each names (``tag``); ``base_image`` is the image a build really
    uses (a Dockerfile's ``BASE_IMAGE``): where it is another release, the library
    versions are read from ``python``, the image's own interpreter at build time.
    """
    unknown = sorted(set(images or ()) - set(IMAGES))
    if unknown:
        raise ValueError(f"unknown image(s) {', '.join(unknown)}; known: {', '.join(IMAGES)}")
    targets = [IMAGES[name] for name in (images or IMAGES)]
    report = CheckReport(str(model_dir))
    targets = [_as_built(image, base_image, python, report) for image in targets]
    root = Path(model_dir)
    if not root.is_dir():
        report.add(FAIL, "model directory", f"{model_dir} is not a directory")
        return report
    environ = os.environ if environ is None else environ

    raw = _check_serving_properties(root, report)
    _check_framework_keys(raw, report)
    _check_engine(raw, environ, report)
    options = djl_init_properties(root, environ)
    for shadowed in shadowed_variables(root, environ):
        report.add(WARN, shadowed.variable, str(shadowed))
    props = _check_options(options, environ, raw, report)
    _check_rolling_batch(options, report)
    _check_entry_point(root, options, environ, props, report, python)
    _check_worker_mode(options, environ, targets, report)
    _check_weights(root, options, report)
    weights = _local_weights(root, options)
    _check_model_files(weights, targets, report)
    if options.get("stream_engine") == NEURON_ENGINE or "neuron" in (images or ()):
        _check_neuron_shapes(weights, options, report)
    return report


def _as_built(image: ContainerImage, base_image: Optional[str], python: str,
              report: CheckReport) -> ContainerImage:
    """``image`` as the checks will take it, with a line saying whose pins they are."""
    if base_image is None or base_image.strip() == image.tag:
        report.add(OK, f"{image.name} image", f"checked against the pins of {image.tag} "
                                              f"(djl-serving {image.djl_serving}, transformers "
                                              f"{image.transformers})")
        return image
    installed = _installed_version(python, "transformers")
    if installed is None:
        report.add(WARN, f"{image.name} image",
                   f"{base_image} is not the release djl-stream's pins describe ({image.tag}), "
                   f"and {python} has no transformers to read: checked against "
                   f"{image.tag}'s pins, which may not be this image's")
        return image
    report.add(OK, f"{image.name} image",
               f"{base_image} is not the release djl-stream's pins describe ({image.tag}): "
               f"checked against its own transformers {installed}, read from {python}")
    return dataclasses.replace(image, tag=base_image.strip(),
                               pins={**image.pins, "transformers": installed})


def _installed_version(python: str, distribution: str) -> Optional[str]:
    """``distribution``'s version installed for ``python``, or ``None``."""
    code = ("import importlib.metadata as m, sys\n"
            "try: print(m.version(sys.argv[1]))\n"
            "except m.PackageNotFoundError: pass")
    try:
        done = subprocess.run([python, "-c", code, distribution], capture_output=True,
                              text=True, timeout=PROBE_TIMEOUT_SECONDS)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None


# -- serving.properties --

def _check_serving_properties(root: Path, report: CheckReport) -> dict[str, str]:
    path = root / "serving.properties"
    if not path.is_file():
        report.add(WARN, "serving.properties",
                   "missing: djl-serving falls back to its defaults and guesses the engine")
        return {}
    try:
        raw = read_serving_properties(root)
    except UnicodeDecodeError as error:
        report.add(FAIL, "serving.properties", f"not UTF-8 text ({error.reason})")
        return {}
    broken = [key for key in raw if re.search(r"\s", key)]
    for key in broken:
        report.add(FAIL, "serving.properties",
                   f"line {key!r} has no '=': write key=value")
    if not broken:
        report.add(OK, "serving.properties", f"{len(raw)} keys")
    return {key: value for key, value in raw.items() if key not in broken}


def _parses(kind: str, value: str) -> bool:
    if kind == "int":
        return re.fullmatch(r"-?\d+", value.strip()) is not None
    if kind == "bool":
        return value.strip().lower() in ("true", "false")
    return True


def _check_framework_keys(raw: Mapping[str, str], report: CheckReport) -> None:
    bad = 0
    for key, value in raw.items():
        if key.startswith("option."):
            continue
        kind = FRAMEWORK_KEYS.get(key)
        if kind is None:
            bad += 1
            if key in ModelProperties.known_keys():
                hint = f"; it is a djl-stream option: write option.{key}"
            else:
                close = difflib.get_close_matches(
                    key, list(FRAMEWORK_KEYS) + [f"option.{k}" for k in ModelProperties.known_keys()],
                    n=1)
                hint = f"; did you mean {close[0]}?" if close else ""
            report.add(FAIL, key, f"unknown djl-serving property{hint}")
        elif key != "job_queue_size" and not _parses(kind, value):
            # (job_queue_size is typed and range-checked with the options, which read it)
            bad += 1
            report.add(FAIL, key, f"expected {'an integer' if kind == 'int' else 'true or false'}"
                                  f", got {value!r}")
    batch_size = raw.get("batch_size", "1").strip()
    if batch_size.isdigit() and int(batch_size) > 1:
        bad += 1
        report.add(FAIL, "batch_size",
                   f"batch_size={batch_size} turns on djl-serving's dynamic batching, which "
                   "refuses streaming; djl-stream batches by itself "
                   "(option.max_rolling_batch_size)")
    others = [key for key in raw if not key.startswith("option.") and key != "engine"]
    if others and not bad:
        report.add(OK, "framework keys", ", ".join(f"{k}={raw[k]}" for k in others))


# -- djl-serving's engine --

def stream_engine_named(value: str) -> Optional[str]:
    """The built-in or registered stream engine ``value`` names, whatever its case.

    >>> stream_engine_named("Transformers-NeuronX"), stream_engine_named("Python")
    ('transformers-neuronx', None)
    """
    from djl_stream.generation.streaming_utils import StreamingUtils

    wanted = value.strip().lower()
    return next((name for name in StreamingUtils.engines() if name.lower() == wanted), None)


def _judge_engine(subject: str, value: str, report: CheckReport) -> None:
    value = value.strip()
    in_env = subject == "OPTION_ENGINE"
    engine_key = "OPTION_ENGINE" if in_env else "engine"
    stream_key = "OPTION_STREAM_ENGINE" if in_env else "option.stream_engine"
    if value == "Python":
        report.add(OK, subject, f"{subject}=Python: djl-serving's Python engine runs the "
                                "entry point")
        return
    stream = stream_engine_named(value)
    if stream:
        report.add(FAIL, subject, f"{subject}={value} is djl-serving's engine key, not "
                                  f"djl-stream's stream engine: set {engine_key}=Python and "
                                  f"{stream_key}={stream}")
    else:
        report.add(FAIL, subject, f"{subject}={value}: djl-stream's handler runs on "
                                  f"djl-serving's Python engine; set {engine_key}=Python")


def _check_engine(raw: Mapping[str, str], environ: Mapping[str, str],
                  report: CheckReport) -> None:
    """djl-serving's own ``engine``: serving.properties' key, else ``OPTION_ENGINE`` (as in
    ``ModelInfo.loadServingProperties``); and the old ``option.engine``."""
    engine = raw.get("engine")
    from_env = (environ.get("OPTION_ENGINE") or "").strip()
    if engine is not None:
        _judge_engine("engine", engine, report)
        stream = stream_engine_named(from_env) if from_env else None
        if stream:
            report.add(FAIL, "OPTION_ENGINE",
                       f"OPTION_ENGINE={from_env} is djl-serving's engine key (and ignored, "
                       f"serving.properties sets engine), not djl-stream's stream engine: "
                       f"set OPTION_STREAM_ENGINE={stream} instead")
    elif from_env:
        _judge_engine("OPTION_ENGINE", from_env, report)
    else:
        report.add(WARN, "engine", "not set: djl-serving guesses it from the directory, and "
                                   "LMI images may pick another engine for a Hugging Face "
                                   "model; set engine=Python")
    old = raw.get("option.engine")
    if old is None:
        return
    if old.strip() in DJL_PYTHON_ENGINES:
        report.add(FAIL, "option.engine", f"option.engine={old}: djl-serving's engine key has "
                                          f"no option. prefix; write engine={old.strip()}")
    else:
        stream = stream_engine_named(old) or old.strip()
        report.add(FAIL, "option.engine",
                   f"option.engine={old} is djl-stream's old name for the stream engine; "
                   "djl-serving passes every key to the handler, so the choice is now "
                   f"option.stream_engine: write option.stream_engine={stream}")


# -- option.* --

def _check_options(options: Mapping[str, str], environ: Mapping[str, str],
                   raw: Mapping[str, str], report: CheckReport) -> Optional[ModelProperties]:
    """Parse the options strictly; one finding per bad key, by dropping each bad key and
    parsing again (a strict parse stops at the first)."""
    subject = {key: "option." + key for key in options}
    subject["job_queue_size"] = "job_queue_size"  # a framework key djl-stream also reads
    env_keys = {name[len("OPTION_"):].lower() for name in environ if name.startswith("OPTION_")}
    from_env = [key for key in options if key in env_keys and f"option.{key}" not in raw]
    for key in from_env:
        subject[key] = f"OPTION_{key.upper()}"
    server_only = SERVER_OPTION_KEYS - set(ModelProperties.known_keys())
    remaining = {key: value for key, value in options.items() if key not in server_only}
    errors = 0
    props: Optional[ModelProperties] = None
    for _ in range(len(remaining) + 1):
        try:
            props = ModelProperties.from_init_properties(remaining, strict=True)
            break
        except PropertyError as error:
            key = error.key.removeprefix("option.")
            errors += 1
            where = subject.get(key, error.key)
            message = str(error).removeprefix(f"{error.key}: ")
            report.add(FAIL, where, message)
            if key not in remaining:  # cannot happen with today's properties; never loop
                break
            remaining.pop(key)
    if errors == 0:
        n = len([k for k in options if k not in ("model_dir",)])
        env_note = f", {len(from_env)} from OPTION_* variables" if from_env else ""
        report.add(OK, "options", f"{n} known and well typed{env_note}")
    return props if errors == 0 else None


def _check_rolling_batch(options: Mapping[str, str], report: CheckReport) -> None:
    value = options.get("rolling_batch", "").strip().lower()
    if value == "disable":
        report.add(OK, "option.rolling_batch", "disable: requests reach handle() one by one "
                                               "and djl-stream batches them itself")
        return
    state = f"{value}:" if value else "unset:"
    report.add(WARN, "option.rolling_batch",
               f"{state} djl-serving's LMI images then turn on their own rolling batch and "
               "send handle() LMI's batched requests; set option.rolling_batch=disable "
               "(the docker/ images set OPTION_ROLLING_BATCH=disable)")


# -- entry point --

PROBE = r'''
import importlib, importlib.util, json, os, sys, threading, time
model_dir, entry, formatter, heavy, weight_suffixes = json.loads(sys.argv[1])
sys.path.insert(0, model_dir)
before = set(sys.modules)
threads_before = set(threading.enumerate())
result = {"error": None, "seconds": None, "heavy": [], "handle": None, "formatter": None,
          "engines": None, "weights": [], "network": [], "processes": [], "threads": []}
module = None
# What the import does, from the interpreter's audit events (PEP 578), while it runs.
watching = True
def audit(event, args):
    if not watching:
        return
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(args[0])
        if path.endswith(tuple(weight_suffixes)) and path not in result["weights"]:
            result["weights"].append(path)
    elif event in ("socket.connect", "socket.getaddrinfo"):
        result["network"].append(repr(args[1] if event == "socket.connect" else args[0]))
    elif event in ("subprocess.Popen", "os.system", "os.exec", "os.posix_spawn"):
        result["processes"].append(repr(args[1] if event == "subprocess.Popen" else args[0]))
sys.addaudithook(audit)
start = time.perf_counter()
try:
    path = os.path.join(model_dir, entry)
    if os.path.isfile(path):
        name = os.path.splitext(os.path.basename(path))[0]
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(entry[:-3] if entry.endswith(".py") else entry)
except BaseException as error:
    result["error"] = f"{type(error).__name__}: {error}"
    module = None
watching = False
result["seconds"] = time.perf_counter() - start
result["heavy"] = sorted(m for m in heavy if m in sys.modules and m not in before)
result["threads"] = sorted(t.name for t in threading.enumerate()
                           if t not in threads_before and t.is_alive())
if module is not None:
    result["handle"] = callable(getattr(module, "handle", None))
    try:
        from djl_stream.protocols.djl.formatters import resolve_formatter
        fmt = resolve_formatter(formatter, module)
        result["formatter"] = {"ok": True, "name": fmt.name, "content_type": fmt.content_type}
    except Exception as error:
        result["formatter"] = {"ok": False, "message": str(error)}
    try:
        from djl_stream.generation.streaming_utils import StreamingUtils
        result["engines"] = StreamingUtils.engines()
    except Exception as error:
        result["engines"] = None
print("\n@@djl-stream-probe@@" + json.dumps(result))
'''


def probe_entry_point(model_dir: Path, entry: str, formatter: Optional[str],
                      python: str = sys.executable,
                      timeout: float = PROBE_TIMEOUT_SECONDS) -> dict[str, Any]:
    """Import ``entry`` in a fresh interpreter started in ``model_dir`` (as djl's worker
    is) and report: ``error``, ``seconds`` (import time, for information), what the import
    did (``heavy`` modules it pulled in, ``weights`` files it opened, ``network``
    addresses it looked up or connected to, ``processes`` it started, ``threads`` it left
    running), ``handle`` (defined?), ``formatter`` (resolved?), ``engines`` (registered
    stream engines after the import, custom ones included).

    The interpreter's path is the worker's: ``model_dir`` and what ``python`` has
    installed, nothing of this checker's added (a ``djl_stream`` the model directory
    neither carries nor finds installed fails here as it would in the image).
    ``PYTHONDONTWRITEBYTECODE`` keeps ``__pycache__`` out of a directory about to ship.
    """
    env = dict(os.environ)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    # an import that opens a weight file is loading the model
    args = json.dumps([str(model_dir.resolve()), entry, formatter, list(HEAVY_MODULES),
                       list(WEIGHT_SUFFIXES)])
    try:
        done = subprocess.run([python, "-c", PROBE, args], cwd=model_dir, env=env,
                              capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"the import did not finish within {timeout:.0f} s"}
    marker = "@@djl-stream-probe@@"
    for line in reversed(done.stdout.splitlines()):
        if line.startswith(marker):
            return json.loads(line[len(marker):])
    tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
    return {"error": f"the import crashed the interpreter (exit {done.returncode}): {tail[0]}"}


def _check_entry_point(root: Path, options: Mapping[str, str], environ: Mapping[str, str],
                       props: Optional[ModelProperties], report: CheckReport,
                       python: str) -> None:
    entry = configured_entry_point(options, environ) or DEFAULT_ENTRY_POINT
    if entry.endswith(".py") and not (root / entry).is_file():
        report.add(FAIL, "entry point", f"{entry} is missing from {root}")
        return
    formatter = props.output_formatter if props else options.get("output_formatter")
    probe = probe_entry_point(root, entry, formatter, python)
    if probe.get("error"):
        report.add(FAIL, "entry point", f"importing {entry} failed: {probe['error']}")
        return
    seconds = float(probe.get("seconds") or 0.0)
    work = import_work(probe)
    if work:
        report.add(FAIL, "entry point",
                   f"importing {entry} {'; '.join(work)}: djl imports it three times at "
                   "start-up; do that work in the init call (the first handle()) instead")
    else:
        report.add(OK, "entry point", f"{entry} imports in {seconds:.2f} s, without torch "
                                      "or transformers, weights, network or threads")
    if probe.get("handle"):
        report.add(OK, "handle", f"{entry} defines handle()")
    else:
        report.add(FAIL, "handle", f"{entry} defines no handle() function: djl-serving calls "
                                   "handle(inputs)")
    fmt = probe.get("formatter") or {}
    if fmt.get("ok"):
        report.add(OK, "output formatter", f"{fmt['name']} ({fmt['content_type']})")
    elif fmt:
        report.add(FAIL, "output formatter", str(fmt.get("message")))
    engines = probe.get("engines")
    engine = props.stream_engine if props else None
    if engine and engines is not None and engine not in engines:
        close = difflib.get_close_matches(engine, engines, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        report.add(FAIL, "option.stream_engine", f"no stream engine {engine!r} is registered "
                                                 f"(registered: {', '.join(engines)}){hint}")
    elif engine:
        report.add(OK, "option.stream_engine", f"{engine} is registered")
    elif engines:
        report.add(OK, "option.stream_engine", f"unset: picked from the hardware at load "
                                               f"(registered: {', '.join(engines)})")


def import_work(probe: Mapping[str, Any]) -> list[str]:
    """What a probed import did that belongs in the init call, in words (empty: nothing).

    >>> import_work({"heavy": ["torch"], "weights": ["/m/model.safetensors"], "threads": []})
    ['imports torch', 'opens weight files (/m/model.safetensors)']
    """
    said = []
    if probe.get("heavy"):
        said.append(f"imports {', '.join(probe['heavy'])}")
    if probe.get("weights"):
        said.append(f"opens weight files ({', '.join(probe['weights'][:3])})")
    if probe.get("network"):
        said.append(f"touches the network ({', '.join(probe['network'][:3])})")
    if probe.get("processes"):
        said.append(f"starts processes ({', '.join(probe['processes'][:3])})")
    if probe.get("threads"):
        said.append(f"leaves threads running ({', '.join(probe['threads'][:3])})")
    return said


# -- the worker djl-serving starts --

def _check_worker_mode(options: Mapping[str, str], environ: Mapping[str, str],
                       targets: Sequence[ContainerImage], report: CheckReport) -> None:
    """djl-serving 0.33 (PyModel) starts the async worker when no entry point is configured
    (``option.entryPoint``, ``OPTION_ENTRYPOINT`` or ``DJL_ENTRY_POINT``) and the image's
    ``SERVING_FEATURES`` is ``vllm``."""
    entry = configured_entry_point(options, environ)
    ignored = options.get("entrypoint")
    if ignored is not None and not entry:
        report.add(WARN, "option.entrypoint",
                   f"{ignored}: djl-serving reads option.entryPoint only (PyModel matches the "
                   "key's case), so it ignores this one and takes model.py; write "
                   f"option.entryPoint={ignored.strip() or DEFAULT_ENTRY_POINT}")
    if entry:
        report.add(OK, "option.entryPoint", f"{entry}: djl-serving starts the synchronous "
                                            "worker, which calls handle()")
        return
    for image in targets:
        if image.async_without_entry_point:
            report.add(WARN, "option.entryPoint",
                       f"unset: the {image.name} image (djl-serving {image.djl_serving}, "
                       f"SERVING_FEATURES={image.serving_features}) then starts the Python "
                       "worker in async mode and awaits handle(); djl-stream supports that, "
                       "but the synchronous worker is the tested default: add "
                       f"option.entryPoint={DEFAULT_ENTRY_POINT} to serving.properties (or "
                       f"set OPTION_ENTRYPOINT={DEFAULT_ENTRY_POINT})")


# -- weights --

def missing_model_files(directory: Path) -> list[str]:
    """What a Hugging Face model folder lacks: config, weights, tokenizer (empty if none).

    >>> missing_model_files(Path("/nonexistent"))
    ['config.json', 'weights (*.safetensors or *.bin)', 'tokenizer (tokenizer.json, tokenizer.model, vocab.json or spiece.model)']
    """
    missing = []
    if not (directory / "config.json").is_file():
        missing.append("config.json")
    if not any(any(directory.glob(pattern)) for pattern in WEIGHT_PATTERNS):
        missing.append("weights (*.safetensors or *.bin)")
    if not any((directory / name).is_file() for name in TOKENIZER_FILES):
        missing.append(f"tokenizer ({', '.join(TOKENIZER_FILES[:-1])} or {TOKENIZER_FILES[-1]})")
    return missing


def _weight_files(directory: Path) -> list[str]:
    return sorted(p.name for pattern in WEIGHT_PATTERNS for p in directory.glob(pattern))


def _is_s3_uri(uri: str) -> bool:
    from djl_stream.shipping.sagemaker import parse_s3_uri

    try:
        parse_s3_uri(uri)
    except ValueError:
        return False
    return True


def _check_weights(root: Path, options: Mapping[str, str], report: CheckReport) -> None:
    model_id = (options.get("model_id") or "").strip()
    if not model_id:
        missing = missing_model_files(root)
        if missing:
            report.add(FAIL, "weights", f"no option.model_id and {root} lacks "
                                        f"{', '.join(missing)}: set option.model_id (hub id, "
                                        "s3:// URI or path) or put the model in the directory")
        else:
            report.add(OK, "weights", f"in {root}: {', '.join(_weight_files(root))}")
        return
    local = Path(model_id).expanduser()
    if not local.is_absolute():
        local = root / model_id
    if model_id.startswith("s3://"):
        if _is_s3_uri(model_id):
            report.add(OK, "weights", f"option.model_id={model_id}: djl-serving downloads it at "
                                      "load (djl-stream serve cannot read S3 itself)")
        else:
            report.add(FAIL, "weights", f"option.model_id={model_id} is not a well-formed S3 "
                                        "URI (s3://bucket/prefix)")
            return
    elif "://" in model_id:
        report.add(FAIL, "weights", f"option.model_id={model_id}: only hub ids, s3:// URIs "
                                    "and local paths are supported")
        return
    elif local.exists():
        missing = missing_model_files(local)
        if missing:
            report.add(FAIL, "weights", f"option.model_id={model_id} lacks {', '.join(missing)}")
            return
        report.add(OK, "weights", f"option.model_id={model_id}: {', '.join(_weight_files(local))}")
        if local.resolve().is_relative_to(root.resolve()):
            return
    elif model_id.startswith(("/", "./", "../", "~")):
        report.add(FAIL, "weights", f"option.model_id={model_id} does not exist")
        return
    elif _HUB_ID.match(model_id) and len(model_id) <= 96 and "--" not in model_id \
            and ".." not in model_id:
        report.add(OK, "weights", f"option.model_id={model_id}: a hub id, fetched at load "
                                  "(needs network access or a populated HF cache)")
    else:
        report.add(FAIL, "weights", f"option.model_id={model_id} is neither an existing path, "
                                    "an s3:// URI nor a valid hub id (owner/name)")
        return
    unused = _weight_files(root)
    if unused:
        report.add(WARN, "unused weights", f"{', '.join(unused)} in {root} are not used "
                                           "(option.model_id points elsewhere); djl-stream "
                                           "package leaves them out")


def _local_weights(root: Path, options: Mapping[str, str]) -> Optional[Path]:
    """The local Hugging Face folder the model loads from, if it is local."""
    model_id = (options.get("model_id") or "").strip()
    if not model_id:
        return root
    local = Path(model_id).expanduser()
    local = local if local.is_absolute() else root / model_id
    return local if local.is_dir() else None


# -- what the image's transformers reads --

def _check_model_files(weights: Optional[Path], targets: Sequence[ContainerImage],
                       report: CheckReport) -> None:
    if weights is None or not (weights / "config.json").is_file():
        return  # nothing local to read (a hub id or S3 URI), or already reported missing
    problems = 0
    for image in targets:
        for problem in model_file_problems(weights, image.transformers):
            problems += 1
            report.add(FAIL, problem.file, f"on the {image.name} image: {problem.message}; "
                                           f"{problem.fix}")
    if not problems:
        versions = ", ".join(f"{image.transformers} ({image.name})" for image in targets)
        report.add(OK, "model files", f"config and tokenizer read as written by "
                                      f"transformers {versions}")


# -- Neuron's compiled shapes --


def _read_config(weights: Optional[Path]) -> dict[str, Any]:
    try:
        data = json.loads((weights / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, TypeError):
        return {}
    return data if isinstance(data, dict) else {}


def _check_neuron_shapes(weights: Optional[Path], options: Mapping[str, str],
                         report: CheckReport) -> None:
    """The options djl-serving's Neuron image fills in by itself (``NeuronSmartDefaultUtils``)
    unless set in serving.properties or as ``OPTION_*``; for the transformers-neuronx
    engine they are the shapes the model is compiled for."""
    image = IMAGES["neuron"]
    unset = [key for key in NEURON_SMART_DEFAULTS if key not in options]
    if not unset:
        shapes = ", ".join(f"{key}={options[key]}" for key in NEURON_SMART_DEFAULTS)
        report.add(OK, "Neuron shapes", f"{shapes}: compiled as set, not left to the "
                                        "image's smart defaults")
        return
    config = _read_config(weights)
    picks = neuron_smart_defaults(config, options, INF2_XLARGE_CORES) if config else {}
    on = f"djl-serving {image.djl_serving}'s Neuron image"
    xlarge = f"on an inf2.xlarge's {INF2_XLARGE_CORES} NeuronCores"
    why = {
        "n_positions": (
            f"{on} sets it to min(max_position_embeddings, 4096)"
            + (f" = {picks['n_positions']} for this model" if "n_positions" in picks else "")
            + ". It is compiled in: a prompt plus max_new_tokens beyond it is refused, and "
              "every position costs compile time and device memory (djl-stream's own "
              "default, 2048, is not what the image uses)"),
        "tensor_parallel_degree": (
            f"{on} picks it from the host's NeuronCores and its estimate of the model's size"
            + (f" ({picks['tensor_parallel_degree']} {xlarge})"
               if "tensor_parallel_degree" in picks else "")
            + ". The graphs are compiled for it, and djl-serving starts one worker per group "
              "of that many cores, each compiling and holding its own copy"),
        "max_rolling_batch_size": (
            f"{on} picks up to 32 from its memory estimate"
            + (f" ({picks['max_rolling_batch_size']} {xlarge})"
               if "max_rolling_batch_size" in picks else "")
            + ". It is the transformers-neuronx engine's compiled batch size: every request "
              "is padded to it, so one prompt costs that many rows at every step"),
    }
    for key in unset:
        report.add(WARN, f"option.{key}", f"unset: {why[key]}; set option.{key} (or "
                                          f"OPTION_{key.upper()})")


def format_report(report: CheckReport, stream: Any = None) -> str:
    """``report.render()`` with ✓/✗ when ``stream`` can encode them, OK/FAIL otherwise."""
    encoding = getattr(stream or sys.stdout, "encoding", None) or "ascii"
    try:
        "✓✗".encode(encoding)
        symbols = True
    except (UnicodeEncodeError, LookupError):
        symbols = False
    return report.render(symbols=symbols)


"""Model properties: what ``serving.properties`` and ``OPTION_*`` variables configure.

djl-serving hands the init call of ``handle()`` every key of ``serving.properties``: the
``option.*`` keys with the ``option.`` prefix removed, the others (``engine``,
``job_queue_size``...) as they are, plus ``model_dir``; environment variables
``OPTION_<KEY>`` become ``option.<key>`` (SageMaker configures containers that way) and
``serving.properties`` wins over them. :func:`djl_init_properties` builds that mapping for
the local server, and :meth:`ModelProperties.from_init_properties` parses it into one typed,
validated object, so nothing downstream handles strings again.

``engine`` in those properties is always djl-serving's engine name (``Python``, ``MPI``):
djl-stream's own choice of stream engine is ``option.stream_engine``.

Example::

    >>> props = ModelProperties.from_init_properties(
    ...     {"model_dir": "/opt/ml/model", "dtype": "fp16", "tensor_parallel_degree": "2"})
    >>> props.dtype, props.tensor_parallel_degree, props.default_max_new_tokens
    ('fp16', 2, 50)
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import os
import re
from pathlib import Path
from typing import Any, Mapping, Optional

from djl_stream.generation.prefill_pacing import DEFAULT_PREFILL_STALL_STEPS
from djl_stream.runtime.quantization import QUANTIZE_METHODS

logger = logging.getLogger(__name__)

DTYPES = ("fp32", "fp16", "bf16", "auto")
CHAT_PROTOCOLS = ("openai", "djl")
#: Keys djl-serving itself puts in the init call (its own settings, the non-option keys of
#: serving.properties, what LMI adds); accepted and ignored here.
DJL_KEYS = frozenset(
    {"handler", "device_id", "entryPoint", "entrypoint", "engine", "rolling_batch",
     "predict_timeout", "model_loading_timeout", "parallel_loading", "task",
     "async_mode", "mpi_mode", "enable_venv", "pythonExecutable", "max_output_size",
     "pipeline_parallel_degree", "cluster_size", "gpu.minWorkers", "gpu.maxWorkers",
     "minWorkers", "maxWorkers", "batch_size", "max_batch_delay", "max_idle_time",
     "load_on_devices", "input_formatter", "is_peft_model", "requestId"}
)
#: The values djl-serving's ``engine`` key takes for a Python handler.
DJL_PYTHON_ENGINES = ("Python", "MPI")


class PropertyError(ValueError):
    """A property is unknown or has a value of the wrong type or range.

    ``key`` names the property as the user wrote it (``option.dtype``), so the message can
    be acted on without reading code.
    """

    def __init__(self, key: str, message: str):
        super().__init__(f"{key}: {message}")
        self.key = key


def suggest_property(key: str) -> str:
    """``"; did you mean option.dtype?"`` for a near-miss such as ``dtpye``, else ``""``."""
    close = difflib.get_close_matches(key, sorted(ModelProperties.known_keys()), n=1)
    return f"; did you mean option.{close[0]}?" if close else ""


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise PropertyError(f"option.{key}", f"expected true or false, got {value!r}")


def _as_int(key: str, value: Any, minimum: int = 1) -> int:
    try:
        number = int(str(value).strip())
    except ValueError:
        raise PropertyError(f"option.{key}", f"expected an integer, got {value!r}") from None
    if number < minimum:
        raise PropertyError(f"option.{key}", f"must be at least {minimum}, got {number}")
    return number


def _as_float(key: str, value: Any, minimum: float = 0.0) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        raise PropertyError(f"option.{key}", f"expected a number, got {value!r}") from None
    if not number >= minimum or number == float("inf"):  # NaN fails the first test
        raise PropertyError(f"option.{key}", f"must be a finite number of at least {minimum:g}, "
                                             f"got {value!r}")
    return number


def _property(default: Any, meaning: str, *, shown: Optional[str] = None,
              key: Optional[str] = None, see: Optional[str] = None, listed: bool = True) -> Any:
    """A :class:`ModelProperties` field with what the properties reference
    (``docs/properties.md``, written by :mod:`djl_stream.serving.properties_reference`)
    says of it: its one line of ``meaning``, the default as the page shows it (``shown``,
    markdown, else the field's default as code), its key when it has no ``option.``
    prefix, the topic page that explains it at length (``see``), and whether a user sets
    it (``listed``)."""
    metadata = {"meaning": meaning, "shown": shown, "key": key, "see": see, "listed": listed}
    if isinstance(default, dict):
        return dataclasses.field(default_factory=dict, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


@dataclasses.dataclass(frozen=True)
class ModelProperties:
    """Typed configuration of one served model: one field per property, each with its
    meaning in its metadata (``docs/properties.md`` lists them, generated from here).

    >>> ModelProperties.from_init_properties({"dtype": "bf16"}).dtype
    'bf16'
    """

    model_dir: str = _property(
        ".", "the model directory, which djl-serving passes to the handler", listed=False)
    model_id: Optional[str] = _property(
        None, "where the weights are: a path (absolute, or relative to the model directory), "
              "an `s3://` prefix djl-serving downloads, or a hub id; unset: the model "
              "directory itself", shown="unset")
    dtype: str = _property(
        "auto", "`fp32`, `fp16`, `bf16` or `auto` (half precision on a GPU, fp32 on a CPU)",
        see="performance.md#precision-and-quantization")
    quantize: Optional[str] = _property(
        None, "load the weights quantized: `int8` (weight-only), `w8a8` (int8 weights and "
              "activations on a CPU with int8 dot products; `int8` elsewhere), "
              "`bitsandbytes8`, `bitsandbytes4` (CUDA)", shown="unset",
        see="performance.md#precision-and-quantization")
    compile: Optional[bool] = _property(
        None, "compile the decode step in the background (a CPU) or replay it from CUDA "
              "graphs (a GPU), once it gives the eager step's logits: `auto`, `true` or "
              "`false`", shown="`auto`",
        see="performance.md#the-compiled-decode-step")
    load_in_8bit: bool = _property(
        False, "deprecated (as in djl-serving): `option.quantize=bitsandbytes8`")
    load_in_4bit: bool = _property(
        False, "deprecated (as in djl-serving): `option.quantize=bitsandbytes4`")
    tensor_parallel_degree: Optional[int] = _property(
        1, "GPUs to spread the model over (`max`: all; ignored on a CPU), or the "
           "NeuronCores transformers-neuronx compiles for", see="deployment.md#on-inferentia2")
    enable_streaming: bool = _property(
        True, "stream the answer when a request does not say `\"stream\"`")
    trust_remote_code: bool = _property(
        False, "run model code from the hub; never settable from a request")
    default_max_new_tokens: int = _property(
        50, "`max_new_tokens` when a request gives none")
    max_new_tokens_limit: int = _property(
        2048, "the largest `max_new_tokens` a request may ask for")
    max_input_length: int = _property(
        4096, "the longest prompt, in tokens")
    max_request_input_length: Optional[int] = _property(
        None, "the most prompt tokens one request may bring, all its prompts together",
        shown="twice `max_input_length`")
    max_request_kv_tokens: Optional[int] = _property(
        None, "the most KV-cache positions one request may hold by its last step (its "
              "prompts plus `max_new_tokens` each); more is a 400 before any model work",
        shown="what fits in ¾ of the weights' size", see="reliability.md#request-limits")
    max_batch_prefill_tokens: Optional[int] = _property(
        None, "the most prompt tokens one prefill pass reads while others decode: longer "
              "prompts are read in chunks beside the running batch",
        shown="64 on a CPU, 2048 on an accelerator",
        see="performance.md#many-clients-at-once-continuous-batching")
    prefill_stall_steps: float = _property(
        DEFAULT_PREFILL_STALL_STEPS, "while others decode, a prefill pass takes at most this "
        "many of their decode steps (`0`: no bound)",
        see="performance.md#many-clients-at-once-continuous-batching")
    enable_prefix_caching: bool = _property(
        True, "a prompt that begins as a running or finished one did (a system prompt, a "
              "conversation's earlier turns) reuses its keys and values instead of reading "
              "those tokens again", see="performance.md#prompts-that-begin-alike")
    output_formatter: Any = _property(
        "jsonlines", "`jsonlines`, `sse`, `jsonlines_details`, or the name of a function in "
                     "`model.py`", see="protocols.md#output-formatters")
    chat_protocol: str = _property(
        "openai", "how a body with `messages` is answered: `openai` (a chat completion) or "
                  "`djl` (`output_tokens` lines)", see="protocols.md")
    apply_chat_template: Optional[bool] = _property(
        None, "send `inputs` prompts through the chat template as one user turn (`auto`: "
              "when the tokenizer has one)", shown="`auto`")
    max_rolling_batch_size: int = _property(
        32, "most prompts decoding together; on transformers-neuronx the compiled batch size")
    job_queue_size: int = _property(
        1000, "most requests waiting for room in the batch; beyond it, 503",
        key="job_queue_size")
    stream_engine: Optional[str] = _property(
        None, "the stream engine: `Accelerate`, `transformers-neuronx`, or one you "
              "registered", shown="picked from the hardware", see="development.md#a-stream-engine")
    n_positions: int = _property(
        2048, "transformers-neuronx: the longest prompt plus new tokens it compiles for",
        see="deployment.md#on-inferentia2")
    compiled_graph_path: Optional[str] = _property(
        None, "transformers-neuronx: where compiled graphs are loaded from or written to",
        shown="`$DJL_CACHE_DIR/djl-stream/neuronx-graphs/<key>`",
        see="deployment.md#on-inferentia2")
    context_length_estimate: Optional[tuple[int, ...]] = _property(
        None, "transformers-neuronx: prompt lengths to compile context graphs for "
              "(`512` or `256,1024`)", shown="unset")
    device_id: int = _property(
        -1, "the GPU djl-serving gives this worker (-1 on a CPU)", listed=False)
    extra: Mapping[str, str] = _property(
        {}, "keys djl-stream does not read (djl-serving's own, say)", listed=False)

    def __post_init__(self) -> None:
        if self.max_request_input_length is None:
            object.__setattr__(self, "max_request_input_length", 2 * self.max_input_length)
        # djl-serving's deprecated spellings, read as it reads them (quantize wins)
        for flag, method in (("load_in_4bit", "bitsandbytes4"), ("load_in_8bit", "bitsandbytes8")):
            if getattr(self, flag) and self.quantize is None:
                logger.warning("option.%s is deprecated (as in djl-serving): use "
                               "option.quantize=%s", flag, method)
                object.__setattr__(self, "quantize", method)

    @classmethod
    def known_keys(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls) if f.name != "extra"]

    @classmethod
    def from_init_properties(
        cls, properties: Mapping[str, Any], *, strict: bool = False
    ) -> "ModelProperties":
        """Parse the init call's properties (``option.`` prefix already removed).

        Known keys are typed and range-checked; a bad value raises :class:`PropertyError`.
        Unknown keys are kept in ``extra`` and logged with the closest known name, because
        djl-serving versions add keys of their own; with ``strict=True`` (what
        ``djl-stream check`` uses) an unknown key raises instead, so a typo in
        ``serving.properties`` cannot silently fall back to a default.
        """
        values: dict[str, Any] = {}
        extra: dict[str, str] = {}
        known = set(cls.known_keys())
        for key, raw in properties.items():
            if key in known:
                values[key] = raw
                continue
            extra[key] = str(raw)
            if key == "engine" and str(raw) not in DJL_PYTHON_ENGINES:
                logger.warning(
                    "engine=%s is djl-serving's engine key (Python or MPI for this handler), "
                    "not djl-stream's; choose a stream engine with option.stream_engine", raw)
            if key in DJL_KEYS or key.startswith("option."):
                # djl's own keys, and prefixed copies of options already read without it
                continue
            hint = suggest_property(key)
            if strict:
                raise PropertyError(f"option.{key}", f"unknown property{hint}")
            logger.warning("ignoring unknown property option.%s%s", key, hint)
        return cls(**_typed(values), extra=extra)

    def weights_location(self) -> str:
        """Where ``from_pretrained`` loads from: ``model_id`` (resolved against the
        model directory when it is a relative path that exists there) or the model
        directory itself."""
        if not self.model_id:
            return self.model_dir
        local = Path(self.model_dir) / self.model_id
        if not Path(self.model_id).is_absolute() and local.exists():
            return str(local)
        return self.model_id


#: Properties whose value is one of a few words (read case-insensitively).
_CHOICES = {"chat_protocol": CHAT_PROTOCOLS}


def _one_of(key: str, value: Any, choices: tuple) -> str:
    text = str(value).strip().lower()
    if text not in choices:
        raise PropertyError(f"option.{key}", f"expected one of {', '.join(choices)}, got {value!r}")
    return text


#: The properties that are plain switches: every field declared ``bool`` (so that a new
#: one is read as one, not as a string whose ``"false"`` would be true).
_SWITCHES = frozenset(f.name for f in dataclasses.fields(ModelProperties)
                      if f.type in ("bool", bool))


def _typed(values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in values.items():
        if key in _SWITCHES:
            out[key] = _as_bool(key, value)
        elif key == "quantize":
            text = str(value).strip().lower()
            if text in ("", "none", "false"):
                out[key] = None
            elif text in QUANTIZE_METHODS:
                out[key] = text
            else:
                raise PropertyError("option.quantize", f"expected one of "
                                    f"{', '.join(QUANTIZE_METHODS)}, got {value!r}")
        elif key in ("default_max_new_tokens", "max_new_tokens_limit", "max_input_length",
                     "max_rolling_batch_size", "job_queue_size", "n_positions",
                     "max_request_input_length", "max_batch_prefill_tokens",
                     "max_request_kv_tokens"):
            out[key] = _as_int(key, value)
        elif key == "prefill_stall_steps":
            out[key] = _as_float(key, value)
        elif key in ("apply_chat_template", "compile"):
            text = str(value).strip().lower()
            out[key] = None if text == "auto" else _as_bool(key, value)
        elif key == "device_id":
            out[key] = _as_int(key, value, minimum=-1)
        elif key == "tensor_parallel_degree":
            text = str(value).strip().lower()
            out[key] = None if text == "max" else _as_int(key, value)
        elif key == "dtype":
            text = str(value).strip().lower()
            aliases = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "half": "fp16"}
            text = aliases.get(text, text)
            if text not in DTYPES:
                raise PropertyError("option.dtype", f"expected one of {', '.join(DTYPES)}, got {value!r}")
            out[key] = text
        elif key in ("model_id", "stream_engine", "compiled_graph_path"):
            out[key] = str(value).strip() or None
        elif key == "context_length_estimate":
            parts = [p for p in str(value).replace(" ", "").split(",") if p]
            out[key] = tuple(_as_int(key, p) for p in parts) or None
        elif key in _CHOICES:
            out[key] = _one_of(key, value, _CHOICES[key])
        elif key == "output_formatter" and callable(value):
            # djl's worker hands over a function marked with @output_formatter itself
            out[key] = value
        else:
            out[key] = str(value)
    if out.get("default_max_new_tokens", 50) > out.get("max_new_tokens_limit", 2048):
        raise PropertyError(
            "option.default_max_new_tokens",
            f"must not exceed option.max_new_tokens_limit ({out.get('max_new_tokens_limit', 2048)})",
        )
    _at_least(out, "max_request_input_length", "max_input_length",
              "a request could not bring even one prompt of the longest length")
    _at_least(out, "max_request_kv_tokens", ("max_input_length", "max_new_tokens_limit"),
              "one prompt of the longest length with the most new tokens must fit")
    _at_least(out, "max_batch_prefill_tokens", "max_rolling_batch_size",
              "a decode step feeds that many tokens, and a prefill chunk needs one column "
              "of every prompt of a request")
    return out


def _at_least(values: dict[str, Any], key: str, floor_keys: str | tuple[str, ...],
              why: str) -> None:
    """Refuse ``key`` set below ``floor_keys`` (one key, or the sum of several; each its
    default when unset)."""
    floor_keys = (floor_keys,) if isinstance(floor_keys, str) else floor_keys
    floor = sum(values.get(name, _DEFAULTS[name]) for name in floor_keys)
    if key in values and values[key] < floor:
        named = " + ".join(f"option.{name}" for name in floor_keys)
        raise PropertyError(f"option.{key}", f"must be at least {named} ({floor}), "
                                             f"got {values[key]}: {why}")


_DEFAULTS = {f.name: f.default for f in dataclasses.fields(ModelProperties)}


def read_serving_properties(model_dir: str | Path) -> dict[str, str]:
    """The raw ``key=value`` pairs of ``MODEL_DIR/serving.properties`` (Java properties
    syntax: ``#``/``!`` comments, ``=`` or ``:`` separators, surrounding blanks trimmed).
    A missing file is an empty mapping, as in djl-serving."""
    path = Path(model_dir) / "serving.properties"
    pairs: dict[str, str] = {}
    if not path.is_file():
        return pairs
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        cut = min((i for i in (line.find("="), line.find(":")) if i >= 0), default=-1)
        if cut < 0:
            pairs[line] = ""
            continue
        pairs[line[:cut].strip()] = line[cut + 1 :].strip()
    return pairs


def djl_init_properties(
    model_dir: str | Path, environ: Optional[Mapping[str, str]] = None
) -> dict[str, str]:
    """The properties djl-serving passes to the init call of ``handle()``.

    As djl-serving's ``ModelInfo`` composes them: ``OPTION_MAX_INPUT_LENGTH=512`` in the
    environment becomes ``max_input_length`` (``OPTION_ENTRYPOINT`` becomes ``entryPoint``,
    and ``OPTION_ENGINE`` is djl's own ``engine`` key); keys of ``serving.properties`` win
    over the environment; ``option.*`` keys lose their prefix and the others (``engine``,
    ``job_queue_size``...) pass as they are. ``model_dir`` is added.

    >>> djl_init_properties("/nowhere", {"OPTION_DTYPE": "fp16", "OPTION_ENGINE": "Python"})
    {'dtype': 'fp16', 'engine': 'Python', 'model_dir': '/nowhere'}
    """
    environ = os.environ if environ is None else environ
    pairs = read_serving_properties(model_dir)
    for name, key, value in _environment_keys(environ):
        pairs.setdefault(key, value)
    # PyModel sends the options first and the model's own keys after them, so on a clash
    # (option.engine next to engine) the non-option key is the one the handler sees.
    merged = {key[len("option."):]: value for key, value in pairs.items()
              if key.startswith("option.")}
    merged.update((key, value) for key, value in pairs.items() if not key.startswith("option."))
    merged["model_dir"] = str(Path(model_dir).resolve())
    return merged


#: The file djl-serving's PyModel loads when no entry point is configured and the model
#: directory has one.
DEFAULT_ENTRY_POINT = "model.py"


def configured_entry_point(properties: Mapping[str, str],
                           environ: Mapping[str, str]) -> Optional[str]:
    """The entry point configured as djl-serving's ``PyModel`` reads it: ``entryPoint`` of
    the init properties (``option.entryPoint`` or ``OPTION_ENTRYPOINT``), else the
    variable ``DJL_ENTRY_POINT``; ``None`` when neither is set. ``option.entrypoint`` in
    lower case is not the key and does not count.

    >>> configured_entry_point({"entrypoint": "a.py"}, {"DJL_ENTRY_POINT": "b.py"})
    'b.py'
    """
    entry = (properties.get("entryPoint") or environ.get("DJL_ENTRY_POINT") or "").strip()
    return entry or None


def _environment_keys(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    """Each ``OPTION_*`` variable as ``(variable, serving.properties key, value)``, the key
    as djl-serving's ``ModelInfo`` derives it."""
    keys = []
    for name, value in environ.items():
        if not name.startswith("OPTION_") or len(name) == len("OPTION_") or not value:
            continue
        key = name[len("OPTION_"):]
        if _SNAKE_CASE.match(key):
            key = key.lower()
        if key == "entrypoint":
            key = "entryPoint"
        keys.append((name, "engine" if key == "engine" else f"option.{key}", value))
    return keys


@dataclasses.dataclass(frozen=True)
class ShadowedVariable:
    """An ``OPTION_*`` variable that ``serving.properties`` overrides with another value:
    djl-serving keeps the file's (``ModelInfo`` puts a variable's key only where the file
    has none), so the variable does nothing."""

    variable: str
    value: str
    key: str
    property_value: str

    def __str__(self) -> str:
        return (f"{self.variable}={self.value} is ignored: serving.properties sets "
                f"{self.key}={self.property_value}, and djl-serving keeps serving.properties "
                f"over the environment (remove {self.key} there to configure it with "
                f"{self.variable})")


def shadowed_variables(model_dir: str | Path,
                       environ: Optional[Mapping[str, str]] = None) -> list[ShadowedVariable]:
    """The ``OPTION_*`` variables of ``environ`` (default ``os.environ``) that
    ``model_dir``'s ``serving.properties`` overrides with a different value.

    >>> shadowed_variables("/nowhere", {"OPTION_DTYPE": "fp16"})  # no serving.properties
    []
    """
    environ = os.environ if environ is None else environ
    pairs = read_serving_properties(model_dir)
    return [ShadowedVariable(name, value, key, pairs[key])
            for name, key, value in _environment_keys(environ)
            if key in pairs and pairs[key] != value]


#: djl lower-cases an ``OPTION_`` name only when it is SNAKE_CASE (``OPTION_entryPoint``
#: keeps its case).
_SNAKE_CASE = re.compile(r"^[A-Z0-9_]+$")

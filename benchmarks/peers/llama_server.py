"""llama.cpp's own C++ server (``llama-server``), built from the llama.cpp sources that
llama-cpp-python's sdist vendors, for the peers it serves with continuous batching.

llama-cpp-python's Python server runs one request at a time, which flatters djl-stream at
many clients; ``llama-server --parallel N`` decodes up to N requests together in one
batch, as djl-stream does. It is built once with CMake into ``.peers/llama-server/``
(``GGML_NATIVE``: for this CPU's instruction sets, as a user building it here would), the
build's seconds recorded beside it. Nothing of llama.cpp is kept in the repository.

Example::

    binary = build_llama_server(Path(".peers"), log=print)
    subprocess.run([str(binary), "--version"])
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Callable, Optional

from .gguf_files import llama_cpp_sources

#: The build's folder under the peers' root.
FOLDER = "llama-server"


def server_binary(root: Path) -> Path:
    return root / FOLDER / "bin" / "llama-server"


def build_seconds(root: Path) -> Optional[float]:
    """How long building took, as recorded then."""
    record = root / FOLDER / ".seconds"
    return float(record.read_text()) if record.is_file() and server_binary(root).is_file() else None


def build_llama_server(root: Path, log: Callable[[str], None]) -> Path:
    """``llama-server``, built once from the sdist's llama.cpp (about ten minutes on two
    cores); the binary's path."""
    binary = server_binary(root)
    if binary.is_file():
        return binary
    if shutil.which("cmake") is None:
        raise RuntimeError("building llama-server needs cmake (Debian's cmake package)")
    sources = llama_cpp_sources(root, log)
    build = root / FOLDER / "build"
    log(f"building llama-server from {sources} into {build} (about ten minutes on 2 cores)")
    started = time.perf_counter()
    subprocess.run(["cmake", "-S", str(sources), "-B", str(build), "-DCMAKE_BUILD_TYPE=Release",
                    "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_BUILD_TESTS=OFF",
                    "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=ON",
                    "-DBUILD_SHARED_LIBS=OFF"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["cmake", "--build", str(build), "--target", "llama-server", "-j",
                    str(os.cpu_count() or 1)], check=True, stdout=subprocess.DEVNULL)
    built = next(build.rglob("llama-server"))
    binary.parent.mkdir(parents=True, exist_ok=True)
    shutil.copy2(built, binary)
    (root / FOLDER / ".seconds").write_text(f"{time.perf_counter() - started:.0f}\n")
    return binary

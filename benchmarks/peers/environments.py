"""Each peer's own virtual environment, under the git-ignored ``.peers/`` folder.

A peer is installed the way its users install it, apart from djl-stream's: llama.cpp
through ``llama-cpp-python[server]`` (built from its sdist here: no CPU wheel of it is on
PyPI for this Python), ``transformers serve`` through ``transformers[serving]``, and Ray
Serve through ``ray[serve]``. torch is pinned to the CPU build this machine carries
(``torch==2.13.0``, as the Makefile does), since an unpinned torch pulls gigabytes of CUDA
packages. An environment is set up once; a stamp file records what was asked and how long
it took, so that a changed pin sets it up again and the report can say what setting up
costs.

Example::

    env = ENVIRONMENTS["llama-cpp"]
    env.ensure(Path(".peers"), log=print)    # False when it was already there
    env.setup_seconds(Path(".peers"))        # how long setting it up took
    subprocess.run([str(env.python(Path(".peers"))), "-c", "import llama_cpp"])
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import transformers

#: The CPU build on this machine's disk (see the Makefile).
TORCH = "torch==2.13.0"
#: Versions of the peers measured; the BENCHMARKS.md section names them.
LLAMA_CPP_PYTHON = "0.3.36"
RAY = "2.60.0"


@dataclasses.dataclass(frozen=True)
class Environment:
    """One peer's virtual environment: ``requirements`` installed after ``torch`` (when
    ``needs_torch``), all into ``root/name``."""

    name: str
    requirements: Tuple[str, ...]
    needs_torch: bool = True
    note: str = ""

    def folder(self, root: Path) -> Path:
        return root / self.name

    def python(self, root: Path) -> Path:
        return self.folder(root) / "bin" / "python"

    @property
    def spec(self) -> str:
        return " ".join(((TORCH,) if self.needs_torch else ()) + self.requirements)

    def _stamp(self, root: Path) -> list[str]:
        stamp = self.folder(root) / ".installed"
        return stamp.read_text().splitlines() if stamp.is_file() else []

    def ready(self, root: Path) -> bool:
        return self._stamp(root)[:1] == [self.spec]

    def setup_seconds(self, root: Path) -> Optional[float]:
        """How long setting this environment up took, as recorded when it was."""
        lines = self._stamp(root)
        return float(lines[1]) if len(lines) > 1 and self.ready(root) else None

    def ensure(self, root: Path, log: Callable[[str], None]) -> bool:
        """Set the environment up unless it already is; whether it was set up now (the
        seconds it took are :meth:`setup_seconds`)."""
        if self.ready(root):
            return False
        started = time.perf_counter()
        folder = self.folder(root)
        log(f"setting up {folder} ({self.spec}){self.note}")
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(folder)], check=True)
        pip = [str(self.python(root)), "-m", "pip", "install", "-q"]
        subprocess.run(pip + ["--upgrade", "pip"], check=True)
        if self.needs_torch:
            subprocess.run(pip + [TORCH], check=True)
        subprocess.run(pip + list(self.requirements), check=True)
        (folder / ".installed").write_text(f"{self.spec}\n{time.perf_counter() - started:.0f}\n")
        return True


ENVIRONMENTS: Dict[str, Environment] = {
    "llama-cpp": Environment("llama-cpp", (f"llama-cpp-python[server]=={LLAMA_CPP_PYTHON}",),
                             needs_torch=False,
                             note=": pip compiles llama.cpp, about 5 minutes on 2 cores"),
    "transformers-serve": Environment(
        "transformers-serve", (f"transformers[serving]=={transformers.__version__}",)),
    "ray-serve": Environment(
        "ray-serve", (f"ray[serve]=={RAY}", f"transformers=={transformers.__version__}")),
    # llama.cpp's convert_hf_to_gguf.py (from the sdist) and what it imports
    "gguf-convert": Environment(
        "gguf-convert", (f"transformers=={transformers.__version__}", "sentencepiece",
                         "protobuf", "numpy", "safetensors")),
}

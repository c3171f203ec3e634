"""Every example in djl_stream's docstrings, and in the benchmarks', runs and shows what
it says.

The examples are the first thing a reader of a public name sees; this keeps them true.
Those that need a tokenizer get the real SmolLM2 one as ``tokenizer``.
"""

from __future__ import annotations

import doctest
import importlib
import io
import pkgutil

import pytest

import benchmarks
import djl_stream

#: Benchmark modules that run inside a peer's own virtual environment (``make bench-peers``),
#: importing what only that environment has (Ray, llama-cpp-python).
PEER_ONLY = {"benchmarks.peers.ray_app", "benchmarks.peers.llama_cpp_server"}
#: Modules that import Ray, the ray extra (``make ray`` installs it and runs them for real).
RAY_ONLY = {"djl_stream.serving.ray_serve"}
MODULES = sorted(info.name for package in (djl_stream, benchmarks)
                 for info in pkgutil.walk_packages(package.__path__, package.__name__ + ".")
                 if not info.name.endswith("__main__") and info.name not in PEER_ONLY | RAY_ONLY)


def test_every_module_is_looked_at():
    assert "djl_stream.generation.detokenize" in MODULES
    assert "djl_stream.protocols.openai.request" in MODULES
    assert "benchmarks.targets" in MODULES and "benchmarks.peers.run" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name, smollm2_tokenizer):
    module = importlib.import_module(name)
    globs = {**vars(module), "tokenizer": smollm2_tokenizer}
    report = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, name, globs=globs):
        runner.run(test, out=report.write)
    assert runner.failures == 0, report.getvalue()

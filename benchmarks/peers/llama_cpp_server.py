"""llama-cpp-python's server (``python -m llama_cpp.server``) with llama.cpp's weight
repacking switched off, for the Q4_1 peer.

On a CPU with AVX-512 and AMX (the Intel Xeon this project was measured on in
November 2026), llama-cpp-python 0.3.36 loaded the Q4_1 file, repacked its weights into
the layout of its fast kernels ("extra buffer types"), and crashed with a segmentation
fault at the first token of the first request; without repacking it generates. The
server's command line has no switch for it (``llama_model_params.use_extra_bufts``), so
this launcher clears it in the default model parameters and runs the server's own
``__main__`` with the arguments it was given. It runs in the ``llama-cpp`` environment::

    .peers/llama-cpp/bin/python benchmarks/peers/llama_cpp_server.py --model FILE --port 8000
"""

from __future__ import annotations

import runpy

import llama_cpp.llama_cpp as bindings

_default_params = bindings.llama_model_default_params


def _params_without_repacking():
    params = _default_params()
    params.use_extra_bufts = False
    return params


if __name__ == "__main__":
    bindings.llama_model_default_params = _params_without_repacking
    runpy.run_module("llama_cpp.server", run_name="__main__", alter_sys=True)

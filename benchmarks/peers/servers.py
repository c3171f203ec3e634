"""The servers compared, each as its users start it, and how one request is put to each.

Every server gets the same prompt text (SmolLM2's chat template already applied, so no
server renders a template of its own), greedy decoding, and a fixed number of new tokens:

* **djl-stream**: ``djl-stream serve model``, OpenAI ``/v1/completions`` with
  ``ignore_eos`` (vLLM's name for it), in float32 (with the defaults, which on a CPU run
  decode steps through the compiled program once it is ready, and with the eager forward,
  ``option.compile=false``), with ``option.quantize=int8`` (weight-only), with
  ``option.quantize=w8a8`` and with ``option.dtype=bf16``;
* **llama-server**: llama.cpp's own C++ server, built from the sources llama-cpp-python's
  sdist vendors (:mod:`.llama_server`), on the F32 and Q8_0 GGUF files, decoding up to 16
  requests together (``--parallel 16``), ``/v1/completions`` with ``min_tokens``;
* **llama.cpp**: ``python -m llama_cpp.server`` (llama-cpp-python) on a GGUF file,
  ``/v1/completions`` with ``min_tokens`` equal to ``max_tokens``; it serves one request
  at a time (its server has no parallel slots);
* **transformers serve**: ``transformers serve MODEL --continuous-batching`` with its KV
  cache capped by ``--cb-num-blocks`` (unset, it sizes the cache from the machine's memory),
  ``/v1/completions`` with a ``generation_config`` of ``min_new_tokens``;
* **Ray Serve**: the tutorial's ``TextIteratorStreamer`` deployment (:mod:`.ray_app`),
  which streams words rather than tokens.

Example::

    peer = PEERS["llama.cpp F32"]
    with peer.server(Path("model"), Path(".peers"), files, workdir) as server:
        timing = stream_once(server.url, peer.body(prompt_text, 64, "model"), read=peer.read)
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import httpx

from ..http_load import PieceReader, ServerProcess, StreamError, configure_model_dir
from ..measure import ProcessMemory
from .environments import ENVIRONMENTS
from .llama_server import server_binary

#: KV-cache blocks for transformers serve (32 tokens of every layer each): 16 clients of a
#: ~60-token prompt and 128 new tokens need ~95. Unset, it sizes the cache (and attention
#: masks that grow with it) from the machine's memory, and refused to start here: 11.6 GB
#: wanted, 5.6 GB seen free.
CB_NUM_BLOCKS = 128
#: Tokens one transformers serve step may take in (its default is 8,192; its attention
#: masks grow with it: 7.2 GB at 512 with 512 blocks).
CB_MAX_BATCH_TOKENS = 256
#: llama.cpp's context: the longest prompt plus new tokens the benchmark asks for.
LLAMA_CPP_CONTEXT = 2048
#: Requests llama-server decodes together (``--parallel``): the most clients measured.
LLAMA_SERVER_SLOTS = 16


def openai_completion_pieces(response: httpx.Response) -> Iterator[str]:
    """An OpenAI completions SSE stream: one ``choices[0].text`` per ``data:`` event."""
    for line in response.iter_lines():
        if not line.startswith("data:"):
            continue
        data = line[len("data:"):].strip()
        if data == "[DONE]":
            return
        event = json.loads(data)
        if "error" in event:
            raise StreamError(str(event["error"]))
        choices = event.get("choices") or []
        if choices and choices[0].get("text"):
            yield choices[0]["text"]


def text_chunks(response: httpx.Response) -> Iterator[str]:
    """A plain-text stream: each chunk as it arrives."""
    for chunk in response.iter_text():
        if chunk:
            yield chunk


class PeerProcess(ServerProcess):
    """A peer's server process: :class:`~benchmarks.http_load.ServerProcess` with the peer's
    own command, readiness route and request path, stopped with everything it started."""

    own_session = True

    def __init__(self, command: Callable[[int], List[str]], *, name: str, workdir: Path,
                 ready_path: str, request_path: str, env: Optional[Dict[str, str]] = None):
        super().__init__(Path("."), name=name, workdir=workdir, env=env)
        self._command = command
        self.ready_path = ready_path
        self.request_path = request_path

    def command(self) -> List[str]:
        return self._command(self.port)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.request_path}"

    def memory(self) -> Optional[ProcessMemory]:
        return ProcessMemory.of_tree(self.pid) if self.pid else None


@dataclasses.dataclass(frozen=True)
class Peer:
    """One server to compare: how to start it and how to ask it for ``n`` greedy tokens.

    ``pieces_are_tokens`` is false for a server that streams words (its inter-token
    figures are per word); ``one_at_a_time`` for a server that runs one request at a time.
    """

    name: str
    environment: Optional[str]            # a key of ENVIRONMENTS; None: djl-stream's own
    #: (model directory, files, port, device) -> the server's arguments after its Python
    command: Callable[[Path, Dict[str, Path], int, str], List[str]]
    ready_path: str
    request_path: str
    body: Callable[[str, int, str], dict]  # (prompt, new tokens, model path) -> JSON
    read: PieceReader = openai_completion_pieces
    pieces_are_tokens: bool = True
    one_at_a_time: bool = False
    weights: str = "float32, from model/"
    #: what ``weights`` reads on a GPU, where that differs (``option.dtype=auto`` is
    #: bfloat16 there, and ``auto`` replays decode steps from CUDA graphs)
    weights_on_gpu: str = ""
    model_file: Optional[str] = None      # a key of the files dict the command reads
    options: Tuple[Tuple[str, str], ...] = ()  # djl-stream's model properties (OPTION_*)
    #: a program to run instead of an interpreter (llama-server), from the peers' root
    executable: Optional[Callable[[Path], Path]] = None

    def weights_on(self, device: str) -> str:
        """The weights and decoding of this peer's rows on ``device`` (``cpu`` or ``cuda``)."""
        return self.weights_on_gpu if device == "cuda" and self.weights_on_gpu else self.weights

    def python(self, root: Path, installed: bool = False) -> str:
        """The interpreter that runs this peer: its environment's under ``root``, or this
        one where djl-stream is the peer or ``installed`` says the peers are installed
        beside it (a machine that cannot reach PyPI, such as a lent GPU machine)."""
        if self.environment is None or installed:
            import sys
            return sys.executable
        return str(ENVIRONMENTS[self.environment].python(root))

    def server(self, model_dir: Path, root: Path, files: Dict[str, Path],
               workdir: Path, device: str = "cpu", installed: bool = False) -> PeerProcess:
        python = str(self.executable(root)) if self.executable else self.python(root, installed)
        name = self.name.replace(" ", "-").replace("(", "").replace(")", "")
        # options go in the environment, as SageMaker passes them; one that the model
        # directory's serving.properties sets (which wins) goes in a copy of that file
        model_dir, options = configure_model_dir(model_dir, dict(self.options),
                                                 workdir / f"{name}-model")
        env = {"OMP_NUM_THREADS": str(os.cpu_count() or 1), "TRANSFORMERS_VERBOSITY": "error",
               **options}
        if device == "cpu":  # on a machine with a GPU too, every peer on its CPU
            env["CUDA_VISIBLE_DEVICES"] = ""
        return PeerProcess(
            lambda port: [python, *self.command(model_dir, files, port, device)],
            name=name, workdir=workdir, ready_path=self.ready_path,
            request_path=self.request_path, env=env)


def _greedy_openai(prompt: str, n: int, model: str, **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": n, "temperature": 0.0,
            "stream": True, **extra}


def _djl_stream(model_dir: Path, files: Dict[str, Path], port: int, device: str) -> List[str]:
    # djl-stream takes the GPU where there is one: nothing to say for --device cuda
    return ["-m", "djl_stream", "serve", str(model_dir), "--port", str(port)]


def _llama_cpp(key: str, repack: bool = True) -> Callable[[Path, Dict[str, Path], int], List[str]]:
    """llama-cpp-python's server on the GGUF file ``key``; without ``repack``, with
    llama.cpp's weight repacking off (:mod:`.llama_cpp_server` says why)."""
    server = (["-m", "llama_cpp.server"] if repack
              else [str(Path(__file__).with_name("llama_cpp_server.py"))])

    def command(model_dir: Path, files: Dict[str, Path], port: int, device: str) -> List[str]:
        return [*server, "--model", str(files[key]), "--host", "127.0.0.1",
                "--port", str(port), "--n_ctx", str(LLAMA_CPP_CONTEXT),
                "--n_threads", str(os.cpu_count() or 1), "--model_alias", "model"]
    return command


def _llama_server(key: str, repack: bool = True
                  ) -> Callable[[Path, Dict[str, Path], int, str], List[str]]:
    """llama.cpp's C++ server on the GGUF file ``key``, decoding up to
    :data:`LLAMA_SERVER_SLOTS` requests together (each slot its own context); without
    ``repack``, its weights served as the file holds them (``--no-repack``)."""
    def command(model_dir: Path, files: Dict[str, Path], port: int, device: str) -> List[str]:
        return ["--model", str(files[key]), "--host", "127.0.0.1", "--port", str(port),
                "--parallel", str(LLAMA_SERVER_SLOTS),
                "--ctx-size", str(LLAMA_CPP_CONTEXT * LLAMA_SERVER_SLOTS),
                "--threads", str(os.cpu_count() or 1), "--alias", "model",
                *(() if repack else ("--no-repack",))]
    return command


def _transformers_serve(model_dir: Path, files: Dict[str, Path], port: int,
                        device: str) -> List[str]:
    # The console script of transformers' own environment, run by its interpreter, in the
    # dtype djl-stream serves the model directory in on that device, so that both read
    # the same weights.
    return ["-m", "transformers.cli.transformers", "serve", str(model_dir.resolve()),
            "--continuous-batching", "--cb-num-blocks", str(CB_NUM_BLOCKS),
            "--cb-max-batch-tokens", str(CB_MAX_BATCH_TOKENS), "--device", device,
            "--dtype", served_dtype(model_dir, device), "--host", "127.0.0.1",
            "--port", str(port)]


def served_dtype(model_dir: Path, device: str) -> str:
    """The dtype djl-stream serves ``model_dir`` in on ``device`` (``cpu`` or ``cuda``), by
    its own rule (:func:`~djl_stream.runtime.loading.torch_dtype`: ``option.dtype``,
    and for ``auto`` float32 on a CPU, bfloat16 on a GPU that has it, else float16), as
    ``transformers serve --dtype`` names it."""
    from djl_stream.runtime.loading import torch_dtype
    from djl_stream.serving.properties import ModelProperties, djl_init_properties

    props = ModelProperties.from_init_properties(djl_init_properties(model_dir))
    return str(torch_dtype(props, on_gpu=device == "cuda")).removeprefix("torch.")


def _ray_serve(model_dir: Path, files: Dict[str, Path], port: int, device: str) -> List[str]:
    return [str(Path(__file__).with_name("ray_app.py")), "--model-dir", str(model_dir),
            "--port", str(port)]


def _djl_stream_peer(name: str, **how) -> Peer:
    """djl-stream's server on ``model/``, with ``how``'s ``weights`` and ``options``."""
    return Peer(name, None, _djl_stream, "/ping", "/v1/completions",
                lambda prompt, n, model: _greedy_openai(prompt, n, model, ignore_eos=True), **how)


PEERS: Dict[str, Peer] = {peer.name: peer for peer in (
    _djl_stream_peer("djl-stream",
                     weights="float32, from model/ (the defaults: on a CPU decode steps run "
                             "the compiled program)",
                     weights_on_gpu="bfloat16, from model/ (the defaults: on a GPU bfloat16, "
                                    "float16 where it has none)"),
    _djl_stream_peer("djl-stream eager",
                     weights="float32, from model/ (option.compile=false: the eager forward)",
                     weights_on_gpu="bfloat16, from model/ (option.compile=false)",
                     options=(("compile", "false"),)),
    _djl_stream_peer("djl-stream int8",
                     weights="int8 weight-only (djl-stream's layers), from model/",
                     weights_on_gpu="int8 weight-only (torchao), from model/",
                     options=(("quantize", "int8"),)),
    _djl_stream_peer("djl-stream w8a8",
                     weights="int8 weights and per-token int8 activations (int8 weight-only "
                             "on a CPU without int8 dot products), from model/",
                     weights_on_gpu="int8 weight-only (torchao), from model/ "
                                    "(option.quantize=w8a8 serves int8 on a GPU)",
                     options=(("quantize", "w8a8"),)),
    _djl_stream_peer("djl-stream bf16", weights="bfloat16, from model/ (option.dtype=bf16)",
                     options=(("dtype", "bf16"),)),
    Peer("llama-server F32", None, _llama_server("f32"), "/health", "/v1/completions",
         lambda prompt, n, model: _greedy_openai(prompt, n, "model", min_tokens=n),
         weights="float32, converted from model/ to GGUF (llama.cpp's C++ server, "
                 f"--parallel {LLAMA_SERVER_SLOTS})", model_file="f32",
         executable=lambda root: server_binary(root)),
    # Repacked into the layout of llama.cpp's fastest int8 kernels, the Q8_0 weights stopped
    # the server with an illegal instruction at load on a CPU that lists AMX among its
    # flags (the same crash as llama-cpp-python's repacked Q4_1, llama_cpp_server.py);
    # not repacked, llama.cpp's own Q8_0 kernels serve them.
    Peer("llama-server Q8_0", None, _llama_server("q8_0", repack=False), "/health",
         "/v1/completions",
         lambda prompt, n, model: _greedy_openai(prompt, n, "model", min_tokens=n),
         weights="Q8_0, converted from model/ to GGUF (llama.cpp's C++ server, "
                 f"--parallel {LLAMA_SERVER_SLOTS}, --no-repack)", model_file="q8_0",
         executable=lambda root: server_binary(root)),
    Peer("llama.cpp F32", "llama-cpp", _llama_cpp("f32"), "/v1/models", "/v1/completions",
         lambda prompt, n, model: _greedy_openai(prompt, n, "model", min_tokens=n),
         one_at_a_time=True, weights="float32, converted from model/ to GGUF", model_file="f32"),
    Peer("llama.cpp Q4_1", "llama-cpp", _llama_cpp("q4_1", repack=False), "/v1/models",
         "/v1/completions",
         lambda prompt, n, model: _greedy_openai(prompt, n, "model", min_tokens=n),
         one_at_a_time=True, weights="Q4_1, the original GGUF file (weights not repacked)",
         model_file="q4_1"),
    Peer("transformers serve", "transformers-serve", _transformers_serve, "/health",
         "/v1/completions",
         lambda prompt, n, model: _greedy_openai(
             prompt, n, model, generation_config=json.dumps(
                 {"min_new_tokens": n, "max_new_tokens": n, "do_sample": False})),
         weights_on_gpu="bfloat16, from model/ (--dtype: djl-stream's dtype there, "
                        "float16 on a GPU without bfloat16)"),
    Peer("Ray Serve (tutorial)", "ray-serve", _ray_serve, "/-/healthz", "/generate",
         lambda prompt, n, model: {"prompt": prompt, "max_new_tokens": n}, read=text_chunks,
         pieces_are_tokens=False),
)}

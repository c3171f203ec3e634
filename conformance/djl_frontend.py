"""djl-serving's Java front end, modelled in Python, around the *real* Python worker.

The Python worker of each djl-serving release branch (``engines/python/setup`` in
``DJL_SERVING_SRC``) runs here unchanged; only its peer, the Java front end, cannot (its
dependencies are out of reach). This module stands in for that peer, following the Java
sources of the same branch function by function:

- :func:`compose_worker_config`: how ``serving.properties`` and ``OPTION_*`` variables
  become the init call's properties and the worker's command line
  (``ModelInfo.loadServingProperties``, ``LmiConfigRecommender.configure``,
  ``NeuronSmartDefaultUtils``, ``PyModel.load``, ``PyProcess``, ``Connection.getPythonStartCmd``);
- :func:`encode_input` and :class:`FrameReader`: the socket wire (``Connection.RequestEncoder``,
  ``Connection.OutputDecoder``, ``CodecUtils``);
- :func:`request_input`: an HTTP request as an ``Input`` (``InferenceRequestHandler``; the
  header and query mapping of ``RequestParser``, whose source is not among the shared
  files, follows DJL_FACTS.md);
- :class:`HttpAnswer`: what the HTTP client receives (``InferenceRequestHandler.sendOutput``;
  in async mode ``AsyncRequestManager`` and ``Request.addResponse`` first).

It is scaffolding for the conformance suite, written apart from djl-stream's own emulation
(``djl_stream.serving.properties``, ``djl_stream.serving.worker``, ``djl_stream.serving.server``), which the suite
holds to it. Example::

    with DjlWorker(src, "0.33.0-dlc", Path("model")) as worker:
        answer = worker.invoke({"inputs": "Hi", "stream": True})
        answer.status, answer.lines()
"""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import re
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

#: ModelInfo.SNAKE_CASE: an OPTION_ name is lower-cased only when it is all upper case.
_SNAKE_CASE = re.compile(r"^[A-Z_\d]+$")
#: LmiConfigRecommender.OPTIMIZED_TASK_ARCHITECTURES
_TEXT_GENERATION_ARCHITECTURES = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
ASYNC_BRANCHES = ("0.33.0-dlc",)


# -- configuration: serving.properties + environment -> init call and command line ------

def read_java_properties(path: Path) -> Dict[str, str]:
    """``java.util.Properties.load`` for the plain files model directories use: ``#`` and
    ``!`` comments, ``=``, ``:`` or blank as separator, blanks around keys and values
    trimmed (no line continuations or escapes, which none of ours use)."""
    pairs: Dict[str, str] = {}
    if not path.is_file():
        return pairs
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line or line[0] in "#!":
            continue
        match = re.match(r"([^=:\s]+)\s*[=:\s]\s*(.*)$", line)
        if match:
            pairs[match.group(1)] = match.group(2).strip()
        else:
            pairs[line] = ""
    return pairs


@dataclasses.dataclass
class WorkerConfig:
    """Everything the front end decides before the worker's first byte: the init call's
    properties and the worker's entry point, recommended entry point and mode."""

    branch: str
    init_properties: Dict[str, str]
    entry_point: Optional[str]
    recommended_entry_point: Optional[str]
    async_mode: bool
    tensor_parallel_degree: int


def compose_worker_config(model_dir: Path, environ: Mapping[str, str], *, branch: str,
                          gpus: int = 0, neuron_cores: int = 0) -> WorkerConfig:
    """What djl-serving ``branch`` sends the worker for ``model_dir`` on a machine with
    ``gpus`` GPUs and ``neuron_cores`` NeuronCores, with ``environ`` as the container's
    environment (``OPTION_*``, ``SERVING_FEATURES``, ``DJL_ENTRY_POINT``...)."""
    model_dir = Path(model_dir).resolve()
    features = environ.get("SERVING_FEATURES")
    # ModelInfo.initialize: SERVING_MAX/MIN_WORKERS seed the arguments
    arguments: Dict[str, str] = {}
    for name, key in (("SERVING_MAX_WORKERS", "maxWorkers"), ("SERVING_MIN_WORKERS", "minWorkers")):
        if environ.get(name):
            arguments.setdefault(key, environ[name])
    # ModelInfo.loadServingProperties: the file, then OPTION_* / ARGS_* where absent
    prop = read_java_properties(model_dir / "serving.properties")
    for name, value in environ.items():
        if not value:
            continue
        if name.startswith("OPTION_"):
            key = name[len("OPTION_"):]
            if _SNAKE_CASE.match(key):
                key = key.lower()
            if key == "entrypoint":
                key = "entryPoint"
            elif key == "engine":
                prop.setdefault("engine", value)
                continue
            prop.setdefault(f"option.{key}", value)
        elif name.startswith("ARGS_"):
            key = name[len("ARGS_"):]
            arguments.setdefault(key.lower() if _SNAKE_CASE.match(key) else key, value)
    # LmiUtils.configureLmiModel: only for a Hugging Face model directory
    config_file = model_dir / "config.json"
    if config_file.is_file():
        _configure_lmi(prop, json.loads(config_file.read_text()), environ, gpus, neuron_cores)
    # ModelInfo.configPerModelSettings
    engine = prop.get("engine", "Python")
    if engine == "MPI":
        prop["option.mpi_mode"] = "true"
    # ModelInfo.initialize: option.* become options, the rest arguments
    options = {key[len("option."):]: value for key, value in prop.items() if key.startswith("option.")}
    arguments.update({key: value for key, value in prop.items() if not key.startswith("option.")})
    arguments.setdefault("engine", engine)
    # PyModel.load(options); DJL's model loader has copied the arguments into the model's
    # properties (DJL_FACTS.md section 1), which PyModel sends after the options.
    init: Dict[str, str] = {}
    properties: Dict[str, str] = dict(arguments)
    entry_point = None
    async_mode = False
    tp_max = False
    tp = _env_tensor_parallel_degree(environ, gpus, neuron_cores)
    for key, value in options.items():
        if key != "env":
            init[key] = value
            properties[key] = value
        if key == "entryPoint":
            entry_point = value
        elif key == "tensor_parallel_degree":
            if value == "max":
                tp_max = True
            else:
                tp = int(value)
        elif key == "async_mode" and branch in ASYNC_BRANCHES:
            async_mode = value.lower() == "true"
    if tp_max:
        tp = (gpus or neuron_cores)
    recommended = None
    if entry_point is None:
        entry_point = environ.get("DJL_ENTRY_POINT")
        if entry_point is None:
            if (model_dir / "model.py").is_file():
                entry_point = "model.py"
            if neuron_cores and tp > 0:
                recommended = "djl_python.transformers_neuronx"
            elif features == "trtllm":
                recommended = ("djl_python.lmi_trtllm.trtllm_async_service"
                               if branch in ASYNC_BRANCHES else "djl_python.tensorrt_llm")
                async_mode = async_mode or branch in ASYNC_BRANCHES
            elif features == "vllm" and branch in ASYNC_BRANCHES:
                recommended = "djl_python.lmi_vllm.vllm_async_service"
                async_mode = True
            elif "model_id" in init or config_file.is_file():
                recommended = "djl_python.huggingface"
    if tp > 0:
        if "maxWorkers" not in properties and "gpu.maxWorkers" not in properties:
            properties["gpu.minWorkers"] = "1"
            properties["gpu.maxWorkers"] = "1"
        properties["tensor_parallel_degree"] = str(tp)
    init.update(properties)
    # PyProcess.predictStandard adds the handler to any input that has none
    init.setdefault("handler", options.get("handler", "handle"))
    return WorkerConfig(branch, init, entry_point, recommended, async_mode, tp)


def _env_tensor_parallel_degree(environ: Mapping[str, str], gpus: int, neuron_cores: int) -> int:
    # PyEnv.getTensorParallelDegree when no option set it
    value = environ.get("TENSOR_PARALLEL_DEGREE")
    if value == "max":
        return gpus or neuron_cores
    return int(value) if value else 0


def _configure_lmi(prop: Dict[str, str], config: Mapping[str, Any], environ: Mapping[str, str],
                   gpus: int, neuron_cores: int) -> None:
    """LmiConfigRecommender.configure (the parts that apply to a Python model)."""
    features = environ.get("SERVING_FEATURES")
    architectures = config.get("architectures") or []
    text_generation = any(a.endswith(_TEXT_GENERATION_ARCHITECTURES) for a in architectures)
    # setRollingBatch
    if int(prop.get("batch_size", "1")) > 1:
        prop["option.rolling_batch"] = "disable"
    else:
        rolling = prop.get("option.rolling_batch", "auto")
        if rolling == "auto":
            if not text_generation:
                rolling = "disable"
            elif features and "tnx" in features:
                rolling = "vllm" if int(prop.get("option.max_rolling_batch_size", "1")) >= 12 else "tnx"
            elif features and "vllm" in features:
                rolling = "vllm"
            else:
                rolling = "disable"
            prop["option.rolling_batch"] = rolling
    if prop.get("option.rolling_batch") == "trtllm":
        prop["option.mpi_mode"] = "true"
    # setHeuristicDefaults: NeuronSmartDefaultUtils, on a machine with NeuronCores
    if neuron_cores and text_generation:
        _neuron_smart_defaults(prop, config, neuron_cores)
    prop.setdefault("option.pipeline_parallel_degree", "1")
    if "option.tensor_parallel_degree" not in prop:
        tp = environ.get("TENSOR_PARALLEL_DEGREE", "max")
        if tp == "max":
            tp = str(gpus) if gpus else (str(neuron_cores) if neuron_cores else None)
        if tp is not None:
            prop["option.tensor_parallel_degree"] = tp
    if "option.max_rolling_batch_size" not in prop:
        rolling = prop.get("option.rolling_batch")
        prop["option.max_rolling_batch_size"] = "256" if rolling in ("vllm", "trtllm") else "32"


def _neuron_smart_defaults(prop: Dict[str, str], config: Mapping[str, Any], cores: int) -> None:
    """NeuronSmartDefaultUtils.applySmartDefaults. Its memory heuristics are djl-stream's
    port (djl_stream.shipping.smart_defaults), which test_smart_defaults_java.py holds to the Java."""
    from djl_stream.shipping.smart_defaults import neuron_smart_defaults

    options = {key[len("option."):]: value for key, value in prop.items() if key.startswith("option.")}
    for key, value in neuron_smart_defaults(config, options, cores).items():
        prop[f"option.{key}"] = value


def worker_command(config: WorkerConfig, engine_dir: Path, model_dir: Path,
                   sock_name: str, python: Optional[str] = None) -> List[str]:
    """Connection.getPythonStartCmd, single process (not MPI), CPU device; ``python`` is
    the image's interpreter (default: this one)."""
    args = [str(python or sys.executable), str(engine_dir / "djl_python_engine.py"),
            "--sock-type", "unix", "--sock-name", sock_name,
            "--model-dir", str(Path(model_dir).resolve()),
            "--entry-point", config.entry_point or "",
            "--device-id", "-1",
            "--cluster-size", "1",
            "--recommended-entry-point", config.recommended_entry_point or "",
            "--log-level", "info"]
    if config.branch in ASYNC_BRANCHES:
        args.append("--async-mode" if config.async_mode else "--no-async-mode")
    return args


# -- the wire --------------------------------------------------------------------------

def _utf8(value: Optional[str]) -> bytes:
    if value is None:
        return struct.pack(">i", -1)
    raw = value.encode("utf-8")
    return struct.pack(">i", len(raw)) + raw


def encode_input(properties: Mapping[str, str], content: Iterable[Tuple[Optional[str], bytes]] = ()
                 ) -> bytes:
    """Connection.RequestEncoder: properties, then content entries (a null key is sent as
    is; the Python side reads it as ``None``)."""
    content = list(content)
    out = bytearray(struct.pack(">h", len(properties)))
    for key, value in properties.items():
        out += _utf8(key) + _utf8(value)
    out += struct.pack(">h", len(content))
    for key, value in content:
        out += _utf8(key) + struct.pack(">i", len(value)) + value
    return bytes(out)


@dataclasses.dataclass
class WorkerOutput:
    """One ``Output`` as Connection.OutputDecoder builds it: the head, then either content
    entries or (``chunks`` not None) the frames of a stream, the last one with more=0."""

    code: int
    message: Optional[str]
    properties: Dict[str, str]
    content: List[Tuple[Optional[str], bytes]]
    chunks: Optional[List[bytes]] = None

    def data(self) -> Optional[bytes]:
        """ai.djl.modality.Input.getData: the entry named ``data``, else the first."""
        for key, value in self.content:
            if key == "data":
                return value
        return self.content[0][1] if self.content else None


class FrameReader:
    """Reads the worker's answers from the socket, frame by frame."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock

    def _exact(self, size: int) -> bytes:
        data = bytearray()
        while len(data) < size:
            part = self.sock.recv(size - len(data))
            if not part:
                raise ConnectionError("the Python worker closed the connection")
            data += part
        return bytes(data)

    def _short(self) -> int:
        return struct.unpack(">h", self._exact(2))[0]

    def _int(self) -> int:
        return struct.unpack(">i", self._exact(4))[0]

    def _utf8(self) -> Optional[str]:
        size = self._int()
        return None if size < 0 else self._exact(size).decode("utf-8")

    def _bytes(self) -> bytes:
        size = self._int()
        return b"" if size < 0 else self._exact(size)

    def read_head(self) -> WorkerOutput:
        code = self._short()
        message = self._utf8()
        properties = {}
        for _ in range(self._short()):
            key = self._utf8()
            properties[key] = self._utf8()
        size = self._short()
        if size == -1:
            return WorkerOutput(code, message, properties, [], chunks=[])
        content = []
        for _ in range(size):
            key = self._utf8()
            content.append((key, self._bytes()))
        return WorkerOutput(code, message, properties, content)

    def read_frame(self) -> Tuple[bool, bytes]:
        """One stream frame: (more, bytes)."""
        more = self._exact(1)[0] == 1
        return more, self._bytes()

    def read_output(self) -> WorkerOutput:
        """A whole Output, stream frames included."""
        output = self.read_head()
        if output.chunks is not None:
            more = True
            while more:
                more, data = self.read_frame()
                output.chunks.append(data)
        return output


# -- HTTP as the client sees it -------------------------------------------------------

@dataclasses.dataclass
class HttpAnswer:
    """An HTTP response as a client receives it: status, headers (lower-case names), and the
    body as the chunks it came in (one element for a plain, non-chunked response)."""

    status: int
    headers: Dict[str, str]
    chunks: List[bytes]
    chunked: bool

    @property
    def body(self) -> bytes:
        return b"".join(self.chunks)

    def json(self) -> Any:
        return json.loads(self.body)

    def lines(self) -> List[str]:
        """The body's lines (a last line without a newline included)."""
        return [line for line in self.body.decode("utf-8").split("\n") if line]

    @property
    def content_type(self) -> Optional[str]:
        return self.headers.get("content-type")


def send_output(code: int, properties: Mapping[str, str], chunks: Optional[List[bytes]],
                data: Optional[bytes]) -> HttpAnswer:
    """InferenceRequestHandler.sendOutput: a chunked supplier whose first chunk is also its
    last becomes a plain response; otherwise the head goes out with the first chunk and
    every chunk follows as it came. ``code`` is the Output's code when the first chunk
    arrived (async mode can change it until then)."""
    headers = {key.lower(): value for key, value in properties.items()}
    if chunks is None:
        return HttpAnswer(code, headers, [data or b""], chunked=False)
    if len(chunks) == 1:
        return HttpAnswer(code, headers, [chunks[0]], chunked=False)
    return HttpAnswer(code, headers, list(chunks), chunked=True)


def request_input(body: bytes, headers: Mapping[str, str] = {},
                  query: Mapping[str, str] = {}) -> Tuple[Dict[str, str], List[Tuple[str, bytes]]]:
    """An HTTP request as the front end's ``Input``: headers as properties (lower-case
    names), the body as content ``data``, query parameters as further entries, and the
    ``requestId`` InferenceRequestHandler adds."""
    properties = {name.lower(): value for name, value in headers.items()}
    properties.setdefault("content-type", "application/json")
    properties["requestId"] = str(uuid.uuid4())
    content = [("data", body)] + [(key, value.encode("utf-8")) for key, value in query.items()]
    return properties, content


# -- a running worker -------------------------------------------------------------------

class WorkerStartError(RuntimeError):
    """The worker did not come up, or its init call failed (the model load fails)."""


class DjlWorker:
    """The real ``djl_python_engine.py`` of one branch serving ``model_dir``, driven over its
    Unix socket as the front end drives it. ``invoke`` is safe from several threads: in the
    synchronous mode requests go one at a time, as djl-serving sends them to one worker; in
    async mode they overlap, each answer routed by its ``request_tracking_id``.
    """

    def __init__(self, src: Path, branch: str, model_dir: Path,
                 environ: Optional[Mapping[str, str]] = None, *, log_path: Optional[Path] = None,
                 start_timeout: float = 1800.0, python: Optional[str] = None) -> None:
        self.src = Path(src)
        self.branch = branch
        self.model_dir = Path(model_dir).resolve()
        self.environ = dict(environ or {})
        self.config = compose_worker_config(self.model_dir, self.environ, branch=branch)
        self.engine_dir = self.src / branch / "engines" / "python" / "setup"
        self.python = python
        # a deadline, not a speed target: a first start on a machine compiles the decode
        # programs (8 to 9 minutes for the embedded model on the 2-core AMD EPYC)
        self.start_timeout = start_timeout
        self._tmp = tempfile.TemporaryDirectory(prefix="djl-sock-")
        self.sock_name = os.path.join(self._tmp.name, "djl_sock.19000")
        handle, name = tempfile.mkstemp(prefix=f"djl-worker-{branch}-", suffix=".log")
        os.close(handle)
        self.log_path = Path(log_path or name)
        self.process: Optional[subprocess.Popen] = None
        self.sock: Optional[socket.socket] = None
        self.init_output: Optional[WorkerOutput] = None
        self._send_lock = threading.Lock()
        self._sync_lock = threading.Lock()
        self._pending: Dict[str, "queue.Queue[WorkerOutput]"] = {}
        self._reader: Optional[threading.Thread] = None

    @property
    def async_mode(self) -> bool:
        return self.config.async_mode

    def __enter__(self) -> "DjlWorker":
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> WorkerOutput:
        """Start the worker (PyProcess.startPythonProcess) and send the init call; raise
        :class:`WorkerStartError` when the model would fail to load."""
        env = {**os.environ, **self.environ}
        # PyEnv.getEnvironmentVars: PYTHONPATH gets the engine folder and the model dir
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (os.environ.get("PYTHONPATH"), str(self.engine_dir), str(self.model_dir)) if p)
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            worker_command(self.config, self.engine_dir, self.model_dir, self.sock_name,
                           self.python),
            cwd=self.model_dir, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        started = threading.Event()

        def pump() -> None:
            # PyProcess.ReaderThread: the worker says it listens with this line
            assert self.process is not None and self.process.stdout is not None
            for line in self.process.stdout:
                log.write(line)
                log.flush()
                if b"Python engine started." in line:
                    started.set()
            log.close()

        threading.Thread(target=pump, name=f"worker-log-{self.branch}", daemon=True).start()
        deadline = time.monotonic() + self.start_timeout
        while not started.wait(0.1):
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise WorkerStartError(f"the {self.branch} worker did not start:\n{self.logs()}")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.connect(self.sock_name)
        self.sock.settimeout(self.start_timeout)
        reader = FrameReader(self.sock)
        self.sock.sendall(encode_input(self.config.init_properties))
        self.init_output = reader.read_output()
        if self.init_output.code >= 300:
            body = (self.init_output.data() or b"").decode("utf-8", errors="replace")
            raise WorkerStartError(f"init -> {self.init_output.code} {body or self.init_output.message}"
                                   f"\n{self.logs()}")
        if self.async_mode:
            self._reader = threading.Thread(target=self._route_async, args=(reader,),
                                            name=f"worker-reader-{self.branch}", daemon=True)
            self._reader.start()
        self._frames = reader
        return self.init_output

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self) -> None:
        if self.sock is not None:
            self.sock.close()
        if self.process is not None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._tmp.cleanup()

    # -- requests --

    def invoke(self, body: Any, headers: Mapping[str, str] = {},
               query: Mapping[str, str] = {}, timeout: float = 300.0) -> HttpAnswer:
        """Send one HTTP request's ``Input`` and return what the HTTP client receives."""
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        properties, content = request_input(raw, headers, query)
        properties.setdefault("handler", self.config.init_properties.get("handler", "handle"))
        if self.async_mode:
            return self._invoke_async(properties, content, timeout)
        with self._sync_lock:
            assert self.sock is not None
            self.sock.settimeout(timeout)
            self.sock.sendall(encode_input(properties, content))
            output = self._frames.read_output()
        return send_output(output.code, output.properties, output.chunks, output.data())

    # AsyncRequestManager.addInput / addOutput, Request.addResponse

    def _invoke_async(self, properties: Dict[str, str], content: List[Tuple[str, bytes]],
                      timeout: float) -> HttpAnswer:
        tracking_id = str(uuid.uuid4())
        properties["request_tracking_id"] = tracking_id
        inbox: "queue.Queue[WorkerOutput]" = queue.Queue()
        self._pending[tracking_id] = inbox
        with self._send_lock:
            assert self.sock is not None
            self.sock.sendall(encode_input(properties, content))
        code, headers, chunks = 200, {}, []
        status_at_first_chunk: Optional[int] = None
        deadline = time.monotonic() + timeout
        try:
            while True:
                output = inbox.get(timeout=max(deadline - time.monotonic(), 0.001))
                if output.chunks is not None:
                    raise AssertionError("a streaming Output in async mode: the front end "
                                         "cannot read it (AsyncRequestManager reads content 0)")
                if output.code != 200:  # sendErrorResponse
                    error = {"code": output.code,
                             "message": f"Async Inference Failure {output.message}"}
                    return HttpAnswer(output.code, {}, [json.dumps(error).encode()], False)
                headers.update({k.lower(): v for k, v in output.properties.items()})
                fields = _decode_map(output.content[0][1])
                last = fields.get("last", "").lower() == "true"
                token = fields.get("data")
                if not token and not last:
                    continue  # a non-streaming answer is held back until it is complete
                if fields.get("code") is not None:
                    code = int(fields["code"])
                    body = {"code": code}
                    if fields.get("error") is not None:
                        body["error"] = fields["error"]
                    chunk = json.dumps(body).encode("utf-8")
                    last = True
                else:
                    chunk = (token or "").encode("utf-8")
                if status_at_first_chunk is None:
                    status_at_first_chunk = code
                chunks.append(chunk)
                if last:
                    break
        finally:
            self._pending.pop(tracking_id, None)
        return send_output(status_at_first_chunk or code, headers, chunks, None)

    def _route_async(self, reader: FrameReader) -> None:
        while True:
            try:
                output = reader.read_output()
            except (OSError, ConnectionError):
                return
            inbox = self._pending.get(output.properties.get("request_tracking_id", ""))
            if inbox is not None:
                inbox.put(output)


def _decode_map(raw: bytes) -> Dict[str, str]:
    """The binary map of Request.addResponse: count, then key/value UTF-8 strings."""
    (count,) = struct.unpack_from(">h", raw)
    offset, fields = 2, {}
    for _ in range(count):
        pair = []
        for _ in range(2):
            (size,) = struct.unpack_from(">i", raw, offset)
            pair.append(raw[offset + 4: offset + 4 + size].decode("utf-8"))
            offset += 4 + size
        fields[pair[0]] = pair[1]
    return fields

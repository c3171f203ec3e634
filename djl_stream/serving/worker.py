"""The Python worker of djl-serving, emulated for one model directory (no HTTP here).

djl-serving runs ``model.py`` in a worker process: it imports the entry point, sends one
*init* call (an ``Input`` without content whose properties are the model options, plus
``handler`` and ``device_id``), then turns each HTTP request into an ``Input`` and sends the
returned ``Output`` back to the front end. :class:`ModelWorker` does the same in-process, so
the local server (:mod:`djl_stream.serving.server`) and the CLI run an unchanged ``model.py``
exactly as the container would.

The module also holds the worker's half of the wire: :func:`output_body`,
:func:`encode_stream_item` and :func:`stream_failure_chunk` turn an ``Output`` (ours or
djl_python's) into bytes exactly as djl-serving does; ``make conformance`` holds them to
what the real worker and front end send.

Example::

    >>> worker = ModelWorker("model/")            # doctest: +SKIP
    >>> worker.load()                             # doctest: +SKIP
    'READY'
    >>> out = worker.invoke(worker.make_input(    # doctest: +SKIP
    ...     b'{"inputs": "Hi", "stream": true}', {"content-type": "application/json"}, {}))
    >>> for item in out.stream_content:           # doctest: +SKIP
    ...     print(encode_stream_item(out, item))
    b'{"output_tokens": ["Hello"]}\\n'
"""

from __future__ import annotations

import importlib
import importlib.util
import itertools
import json
import logging
import os
import sys
import threading
import types
import uuid
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional, Union

from djl_stream.serving.outputs import djl_json
from djl_stream.serving.properties import (DEFAULT_ENTRY_POINT, configured_entry_point,
                                           djl_init_properties, shadowed_variables)
from djl_stream.serving.replies import is_out_of_memory

logger = logging.getLogger(__name__)

LOADING, READY, FAILED = "LOADING", "READY", "FAILED"
#: djl's name for the function it calls; sent as the ``handler`` property.
HANDLER = "handle"

QueryParams = Union[Mapping[str, str], Iterable[tuple[str, str]]]
HeaderPairs = Union[Mapping[str, str], Iterable[tuple[str, str]]]

_module_counter = itertools.count()


class WorkerNotReady(RuntimeError):
    """:meth:`ModelWorker.invoke` was called before the model loaded, or after it failed."""


def _pairs(items: Any) -> list[tuple[str, str]]:
    # Starlette's Headers/QueryParams are Mappings whose multi_items() keep repeats.
    if hasattr(items, "multi_items"):
        return list(items.multi_items())
    if isinstance(items, Mapping):
        return list(items.items())
    return list(items or ())


def _new_input(properties: Mapping[str, str], content: Iterable[tuple[str, Any]] = ()) -> Any:
    """An ``Input`` of the class in use (djl_python's in the container, else ours).

    Filled through the ``properties`` dict and ``content.add`` that both classes share,
    rather than a constructor only ours has.
    """
    from djl_stream.serving.compat import Input

    inp = Input()
    for key, value in properties.items():
        inp.properties[key] = value
    for key, value in content:
        inp.content.add(key, value)
    return inp


def _values(content: Any) -> list[tuple[Optional[str], bytes]]:
    if content is None:
        return []
    if hasattr(content, "get_keys") and hasattr(content, "get_values"):
        return list(zip(content.get_keys(), content.get_values()))
    return list(content)


def _to_bytes(value: Any) -> bytes:
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        return value.encode("utf-8")
    return (json.dumps(value, ensure_ascii=False) + "\n").encode("utf-8")


def output_body(output: Any) -> bytes:
    """The HTTP body of a non-streaming ``Output``, chosen as djl's front end does.

    djl sends one content entry: the one named ``data`` if there is one, else the first.
    Further entries (batched answers the front end would split) are not sent.

    >>> from djl_stream.serving.outputs import Output
    >>> output_body(Output().add("first").add("second")), output_body(Output())
    (b'first', b'')
    """
    pairs = _values(getattr(output, "content", None))
    if not pairs:
        return b""
    for key, value in pairs:
        if key == "data":
            return _to_bytes(value)
    return _to_bytes(pairs[0][1])


def next_stream_chunk(output: Any) -> Optional[bytes]:
    """Pull and format one item of ``output``'s stream; ``None`` once it is exhausted.

    Blocks until the model produced the next token: call it from a worker thread (a
    :class:`~djl_stream.serving.stream_pump.StreamPump`'s).
    """
    try:
        item = next(output.stream_content)
    except StopIteration:
        return None
    return encode_stream_item(output, item)


def encode_stream_item(output: Any, item: Any) -> bytes:
    """The bytes of one stream item, as djl_python's ``Output.send`` makes them.

    Uses ``output.format_stream_item`` when the class has it (ours); djl_python's ``Output``
    keeps the formatter in ``stream_output_formatter``, and the item is then sent by djl's
    rules: ``str`` UTF-8 encoded, bytes as they are, anything else as its pretty JSON.

    >>> from djl_stream.serving.outputs import Output
    >>> out = Output().add_stream_content(iter([]), output_formatter=lambda p: p[0] + "\\n")
    >>> encode_stream_item(out, ["tok"])
    b'tok\\n'
    """
    if hasattr(output, "format_stream_item"):
        return bytes(output.format_stream_item(item))
    formatter = getattr(output, "stream_output_formatter", None)
    if formatter is not None:
        item = formatter(item)
    if isinstance(item, str):
        return item.encode("utf-8")
    if isinstance(item, (bytes, bytearray)):
        return bytes(item)
    return djl_json(item)


def stream_failure_chunk(error: BaseException) -> bytes:
    """What djl-serving sends when a stream's iterator (or its formatter) raises: the
    exception's text, raw, as the stream's last chunk, after whatever was already sent.

    djl-stream's own handler never lets that happen (it ends a failed stream with an error
    record in the stream's format); this is for handlers that do.

    >>> stream_failure_chunk(RuntimeError("device lost"))
    b'device lost'
    """
    return str(error).encode("utf-8")


def request_input(body: bytes, headers: HeaderPairs, query: QueryParams = ()) -> Any:
    """The ``Input`` djl's front end builds for one HTTP request.

    Headers become properties with lower-case names (repeats joined with ``, ``), the
    body is content ``data`` — even when empty, so a handler never mistakes a request
    for the init call — query parameters follow as further content entries, and
    ``requestId`` is a fresh UUID.

    >>> inp = request_input(b"hi", {"X-Trace": "1"}, {"mode": "fast"})
    >>> inp.get_property("x-trace"), inp.get_as_string(), inp.get_as_string("mode")
    ('1', 'hi', 'fast')
    """
    props: dict[str, str] = {}
    for name, value in _pairs(headers):
        name = name.lower()
        props[name] = f"{props[name]}, {value}" if name in props else value
    props["requestId"] = str(uuid.uuid4())
    content = [("data", bytes(body))]
    content += [(key, value.encode("utf-8")) for key, value in _pairs(query)]
    return _new_input(props, content)


def input_parts(inp: Any) -> tuple[dict[str, str], list[tuple[Optional[str], bytes]]]:
    """An ``Input``'s properties and content entries, as plain data that can travel to
    another process (where :func:`input_from_parts` rebuilds it).

    >>> properties, content = input_parts(request_input(b"hi", {"X-Trace": "1"}))
    >>> properties["x-trace"], content
    ('1', [('data', b'hi')])
    """
    return dict(inp.properties), [(key, _to_bytes(value))
                                  for key, value in _values(getattr(inp, "content", None))]


def input_from_parts(properties: Mapping[str, str],
                     content: Iterable[tuple[Optional[str], bytes]]) -> Any:
    """The ``Input`` that :func:`input_parts` took apart."""
    return _new_input(properties, content)


class ModelWorker:
    """One model directory served the way djl-serving's Python engine serves it.

    ``environ`` (default ``os.environ``) supplies ``OPTION_*`` variables, as SageMaker sets
    them. :meth:`load` imports the entry point and sends the init call; until it is done
    ``status`` is ``"LOADING"``, then ``"READY"``, or ``"FAILED"`` with ``failure_reason``
    (the whole error, for the log and the console; clients get :meth:`not_ready_message`).

    ``handle()`` is called from whatever thread calls :meth:`invoke`, concurrently when
    requests overlap — unlike djl's one-request-at-a-time worker — because concurrent
    streams are meant to be batched together by the handler.

    >>> worker = ModelWorker("model/")            # doctest: +SKIP
    >>> worker.load(), worker.model_name          # doctest: +SKIP
    ('READY', 'model')
    """

    def __init__(self, model_dir: str | os.PathLike[str],
                 environ: Optional[Mapping[str, str]] = None) -> None:
        self.model_dir = Path(model_dir).resolve()
        self.environ: Mapping[str, str] = os.environ if environ is None else environ
        # Read once: serving.properties does not change under a running worker, and the
        # server asks for the model name on every request.
        self._properties = djl_init_properties(self.model_dir, self.environ)
        self.status = LOADING
        self.failure_reason: Optional[str] = None
        self.failure_type: Optional[str] = None
        self.module: Optional[types.ModuleType] = None
        self._handle: Any = None
        self._lock = threading.Lock()
        self._loaded = False

    # -- identity --

    @property
    def properties(self) -> dict[str, str]:
        """The model options as the init call receives them (``option.`` prefix removed)."""
        return dict(self._properties)

    @property
    def model_name(self) -> str:
        """``option.model_name``, else the name of the model directory (``model`` for
        SageMaker's ``/opt/ml/model``)."""
        return self._properties.get("model_name") or self.model_dir.name

    @property
    def entry_point(self) -> str:
        """``option.entryPoint`` (``OPTION_ENTRYPOINT``), else ``DJL_ENTRY_POINT``, else
        ``model.py``, as djl-serving's ``PyModel`` picks it: ``option.entrypoint`` in lower
        case is not its key and is ignored there, so here too."""
        return configured_entry_point(self._properties, self.environ) or DEFAULT_ENTRY_POINT

    # -- loading --

    def load(self) -> str:
        """Import the entry point and send the init call; return the new ``status``.

        Only the first call does the work; concurrent callers wait for it and later calls
        return at once. A failure is recorded, not raised: djl keeps the front end up and
        reports the model as failed.
        """
        with self._lock:
            if self._loaded:
                return self.status
            for shadowed in shadowed_variables(self.model_dir, self.environ):
                logger.warning("%s", shadowed)
            if "entrypoint" in self._properties and "entryPoint" not in self._properties:
                logger.warning("option.entrypoint=%s is ignored: djl-serving reads "
                               "option.entryPoint only (the case matters); loading %s",
                               self._properties["entrypoint"], self.entry_point)
            try:
                self._handle = self._import_handler()
                self._send_init()
            except Exception as error:
                self.failure_reason = f"{type(error).__name__}: {error}"
                self.failure_type = type(error).__name__
                self.status = FAILED
                logger.exception("model %s failed to load", self.model_name)
            else:
                self.status = READY
                logger.info("model %s is ready", self.model_name)
            finally:
                self._loaded = True
            return self.status

    def _import_handler(self) -> Any:
        entry = self.entry_point
        path = self.model_dir / entry
        if not path.is_file() and (self.model_dir / f"{entry}.py").is_file():
            path = self.model_dir / f"{entry}.py"
        # The model's own modules (helpers next to model.py) must be importable, as in djl
        # where the model directory is the worker's working directory.
        if str(self.model_dir) not in sys.path:
            sys.path.insert(0, str(self.model_dir))
        if path.is_file():
            # A unique module name: several model directories (tests, or two workers) may
            # each have a model.py, and they must not replace each other in sys.modules.
            name = f"djl_stream_model_{next(_module_counter)}_{path.stem}"
            spec = importlib.util.spec_from_file_location(name, path)
            if spec is None or spec.loader is None:
                raise ImportError(f"cannot import {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[name] = module
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[name]
                raise
        else:
            # Like djl, an entry point that is no file in the model directory names an
            # installed module (djl_python.huggingface, or a package of ours).
            try:
                module = importlib.import_module(entry.removesuffix(".py"))
            except ModuleNotFoundError:
                raise FileNotFoundError(
                    f"entry point {entry!r} is neither a file in {self.model_dir} nor an "
                    "importable module") from None
        handler = getattr(module, HANDLER, None)
        if not callable(handler):
            raise AttributeError(f"{module.__file__ or entry} defines no {HANDLER}() function")
        self.module = module
        return handler

    def _device_id(self) -> str:
        try:
            import torch  # lazily: costs a second or two, and only the load needs it
        except ImportError:
            return "-1"
        return "0" if torch.cuda.is_available() else "-1"

    def init_input(self) -> Any:
        """The ``Input`` of the init call: no content; the model options, ``model_dir``,
        ``handler`` and ``device_id`` as properties."""
        props = self.properties
        props["handler"] = HANDLER
        props["device_id"] = self._device_id()
        return _new_input(props)

    def _send_init(self) -> None:
        result = self._handle(self.init_input())
        code = getattr(result, "code", 200) if result is not None else 200
        if code >= 400:
            body = output_body(result).decode("utf-8", errors="replace")
            try:
                body = str(json.loads(body).get("error") or body)
            except (ValueError, AttributeError):
                pass
            raise RuntimeError(f"init call answered {code}: {body or result.message}")

    # -- requests --

    def make_input(self, body: bytes, headers: HeaderPairs, query: QueryParams = ()) -> Any:
        """The ``Input`` djl's front end builds for one HTTP request (:func:`request_input`)."""
        return request_input(body, headers, query)

    def invoke(self, inp: Any) -> Any:
        """Call ``handle(inp)`` and return an ``Output``, never raising for the handler.

        As djl-serving's synchronous worker answers: an exception becomes
        ``Output().error(str(e))`` (424 with a JSON body), or a bodiless 507 whose message is
        the exception's text for out-of-memory; ``None`` becomes a 204; anything that is not
        an ``Output`` becomes a 424 naming its type. Raises :class:`WorkerNotReady` when the
        model is not loaded.
        """
        if self.status != READY:
            raise WorkerNotReady(self.not_ready_message())
        from djl_stream.serving.compat import Output

        try:
            result = self._handle(inp)
        except Exception as error:
            logger.exception("handle() failed for request %s",
                             inp.properties.get("requestId", "?"))
            if is_out_of_memory(error):
                return Output(code=507, message=str(error))
            return Output().error(str(error))
        if result is None:
            return Output(code=204, message="No content")
        if not isinstance(result, Output):
            return Output().error(f"Invalid output type: {type(result)}")
        return result

    def not_ready_message(self) -> str:
        """Why requests are refused now, as clients are told: still loading, or the load
        failed. Of a failure only the exception's type: its text names paths and settings
        (``failure_reason`` has it, and the log its traceback).

        >>> ModelWorker("model/").not_ready_message()
        'model model is loading'
        """
        if self.status == FAILED:
            return (f"model {self.model_name} failed to load ({self.failure_type}); "
                    "the server log has the details")
        if self.status == LOADING:
            return f"model {self.model_name} is loading"
        return f"model {self.model_name} is ready"

    def __repr__(self) -> str:
        return f"ModelWorker({str(self.model_dir)!r}, status={self.status!r})"

"""The model directory as a Ray Serve application: several replicas behind one front.

Two deployments, as Ray Serve's own LLM examples split the work:

- **ModelReplica** (``N`` of them, ``replica_cpus`` each): one :class:`ModelWorker` per
  replica, so each replica runs the directory's unchanged ``handle()`` with its own
  scheduler and batches its requests continuously. It answers one call, ``answer``: an
  ``Input`` in, the ``Output``'s head (status, headers, body or the stream's error records)
  then the stream's chunks out, streamed back through Ray.
- **Front** (one, no CPU of its own): the local server's Starlette app
  (:func:`~djl_stream.serving.server.create_app`) with a :class:`RemoteWorker` in place of
  the in-process worker, behind Ray Serve's HTTP proxy. Every route of ``djl-stream serve``
  (djl's, OpenAI's, TGI's, the chat socket and page) works the same, and the answer's bytes
  are the replica's, unchanged.

Ray's router sends each call to the replica with the fewest calls in flight, at most
``max_ongoing_requests`` each (the model's ``max_rolling_batch_size``: a replica is sent no
more than it batches; the rest wait in the router for the first free row on any replica).
A replica that dies mid-answer ends only its own streams, each with the stream's own error
record (the replica rendered it when the stream began: :data:`ERROR_RECORD_ATTRIBUTE`), and
Ray starts a new one. Each answer says which replica served it in
``x-djl-stream-replica`` (Ray's replica id and the process id), for finding its log.

Run it with ``djl-stream serve DIR --ray --replicas 2`` (:func:`serve_on_ray`), or point Ray
Serve's own CLI at :func:`app_builder`::

    $ serve run djl_stream.serving.ray_serve:app_builder model_dir=model replicas=2
    $ curl -N localhost:8000/invocations -d '{"inputs": "Hello", "stream": true}'
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
from pathlib import Path
from typing import Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional

import ray
from ray import serve
from ray.serve.handle import DeploymentHandle

from djl_stream.serving.access import AccessControl, warn_if_exposed
from djl_stream.serving.admission import SHUTTING_DOWN
from djl_stream.serving.cancellation import Cancellation, attach_cancellation, cancellation_of
from djl_stream.serving.compat import Output
from djl_stream.serving.http_limits import HttpLimits
from djl_stream.serving.properties import djl_init_properties
from djl_stream.serving.replies import ERROR_RECORD_ATTRIBUTE
from djl_stream.serving.scaling import ScalingOptions, passed_environment
from djl_stream.serving.server import DEFAULT_MAX_THREADS, create_app
from djl_stream.serving.worker import (FAILED, LOADING, READY, ModelWorker, WorkerNotReady,
                                       input_from_parts, input_parts, next_stream_chunk,
                                       output_body, request_input, stream_failure_chunk)

logger = logging.getLogger(__name__)

#: The application's name in Ray Serve (``serve status`` lists it).
APP_NAME = "djl-stream"
#: The response header naming the replica that answered.
REPLICA_HEADER = "x-djl-stream-replica"
#: How a stream whose replica died ends, inside the stream's own error record.
REPLICA_LOST = ("the model replica generating this answer stopped before it was complete; "
                "the other replicas go on serving, and Ray Serve starts a new one")


# -- the replicas' side ----------------------------------------------------------------

class ModelReplica:
    """One replica: the model directory's ``handle()`` in a :class:`ModelWorker`.

    The constructor loads the model and raises if that fails, so that Ray reports the
    replica as failed instead of routing requests to it.
    """

    def __init__(self, model_dir: str, environ: Optional[Mapping[str, str]] = None) -> None:
        os.environ.update(environ or {})
        self.worker = ModelWorker(model_dir)
        # Ray constructs a replica on its event loop, where handle() would answer the init
        # call with a coroutine (djl's async worker mode): load from a thread of its own.
        with concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="model-load") as load:
            status = load.submit(self.worker.load).result()
        if status != READY:
            raise RuntimeError(f"model {self.worker.model_name} failed to load: "
                               f"{self.worker.failure_reason}")
        context = serve.get_replica_context()
        self.identity = f"{context.replica_id.unique_id}; pid={os.getpid()}"
        # Pulling a stream's next chunk blocks until the model produced it: a thread each.
        self._threads = concurrent.futures.ThreadPoolExecutor(
            DEFAULT_MAX_THREADS, thread_name_prefix="replica-stream")

    def describe(self) -> Dict[str, Any]:
        """What the front needs to know of the model (its name, options and directory)."""
        worker = self.worker
        return {"model_name": worker.model_name, "properties": worker.properties,
                "model_dir": str(worker.model_dir)}

    async def answer(self, properties: Dict[str, str],
                     content: List[tuple]) -> AsyncIterator[Any]:
        """One request: the head of its ``Output`` (a dict), then each stream chunk (bytes).

        A call cancelled by the front (its client left) cancels the request's
        :class:`Cancellation`, which stops its generation, queued or running.
        """
        loop = asyncio.get_running_loop()
        cancellation = Cancellation()
        inp = attach_cancellation(input_from_parts(properties, content), cancellation)
        invoked = loop.run_in_executor(self._threads, self.worker.invoke, inp)
        try:
            output = await asyncio.shield(invoked)
        except asyncio.CancelledError:
            cancellation.cancel()
            invoked.add_done_callback(lambda done: _discard(done, self._threads))
            raise
        head = {"code": int(output.code), "message": str(output.message),
                "properties": {**dict(output.properties), REPLICA_HEADER: self.identity}}
        if getattr(output, "stream_content", None) is None:
            yield {**head, "body": output_body(output)}
            return
        error_record = getattr(output, ERROR_RECORD_ATTRIBUTE, None)
        if error_record is not None:
            head["replica_lost_record"] = error_record(f"ReplicaLost: {REPLICA_LOST}")
            head["shutdown_record"] = error_record(f"ShuttingDown: {SHUTTING_DOWN}")
        yield head
        pulling: Optional[asyncio.Future] = None
        try:
            while True:
                pulling = loop.run_in_executor(self._threads, next_stream_chunk, output)
                chunk = await asyncio.shield(pulling)
                pulling = None
                if chunk is None:
                    return
                yield chunk
        finally:
            # Ended early (the front cancelled, or the client went away): stop generating.
            # A next() in flight finishes first; the stream is closed after it, never beside.
            cancellation.cancel()
            close = output.stream_content.close if hasattr(output.stream_content, "close") \
                else (lambda: None)
            if pulling is None:
                loop.run_in_executor(self._threads, close)
            else:
                pulling.add_done_callback(lambda _: self._threads.submit(close))


def _discard(invoked: concurrent.futures.Future, threads: concurrent.futures.Executor) -> None:
    """Close the stream of an answer whose caller left while ``handle()`` ran."""
    if invoked.cancelled() or invoked.exception() is not None:
        return
    close = getattr(getattr(invoked.result(), "stream_content", None), "close", None)
    if close is not None:
        threads.submit(close)


# -- the front's side ------------------------------------------------------------------

class RemoteWorker:
    """What the local server asks of a :class:`ModelWorker`, answered by the model
    replicas through a Ray Serve ``DeploymentHandle``.

    ``invoke`` sends the ``Input`` to a replica and returns an ``Output`` that carries the
    replica's answer: its status, headers and body, or its stream, chunk by chunk. A
    replica lost before its answer began gives a 503; after, the stream ends with its own
    error record. Cancelling the request's :class:`Cancellation` cancels the call.
    """

    def __init__(self, replicas: DeploymentHandle) -> None:
        self._replicas = replicas
        self._streaming = replicas.options(stream=True)
        self.status = LOADING
        self.failure_reason: Optional[str] = None
        self.failure_type: Optional[str] = None
        self.model_dir = Path("model")
        self._description: Dict[str, Any] = {"model_name": "model", "properties": {}}

    @property
    def model_name(self) -> str:
        return self._description["model_name"]

    @property
    def properties(self) -> Dict[str, str]:
        return dict(self._description["properties"])

    def load(self) -> str:
        """Wait for a replica to be up and learn the model's name and options from it."""
        try:
            self._description = self._replicas.describe.remote().result()
        except Exception as error:  # noqa: BLE001 - recorded, as ModelWorker records it
            self.failure_reason = f"{type(error).__name__}: {error}"
            self.failure_type = type(error).__name__
            self.status = FAILED
            logger.exception("no model replica answered")
            return self.status
        self.model_dir = Path(self._description["model_dir"])
        self.status = READY
        logger.info("model %s is ready on Ray Serve", self.model_name)
        return self.status

    def not_ready_message(self) -> str:
        if self.status == FAILED:
            return (f"model {self.model_name} has no replica ({self.failure_type}); "
                    "the server log has the details")
        if self.status == LOADING:
            return f"model {self.model_name} is loading"
        return f"model {self.model_name} is ready"

    @staticmethod
    def make_input(body: bytes, headers: Any, query: Any = ()) -> Any:
        return request_input(body, headers, query)

    def invoke(self, inp: Any) -> Any:
        if self.status != READY:
            raise WorkerNotReady(self.not_ready_message())
        properties, content = input_parts(inp)
        responses = self._streaming.answer.remote(properties, content)
        cancellation = cancellation_of(inp)
        forget = (cancellation.on_cancel(responses.cancel) if cancellation is not None
                  else (lambda: None))
        try:
            head = next(responses)
        except BaseException as error:  # noqa: BLE001 - cancelled, or the replica is gone
            forget()
            if cancellation is not None and cancellation.cancelled:
                return Output(code=499, message="Client Closed Request")
            logger.warning("a model replica failed before answering: %s", error)
            return Output(code=503, message="Service Unavailable").add_as_json(
                {"code": 503, "type": "ServiceUnavailableException",
                 "message": f"{REPLICA_LOST} ({type(error).__name__})"})
        output = Output(code=head["code"], message=head["message"])
        for name, value in head["properties"].items():
            output.add_property(name, value)
        if "body" in head:
            forget()
            return output.add(head["body"])
        return output.add_stream_content(_remote_chunks(responses, head, cancellation, forget))


def _remote_chunks(responses: Iterator[bytes], head: Mapping[str, Any],
                   cancellation: Optional[Cancellation], forget: Any) -> Iterator[bytes]:
    """The replica's chunks; a stream cut short by a lost replica or a shutdown ends with
    the stream's own error record (raw text, as djl's front end sends it, for a handler
    that has none)."""
    try:
        for chunk in responses:
            yield chunk
    except Exception as error:  # noqa: BLE001 - the stream's end must reach the client
        if cancellation is not None and cancellation.cancelled:
            if cancellation.error is not None:
                yield head.get("shutdown_record") or stream_failure_chunk(cancellation.error)
            return
        logger.warning("a model replica stopped mid-stream: %s", error)
        yield head.get("replica_lost_record") or stream_failure_chunk(error)
    finally:
        forget()
        responses.cancel()


class Front:
    """The front deployment: ``djl-stream serve``'s app on the model replicas."""

    def __init__(self, replicas: DeploymentHandle, limits: HttpLimits = HttpLimits(),
                 access: AccessControl = AccessControl()) -> None:
        self.worker = RemoteWorker(replicas)
        self.limits = limits
        self.access = access

    def __serve_build_asgi_app__(self) -> Any:
        return create_app(".", worker=self.worker, limits=self.limits, access=self.access)


# -- building and running the application -----------------------------------------------

def build_app(model_dir: str | Path, scaling: ScalingOptions = ScalingOptions(),
              environ: Optional[Mapping[str, str]] = None,
              limits: HttpLimits = HttpLimits(), access: AccessControl = AccessControl()) -> Any:
    """The Ray Serve application serving ``model_dir`` (not yet running: ``serve.run`` it).

    ``environ`` (default ``os.environ``) gives the replicas their ``OPTION_*`` variables.

    >>> app = build_app("model/", ScalingOptions(replicas=2))  # doctest: +SKIP
    >>> serve.run(app, name=APP_NAME, route_prefix="/")      # doctest: +SKIP
    """
    environ = os.environ if environ is None else environ
    model_dir = Path(model_dir).resolve()
    rows = djl_init_properties(model_dir, environ).get("max_rolling_batch_size")
    replica = serve.deployment(ModelReplica, name="ModelReplica",
                               **scaling.deployment_options(int(rows) if rows else None))
    front = serve.deployment(serve.ingress()(Front), name="Front",
                             ray_actor_options={"num_cpus": 0},
                             max_ongoing_requests=limits.limit_concurrency or 1000)
    replicas = replica.bind(str(model_dir), passed_environment(environ))
    return front.bind(replicas, limits, access)


def app_builder(args: Dict[str, str]) -> Any:
    """The application for Ray Serve's CLI: ``serve run
    djl_stream.serving.ray_serve:app_builder model_dir=DIR [replicas=N] [min_replicas=N]
    [max_replicas=N] [target_ongoing_requests=N] [replica_cpus=N]``."""
    args = dict(args)
    model_dir = args.pop("model_dir", "model")
    numbers = {"replicas": int, "min_replicas": int, "max_replicas": int,
               "target_ongoing_requests": float, "replica_cpus": float,
               "max_ongoing_requests": int}
    unknown = sorted(set(args) - set(numbers))
    if unknown:
        raise ValueError(f"unknown arguments {unknown}; known: model_dir, {', '.join(numbers)}")
    scaling = ScalingOptions(**{name: numbers[name](value) for name, value in args.items()})
    return build_app(model_dir, scaling)


def serve_on_ray(model_dir: str | Path, host: str = "127.0.0.1", port: int = 8080,
                 scaling: ScalingOptions = ScalingOptions(),
                 limits: HttpLimits = HttpLimits(), access: AccessControl = AccessControl(),
                 address: Optional[str] = None, cpus: Optional[float] = None) -> None:
    """Deploy ``model_dir`` on Ray Serve, HTTP on ``host:port``, until SIGTERM or Ctrl+C.

    Connects to the cluster at ``address`` (or ``RAY_ADDRESS``); without one, starts a
    local cluster of ``cpus`` CPUs (default: the machine's) on 127.0.0.1.
    """
    warn_if_exposed(host, access)
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address)
    else:
        ray.init(num_cpus=cpus, include_dashboard=False, _node_ip_address="127.0.0.1")
    serve.start(http_options={"host": host, "port": port})
    serve.run(build_app(model_dir, scaling, limits=limits, access=access), name=APP_NAME,
              route_prefix="/")
    logger.info("serving %s on http://%s:%d through Ray Serve", model_dir, host, port)
    stop = threading.Event()
    _on_termination(stop.set)
    try:
        stop.wait()
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()


def _on_termination(callback: Any) -> None:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: callback())

"""djl-stream's real server in a subprocess, and streaming clients that time every line.

:class:`ServerProcess` starts ``python -m djl_stream serve MODEL_DIR`` on a free loopback
port and waits for ``GET /ping`` to answer 200. :func:`stream_once` sends one streaming
request with httpx and records when each line (one decode step) arrives;
:func:`run_concurrent` does that from several threads released together, and
:func:`late_arrival` sends one more request while the others are decoding.

Example::

    with ServerProcess("model", name="default", workdir=Path("/tmp/x")) as server:
        timing = stream_once(server.url, request_body("Hello", 16))
        load = run_concurrent(server.url, [request_body("Hello", 16)] * 4)
        print(timing.ttft, load.aggregate_tokens_per_s)
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Sequence

import httpx

from djl_stream.serving.properties import read_serving_properties

from .measure import ProcessMemory, StreamTiming, all_inter_token, percentile

READY_TIMEOUT_S = 600.0
#: Read timeout between two lines: a queued one-at-a-time request may wait for all others.
READ_TIMEOUT_S = 900.0


def request_body(prompt: str, new_tokens: int) -> dict:
    """A greedy streaming request for ``new_tokens`` tokens."""
    return {"inputs": prompt, "parameters": {"max_new_tokens": new_tokens}, "stream": True}


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def configure_model_dir(
    model_dir: Path, options: Mapping[str, str], workdir: Path
) -> tuple[Path, Dict[str, str]]:
    """Where to serve from and which ``OPTION_*`` variables to set for ``options``.

    Options go in the environment, as SageMaker passes them; ``serving.properties`` wins
    over the environment, so an option the file sets is overridden in a copy of the model
    directory whose entries are symlinks except for a rewritten ``serving.properties``.
    """
    env = {f"OPTION_{key.upper()}": value for key, value in options.items()}
    in_file = read_serving_properties(model_dir)
    clashing = {k: v for k, v in options.items() if f"option.{k}" in in_file}
    if not clashing:
        return model_dir, env
    overlay = workdir / model_dir.resolve().name
    overlay.mkdir(parents=True)
    for entry in model_dir.resolve().iterdir():
        if entry.name != "serving.properties":
            (overlay / entry.name).symlink_to(entry)
    merged = {**in_file, **{f"option.{k}": v for k, v in clashing.items()}}
    (overlay / "serving.properties").write_text(
        "".join(f"{key}={value}\n" for key, value in merged.items()), encoding="utf-8"
    )
    return overlay, env


class ServerProcess:
    """``python -m djl_stream serve`` in a subprocess, ready once :meth:`start` returns.

    ``options`` are model properties (``{"max_rolling_batch_size": "1"}``); ``env`` more
    environment variables; ``flags`` more arguments of ``djl-stream serve``
    (``("--timeout-header", "2")``). The server's log goes to ``workdir/<name>.log``.
    """

    def __init__(
        self,
        model_dir: str | Path,
        *,
        name: str,
        workdir: Path,
        options: Optional[Mapping[str, str]] = None,
        env: Optional[Mapping[str, str]] = None,
        flags: Sequence[str] = (),
    ) -> None:
        self.name = name
        self.flags = tuple(flags)
        self.workdir = workdir / name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.model_dir, option_env = configure_model_dir(Path(model_dir), options or {}, self.workdir)
        self.env = {**os.environ, **option_env, **(env or {})}
        self.port = free_port()
        self.log_path = self.workdir / "server.log"
        self.process: Optional[subprocess.Popen] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/invocations"

    @property
    def pid(self) -> Optional[int]:
        return self.process.pid if self.process else None

    def start(self) -> "ServerProcess":
        """Launch and wait until ready."""
        self.launch()
        self.wait_ready()
        return self

    #: The route that answers 200 once the model is loaded.
    ready_path = "/ping"
    #: Start the server as a process group of its own, stopped as a whole (a server that
    #: starts helper processes, as Ray does).
    own_session = False

    def command(self) -> List[str]:
        """What :meth:`launch` runs."""
        return [sys.executable, "-m", "djl_stream", "serve", str(self.model_dir),
                "--port", str(self.port), *self.flags]

    def launch(self) -> None:
        """Start the process; the model loads in the background."""
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(self.command(), env=self.env, stdout=log,
                                            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            start_new_session=self.own_session)

    def wait_ready(self) -> None:
        """Poll :attr:`ready_path` until it answers 200; raise with the log's tail if the
        process exits or the model does not load in time."""
        deadline = time.monotonic() + READY_TIMEOUT_S
        ping = f"http://127.0.0.1:{self.port}{self.ready_path}"
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the {self.name} server exited with {self.process.returncode}:\n"
                                   f"{self.log_tail()}")
            try:
                if httpx.get(ping, timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        self.stop()
        raise RuntimeError(f"the {self.name} server was not ready after {READY_TIMEOUT_S:.0f} s:\n"
                           f"{self.log_tail()}")

    def wait_compiled(self, body: dict, timeout: float = READY_TIMEOUT_S) -> str:
        """Where the server gets compiled decode steps (its log says so), send ``body``
        (alone, and six at once: a program of few rows and the one of every row count are
        each checked by a step they run) until its decode steps run every one of them, or
        it says the eager forward goes on serving for one; returns which (``compiled``,
        ``eager``), ``eager`` at once where it compiles nothing (``option.compile=false``,
        a GPU)."""
        from concurrent.futures import ThreadPoolExecutor

        from djl_stream.runtime.decode_program import NOT_USED, SWITCHED

        deadline = time.monotonic() + timeout
        with httpx.Client(timeout=_timeout()) as client, ThreadPoolExecutor(6) as pool:
            for attempt in itertools.count():
                text = self.log_path.read_text(errors="replace")
                wanted = text.count("getting the compiled decode step")
                if not wanted:
                    return "eager"
                if text.count(SWITCHED) + text.count(NOT_USED) >= wanted:
                    return "compiled" if SWITCHED in text else "eager"
                if time.monotonic() > deadline:
                    raise RuntimeError(f"the {self.name} server's decode step was not compiled "
                                       f"after {timeout:.0f} s:\n{self.log_tail()}")
                clients = 6 if attempt % 2 else 1
                try:
                    list(pool.map(lambda _: client.post(self.url, json={**body, "stream": False}),
                                  range(clients)))
                except httpx.HTTPError as error:  # (the log, which a temporary folder loses)
                    raise RuntimeError(
                        f"the {self.name} server failed a request while its decode steps "
                        f"compiled ({type(error).__name__}: {error}); exit status "
                        f"{self.process.poll()}:\n{self.log_tail()}") from error
                time.sleep(1.0)
        return "eager"

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def memory(self) -> Optional[ProcessMemory]:
        return ProcessMemory.of(self.pid) if self.pid else None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        if self.own_session:  # whatever the server started goes with it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


class StreamError(Exception):
    """The server reported an error inside the stream (after its 200)."""


#: Reads a streamed response: yields each piece of text as it arrives; raises
#: :class:`StreamError` for an error the server put in the stream.
PieceReader = Callable[[httpx.Response], Iterator[str]]


def djl_lines(response: httpx.Response) -> Iterator[str]:
    """djl-serving's JSON lines: one ``{"output_tokens": [...]}`` line per decode step
    (the first prompt's piece), or an ``{"error": ...}`` line."""
    for line in response.iter_lines():
        if not line:
            continue
        record = json.loads(line)
        if "error" in record:
            raise StreamError(str(record["error"]))
        yield record["output_tokens"][0]


def stream_once(
    url: str,
    body: dict,
    *,
    client: Optional[httpx.Client] = None,
    on_line: Optional[Callable[[], None]] = None,
    read: PieceReader = djl_lines,
) -> StreamTiming:
    """Send one streaming request and time every piece ``read`` yields (for djl's lines,
    one line = one decode step).

    The clock starts before the request is sent, so time to first token includes the
    HTTP round trip, request parsing, the chat template and the prefill. An HTTP error or
    an error in the stream ends the timing with ``error`` set.
    """
    own = client is None
    client = client or httpx.Client(timeout=_timeout())
    arrivals: List[float] = []
    pieces: List[str] = []
    error = None
    start = time.perf_counter()
    try:
        with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                error = f"HTTP {response.status_code}: {response.read()[:300]!r}"
            else:
                for piece in read(response):
                    arrivals.append(time.perf_counter())
                    pieces.append(piece)
                    if on_line is not None:
                        on_line()
    except (httpx.HTTPError, StreamError) as failure:
        error = f"{type(failure).__name__}: {failure}"
    finally:
        if own:
            client.close()
    end = time.perf_counter()
    return StreamTiming(start, tuple(arrivals), end, len(arrivals), "".join(pieces), error=error)


def _timeout() -> httpx.Timeout:
    return httpx.Timeout(READ_TIMEOUT_S, connect=10.0)


@dataclasses.dataclass(frozen=True)
class LoadResult:
    """What ``clients`` concurrent streams saw."""

    clients: int
    timings: tuple[StreamTiming, ...]

    @property
    def tokens(self) -> int:
        return sum(t.tokens for t in self.timings)

    @property
    def aggregate_tokens_per_s(self) -> float:
        """Tokens received by every client over the span from the first request sent to
        the last line received."""
        span = max(t.end for t in self.timings) - min(t.start for t in self.timings)
        return self.tokens / span

    def ttft(self, q: float) -> float:
        return percentile((t.ttft for t in self.timings if t.ttft is not None), q)

    def inter_token(self, q: float) -> float:
        return percentile(all_inter_token(self.timings), q)

    @property
    def errors(self) -> List[str]:
        return [t.error for t in self.timings if t.error]


def _run_threads(targets: Sequence[Callable[[], None]]) -> List[threading.Thread]:
    threads = [threading.Thread(target=t, daemon=True) for t in targets]
    for thread in threads:
        thread.start()
    return threads


def run_concurrent(url: str, bodies: Sequence[dict], read: PieceReader = djl_lines) -> LoadResult:
    """One client per body, each with its own connection, released at the same instant."""
    clients = [httpx.Client(timeout=_timeout()) for _ in bodies]
    barrier = threading.Barrier(len(bodies))
    timings: List[Optional[StreamTiming]] = [None] * len(bodies)

    def client_task(i: int) -> Callable[[], None]:
        def task() -> None:
            barrier.wait()
            timings[i] = stream_once(url, bodies[i], client=clients[i], read=read)
        return task

    try:
        for thread in _run_threads([client_task(i) for i in range(len(bodies))]):
            thread.join()
    finally:
        for client in clients:
            client.close()
    return LoadResult(len(bodies), tuple(timings))


def late_arrival(
    url: str, early_bodies: Sequence[dict], late_body: dict, *, steps_before: int = 2
) -> tuple[StreamTiming, LoadResult]:
    """Start the ``early_bodies`` streams; once each of them has received ``steps_before``
    lines (all prefilled and decoding), send ``late_body``. Returns the late request's
    timing and what the early ones saw.

    Should an early stream end before all of them got that far (a server that serves one
    request at a time), the late request goes out then.
    """
    counts = [0] * len(early_bodies)
    lock = threading.Lock()
    all_decoding = threading.Event()
    timings: List[Optional[StreamTiming]] = [None] * len(early_bodies)

    def client_task(i: int) -> Callable[[], None]:
        def seen_line() -> None:
            with lock:
                counts[i] += 1
                if min(counts) >= steps_before:
                    all_decoding.set()

        def task() -> None:
            timings[i] = stream_once(url, early_bodies[i], on_line=seen_line)
            all_decoding.set()
        return task

    threads = _run_threads([client_task(i) for i in range(len(early_bodies))])
    all_decoding.wait()
    late = stream_once(url, late_body)
    for thread in threads:
        thread.join()
    return late, LoadResult(len(early_bodies), tuple(timings))


def not_yet_decoding(late: StreamTiming, early: LoadResult, steps_before: int = 2) -> int:
    """How many of :func:`late_arrival`'s early streams had fewer than ``steps_before``
    lines when the late request went out: none where it joined them all decoding; some
    where an early stream ended first (a server that decodes fewer requests at once than
    there were early clients), and the late request then waited behind those instead.

    >>> decoding = StreamTiming(0.0, (0.1, 0.2, 0.3), 0.3, 3)
    >>> waiting = StreamTiming(0.0, (0.4, 0.5), 0.5, 2)
    >>> late = StreamTiming(0.25, (0.45,), 0.45, 1)
    >>> not_yet_decoding(late, LoadResult(2, (decoding, decoding))), not_yet_decoding(
    ...     late, LoadResult(2, (decoding, waiting)))
    (0, 1)
    """
    return sum(1 for timing in early.timings
               if sum(t <= late.start for t in timing.arrivals) < steps_before)


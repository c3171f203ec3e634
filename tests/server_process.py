"""``python -m djl_stream serve DIR`` as a real subprocess on a free loopback port, with an
httpx client for it: how every server test runs the server, exactly as `make serve` does."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Mapping, Optional, Sequence

import httpx


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """The server for ``model_dir``; its output goes to ``log_path`` (a temporary file by
    default). ``env`` adds environment variables (``OPTION_*`` ones, for instance), ``args``
    options of ``djl-stream serve`` (``--shutdown-grace``, for instance). It serves with
    the eager step (``OPTION_COMPILE=false``) unless ``env`` or the directory's
    ``serving.properties`` says otherwise: a compile would take a core for the server's
    whole life in a test, and the compiled step has tests of its own.
    ``client_timeout`` is a deadline for each HTTP call of ``http``, not a speed target:
    the machine that runs the tests may be busy. ``headers`` go with each call of ``http``
    (an API key's, for a server that protects ``/ping``)."""

    def __init__(self, model_dir: Path, *, log_path: Optional[Path] = None,
                 env: Optional[Mapping[str, str]] = None, client_timeout: float = 120.0,
                 args: Sequence[str] = (), headers: Optional[Mapping[str, str]] = None) -> None:
        self.model_dir = Path(model_dir)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if log_path is None:
            handle, name = tempfile.mkstemp(prefix=f"djl-stream-{self.port}-", suffix=".log")
            os.close(handle)
            log_path = Path(name)
        self.log_path = Path(log_path)
        self.log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "djl_stream", "serve", str(self.model_dir), "--port", str(self.port),
             *args],
            stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, "OPTION_COMPILE": "false", **(env or {})})
        self.http = httpx.Client(base_url=self.url, timeout=client_timeout, headers=headers)

    def first_ping(self, timeout: float = 30.0) -> httpx.Response:
        """The first answer to /ping: the server is up, the model may still be loading."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert self.process.poll() is None, f"server exited:\n{self.logs()}"
            try:
                return self.http.get("/ping")
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError(f"server did not start:\n{self.logs()}")

    def wait_ready(self, timeout: float = 30.0) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while self.first_ping(timeout).status_code != 200:
            assert time.monotonic() < deadline, f"model did not load:\n{self.logs()}"
            time.sleep(0.05)
        return self

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """What an orchestrator sends before scaling in (SIGTERM by default)."""
        self.process.send_signal(sig)

    def wait_exit(self, timeout: float = 120.0) -> int:
        """The exit status once the server has stopped by itself (a deadline, not a speed
        target)."""
        try:
            return self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"the server did not exit:\n{self.logs()}") from None

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, condition, since: int = 0, timeout: float = 60.0) -> str:
        """The log written after offset ``since`` once ``condition`` (a text it must hold,
        or a test of the log) holds: the server writes a request's log lines as it ends
        the request, which may be a moment after the client read the answer (a
        deadline, not a speed target)."""
        test = condition if callable(condition) else (lambda log: condition in log)
        deadline = time.monotonic() + timeout
        while not test(new := self.logs()[since:]):
            assert time.monotonic() < deadline, f"never logged {condition!r}:\n{new[-3000:]}"
            time.sleep(0.05)
        return new

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM, then SIGKILL if the server has not exited within ``grace`` seconds."""
        self.http.close()
        self.process.terminate()
        try:
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


@contextmanager
def serving(model_dir: Path, **options) -> Iterator[ServerProcess]:
    """A ready server for ``model_dir`` (``options`` as :class:`ServerProcess`'s), stopped on
    leaving: what a module-scoped server fixture yields. Its deadline is generous, not a
    speed target: the machine that runs the tests may be busy."""
    process = ServerProcess(model_dir, **options)
    try:
        yield process.wait_ready(timeout=600)
    finally:
        process.stop()

"""Where a model directory runs in the conformance suite, behind one interface.

A :class:`Target` is one way to serve a model directory: the real djl-serving Python worker
of a release branch in its synchronous or asynchronous mode (behind the modelled front end
of :mod:`djl_frontend`), or ``djl-stream serve`` (the local server, over real HTTP). Each
answers ``ask(body)`` with the :class:`~djl_frontend.HttpAnswer` an HTTP client receives,
so one scenario runs on all of them and their answers can be compared.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any, Dict, Iterator, Mapping, Optional

from djl_frontend import DjlWorker, HttpAnswer


@dataclasses.dataclass(frozen=True)
class Target:
    """``branch`` is a djl-serving release branch, or ``None`` for ``djl-stream serve``."""

    name: str
    branch: Optional[str] = None
    async_mode: bool = False

    @property
    def local(self) -> bool:
        return self.branch is None

    def environ(self, base: Mapping[str, str]) -> Dict[str, str]:
        env = dict(base)
        if self.async_mode:
            # djl-serving 0.33 reads option.async_mode (PyModel.load); LMI images get there
            # without it when SERVING_FEATURES=vllm and no entry point is configured.
            env["OPTION_ASYNC_MODE"] = "true"
        return env


SYNC_033 = Target("djl-0.33", "0.33.0-dlc")
SYNC_030 = Target("djl-0.30", "0.30.0-dlc")
ASYNC_033 = Target("djl-0.33-async", "0.33.0-dlc", async_mode=True)
LOCAL = Target("djl-stream-serve")
ALL = (SYNC_033, SYNC_030, ASYNC_033, LOCAL)
REAL = (SYNC_033, SYNC_030, ASYNC_033)


class Served:
    """A model directory running on a target; ``ask`` sends one request."""

    def __init__(self, target: Target, model_dir: Path, src: Path,
                 environ: Mapping[str, str] = {}) -> None:
        self.target = target
        self.model_dir = model_dir
        env = target.environ(environ)
        if target.local:
            from server_process import ServerProcess

            self.server = ServerProcess(model_dir, env=env, client_timeout=300.0)
            self.server.wait_ready(timeout=1800.0)  # (a first start compiles: a deadline)
            self.worker = None
        else:
            self.server = None
            self.worker = DjlWorker(src, target.branch, model_dir, env)
            self.worker.start()
            assert self.worker.async_mode == target.async_mode

    def ask(self, body: Any, headers: Mapping[str, str] = {}) -> HttpAnswer:
        if self.worker is not None:
            return self.worker.invoke(body, headers)
        raw = body if isinstance(body, bytes) else json.dumps(body).encode("utf-8")
        with self.server.http.stream("POST", "/invocations", content=raw,
                                     headers={"content-type": "application/json", **headers}) as r:
            chunks = list(r.iter_raw())
            return HttpAnswer(r.status_code, dict(r.headers), chunks,
                              chunked=r.headers.get("transfer-encoding") == "chunked")

    def logs(self) -> str:
        return self.worker.logs() if self.worker is not None else self.server.logs()

    def stop(self) -> None:
        if self.worker is not None:
            self.worker.stop()
        else:
            self.server.stop()


class Fleet:
    """Every target serving the same model directory, started on first use."""

    def __init__(self, model_dir: Path, src: Path, environ: Mapping[str, str] = {}) -> None:
        self.model_dir = model_dir
        self.src = src
        self.environ = dict(environ)
        self._served: Dict[Target, Served] = {}

    def __getitem__(self, target: Target) -> Served:
        if target not in self._served:
            self._served[target] = Served(target, self.model_dir, self.src, self.environ)
        return self._served[target]

    def ask_all(self, body: Any, targets=ALL) -> Dict[Target, HttpAnswer]:
        return {target: self[target].ask(body) for target in targets}

    def stop(self) -> None:
        for served in self._served.values():
            served.stop()
        self._served.clear()


def fleet_fixture(fleet: Fleet) -> Iterator[Fleet]:
    try:
        yield fleet
    finally:
        fleet.stop()

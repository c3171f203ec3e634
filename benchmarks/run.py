"""``python -m benchmarks.run``: measure everything, write ``BENCHMARKS.md`` and the plot.

The run, in order: load the model in-process and start two servers (continuous batching,
and one at a time with ``OPTION_MAX_ROLLING_BATCH_SIZE=1``); warm every row up; the
single-stream rows, interleaved (every row once per repetition); the concurrency load
tests, interleaved the same way (every client count on both servers per repetition, then a
late arrival); memory before and after; then the report. Targets are printed and written,
never asserted: the exit status is 0 whatever the figures.

Examples::

    python -m benchmarks.run --model-dir model                  # make bench
    python -m benchmarks.run --model-dir model --quick          # smoke run, ~30 s on 2 cores
    python -m benchmarks.run --model-dir /models/llama --device cuda --dtype bf16 \\
        --new-tokens 256 --concurrency 1,4,16,64
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from . import http_load, inprocess, report
from .machine import describe
from .measure import (
    MemoryChange,
    ProcessMemory,
    cpu_load,
    process_cpu_seconds,
    system_busy_cpu_seconds,
)
from .sections import kept_sections
from .results import CONTINUOUS, ONE_AT_A_TIME, Results
from .settings import PROMPTS, Settings
from .targets import evaluate

#: Idle time before reading a server's memory after a load. A client receives its last
#: line before the server's decode loop has finished that step, dropped the batch and
#: returned the freed memory (malloc_trim): read at once, RSS right after a 16-client burst
#: was +117 MB, and 100 ms later +23 MB (measured in-process through the service).
SETTLE_SECONDS = 1.0

#: Model properties of the two ways of serving (``OPTION_<NAME>`` in the server's env).
SERVER_OPTIONS = {CONTINUOUS: {}, ONE_AT_A_TIME: {"max_rolling_batch_size": "1"}}


def _int_list(text: str) -> List[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.run",
        description="Benchmark djl-stream against generate(), a bare KV-cache loop and the "
                    "Jina and Ray Serve tutorials' streaming, in-process and over HTTP; "
                    "write BENCHMARKS.md and a concurrency plot.")
    parser.add_argument("--model-dir", default="model", help="model directory (default: %(default)s)")
    parser.add_argument("--new-tokens", type=int, help="tokens per single-stream row (default: 128)")
    parser.add_argument("--concurrency", type=_int_list,
                        help="concurrent HTTP clients to try (default: 1,2,4,8,16)")
    parser.add_argument("--concurrency-new-tokens", type=int,
                        help="tokens each concurrent client asks for (default: 32)")
    parser.add_argument("--repetitions", type=int,
                        help="interleaved repetitions of the single-stream rows (default: 3)")
    parser.add_argument("--jina-repetitions", type=int,
                        help="repetitions of the slow Jina row (default: 1)")
    parser.add_argument("--concurrency-repetitions", type=int,
                        help="interleaved repetitions of the load tests (default: 2)")
    parser.add_argument("--device", default="auto",
                        help="auto, cpu, cuda or cuda:N (default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "fp16", "bf16"],
                        help="model dtype; auto follows serving.properties (default: %(default)s)")
    parser.add_argument("--threads", type=int,
                        help="torch threads in every process (default: torch's own default)")
    parser.add_argument("--output", default="BENCHMARKS.md", help="report file (default: %(default)s)")
    parser.add_argument("--plot", default="benchmarks/concurrency.png",
                        help="concurrency plot (default: %(default)s)")
    parser.add_argument("--skip-http", action="store_true",
                        help="only the in-process rows (no server, no concurrency)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 8 tokens, 1,2,4 clients of 4 tokens, 1 repetition")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    return Settings.resolve(
        model_dir=args.model_dir, quick=args.quick, new_tokens=args.new_tokens,
        concurrency=args.concurrency, concurrency_new_tokens=args.concurrency_new_tokens,
        repetitions=args.repetitions, jina_repetitions=args.jina_repetitions,
        concurrency_repetitions=args.concurrency_repetitions, device=args.device, dtype=args.dtype,
        threads=args.threads, skip_http=args.skip_http, output=args.output, plot=args.plot,
    )


def log(message: str) -> None:
    print(message, flush=True)


def _server_env(settings: Settings) -> Dict[str, str]:
    env: Dict[str, str] = {}
    if settings.threads:
        env["OMP_NUM_THREADS"] = str(settings.threads)
    if settings.device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif settings.device.startswith("cuda:"):
        env["OPTION_DEVICE_ID"] = settings.device.split(":", 1)[1]
    return env


def start_servers(settings: Settings, workdir: Path,
                  stack: contextlib.ExitStack) -> Dict[str, http_load.ServerProcess]:
    """Both servers, one after the other, each warmed up by one short request before the
    next starts: what a server measures while it loads (djl-stream's packing trial) then
    sees the machine as it would alone (:func:`benchmarks.peers.run.start_servers`)."""
    servers = {}
    for mode, options in SERVER_OPTIONS.items():
        if settings.dtype != "auto":
            options = {**options, "dtype": settings.dtype}
        server = http_load.ServerProcess(settings.model_dir, name=mode.replace(" ", "-"),
                                         workdir=workdir, options=options,
                                         env=_server_env(settings))
        stack.callback(server.stop)
        server.launch()
        server.wait_ready()
        warm = http_load.stream_once(server.url, http_load.request_body(PROMPTS[0], settings.warmup_tokens))
        if warm.error:
            raise RuntimeError(f"the {mode} server failed its warm-up request: {warm.error}\n"
                               f"{server.log_tail()}")
        step = server.wait_compiled(http_load.request_body(PROMPTS[0], settings.warmup_tokens))
        log(f"server ({mode}) ready on {server.url}, pid {server.pid}, {step} decode step")
        servers[mode] = server
    return servers


def http_row(server: http_load.ServerProcess) -> inprocess.Row:
    def run(_lm, prompt: inprocess.Prompt, n: int):
        return http_load.stream_once(server.url, http_load.request_body(prompt.request, n))

    return inprocess.Row(
        "http", "djl-stream over HTTP, one client (end to end)",
        "the real server (continuous batching, as configured by default) in a subprocess, "
        "streamed with httpx; arrivals are line arrivals at the client", run)


def single_stream(settings: Settings, lm: inprocess.LoadedModel, rows: Sequence[inprocess.Row],
                  results: Results) -> None:
    prompt = lm.prompt(PROMPTS[0])
    results.machine["prompt tokens"] = str(len(prompt.ids))
    inprocess.warm_up(rows, lm, prompt, settings.warmup_tokens)
    before = ProcessMemory.of()
    for rep in range(1, settings.repetitions + 1):
        for row in rows:
            if row.key == "jina" and rep > settings.jina_repetitions:
                continue
            timing = inprocess.measure(row, lm, prompt, settings.new_tokens)
            results.single.setdefault(row.key, []).append(timing)
            ttft = "" if timing.ttft is None else f", TTFT {timing.ttft * 1e3:.0f} ms"
            error = f" ERROR {timing.error}" if timing.error else ""
            log(f"  [{rep}/{settings.repetitions}] {row.key:<10} {timing.tokens_per_s:7.2f} tok/s"
                f" ({timing.tokens} tokens in {timing.wall:.2f} s{ttft}){error}")
    results.memory.append(MemoryChange("benchmark process (in-process rows)", before,
                                       ProcessMemory.of()))


def concurrency(settings: Settings, servers: Dict[str, http_load.ServerProcess],
                results: Results) -> None:
    n = settings.concurrency_new_tokens

    def bodies(count: int, first: int = 0) -> List[dict]:
        return [http_load.request_body(PROMPTS[(first + i) % len(PROMPTS)], n) for i in range(count)]

    reps = settings.concurrency_repetitions
    for rep in range(1, reps + 1):
        for clients in settings.concurrency:
            for mode, server in servers.items():
                gc.collect()
                load = http_load.run_concurrent(server.url, bodies(clients))
                results.concurrency.setdefault((mode, clients), []).append(load)
                log(f"  [{rep}/{reps}] {clients:>3} clients, {mode:<19} "
                    f"{load.aggregate_tokens_per_s:7.2f} tok/s, TTFT p50 {load.ttft(50) * 1e3:6.0f} ms, "
                    f"ITL p50 {load.inter_token(50) * 1e3:5.0f} ms"
                    + (f", {len(load.errors)} errors" if load.errors else ""))
        if settings.late_arrival_clients >= 1:
            gc.collect()
            late, early = http_load.late_arrival(
                servers[CONTINUOUS].url, bodies(settings.late_arrival_clients, first=1),
                http_load.request_body(PROMPTS[0], n))
            results.late.setdefault(CONTINUOUS, []).append(late)
            waiting = http_load.not_yet_decoding(late, early)
            if waiting:
                # (what the target means is a request joining a running batch: say where
                # this one did not, rather than report its wait as that)
                results.notes.append(
                    f"late arrival, repetition {rep}: {waiting} of the "
                    f"{settings.late_arrival_clients} early clients were not yet decoding "
                    "when the late request went out (an early stream had ended first), so it "
                    "waited behind them rather than joining a running batch")
            log(f"  [{rep}/{reps}] late arrival after "
                f"{settings.late_arrival_clients} clients: TTFT "
                + ("—" if late.ttft is None else f"{late.ttft * 1e3:.0f} ms")
                + (f" ERROR {late.error}" if late.error else "")
                + (f" ({waiting} early clients not yet decoding)" if waiting else ""))
        time.sleep(SETTLE_SECONDS)
        for mode, server in servers.items():
            results.memory_trace.setdefault(f"server ({mode})", []).append(server.memory())


def _machine(settings: Settings, lm: inprocess.LoadedModel) -> Dict[str, str]:
    import torch

    machine = describe()
    threads = torch.get_num_threads()
    origin = "set by --threads" if settings.threads else "torch's default"
    machine["torch threads"] = f"{threads} ({origin}; the servers get the same)"
    machine["model dtype"] = str(lm.dtype).replace("torch.", "")
    machine["model device"] = str(lm.device)
    machine["date"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    load = cpu_load()
    if load:
        machine["load average at start"] = " ".join(f"{x:.2f}" for x in load)
    return machine


def command_line(argv: Sequence[str]) -> str:
    """How this run was started, with the interpreter as the user would type it."""
    python = sys.executable
    with contextlib.suppress(ValueError):
        relative = os.path.relpath(python)
        if not relative.startswith(".."):
            python = relative
    return shlex.join([python, "-m", "benchmarks.run", *argv])


class CpuAccount:
    """How much CPU processes other than this benchmark and its servers took while it ran:
    on a shared machine, the first thing to check before trusting a figure."""

    def __init__(self) -> None:
        self.busy = system_busy_cpu_seconds()
        self.own = process_cpu_seconds()
        self.started = time.perf_counter()
        self.servers = 0.0

    def add_servers(self, servers: Sequence[http_load.ServerProcess]) -> None:
        self.servers += sum(process_cpu_seconds(s.pid) or 0.0 for s in servers if s.pid)

    def others(self) -> Optional[str]:
        busy, own = system_busy_cpu_seconds(), process_cpu_seconds()
        if None in (busy, own, self.busy, self.own):
            return None
        others = max((busy - self.busy) - (own - self.own) - self.servers, 0.0)
        available = (time.perf_counter() - self.started) * (os.cpu_count() or 1)
        return (f"{others:.0f} CPU-seconds of {available:.0f} available "
                f"({others / available * 100:.0f} %)")


def run(settings: Settings) -> Results:
    started = time.perf_counter()
    cpu = CpuAccount()
    import torch

    if settings.threads:
        torch.set_num_threads(settings.threads)
    log(f"loading {settings.model_dir} in-process")
    lm = inprocess.LoadedModel.load(settings.model_dir, settings.device, settings.dtype)
    results = Results(settings, _machine(settings, lm))
    with tempfile.TemporaryDirectory(prefix="djl-stream-bench-") as workdir, \
            contextlib.ExitStack() as stack:
        servers = {}
        if not settings.skip_http:
            try:
                servers = start_servers(settings, Path(workdir), stack)
            except RuntimeError as error:
                log(f"no HTTP rows: {error}")
                results.notes.append(f"the server did not start, so there are no HTTP rows: "
                                     f"{str(error).splitlines()[0]}")
        servers_before = {mode: server.memory() for mode, server in servers.items()}
        rows = list(inprocess.ROWS)
        if servers:
            rows.append(http_row(servers[CONTINUOUS]))
        results.rows = rows
        log(f"single stream: {len(rows)} rows x {settings.repetitions} repetitions, "
            f"{settings.new_tokens} new tokens")
        single_stream(settings, lm, rows, results)
        if servers:
            log(f"concurrency: {', '.join(map(str, settings.concurrency))} clients x "
                f"{settings.concurrency_repetitions} repetitions, "
                f"{settings.concurrency_new_tokens} new tokens")
            concurrency(settings, servers, results)
        time.sleep(SETTLE_SECONDS)
        for mode, server in servers.items():
            results.memory.append(MemoryChange(f"server ({mode})", servers_before[mode],
                                               server.memory()))
        cpu.add_servers(list(servers.values()))
    load = cpu_load()
    if load:
        results.machine["load average at end"] = " ".join(f"{x:.2f}" for x in load)
    others = cpu.others()
    if others:
        results.machine["CPU taken by other processes during the run"] = others
    results.elapsed_s = time.perf_counter() - started
    return results


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        settings = settings_from(args)
    except ValueError as error:
        build_parser().error(str(error))
    results = run(settings)
    checks = evaluate(results)
    output, plot = Path(settings.output), Path(settings.plot)
    plotted = report.plot_concurrency(results, plot)
    text = report.markdown(results, checks, command_line(argv),
                           report.link(plot, output) if plotted else None)
    # the sections make bench-peers and make bench-quantization wrote: this run keeps them
    for kept in kept_sections(output):
        text = text.rstrip("\n") + "\n\n" + kept + "\n"
    output.write_text(text, encoding="utf-8")
    log("")
    others = results.machine.get("CPU taken by other processes during the run")
    if others:
        log(f"CPU taken by other processes during the run: {others}")
    for check in checks:
        log(check.line())
    log(f"\nwrote {output}" + (f" and {plot}" if plotted else "")
        + f" in {results.elapsed_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

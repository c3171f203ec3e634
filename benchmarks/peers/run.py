"""``python -m benchmarks.peers`` (``make bench-peers``): djl-stream beside llama.cpp,
``transformers serve`` and Ray Serve, in one run, written into ``BENCHMARKS.md``.

The run sets up each peer's environment and GGUF files (once; the time each took is
reported), starts the servers one after the other, warms each up, and then:

1. the greedy-text check: each prompt once per server, its text compared with djl-stream's;
2. the load rows, interleaved: for each repetition and each client count (1, 4, 16
   clients released together), every server in turn, so that a machine that slows down
   slows every peer alike; while one server is measured the others are paused (their
   whole process trees stopped with SIGSTOP, resumed with SIGCONT after the row), so that
   an idle server's timers and polling threads take nothing from it; the CPU that anything
   else took meanwhile is counted per peer;
3. each server's resident memory (its whole process tree) after the load, and its peak.

The section it writes (between ``<!-- peers -->`` and ``<!-- /peers -->``) holds the
figures, the targets computed from them (never asserted), the CPU taken by
other processes during each peer's turn, and the setup times. ``make bench`` keeps the
section when it rewrites the rest of the file.

Examples::

    python -m benchmarks.peers --model-dir model                  # make bench-peers
    python -m benchmarks.peers --model-dir model --peers djl-stream,"llama.cpp F32" --quick
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from ..http_load import LoadResult, run_concurrent, stream_once
from ..inprocess import LoadedModel
from ..machine import describe
from ..measure import ProcessMemory, cpu_load, process_cpu_seconds, system_busy_cpu_seconds
from ..report import WHY_MISSED
from ..results import ratio
from ..sections import write_section
from ..measure import Paused, process_tree
from ..settings import PROMPTS
from ..targets import missed_by
from .environments import ENVIRONMENTS
from .gguf_files import conversion_seconds, float32_gguf, float32_gguf_path, original_q4_1
from .llama_server import build_llama_server, build_seconds, server_binary
from .servers import PEERS, Peer

#: This run's section of BENCHMARKS.md (kept by make bench, see benchmarks.sections).
SECTION = "peers"
ROOT = Path(".peers")
#: The djl-stream rows the targets are computed from: the defaults' (on a CPU, decode steps
#: through the compiled program) and the eager forward's (the throughput and single-stream
#: targets are computed for each), and its int8 rows (weight-only, W8A8), each held against
#: the defaults' float32 row.
OURS, OURS_EAGER = "djl-stream", "djl-stream eager"
OURS_FLOAT32 = (OURS, OURS_EAGER)
OURS_INT8 = (("djl-stream int8", OURS), ("djl-stream w8a8", OURS))


def log(message: str) -> None:
    print(message, flush=True)


@dataclasses.dataclass
class PeerResult:
    """What one peer's rows measured."""

    peer: Peer
    loads: Dict[int, List[LoadResult]] = dataclasses.field(default_factory=dict)
    texts: List[str] = dataclasses.field(default_factory=list)
    memory: Optional[ProcessMemory] = None
    #: CPU seconds others took while this peer's rows ran, and the seconds available.
    other_cpu: float = 0.0
    available_cpu: float = 0.0
    error: str = ""

    def median(self, clients: int, figure: str) -> float:
        values = []
        for load in self.loads.get(clients, []):
            if load.errors:
                continue
            values.append({"aggregate": load.aggregate_tokens_per_s,
                           "ttft_p50": load.ttft(50), "itl_p50": load.inter_token(50),
                           "itl_p90": load.inter_token(90)}[figure])
        values = [v for v in values if not math.isnan(v)]
        return statistics.median(values) if values else math.nan

    @property
    def other_cpu_line(self) -> str:
        if not self.available_cpu:
            return "not measured"
        return (f"{self.other_cpu:.0f} of {self.available_cpu:.0f} CPU-s "
                f"({self.other_cpu / self.available_cpu * 100:.0f} %)")


def _tree_cpu_seconds(pid: int) -> float:
    return sum(process_cpu_seconds(p) or 0.0 for p in process_tree(pid))


class Turn:
    """One peer's row: the CPU the machine spent on anything but this process and the
    peer's own server meanwhile (the other servers included, when they are not paused)."""

    def __init__(self, server) -> None:
        self.server = server

    def __enter__(self) -> "Turn":
        self.busy, self.own = system_busy_cpu_seconds(), process_cpu_seconds()
        self.served, self.started = _tree_cpu_seconds(self.server.pid), time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        busy, own = system_busy_cpu_seconds(), process_cpu_seconds()
        served = _tree_cpu_seconds(self.server.pid)
        self.available = (time.perf_counter() - self.started) * len(os.sched_getaffinity(0))
        self.others = 0.0
        if None not in (busy, own, self.busy, self.own):
            self.others = max((busy - self.busy) - (own - self.own) - (served - self.served), 0.0)


def start_servers(peers: Sequence[Peer], files: Dict[str, Path], args, workdir: Path,
                  results: Dict[str, PeerResult], stack: contextlib.ExitStack) -> Dict[str, object]:
    """Every peer's server, started one after the other (each ready and warmed up by one
    short request before the next starts), so that what a server measures while it loads
    sees the machine as it would alone: started together, eleven servers loading on two
    cores made djl-stream's packing trial pack the Xeon's layers, where packing slows a
    single stream (36 ms a token against 29). A peer that fails to start is reported and
    left out."""
    ready = {}
    for peer in peers:
        server = peer.server(Path(args.model_dir), ROOT, files, workdir, device=args.device,
                             installed=args.installed)
        stack.callback(server.stop)
        try:
            server.launch()
            server.wait_ready()
            warm = stream_once(server.url, _body(peer, args, PROMPT_TEXTS[0], 4), read=peer.read)
            if warm.error:
                raise RuntimeError(f"warm-up failed: {warm.error}")
            step = (server.wait_compiled(_body(peer, args, PROMPT_TEXTS[0], 4))
                    if peer.environment is None and peer.executable is None else "its own")
            ready[peer.name] = server
            log(f"{peer.name}: ready on {server.url} ({step} decode step)")
        except Exception as error:  # noqa: BLE001 - a peer that fails is reported, the run goes on
            message = str(error).splitlines()[0] if str(error) else ""
            results[peer.name].error = f"{type(error).__name__}: {message}"
            log(f"{peer.name}: FAILED {results[peer.name].error}\n{server.log_tail()}")
            server.stop()
    return ready


#: The prompts as every server is sent them (the chat template applied), set by main().
PROMPT_TEXTS: List[str] = []


def _body(peer: Peer, args, prompt: str, tokens: int) -> dict:
    # transformers serve answers only to requests naming its model's path
    return peer.body(prompt, tokens, str(Path(args.model_dir).resolve()))


def measure(peers: Sequence[Peer], files: Dict[str, Path], args,
            workdir: Path) -> List[PeerResult]:
    """Every peer's rows, interleaved: for each repetition and client count, each peer in
    turn, all servers up, so that a machine that slows down slows every peer alike; the
    others are paused during a peer's row (:class:`Paused`) unless ``--keep-others-running``."""
    results = {peer.name: PeerResult(peer) for peer in peers}
    with contextlib.ExitStack() as stack:
        servers = start_servers(peers, files, args, workdir, results, stack)
        live = [peer for peer in peers if peer.name in servers]
        for peer in live:
            for prompt in PROMPT_TEXTS:
                timing = stream_once(servers[peer.name].url,
                                     _body(peer, args, prompt, args.new_tokens), read=peer.read)
                results[peer.name].texts.append(
                    timing.text if not timing.error else f"(error: {timing.error})")
        for rep in range(1, args.repetitions + 1):
            for clients in args.clients:
                for peer in live:
                    server, result = servers[peer.name], results[peer.name]
                    gc.collect()
                    bodies = [_body(peer, args, PROMPT_TEXTS[i % len(PROMPT_TEXTS)], args.new_tokens)
                              for i in range(clients)]
                    others = [servers[p.name] for p in live if p is not peer]
                    with Paused(others if args.pause_others else []), Turn(server) as turn:
                        load = run_concurrent(server.url, bodies, read=peer.read)
                    result.other_cpu += turn.others
                    result.available_cpu += turn.available
                    if not peer.pieces_are_tokens:  # a word stream: count the tokens asked for
                        load = _counted_as_asked(load, args.new_tokens)
                    result.loads.setdefault(clients, []).append(load)
                    log(f"  [{rep}/{args.repetitions}] {clients:>2} clients, {peer.name:<22} "
                        f"{load.aggregate_tokens_per_s:6.1f} tok/s, TTFT p50 "
                        f"{load.ttft(50) * 1e3:6.0f} ms, ITL p50 {load.inter_token(50) * 1e3:5.0f} ms"
                        + (f", errors: {load.errors[:1]}" if load.errors else ""))
        time.sleep(1.0)
        for peer in live:
            results[peer.name].memory = servers[peer.name].memory()
    return [results[peer.name] for peer in peers]


def _counted_as_asked(load: LoadResult, tokens: int) -> LoadResult:
    timings = tuple(dataclasses.replace(t, tokens=tokens if not t.error else t.tokens)
                    for t in load.timings)
    return LoadResult(load.clients, timings)


def _agreement(text: str, reference: str) -> str:
    if text == reference:
        return "same text"
    same = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b),
                min(len(text), len(reference)))
    return f"differs after {same} of {len(reference)} characters"


def _fmt(value: float, scale: float = 1.0, digits: int = 0, unit: str = "") -> str:
    return "—" if math.isnan(value) else f"{value * scale:.{digits}f}{unit}"


def report(results: List[PeerResult], setup: Dict[str, tuple], args, machine: Dict[str, str],
           elapsed: float, command: str) -> str:
    by_name = {r.peer.name: r for r in results}
    lines = ["## Peers: djl-stream beside llama.cpp, transformers serve and Ray Serve", "",
             f"Measured on {machine.get('date')} with `{command}` (what `make bench-peers` runs) "
             f"in {elapsed / 60:.0f} min, on {machine.get('cpu')} (GPU: {machine.get('gpu')}), "
             f"every server on the {'GPU' if args.device == 'cuda' else 'CPU'}. "
             f"Every server: the same prompts (SmolLM2's chat template applied by the client), "
             f"greedy, exactly {args.new_tokens} new tokens (end-of-sequence ids barred: "
             "`ignore_eos`, `min_tokens` or `min_new_tokens`). The servers are started one after "
             "the other (each loads on an otherwise idle machine), then all run at once and are "
             "measured in turn, row by row (each repetition, each client count, each server), "
             "so that a machine that slows down slows every peer alike; "
             + ("the servers not being measured are paused (SIGSTOP, their whole process "
                "tree) and resumed after the row; " if args.pause_others else
                "the servers not being measured stay up and idle (`--keep-others-running`); ")
             + "clients are released "
             "together, each on its own connection. Figures are medians over "
             f"{args.repetitions} repetitions.", ""]
    lines += ["### Targets", ""]
    lines += [f"- {line}" for line in targets(by_name, args)]
    lines += ["", f"What misses a target: [Targets missed, and why]({WHY_MISSED}).", ""]
    lines += ["| server | weights | clients | aggregate tokens/s | TTFT p50 | ITL p50 | ITL p90 | "
              "RSS after | peak RSS |", "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        if r.error:
            lines.append(f"| {r.peer.name} | {r.peer.weights_on(args.device)} | — | "
                         f"failed: {r.error} | | | | | |")
            continue
        for clients in args.clients:
            word = "" if r.peer.pieces_are_tokens else " ¹"
            lines.append(
                f"| {r.peer.name} | {r.peer.weights_on(args.device)} | {clients} | "
                f"{_fmt(r.median(clients, 'aggregate'), digits=1)} | "
                f"{_fmt(r.median(clients, 'ttft_p50'), 1e3, unit=' ms')} | "
                f"{_fmt(r.median(clients, 'itl_p50'), 1e3, unit=' ms')}{word} | "
                f"{_fmt(r.median(clients, 'itl_p90'), 1e3, unit=' ms')}{word} | "
                f"{_fmt(r.memory.rss / 1e6 if r.memory else math.nan, unit=' MB')} | "
                f"{_fmt(r.memory.peak / 1e6 if r.memory else math.nan, unit=' MB')} |")
    lines += ["", "¹ the tutorial's streamer hands out whole words: its gaps are between words. "
              "llama.cpp's server runs one request at a time: its clients queue. RSS is the "
              "server's whole process tree (Ray's workers included), after the load.", ""]
    reference = by_name.get(OURS)
    lines += [f"### Greedy text agreement with djl-stream "
              f"({'bfloat16' if args.device == 'cuda' else 'float32'})", "",
              "| server | " + " | ".join(f"prompt {i + 1}" for i in range(len(PROMPTS))) + " |",
              "|---|" + "---|" * len(PROMPTS)]
    for r in results:
        if r.error or reference is None or reference.error:
            continue
        cells = [_agreement(text, ref) for text, ref in zip(r.texts, reference.texts)]
        lines.append(f"| {r.peer.name} | " + " | ".join(cells) + " |")
    lines += ["", "### CPU taken by other processes during each peer's rows", "",
              "Everything but the benchmark itself and the peer being measured"
              + (" (the other servers were paused):" if args.pause_others
                 else ", the other servers idling beside it included:"), ""]
    lines += [f"- {r.peer.name}: {r.other_cpu_line}" for r in results]
    lines += ["", "### Setting the peers up", ""]
    for name, (seconds, now) in setup.items():
        took = "time not recorded" if seconds is None else f"{seconds / 60:.1f} min"
        lines.append(f"- {name}: {took}" + (", in this run" if now else
                                           ", when it was set up (kept in `.peers/`)"))
    if args.installed:
        lines.append("- none: the peers were installed beside djl-stream in the benchmark's own "
                     "interpreter (`--installed`)")
    lines += [""]
    return "\n".join(lines)


def targets(by_name: Dict[str, PeerResult], args) -> List[str]:
    def figure(name: str, clients: int, what: str) -> float:
        result = by_name.get(name)
        return math.nan if result is None or result.error else result.median(clients, what)

    out = []

    def check(text: str, value: float, limit: float, at_most: bool, detail: str) -> None:
        if math.isnan(value):
            out.append(f"**NOT MEASURED** {text}")
            return
        passed = value <= limit if at_most else value >= limit
        miss = missed_by(value, limit, at_most)
        out.append(f"**{'PASS' if passed else 'FAIL'}** {text}: {value:.2f}x{miss}; {detail}")

    most = max(args.clients)
    server_itl = figure("llama-server F32", 1, "itl_p50")
    for name in OURS_FLOAT32:
        itl = figure(name, 1, "itl_p50")
        check(f"{name} single-stream ITL p50 <= 1.0x llama-server F32's", ratio(itl, server_itl),
              1.0, True, f"{_fmt(itl, 1e3, 1, ' ms')} vs {_fmt(server_itl, 1e3, 1, ' ms')}")
    theirs = figure("llama-server F32", most, "aggregate")
    ours_many = figure(OURS, most, "aggregate")
    check(f"{OURS} aggregate tokens/s at {most} clients >= 1.5x llama-server F32's "
          f"(--parallel)", ratio(ours_many, theirs), 1.5, False,
          f"{_fmt(ours_many, digits=1)} vs {_fmt(theirs, digits=1)} tokens/s")
    q8_itl, int8_itl = figure("llama-server Q8_0", 1, "itl_p50"), figure("djl-stream int8", 1,
                                                                        "itl_p50")
    check("djl-stream int8 single-stream ITL p50 <= 1.0x llama-server Q8_0's",
          ratio(int8_itl, q8_itl), 1.0, True,
          f"{_fmt(int8_itl, 1e3, 1, ' ms')} vs {_fmt(q8_itl, 1e3, 1, ' ms')}")
    llama_itl = figure("llama.cpp F32", 1, "itl_p50")
    for name in OURS_FLOAT32:
        itl = figure(name, 1, "itl_p50")
        check(f"{name} single-stream ITL p50 <= 1.15x llama.cpp F32's (llama-cpp-python)",
              ratio(itl, llama_itl), 1.15, True,
              f"{_fmt(itl, 1e3, 1, ' ms')} vs {_fmt(llama_itl, 1e3, 1, ' ms')}")
    for peer, limit in (("transformers serve", 1.5), ("llama.cpp F32", 4.0)):
        theirs = figure(peer, most, "aggregate")
        for name in OURS_FLOAT32:
            ours_many = figure(name, most, "aggregate")
            check(f"{name} aggregate tokens/s at {most} clients >= {limit}x {peer}'s",
                  ratio(ours_many, theirs), limit, False,
                  f"{_fmt(ours_many, digits=1)} vs {_fmt(theirs, digits=1)} tokens/s")
    for int8_peer, float_peer in OURS_INT8:
        int8_itl, float_itl = figure(int8_peer, 1, "itl_p50"), figure(float_peer, 1, "itl_p50")
        check(f"{int8_peer} single-stream >= 1.6x our float32 ({float_peer}, ITL p50)",
              ratio(float_itl, int8_itl), 1.6, False,
              f"{_fmt(int8_itl, 1e3, 1, ' ms')} vs {_fmt(float_itl, 1e3, 1, ' ms')}")
    return out


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.peers",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--peers", default=",".join(PEERS),
                        help="comma-separated peers to run (default: all)")
    parser.add_argument("--clients", default="1,4,16")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--output", default="BENCHMARKS.md")
    parser.add_argument("--keep-others-running", dest="pause_others", action="store_false",
                        help="leave the other servers running (idle) while one is measured, "
                             "instead of pausing them")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="where the servers run: cuda suits djl-stream and transformers "
                             "serve (the llama.cpp and Ray environments set up here are CPU "
                             "builds); default cpu")
    parser.add_argument("--installed", action="store_true",
                        help="the peers are installed in this interpreter: run them with it and "
                             "set no environment up in .peers/ (a machine that cannot reach "
                             "PyPI, such as a lent GPU machine)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke run: 16 tokens, 1 and 4 clients, one repetition")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.quick:
        args.new_tokens, args.clients, args.repetitions = 16, "1,4", 1
    args.clients = [int(c) for c in str(args.clients).split(",")]
    names = [n.strip() for n in args.peers.split(",") if n.strip()]
    unknown = [n for n in names if n not in PEERS]
    if unknown:
        build_parser().error(f"unknown peers {unknown}; known: {list(PEERS)}")
    peers = [PEERS[n] for n in names]
    started = time.perf_counter()
    ROOT.mkdir(exist_ok=True)
    setup: Dict[str, tuple] = {}  # what -> (seconds it took, done in this run)
    needs_gguf = any(peer.model_file for peer in peers)
    environments = {peer.environment for peer in peers} | ({"gguf-convert"} if needs_gguf else set())
    for name in sorted(environments - {None}) if not args.installed else ():
        now = ENVIRONMENTS[name].ensure(ROOT, log)
        setup[f"{name} environment"] = (ENVIRONMENTS[name].setup_seconds(ROOT), now)
    files: Dict[str, Path] = {}
    if needs_gguf:
        now = not float32_gguf_path(Path(args.model_dir), ROOT).is_file()
        converter = (Path(sys.executable) if args.installed
                     else ENVIRONMENTS["gguf-convert"].python(ROOT))
        files["f32"] = float32_gguf(Path(args.model_dir), ROOT, converter, log)
        setup["F32 GGUF conversion"] = (conversion_seconds(Path(args.model_dir), ROOT), now)
        files["q4_1"] = original_q4_1()
        if any(peer.model_file == "q8_0" for peer in peers):
            files["q8_0"] = float32_gguf(Path(args.model_dir), ROOT, converter, log, kind="q8_0")
    if any(peer.executable is not None for peer in peers):
        now = not server_binary(ROOT).is_file()
        build_llama_server(ROOT, log)
        setup["llama-server build"] = (build_seconds(ROOT), now)
    # only its chat template is wanted
    loaded = LoadedModel.load(args.model_dir, device="cpu")
    PROMPT_TEXTS[:] = [loaded.prompt(p).text for p in PROMPTS]
    machine = describe()
    machine["date"] = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    del loaded
    log(f"starting {len(peers)} servers" + (f" (load {cpu_load()[0]:.2f})" if cpu_load() else ""))
    with tempfile.TemporaryDirectory(prefix="djl-stream-peers-") as workdir:
        results = measure(peers, files, args, Path(workdir))
    command = " ".join(["python -m benchmarks.peers", *argv])
    section = report(results, setup, args, machine, time.perf_counter() - started, command)
    write_section(Path(args.output), SECTION, section)
    for line in targets({r.peer.name: r for r in results}, args):
        log(line)
    log(f"wrote the peers section of {args.output}")
    return 0

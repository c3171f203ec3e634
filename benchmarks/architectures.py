"""``python -m benchmarks.architectures``: the same server figures for models of one size in
several architectures, side by side: djl-stream's runtime is the same for all of them.

Each model is the embedded model's shapes (width, layers, heads, key/value heads, MLP
width, vocabulary) in another architecture's transformers class, with random weights
(:mod:`benchmarks.random_weights` says why its text means nothing and its speed holds):
Llama (the embedded model's own architecture), Qwen2 (attention biases) and Mistral (a
sliding window of half the context). Each is served as ``make serve`` serves it (its
decode step compiled, waited for), and measured over HTTP: one stream's inter-token
latency (``--new-tokens`` greedy tokens) and 16 clients' aggregate tokens per second, the
servers taking turns (the others paused) so that the machine's drift over the run hits
every architecture alike. The
table holds each architecture's figures as a share of Llama's, and is written into
BENCHMARKS.md's architectures section (``make bench`` keeps it).

Example::

    python -m benchmarks.architectures --model-dir model
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import shutil
import statistics
import tempfile
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from . import http_load
from .machine import describe
from .measure import Paused, all_inter_token
from .random_weights import MARKER
from .sections import write_section
from .settings import PROMPTS

#: The architectures measured, as changes to the embedded model's config.
ARCHITECTURES: Dict[str, dict] = {
    "Llama": {"architectures": ["LlamaForCausalLM"], "model_type": "llama"},
    "Qwen2": {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
              "attention_bias": True, "use_sliding_window": False},
    "Mistral": {"architectures": ["MistralForCausalLM"], "model_type": "mistral"},
}
SECTION = "architectures"
#: Each figure's limit against Llama's: within 10 %.
WITHIN = 0.10


def shaped_model(source: Path, target: Path, name: str, seed: int = 0) -> Path:
    """A model directory of ``source``'s shapes and tokenizer in architecture ``name``,
    random float32 weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if path.is_file() and path.suffix in (".json", ".jinja", ".py", ".properties", ".txt"):
            shutil.copy(path, target / path.name)
    config = json.loads((source / "config.json").read_text())
    config.update(ARCHITECTURES[name])
    if name == "Mistral":
        config["sliding_window"] = config.get("max_position_embeddings", 8192) // 2
    (target / "config.json").write_text(json.dumps(config))
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(target),
                                             dtype=torch.float32)
    model.save_pretrained(target)
    (target / MARKER).write_text(f"random weights in {source}'s shapes, {name}: timing only\n")
    return target


def measure_in_turns(servers: Dict[str, "http_load.ServerProcess"], new_tokens: int,
                     clients: int, repetitions: int) -> Dict[str, Dict[str, float]]:
    """Each server's single-stream ITL (median, seconds) and aggregate tokens/s at
    ``clients`` clients (median over ``repetitions``), the servers taking turns within each
    repetition, the others paused: a machine that slows down or speeds up over the run
    does so for every architecture alike."""
    itl: Dict[str, List[float]] = {name: [] for name in servers}
    aggregate: Dict[str, List[float]] = {name: [] for name in servers}
    for _ in range(repetitions):
        for name, server in servers.items():
            others = [other for other_name, other in servers.items() if other_name != name]
            with Paused(others):
                one = http_load.stream_once(server.url, _fixed(PROMPTS[0], new_tokens))
                itl[name].append(statistics.median(all_inter_token([one])))
                many = http_load.run_concurrent(server.url, [
                    _fixed(PROMPTS[i % len(PROMPTS)], 32) for i in range(clients)])
                aggregate[name].append(many.aggregate_tokens_per_s)
    return {name: {"itl": statistics.median(itl[name]),
                   "aggregate": statistics.median(aggregate[name])} for name in servers}


def start_compiled(model_dir: Path, workdir: Path, name: str,
                   stack: contextlib.ExitStack) -> Tuple["http_load.ServerProcess", bool]:
    """``model_dir``'s server, ready and (where it compiles) serving with its compiled
    step; whether it is."""
    server = http_load.ServerProcess(model_dir, name=name, workdir=workdir)
    stack.enter_context(server)  # (started and ready)
    body = http_load.request_body(PROMPTS[0], 4)
    http_load.stream_once(server.url, body)
    return server, server.wait_compiled(body) == "compiled"


def _fixed(prompt: str, tokens: int) -> dict:
    return {"inputs": prompt, "stream": True,
            "parameters": {"max_new_tokens": tokens, "min_new_tokens": tokens}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.architectures",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--repetitions", type=int, default=2)
    parser.add_argument("--output", default="BENCHMARKS.md")
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    results: Dict[str, Dict[str, float]] = {}
    started = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory(prefix="djl-stream-architectures-") as work, \
            contextlib.ExitStack() as stack:
        servers, compiled = {}, {}
        for name in ARCHITECTURES:  # (one after another: each compiles alone)
            directory = shaped_model(Path(args.model_dir), Path(work) / name, name)
            with Paused(list(servers.values())):
                servers[name], compiled[name] = start_compiled(directory, Path(work), name,
                                                               stack)
        results = measure_in_turns(servers, args.new_tokens, args.clients, args.repetitions)
        for name in results:
            results[name]["compiled"] = compiled[name]
            print(f"{name}: {results[name]}", flush=True)
    base = results["Llama"]
    lines = ["| architecture | decode step | one stream ITL p50 | × Llama's | "
             f"{args.clients} clients tokens/s | × Llama's |", "|---|---|---|---|---|---|"]
    checks = []
    for name, figures in results.items():
        itl_share, many_share = figures["itl"] / base["itl"], figures["aggregate"] / base["aggregate"]
        lines.append(f"| {name} | {'compiled' if figures['compiled'] else 'eager'} | "
                     f"{figures['itl'] * 1e3:.1f} ms | {itl_share:.2f}x | "
                     f"{figures['aggregate']:.1f} | {many_share:.2f}x |")
        if name != "Llama":
            for what, share, passed in (
                    ("one stream's ITL", itl_share, itl_share <= 1 + WITHIN),
                    (f"{args.clients} clients' tokens/s", many_share, many_share >= 1 - WITHIN)):
                checks.append(f"- **{'PASS' if passed else 'FAIL'}** {name} {what} within "
                              f"{WITHIN:.0%} of Llama's: {share:.2f}x")
    machine = describe()
    command = " ".join(["python -m benchmarks.architectures", *(argv or [])])
    write_section(Path(args.output), SECTION, "\n".join([
        "## One size, three architectures", "",
        f"Measured on {started} with `{command}`, on {machine.get('cpu')}: the embedded "
        "model's shapes in Llama's, Qwen2's (attention biases) and Mistral's (a sliding "
        "window of half the context) transformers classes, random float32 weights, each "
        "served by `djl-stream serve` with its decode step compiled, the three servers "
        "taking turns within each repetition, the others paused.", "",
        *checks, "", *lines, ""]))
    print("\n".join(checks + [""] + lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""``benchmarks/on_a_gpu.sh``, read here because it runs only where a CUDA GPU is lent, for
15 minutes at a time: a step whose command line no longer parses would spend those minutes
on an argparse error. These tests run no GPU step. They check the script as a file: bash
parses it, every step the default list names exists, every ``python -m benchmarks...``
command it runs is accepted by that module's own argument parser (with its peers and
quantization methods known to the modules), and every test file it names exists.
"""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path
from typing import List, Tuple

import pytest

from benchmarks import decode_step, quantization, random_weights
from benchmarks import run as bench_run
from benchmarks.peers import run as peers_run
from benchmarks.peers.servers import PEERS
from djl_stream.runtime.quantization import QUANTIZE_METHODS

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "on_a_gpu.sh"
PARSERS = {
    "benchmarks.random_weights": random_weights.build_parser,
    "benchmarks.decode_step": decode_step.build_parser,
    "benchmarks.run": bench_run.build_parser,
    "benchmarks.peers": peers_run.build_parser,
    "benchmarks.quantization": quantization.build_parser,
}
# What the script's variables hold when it runs (any path will do for parsing).
VARIABLES = {"$python": "python", '"$model"': "/tmp/model",
             '"$out/': '"/tmp/out/', '"${BENCH_REPETITIONS:-3}"': "3",
             '"${QUANT_METHODS:-none,int8,w8a8,bitsandbytes8,bitsandbytes4}"':
             "none,int8,w8a8,bitsandbytes8,bitsandbytes4"}


def script_steps() -> List[Tuple[str, List[str]]]:
    """Each ``step NAME SECONDS COMMAND...`` line of the script (continuations joined):
    its name and its command, split as bash would split it."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    steps = []
    for line in text.splitlines():
        line = line.strip()  # (a step inside an if block is indented)
        if not line.startswith("step ") or "()" in line:
            continue
        for variable, value in VARIABLES.items():
            line = line.replace(variable, value)
        _, name, seconds, *command = shlex.split(line)
        assert seconds.isdigit(), line
        steps.append((name, command))
    return steps


def test_bash_parses_the_script():
    subprocess.run(["bash", "-n", str(SCRIPT)], check=True)


def test_the_default_steps_are_the_steps_the_script_defines():
    defined = [name for name, _ in script_steps()]
    default = re.search(r'\$\{STEPS:-([^}]*)\}', SCRIPT.read_text()).group(1).split()
    assert sorted(default) == sorted(set(defined) - {"random_weights"})
    assert "random_weights" in defined  # RANDOM_WEIGHTS=1's step


@pytest.mark.parametrize("name,command", script_steps(), ids=[n for n, _ in script_steps()])
def test_each_step_s_command_is_accepted_by_what_it_runs(name, command):
    assert command[:2] == ["python", "-m"], command
    module, arguments = command[2], command[3:]
    if module == "pytest":
        files = [a for a in arguments if a.endswith(".py")]
        assert files, command
        for file in files:
            assert (ROOT / file).is_file(), f"{name}: {file} does not exist"
        return
    assert module in PARSERS, f"{name}: no parser known for {module}"
    args = PARSERS[module]().parse_args(arguments)  # exits (SystemExit) on a bad option
    if module == "benchmarks.peers":
        unknown = [p for p in args.peers.split(",") if p.strip() not in PEERS]
        assert not unknown, f"{name}: unknown peers {unknown}"
    if module == "benchmarks.quantization":
        known = set(QUANTIZE_METHODS) | {"none"} | set(quantization.DTYPES)
        methods = [m.strip() for m in args.methods.split(",")]
        assert set(methods) <= known, f"{name}: unknown methods {set(methods) - known}"


def test_a_renamed_option_would_be_caught():
    # the check above fails for a command that a module's parser refuses
    with pytest.raises(SystemExit):
        decode_step.build_parser().parse_args(["--device", "cuda", "--batch-rows", "1"])

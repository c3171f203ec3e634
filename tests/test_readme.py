"""Every command and snippet of the README runs, and prints what the README shows.

The README's code blocks are of five kinds, and this suite runs each the way it says:

- ``console``: ``$ command`` lines (``\\`` continues a line), each followed by the output
  the README shows; the command runs in bash from the repository's root, against a real
  ``djl-stream serve model/`` on the embedded model, and its standard output must match.
- ``python`` followed by a ``text`` block: the snippet runs in a fresh interpreter against
  that server, and prints the text block.
- ``sh``: commands that set things up or take minutes (``make serve``, ``djl-stream
  package``): a ``make`` target must exist (``make -n``), and a ``djl-stream`` command must
  accept every flag the line gives it (its ``--help``).
- ``json``: the shape of a request body, not a command.

In expected output, a line ``…`` stands for any lines, and ``…`` within a line for any
text. The server runs with ``option.compile=false``: the compiled step gives the eager
step's tokens (its own tests check that), and compiling the embedded model would take
minutes.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from server_process import ServerProcess

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
KINDS = {"console", "python", "text", "sh", "json"}
ADDRESS = "localhost:8080"

pytestmark = pytest.mark.embedded


def code_blocks(text: str) -> list[tuple[str, str]]:
    """``(kind, body)`` of each fenced block, in order (indented ones in lists too)."""
    blocks = []
    for indent, kind, body in re.findall(r"^( *)```(\w*)\n(.*?)^\1```$", text,
                                         flags=re.M | re.S):
        lines = [line[len(indent):] for line in body.splitlines()]
        blocks.append((kind, "\n".join(lines)))
    return blocks


BLOCKS = code_blocks(README.read_text(encoding="utf-8"))


def pattern(expected: str) -> re.Pattern:
    """``expected`` as a regular expression: a line ``…`` is any lines, ``…`` in a line any
    text."""
    parts = []
    for line in expected.strip("\n").split("\n"):
        if line.strip() == "…":
            parts.append(r"(?:[^\n]*\n)*?")
        else:
            parts.append(".*?".join(re.escape(piece) for piece in line.split("…")) + r"\n")
    return re.compile("".join(parts), flags=re.S)


def matches(expected: str, actual: str) -> bool:
    return pattern(expected).fullmatch(actual.strip("\n") + "\n") is not None


def console_sessions(body: str) -> list[tuple[str, str]]:
    """``(command, expected output)`` of each ``$`` line of a console block."""
    sessions: list[list[str]] = []
    continued = False
    for line in body.split("\n"):
        if continued:
            sessions[-1][0] += "\n" + line
        elif line.startswith("$ "):
            sessions.append([line[2:], ""])
        else:
            sessions[-1][1] += line + "\n"
        continued = (continued or line.startswith("$ ")) and line.endswith("\\")
    return [(command, output) for command, output in sessions]


@pytest.fixture(scope="module")
def server(embedded_model_dir):
    served = ServerProcess(embedded_model_dir)  # (with the eager step: see ServerProcess)
    try:
        yield served.wait_ready(timeout=300)
    finally:
        served.stop()


def environment(server) -> dict:
    """The user's shell after ``make serve``: the venv's commands first on the path (and,
    as for the server, the eager step: ``djl-stream generate`` would start a compile)."""
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "OPTION_COMPILE": "false",
            "PATH": bin_dir + os.pathsep + os.environ.get("PATH", "")}


def at(server, text: str) -> str:
    return text.replace(ADDRESS, f"127.0.0.1:{server.port}")


def test_every_block_is_of_a_kind_this_suite_runs():
    kinds = [kind for kind, _ in BLOCKS]
    assert set(kinds) <= KINDS, set(kinds) - KINDS
    for previous, (kind, _) in zip([None] + kinds, BLOCKS):
        if kind == "text":
            assert previous == "python", "a text block shows the output of a python block"
    assert kinds.count("console") >= 3 and kinds.count("python") >= 2


CONSOLE = [session for kind, body in BLOCKS if kind == "console"
           for session in console_sessions(body)]


@pytest.mark.parametrize("command, expected", CONSOLE, ids=[c.split("\n")[0][:50]
                                                            for c, _ in CONSOLE])
def test_each_console_command_prints_what_the_readme_shows(server, command, expected):
    done = subprocess.run(["bash", "-c", at(server, command)], cwd=REPO, capture_output=True,
                          text=True, env=environment(server), timeout=600)
    assert done.returncode == 0, done.stderr
    assert matches(expected, done.stdout), (
        f"the README shows:\n{expected}\nit printed:\n{done.stdout}")


SNIPPETS = [(body, BLOCKS[i + 1][1]) for i, (kind, body) in enumerate(BLOCKS)
            if kind == "python" and i + 1 < len(BLOCKS) and BLOCKS[i + 1][0] == "text"]


@pytest.mark.parametrize("code, expected", SNIPPETS, ids=[f"snippet{i}" for i, _ in
                                                          enumerate(SNIPPETS)])
def test_each_python_snippet_prints_what_the_readme_shows(server, code, expected):
    done = subprocess.run([sys.executable, "-c", at(server, code)], cwd=REPO,
                          capture_output=True, text=True, env=environment(server), timeout=600)
    assert done.returncode == 0, done.stderr
    assert matches(expected, done.stdout), (
        f"the README shows:\n{expected}\nit printed:\n{done.stdout}")


def test_every_python_block_shows_its_output():
    python = [body for kind, body in BLOCKS if kind == "python"]
    assert len(python) == len(SNIPPETS)


SETUP = [line.strip() for kind, body in BLOCKS if kind == "sh"
         for line in body.split("\n") if line.strip()]


@pytest.mark.parametrize("line", SETUP)
def test_each_setup_command_exists_with_the_flags_it_is_given(line):
    words = line.split()
    if words[0] == "make":
        done = subprocess.run(["make", "-n", *words[1:]], cwd=REPO, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr
    elif words[0] == "djl-stream":
        command = [sys.executable, "-m", "djl_stream", words[1], "--help"]
        done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        for flag in (word.split("=")[0] for word in words[2:] if word.startswith("-")):
            assert flag in done.stdout, f"djl-stream {words[1]} has no {flag}"
    else:
        pytest.fail(f"the suite does not know how to check {line!r}")


def test_the_matching_rules_can_fail():
    assert matches("a\n…\nd", "a\nb\nc\nd") and matches("x … z", "x y z")
    assert not matches("a\n…\nd", "a\nb\nc") and not matches("x … z", "x y")

"""docker/: contract checks; no Docker engine runs here.

Nothing here builds or runs an image. The Dockerfiles are parsed (a small reader of
instructions: comments, line continuations, JSON and shell forms) and held to what the
images must do: build from the repository root with every ``COPY`` source present and not
excluded by ``.dockerignore``; put ``model/`` at ``/opt/ml/model``; install djl_stream from
the copied sources; keep djl-serving's own ``CMD ["serve"]``; and ship a ``model/`` that
passes ``djl-stream check`` under the environment the Dockerfile sets.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex
from pathlib import Path
from typing import Optional

import pytest

from djl_stream.check import check_model_dir

REPO = Path(__file__).resolve().parents[1]
DOCKERFILES = {"lmi": REPO / "docker" / "Dockerfile.lmi",
               "neuron": REPO / "docker" / "Dockerfile.neuron"}


# -- a small Dockerfile reader --

@dataclasses.dataclass
class Instruction:
    name: str   # upper case: FROM, COPY, RUN...
    args: str   # the rest of the (joined) line
    line: int   # where it starts, 1-based

    def json_form(self) -> Optional[list[str]]:
        """``["a", "b"]`` arguments (exec form), else ``None`` (shell form)."""
        if self.args.startswith("["):
            try:
                value = json.loads(self.args)
            except json.JSONDecodeError:
                return None
            return value if isinstance(value, list) else None
        return None

    def words(self) -> list[str]:
        return self.json_form() or shlex.split(self.args, posix=True)


def parse_dockerfile(text: str) -> list[Instruction]:
    """Instructions in order. A trailing backslash continues the line; comment lines
    (also inside a continuation, as Docker allows) and blank lines are skipped."""
    instructions: list[Instruction] = []
    pending: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if stripped.startswith("#") or (not stripped and not pending):
            continue
        if not stripped:
            continue
        if not pending:
            start = number
        if stripped.endswith("\\"):
            pending.append(stripped[:-1].strip())
            continue
        pending.append(stripped)
        joined = " ".join(part for part in pending if part)
        pending = []
        name, _, args = joined.partition(" ")
        instructions.append(Instruction(name.upper(), args.strip(), start))
    assert not pending, "the Dockerfile ends inside a line continuation"
    return instructions


def test_the_reader_handles_continuations_comments_and_both_forms() -> None:
    text = ('# syntax=docker/dockerfile:1\nARG BASE=img:1\nFROM ${BASE}\n'
            'RUN a \\\n    # a comment inside\n    && b\nCMD ["serve"]\n')
    got = [(i.name, i.args, i.line) for i in parse_dockerfile(text)]
    assert got == [("ARG", "BASE=img:1", 2), ("FROM", "${BASE}", 3), ("RUN", "a && b", 4),
                   ("CMD", '["serve"]', 7)]
    assert parse_dockerfile(text)[-1].json_form() == ["serve"]


def arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    defaults = {}
    for inst in instructions:
        if inst.name == "ARG" and "=" in inst.args:
            key, _, value = inst.args.partition("=")
            defaults[key.strip()] = value.strip().strip('"')
    return defaults


def environment(instructions: list[Instruction]) -> dict[str, str]:
    """``ENV K=V K2=V2`` (and the old ``ENV K V``) as a mapping."""
    env: dict[str, str] = {}
    for inst in instructions:
        if inst.name != "ENV":
            continue
        words = inst.words()
        if words and "=" not in words[0]:
            env[words[0]] = " ".join(words[1:])
            continue
        for word in words:
            key, _, value = word.partition("=")
            env[key] = value
    return env


@dataclasses.dataclass
class Copy:
    sources: list[str]
    destination: str
    flags: list[str]


def copies(instructions: list[Instruction]) -> list[Copy]:
    found = []
    for inst in instructions:
        if inst.name not in ("COPY", "ADD"):
            continue
        words = inst.words()
        flags = [w for w in words if w.startswith("--")]
        paths = [w for w in words if not w.startswith("--")]
        found.append(Copy(paths[:-1], paths[-1], flags))
    return found


# -- .dockerignore (Docker's rules: Go path patterns, ** for any depth, ! to re-include) --

def dockerignore_patterns() -> list[tuple[bool, re.Pattern[str]]]:
    patterns = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        include = text.startswith("!")
        text = text.lstrip("!").strip("/")
        regex = ""
        i = 0
        while i < len(text):
            if text.startswith("**/", i):
                regex, i = regex + "(?:.*/)?", i + 3
            elif text.startswith("**", i):
                regex, i = regex + ".*", i + 2
            elif text[i] == "*":
                regex, i = regex + "[^/]*", i + 1
            elif text[i] == "?":
                regex, i = regex + "[^/]", i + 1
            elif text[i] == "[":
                end = text.index("]", i)
                regex, i = regex + text[i:end + 1], end + 1
            else:
                regex, i = regex + re.escape(text[i]), i + 1
        patterns.append((include, re.compile(regex + r"\Z")))
    return patterns


def ignored(relative: str) -> bool:
    """Whether .dockerignore keeps ``relative`` (or a folder above it) out of the context."""
    parts = relative.strip("/").split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    excluded = False
    for include, pattern in dockerignore_patterns():
        if any(pattern.match(prefix) for prefix in prefixes):
            excluded = not include
    return excluded


def test_the_dockerignore_reader() -> None:
    assert ignored(".venv/bin/python") and ignored("djl_stream/__pycache__/x.pyc")
    assert ignored("tests/test_check.py") and ignored("model.tar.gz")
    assert not ignored("djl_stream/cli.py") and not ignored("model/model.py")


def test_the_build_context_keeps_the_model_weights_and_drops_the_rest() -> None:
    # The images are self-contained (docker/README.md): whatever model/ holds goes in.
    assert not ignored("model/model.safetensors") and not ignored("model/tokenizer.json")
    for path in (".git/HEAD", ".venv/lib", "model/__pycache__/model.cpython-311.pyc",
                 ".pytest_cache/x", ".hypothesis/x", "djl_stream.egg-info/PKG-INFO"):
        assert ignored(path), path


# -- the Dockerfiles --

@pytest.fixture(params=sorted(DOCKERFILES), ids=str)
def dockerfile(request: pytest.FixtureRequest) -> tuple[str, list[Instruction]]:
    return request.param, parse_dockerfile(DOCKERFILES[request.param].read_text())


def test_from_is_a_concrete_djl_image_chosen_by_a_build_arg(dockerfile) -> None:
    kind, instructions = dockerfile
    froms = [i for i in instructions if i.name == "FROM"]
    assert len(froms) == 1 and froms[0].args == "${BASE_IMAGE}"
    assert instructions.index(froms[0]) > next(
        n for n, i in enumerate(instructions) if i.name == "ARG" and i.args.startswith("BASE_IMAGE="))
    image = arg_defaults(instructions)["BASE_IMAGE"]
    name, _, tag = image.rpartition(":")
    assert name.endswith(("/djl-inference", "deepjavalibrary/djl-serving"))
    assert re.fullmatch(r"\d+\.\d+\.\d+-.+", tag), f"not a pinned version: {image}"
    assert ("lmi" in tag) if kind == "lmi" else ("neuronx" in tag or "inf2" in tag)


def test_every_copy_source_is_in_the_build_context(dockerfile) -> None:
    _, instructions = dockerfile
    for copy in copies(instructions):
        assert not any(f.startswith("--from") for f in copy.flags)
        for source in copy.sources:
            path = REPO / source
            assert path.exists(), f"COPY {source}: no such file in the repository"
            assert not ignored(source), f"COPY {source}: excluded by .dockerignore"


def test_model_goes_to_opt_ml_model(dockerfile) -> None:
    _, instructions = dockerfile
    model = [c for c in copies(instructions) if c.sources == ["model/"]]
    assert len(model) == 1
    assert model[0].destination.rstrip("/") == "/opt/ml/model"


def test_djl_stream_is_installed_from_the_copied_sources(dockerfile) -> None:
    _, instructions = dockerfile
    destinations = {}
    for copy in copies(instructions):
        for source in copy.sources:
            destinations[source.rstrip("/")] = copy.destination.rstrip("/")
    package_dir = destinations["pyproject.toml"]
    assert destinations["djl_stream"] == f"{package_dir}/djl_stream"
    # pyproject's readme is read while pip builds the package: it must be copied too.
    assert destinations["README.md"] == package_dir
    installs = [i.args for i in instructions if i.name == "RUN" and "pip install" in i.args]
    assert any(re.search(rf"pip install .*{re.escape(package_dir)}(\s|$)", run) for run in installs)
    assert all("--no-deps" not in run for run in installs)
    # ...with the base image's torch pinned, and a smoke import of what the worker imports.
    assert any("--constraint" in run and "pip freeze" in run for run in installs)
    assert any("import djl_stream.service" in run for run in installs)


def test_djl_servings_own_entry_point_and_cmd_are_kept(dockerfile) -> None:
    _, instructions = dockerfile
    assert not [i for i in instructions if i.name == "ENTRYPOINT"]
    cmds = [i for i in instructions if i.name == "CMD"]
    assert len(cmds) == 1 and cmds[0].json_form() == ["serve"]


def test_the_image_turns_off_lmi_rolling_batch(dockerfile) -> None:
    kind, instructions = dockerfile
    env = environment(instructions)
    assert env["OPTION_ROLLING_BATCH"] == "disable"
    if kind == "neuron":
        assert env["OPTION_STREAM_ENGINE"] == "transformers-neuronx"


def test_the_build_runs_djl_stream_check_on_the_model(dockerfile) -> None:
    _, instructions = dockerfile
    runs = [i.args for i in instructions if i.name == "RUN"]
    assert any("djl_stream check /opt/ml/model" in run for run in runs)
    copy_model = next(i for i in instructions if i.name == "COPY" and i.args.startswith("model/"))
    check = next(i for i in instructions if i.name == "RUN" and "djl_stream check" in i.args)
    assert instructions.index(check) > instructions.index(copy_model)


# -- the entry points the images rely on --

def defines(path: Path, function: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == function for node in tree.body)


def test_the_entry_points_named_exist() -> None:
    assert (REPO / "djl_stream" / "__init__.py").is_file()
    assert (REPO / "djl_stream" / "__main__.py").is_file()  # `python3 -m djl_stream check`
    assert defines(REPO / "model" / "model.py", "handle")
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    module, _, function = project["scripts"]["djl-stream"].partition(":")
    assert defines(REPO / Path(*module.split(".")).with_suffix(".py"), function)
    assert project["readme"] == "README.md"


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_model_passes_djl_stream_check_with_the_image_environment(
        kind: str, embedded_model_dir: Path) -> None:
    env = environment(parse_dockerfile(DOCKERFILES[kind].read_text()))
    report = check_model_dir(embedded_model_dir, environ=env)
    assert report.ok, report.render()
    assert not report.warnings, report.render()

"""docker/: contract checks; no Docker engine runs here.

Nothing here builds or runs an image. The Dockerfiles are parsed (a small reader of
instructions: comments, line continuations, JSON and shell forms) and held to what the
images must do: build from the repository root with every ``COPY`` source present and not
excluded by ``.dockerignore``; put ``model/`` at ``/opt/ml/model``; install djl_stream's core
from the copied sources, constrained by a full ``pip freeze`` of the image; keep
djl-serving's own ``CMD ["serve"]``; set the Neuron image's compiled shapes to values that
fit the embedded model on an inf2.xlarge; and ship a ``model/`` that passes
``djl-stream check --image <kind>`` under the environment the Dockerfile sets. Whether pip
really resolves inside the images is not checked here (no Docker engine); the core
requirements are held to the images' pins (djl_stream.shipping.images).
"""

from __future__ import annotations

import ast
import dataclasses
import json
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Optional

import pytest

from djl_stream.shipping.check import check_model_dir

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
    [install] = [i.args for i in instructions if i.name == "RUN" and "pip install" in i.args]
    steps = [step.strip() for step in install.split("&&")]
    # The whole image, as it is, is the constraint: a full freeze (pip, setuptools and wheel
    # included; editables left out, as pip refuses them as constraints), not a filtered one.
    freeze = next(n for n, step in enumerate(steps) if " pip freeze" in step)
    words = shlex.split(steps[freeze])
    assert words[:4] == ["python3", "-m", "pip", "freeze"]
    assert set(words[4:words.index(">")]) == {"--all", "--exclude-editable"}
    constraints = words[words.index(">") + 1]
    assert "|" not in steps[freeze] and "grep" not in install
    # ...then the core package (no extra) from the copied sources, under that constraint.
    pip = next(n for n, step in enumerate(steps) if " pip install " in step)
    assert pip > freeze
    words = shlex.split(steps[pip])
    assert words[:4] == ["python3", "-m", "pip", "install"]
    assert words[words.index("--constraint") + 1] == constraints
    targets = [w for w in words[4:] if not w.startswith("-") and w != constraints]
    assert targets == [package_dir]  # not f"{package_dir}[serve]"
    for loosening in ("--no-deps", "-U", "--upgrade", "--force-reinstall", "--ignore-installed"):
        assert loosening not in words
    assert "PIP_CONSTRAINT" not in install  # would also pin the isolated build environment
    # ...and a smoke import of what the worker imports.
    assert "import djl_stream.serving.service" in steps[-1]


def test_no_package_pins_of_its_own(dockerfile) -> None:
    """djl-stream fits the images' own transformers: nothing is pinned or kept by name."""
    _, instructions = dockerfile
    assert not {"TRANSFORMERS_PIN", "KEEP_PACKAGES"} & set(arg_defaults(instructions))
    assert not any("==" in i.args for i in instructions if i.name == "RUN")


@pytest.mark.parametrize("kind", sorted(DOCKERFILES))
def test_the_core_requirements_are_met_by_the_images_pins(kind: str) -> None:
    """What the constrained install needs: every core requirement djl-stream shares with
    the image accepts the image's version (so pip has nothing to replace)."""
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    from djl_stream.shipping.images import IMAGES

    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    pins = {canonicalize_name(name): version for name, version in IMAGES[kind].pins.items()}
    shared = 0
    for text in project["dependencies"]:
        requirement = Requirement(text)
        pinned = pins.get(canonicalize_name(requirement.name))
        if pinned is not None:
            shared += 1
            assert requirement.specifier.contains(pinned, prereleases=True), (text, pinned)
    assert shared >= 3  # torch, transformers, accelerate, pydantic at least


def test_the_worker_needs_nothing_from_the_serve_extra() -> None:
    """The images install the core only: what the smoke import loads must not need the
    local server's packages."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    serve = [re.split(r"[<>=!~\[; ]", text)[0] for text in
             project["optional-dependencies"]["serve"]]
    assert serve
    blocked = "; ".join(f"sys.modules[{name!r}] = None" for name in serve)
    code = f"import sys; {blocked}; import djl_stream.serving.service; import djl_stream.generation.engines.neuronx"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, cwd=REPO)


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
    kind, instructions = dockerfile
    runs = [i.args for i in instructions if i.name == "RUN"]
    assert any(f"djl_stream check --image {kind} /opt/ml/model" in run for run in runs)
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
    report = check_model_dir(embedded_model_dir, environ=env, images=[kind])
    assert report.ok, report.render()
    assert not report.warnings, report.render()


# -- the Neuron image's compiled shapes --

INF2_XLARGE = {"neuron_cores": 2, "gib_per_core": 16}


def test_the_neuron_image_sets_the_shapes_it_would_otherwise_guess(embedded_model_dir: Path) -> None:
    """djl-serving 0.30 fills n_positions, tensor_parallel_degree and max_rolling_batch_size
    in by heuristics unless set; the image sets all three, and serving.properties (which
    wins) leaves them as the image sets them."""
    from djl_stream.serving.properties import djl_init_properties
    from djl_stream.shipping.smart_defaults import NEURON_SMART_DEFAULTS, neuron_smart_defaults

    env = environment(parse_dockerfile(DOCKERFILES["neuron"].read_text()))
    chosen = {key: env[f"OPTION_{key.upper()}"] for key in NEURON_SMART_DEFAULTS}
    effective = djl_init_properties(embedded_model_dir, env)
    assert {key: effective[key] for key in NEURON_SMART_DEFAULTS} == chosen
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert neuron_smart_defaults(config, chosen, INF2_XLARGE["neuron_cores"]) == {}
    # ...and not what the image would have guessed, or setting them would change nothing.
    assert neuron_smart_defaults(config, {}, INF2_XLARGE["neuron_cores"]) != chosen


def test_the_neuron_shapes_fit_the_embedded_model_on_an_inf2_xlarge(embedded_model_dir: Path) -> None:
    env = environment(parse_dockerfile(DOCKERFILES["neuron"].read_text()))
    tp = int(env["OPTION_TENSOR_PARALLEL_DEGREE"])
    n_positions = int(env["OPTION_N_POSITIONS"])
    batch = int(env["OPTION_MAX_ROLLING_BATCH_SIZE"])
    config = json.loads((embedded_model_dir / "config.json").read_text())
    assert INF2_XLARGE["neuron_cores"] % tp == 0
    # the heads shard evenly (transformers-neuronx pads them otherwise)
    assert config["num_attention_heads"] % tp == 0 and config["num_key_value_heads"] % tp == 0
    assert n_positions <= config["max_position_embeddings"]
    assert 1 <= batch <= 32
    # fp16 weights plus the KV cache of a full batch at n_positions, well within the cores
    # of one copy
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    weights = (embedded_model_dir / "model.safetensors").stat().st_size / 2  # stored as fp32
    kv_cache = (2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim
                * n_positions * batch * 2)
    assert weights + kv_cache < 0.5 * tp * INF2_XLARGE["gib_per_core"] * 2**30

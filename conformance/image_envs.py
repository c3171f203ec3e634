"""Virtual environments shaped like the djl-serving images djl-stream is installed into.

The images cannot run here (CUDA, Neuron devices, gigabytes of layers), but what matters
about them for djl-stream is their Python and the packages they pin, and both are written
in their Dockerfiles and pin files (``DJL_SERVING_SRC``). From those this module builds,
per image (:data:`djl_stream.shipping.images.IMAGES`):

- the image's **pins** (:func:`read_image`), parsed from the real files;
- a **resolution venv**: the image's Python, the image's versions of every package
  djl-stream depends on directly or through transformers, really installed, and every
  other package the image pins (torch, vllm, the Neuron SDK's ...) as a metadata-only stub:
  torch's wheels are gigabytes and PyPI serves no separate metadata file for them, so
  resolving against a real pin would download them, and several of the others are not on
  PyPI at all. ``pip install --dry-run --report`` of a djl-stream wheel there shows what
  installing djl-stream in the image would change (:func:`dry_run`);
- a **runtime venv**: this machine's Python 3.11 with the image's transformers,
  tokenizers, accelerate, pydantic and huggingface-hub, and djl-stream installed without
  its dependencies, to run djl-stream's code on the image's libraries. torch there is the
  local CPU build (``torch==2.13.0``): the images' own torch builds (CUDA 2.6.0, Neuron
  2.1.2) cannot be installed on this machine.

Venvs are cached in ``.compat/`` under a key made of the image's pins, the recipe and
``pyproject.toml``, so a change to any of them builds fresh ones.

Run on its own to build them and print where they are::

    DJL_SERVING_SRC=../shared/djl-serving .venv/bin/python conformance/image_envs.py
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from pathlib import Path
from typing import Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".compat"
PYENV_ROOT = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))

#: The Dockerfile of each image in its release branch's ``serving/docker/``.
DOCKERFILES = {"lmi": "lmi.Dockerfile", "neuron": "pytorch-inf2.Dockerfile"}
#: Dependencies of djl-stream only present as metadata in the resolution venv (see the
#: module docstring); the image's other pins are stubbed too (:func:`stubbed_pins`).
STUBBED = ("torch",)
#: Dependencies of transformers that djl-stream imports itself, so their image versions count.
THROUGH_TRANSFORMERS = ("huggingface-hub",)
#: The Python of the runtime venvs: the one this machine's torch wheel is built for.
RUNTIME_PYTHON = "3.11"
RUNTIME_TORCH = "torch==2.13.0"
#: What the unit tests and probes need besides djl-stream's own dependencies. jinja2 renders
#: chat templates; both images carry it.
RUNTIME_EXTRAS = ("jinja2", "numpy", "pytest>=8", "hypothesis>=6.100")
#: Bump to rebuild every cached venv after a change in how they are made.
RECIPE = 1


class ImageEnvError(RuntimeError):
    """A venv cannot be built; the message says what is missing."""


# ---------------------------------------------------------------------------------------
# The images' pins, from their Dockerfiles


@dataclasses.dataclass(frozen=True)
class ImagePins:
    """What one image's Dockerfile installs.

    ``pins``: canonical package name -> the exact version installed; ``unpinned``: packages
    installed without a version (pip took the newest the others allowed).
    """

    image: str
    branch: str
    python: str
    pins: Mapping[str, str]
    unpinned: frozenset
    serving_features: str


def _instructions(dockerfile: str) -> List[Tuple[str, str]]:
    """``(INSTRUCTION, arguments)`` of a Dockerfile, continuation lines joined."""
    text = re.sub(r"\\\n", " ", "\n".join(
        line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")))
    found = []
    for line in text.splitlines():
        parts = line.strip().split(None, 1)
        if parts:
            found.append((parts[0].upper(), parts[1] if len(parts) > 1 else ""))
    return found


def _expand(text: str, args: Mapping[str, str]) -> str:
    """``${name}`` and ``$name`` replaced by the ARG defaults; unknown ones left as they are."""
    def value(match: re.Match) -> str:
        name = match.group(1) or match.group(2)
        return args.get(name, match.group(0))

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


_OPTIONS_WITH_VALUE = {"-i", "--index-url", "--extra-index-url", "-f", "--find-links",
                       "-c", "--constraint", "-t", "--target"}


def _pip_install_tokens(command: str) -> Optional[List[str]]:
    try:
        words = shlex.split(command)
    except ValueError:
        return None
    for i in range(len(words) - 1):
        if re.fullmatch(r"(.*/)?pip3?(\.\d+)?", words[i]) and words[i + 1] == "install":
            return words[i + 2:]
    return None


def _requirement_strings(tokens: Sequence[str], read_file) -> Iterator[str]:
    tokens = list(tokens)
    i = 0
    while i < len(tokens):
        token = tokens[i]
        if token in ("-r", "--requirement"):
            yield from _requirement_lines(read_file(tokens[i + 1]))
            i += 2
            continue
        if token in _OPTIONS_WITH_VALUE:
            i += 2
            continue
        i += 1
        if token.startswith("-") or "://" in token or "$" in token:
            continue  # options, wheel URLs, values the Dockerfile builds at run time
        yield token


def _requirement_lines(text: str) -> Iterator[str]:
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line and not line.startswith("-"):
            yield line


def read_image(image: str, djl_src: Path) -> ImagePins:
    """The pins of ``image`` ("lmi" or "neuron"), read from its Dockerfile in ``djl_src``.

    Every ``pip install`` of every ``RUN`` counts, in order (a later pin of a package
    replaces an earlier one; a later bare name keeps it, as pip does), with ``ARG``
    defaults substituted and ``-r`` files found through the ``COPY`` that put them there.
    torch counts too when it comes from djl's install script (the Neuron image's
    ``install_djl_serving.sh ... ${torch_version}``) rather than pip.
    """
    from djl_stream.shipping.images import IMAGES

    branch = f"{IMAGES[image].djl_serving}-dlc"
    docker_dir = djl_src / branch / "serving" / "docker"
    dockerfile = docker_dir / DOCKERFILES[image]
    if not dockerfile.is_file():
        raise ImageEnvError(f"{dockerfile} not found: DJL_SERVING_SRC must hold {branch}/")
    instructions = _instructions(dockerfile.read_text())
    args: Dict[str, str] = {}
    env: Dict[str, str] = {}
    copies: Dict[str, Path] = {}
    pins: Dict[str, str] = {}
    unpinned = set()

    def read_file(name: str) -> str:
        source = copies.get(name) or copies.get(f"./{name}") or docker_dir / name
        return source.read_text()

    for instruction, rest in instructions:
        if instruction == "ARG" and "=" in rest:
            name, value = rest.split("=", 1)
            args[name.strip()] = value.strip()
        elif instruction == "ENV" and "=" in rest:
            name, value = rest.split("=", 1)
            env[name.strip()] = value.strip().strip('"')
        elif instruction == "COPY":
            parts = rest.split()
            if len(parts) == 2:
                copies[parts[1]] = docker_dir / parts[0]
        elif instruction == "RUN":
            for command in re.split(r"&&|;", _expand(rest, args)):
                tokens = _pip_install_tokens(command)
                if tokens is None:
                    continue
                for text in _requirement_strings(tokens, read_file):
                    try:
                        requirement = Requirement(text)
                    except InvalidRequirement:
                        continue
                    name = canonicalize_name(requirement.name)
                    exact = [s.version for s in requirement.specifier if s.operator == "=="]
                    if exact:
                        pins[name] = exact[0]
                        unpinned.discard(name)
                    elif name not in pins:
                        unpinned.add(name)
    if "torch" not in pins and "torch_version" in args:
        pins["torch"] = args["torch_version"]
    if "python_version" not in args:
        raise ImageEnvError(f"{dockerfile} has no ARG python_version")
    return ImagePins(image, branch, args["python_version"], pins, frozenset(unpinned),
                     env.get("SERVING_FEATURES", ""))


# ---------------------------------------------------------------------------------------
# What goes into the venvs


def core_dependencies(pyproject: Path = REPO / "pyproject.toml") -> List[str]:
    """Canonical names of djl-stream's core dependencies, then the transformers
    dependencies it uses directly (:data:`THROUGH_TRANSFORMERS`)."""
    project = tomllib.loads(pyproject.read_text())["project"]
    names = [canonicalize_name(Requirement(text).name) for text in project["dependencies"]]
    return names + [n for n in THROUGH_TRANSFORMERS if n not in names]


def image_requirements(pins: ImagePins, *, runtime: bool) -> List[str]:
    """pip requirements that give a venv the image's versions of djl-stream's dependencies:
    ``name==pin`` where the image pins one, the bare name where it lets pip choose (which
    then picks what the image's transformers allows, e.g. its tokenizers range). Stubbed
    packages are left out of the resolution venv's list (:func:`write_stub`) and replaced by
    the local CPU torch in a runtime venv."""
    requirements = []
    for name in core_dependencies():
        if name in STUBBED:
            if runtime and name == "torch":
                requirements.append(RUNTIME_TORCH)
            continue
        requirements.append(f"{name}=={pins.pins[name]}" if name in pins.pins else name)
    if runtime:
        requirements += RUNTIME_EXTRAS
    return requirements


def stubbed_pins(pins: ImagePins) -> Dict[str, str]:
    """The image's pins that the resolution venv holds as metadata only: every pin but
    those :func:`image_requirements` installs for real. A stub keeps the image's version in
    view should djl-stream ever depend on one of them."""
    real = {canonicalize_name(Requirement(r).name) for r in image_requirements(pins, runtime=False)}
    return {name: version for name, version in sorted(pins.pins.items()) if name not in real}


def write_stub(site_packages: Path, name: str, version: str) -> Path:
    """A metadata-only installation of ``name`` ``version``: a ``.dist-info`` with METADATA,
    INSTALLER and RECORD (so pip sees it installed and could uninstall it), no code. It
    declares no dependencies: only its own version takes part in resolving djl-stream."""
    info = site_packages / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
                                   "Summary: metadata-only stand-in (djl-stream conformance)\n")
    (info / "INSTALLER").write_text("djl-stream-conformance\n")
    (info / "RECORD").write_text("".join(f"{info.name}/{f},,\n"
                                         for f in ("METADATA", "INSTALLER", "RECORD")))
    return info


# ---------------------------------------------------------------------------------------
# Building and caching


def find_python(version: str) -> Path:
    """The interpreter for ``version`` ("3.12"): pyenv's newest ``3.12.*``, else
    ``python3.12`` on PATH; :class:`ImageEnvError` naming what to install otherwise."""
    candidates = sorted(
        (p for p in (PYENV_ROOT / "versions").glob(f"{version}.*")
         if re.fullmatch(rf"{re.escape(version)}\.\d+", p.name) and (p / "bin" / "python").exists()),
        key=lambda p: int(p.name.rsplit(".", 1)[1]))
    if candidates:
        return candidates[-1] / "bin" / "python"
    found = shutil.which(f"python{version}")
    if found:
        probe = subprocess.run([found, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                               capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip() == version:
            return Path(found)
    raise ImageEnvError(
        f"no Python {version} found (looked in {PYENV_ROOT}/versions/{version}.* and for "
        f"python{version} on PATH): the image venvs need the image's own Python version; "
        f"install it, e.g. `pyenv install {version}`")


@dataclasses.dataclass(frozen=True)
class Venv:
    """A built venv: where it is and what it was built for."""

    path: Path
    image: str
    kind: str  # "resolve" or "runtime"

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def installed(self) -> Dict[str, str]:
        """Canonical name -> version of every distribution in the venv."""
        out = run([self.python, "-m", "pip", "list", "--format", "json"])
        return {canonicalize_name(d["name"]): d["version"] for d in json.loads(out)}


def run(command: Sequence, *, cwd: Optional[Path] = None, env: Optional[Mapping] = None) -> str:
    """Run ``command``; its stdout, or :class:`ImageEnvError` with its output."""
    result = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True,
                            text=True)
    if result.returncode != 0:
        raise ImageEnvError(f"{' '.join(map(str, command))} failed ({result.returncode}):\n"
                            f"{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return result.stdout


def cache_key(pins: ImagePins, kind: str) -> str:
    """Changes with the image's pins, the recipe and pyproject.toml."""
    recipe = {
        "recipe": RECIPE, "kind": kind, "python": pins.python,
        "pins": dict(sorted(pins.pins.items())),
        "requirements": image_requirements(pins, runtime=kind == "runtime"),
        "stubs": stubbed_pins(pins),
        "pyproject": (REPO / "pyproject.toml").read_text(),
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def build_venv(pins: ImagePins, kind: str, cache: Path = CACHE) -> Venv:
    """The cached venv of ``kind`` ("resolve" or "runtime") for the image, built if needed.

    A venv is complete once its ``.complete`` file exists; a half-built one (an interrupted
    run) is removed and built again, and so are the same image's venvs of other keys.
    """
    from djl_stream.runtime.file_lock import exclusive_lock

    prefix = f"{pins.image}-{kind}-"
    path = cache / f"{prefix}{cache_key(pins, kind)}"
    venv = Venv(path, pins.image, kind)
    with exclusive_lock(cache / f"{prefix}lock"):
        if (path / ".complete").is_file():
            return venv
        for old in cache.glob(f"{prefix}*"):
            if old.is_dir():
                shutil.rmtree(old)
        python = find_python(pins.python if kind == "resolve" else RUNTIME_PYTHON)
        run([python, "-m", "venv", path])
        pip = [venv.python, "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
        if kind == "resolve":
            # The images' own pips are not pinned anywhere; a current pip reads every
            # metadata version the wheels use, and resolves by the same rules.
            run(pip + ["--upgrade", "pip"])
            site = Path(run([venv.python, "-c",
                             "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).strip())
            missing = [name for name in STUBBED if name not in pins.pins]
            if missing:
                raise ImageEnvError(f"{pins.image}: no pin of {', '.join(missing)} to stub")
            for name, version in stubbed_pins(pins).items():
                write_stub(site, name, version)
        run(pip + image_requirements(pins, runtime=kind == "runtime"))
        (path / ".complete").write_text(json.dumps(venv.installed(), indent=1, sort_keys=True))
    return venv


def build_all(djl_src: Path, images: Sequence[str] = tuple(DOCKERFILES),
              kinds: Sequence[str] = ("resolve", "runtime")) -> Dict[Tuple[str, str], Venv]:
    """Every venv of ``images`` × ``kinds``, built concurrently where missing."""
    pins = {image: read_image(image, djl_src) for image in images}
    with concurrent.futures.ThreadPoolExecutor(len(images) * len(kinds)) as pool:
        futures = {(image, kind): pool.submit(build_venv, pins[image], kind)
                   for image in images for kind in kinds}
        return {key: future.result() for key, future in futures.items()}


# ---------------------------------------------------------------------------------------
# djl-stream wheels and what installing one would do


def build_wheel(out_dir: Path, *, dependency_override: Optional[Tuple[str, str]] = None) -> Path:
    """A djl-stream wheel built from a copy of the repository's sources in a temp directory.

    ``dependency_override=("transformers", "transformers>=4.56,<6")`` replaces that core
    dependency in the copy's pyproject.toml first (a wheel the check must refuse).
    """
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "djl-stream"
        shutil.copytree(REPO / "djl_stream", source / "djl_stream",
                        ignore=shutil.ignore_patterns("__pycache__"))
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / name, source / name)
        if dependency_override is not None:
            name, replacement = dependency_override
            pyproject = source / "pyproject.toml"
            text = pyproject.read_text()
            pattern = rf'"{re.escape(name)}(?=[<>=!~ ;"])[^"]*"'
            text, count = re.subn(pattern, json.dumps(replacement), text, count=1)
            if count != 1:
                raise ImageEnvError(f"no dependency {name!r} in pyproject.toml to replace")
            pyproject.write_text(text)
        out_dir.mkdir(parents=True, exist_ok=True)
        run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps",
             "--disable-pip-version-check", "-w", out_dir, source])
    wheels = sorted(out_dir.glob("djl_stream-*.whl"), key=lambda p: p.stat().st_mtime)
    if not wheels:
        raise ImageEnvError(f"pip wheel wrote no djl_stream wheel into {out_dir}")
    return wheels[-1]


def wheel_requirements(wheel: Path) -> List[str]:
    """The ``Requires-Dist`` lines of a wheel's METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = archive.read(name).decode()
    return [line.split(":", 1)[1].strip() for line in metadata.splitlines()
            if line.startswith("Requires-Dist:")]


def dry_run(venv: Venv, wheel: Path) -> List[Tuple[str, str]]:
    """``(name, version)`` of everything ``pip install WHEEL`` would install in ``venv``
    (new packages and replacements alike), from ``pip install --dry-run --report``."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        run([venv.python, "-m", "pip", "install", "--dry-run", "--quiet",
             "--disable-pip-version-check", "--report", report, wheel])
        installs = json.loads(report.read_text())["install"]
    return [(canonicalize_name(item["metadata"]["name"]), item["metadata"]["version"])
            for item in installs]


def install_djl_stream(venv: Venv, wheel: Path) -> None:
    """Install ``wheel`` into a runtime venv without its dependencies (the image's stay)."""
    run([venv.python, "-m", "pip", "install", "--quiet", "--no-deps", "--force-reinstall",
         "--disable-pip-version-check", wheel])


def main() -> int:
    djl_src = Path(os.environ.get("DJL_SERVING_SRC", REPO.parent / "shared" / "djl-serving"))
    for (image, kind), venv in build_all(djl_src.resolve()).items():
        print(f"{image:7} {kind:8} {venv.path}")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    sys.exit(main())

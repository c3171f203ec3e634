"""djl-stream with the Python and the packages of the djl-serving images it ships on.

The facts in ``djl_stream/shipping/images.py`` must be the images' real pins; installing djl-stream
into an image must replace none of its packages (a ``pip --dry-run`` in a venv holding the
image's versions, see :mod:`image_envs`); and djl-stream must behave under the images'
transformers, tokenizers, accelerate and pydantic as it does under the local ones: the
embedded model reads the same, answers the same greedy requests with the same bytes, and
the unit tests of the parts that run in each image pass there.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet

import image_envs
from image_envs import REPO, ImageEnvError, core_dependencies, dry_run, read_image

from djl_stream.shipping.images import IMAGES

IMAGE_NAMES = ("lmi", "neuron")
MODEL_DIR = REPO / "model"
PROBE = Path(__file__).with_name("runtime_probe.py")
#: The unit tests of what runs inside each image. The Accelerate engine (continuous
#: batching) runs in both; the transformers-neuronx engine only in the Neuron one.
ACCELERATE_TESTS = ("test_batch.py", "test_scheduler.py", "test_engine_accelerate.py",
                    "test_service.py", "test_loading.py")
# test_model_files.py holds djl-stream check's rules to the transformers it runs under; its
# tokenizer-class test only has lists for the images' releases, so it runs here, not in
# the main venv.
COMMON_TESTS = ("test_request.py", "test_detokenize.py", "test_stopping.py",
                "test_formatters.py", "test_embedded.py", "test_streaming_utils.py",
                "test_model_files.py")
UNIT_TESTS = {
    "lmi": ACCELERATE_TESTS + COMMON_TESTS,
    "neuron": ("test_engine_neuronx.py",) + ACCELERATE_TESTS + COMMON_TESTS,
}
SECONDS = 600  # no subprocess here may run longer


@pytest.fixture(scope="session")
def image_pins(djl_src):
    return {image: read_image(image, djl_src) for image in IMAGE_NAMES}


@pytest.fixture(scope="session")
def venvs(djl_src):
    return image_envs.build_all(djl_src, IMAGE_NAMES)


@pytest.fixture(scope="session")
def wheels(tmp_path_factory):
    out = tmp_path_factory.mktemp("wheels")
    return {
        "djl-stream": image_envs.build_wheel(out / "repo"),
        "needs transformers>=4.56": image_envs.build_wheel(
            out / "newer", dependency_override=("transformers", "transformers>=4.56,<6")),
    }


@pytest.fixture(scope="session")
def runtimes(venvs, wheels):
    """The runtime venvs, with the djl-stream wheel of this checkout installed (no deps)."""
    chosen = {image: venvs[image, "runtime"] for image in IMAGE_NAMES}
    for venv in chosen.values():
        image_envs.install_djl_stream(venv, wheels["djl-stream"])
    return chosen


def run_probe(python: Path, out: Path) -> dict:
    # Run outside the repository, so the runtime venvs import their installed djl-stream.
    result = subprocess.run([str(python), str(PROBE), str(MODEL_DIR), str(out)],
                            cwd=out.parent, capture_output=True, text=True, timeout=SECONDS,
                            env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert result.returncode == 0, f"{python} {PROBE.name} failed:\n{result.stderr[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="session")
def probes(runtimes, tmp_path_factory):
    """The probe's findings under the main venv ("main") and each image's runtime venv."""
    out = tmp_path_factory.mktemp("probes")
    pythons = {"main": Path(sys.executable),
               **{image: venv.python for image, venv in runtimes.items()}}
    with concurrent.futures.ThreadPoolExecutor(len(pythons)) as pool:
        futures = {name: pool.submit(run_probe, python, out / f"{name}.json")
                   for name, python in pythons.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="session")
def unit_runs(runtimes, tmp_path_factory):
    """The unit tests of :data:`UNIT_TESTS`, started in every runtime venv at once; each
    value is a ``Popen`` whose combined output goes to a log file."""
    logs = tmp_path_factory.mktemp("unit-runs")
    started = {}
    for image, venv in runtimes.items():
        log = open(logs / f"{image}.log", "w+")
        # bin/pytest (not python -m pytest) keeps the repository off sys.path: the tests
        # import the djl-stream installed in the venv.
        command = [str(venv.path / "bin" / "pytest"), "-q", "-p", "no:cacheprovider",
                   *(f"tests/{name}" for name in UNIT_TESTS[image])]
        started[image] = (subprocess.Popen(command, cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                           env={**os.environ, "HF_HUB_OFFLINE": "1"}), log)
    yield started
    for process, log in started.values():
        if process.poll() is None:
            process.kill()
        log.close()


# --- the facts ---------------------------------------------------------------------


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_images_py_states_the_real_pins(image, image_pins):
    real, facts = image_pins[image], IMAGES[image]
    assert facts.python == real.python
    assert facts.serving_features == real.serving_features
    assert {name: real.pins.get(name) for name in facts.pins} == dict(facts.pins)
    # and leaves out no pin of a package djl-stream depends on
    pinned_dependencies = {n for n in core_dependencies() if n in real.pins}
    assert pinned_dependencies <= set(facts.pins), pinned_dependencies - set(facts.pins)


def test_a_missing_python_is_named_with_what_to_do():
    with pytest.raises(ImageEnvError, match=r"no Python 2\.9 found.*pyenv install 2\.9"):
        image_envs.find_python("2.9")


# --- resolution: installing djl-stream changes nothing in the image -------------------


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_the_resolution_venv_holds_the_image_versions(image, image_pins, venvs):
    pins, venv = image_pins[image], venvs[image, "resolve"]
    python = subprocess.run([str(venv.python), "-c",
                             "import sys; print('%d.%d' % sys.version_info[:2])"],
                            capture_output=True, text=True, check=True).stdout.strip()
    assert python == pins.python
    installed = venv.installed()
    assert set(core_dependencies()) <= set(installed)
    # every pin of the image, installed for real or as a stub, and none replaced since
    assert {name: installed.get(name) for name in pins.pins} == dict(pins.pins)
    transformers_deps = json.loads(subprocess.run(
        [str(venv.python), "-c", "import importlib.metadata as m, json; "
         "print(json.dumps(m.requires('transformers')))"],
        capture_output=True, text=True, check=True).stdout)
    tokenizers_range = next(r for r in transformers_deps if r.startswith("tokenizers"))
    assert installed["tokenizers"] in SpecifierSet(tokenizers_range[len("tokenizers"):])


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_installing_djl_stream_installs_djl_stream_only(image, venvs, wheels):
    version = wheels["djl-stream"].name.split("-")[1]
    assert dry_run(venvs[image, "resolve"], wheels["djl-stream"]) == [("djl-stream", version)]


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_a_wheel_needing_newer_transformers_would_replace_the_images(image, image_pins, venvs,
                                                                     wheels):
    assert "transformers<6,>=4.56" in image_envs.wheel_requirements(wheels["needs transformers>=4.56"])
    would_install = dict(dry_run(venvs[image, "resolve"], wheels["needs transformers>=4.56"]))
    assert "transformers" in would_install
    assert would_install["transformers"] != image_pins[image].pins["transformers"]


# --- runtime: djl-stream under the images' libraries --------------------------------


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_the_runtime_venv_runs_the_image_libraries_and_the_installed_djl_stream(
        image, image_pins, probes, runtimes):
    found, pins = probes[image], image_pins[image]
    for name in ("transformers", "accelerate", "pydantic", "huggingface-hub"):
        if name in pins.pins:
            assert found["versions"][name] == pins.pins[name], name
    assert found["versions"]["transformers"] != probes["main"]["versions"]["transformers"]
    assert Path(found["djl_stream"]).is_relative_to(runtimes[image].path)


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_the_embedded_model_reads_the_same_config(image, probes):
    found, main = probes[image], probes["main"]
    assert found["config"]["rope_theta"] == 100000.0
    assert found["config"] == main["config"]
    # what the model computes with, not only what the config says
    head_dim = found["config"]["head_dim"]
    expected = [100000.0 ** (-i / head_dim) for i in range(0, head_dim, 2)]
    assert all(math.isclose(a, b, rel_tol=1e-5) for a, b in
               zip(found["service"]["inv_freq"], expected, strict=True))
    assert found["service"]["inv_freq"] == main["service"]["inv_freq"]
    assert found["service"]["model_dtype"] == main["service"]["model_dtype"] == "float32"


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_the_tokenizer_and_chat_template_give_the_same_ids_and_prompt(image, probes):
    found, main = probes[image]["tokenizer"], probes["main"]["tokenizer"]
    assert found["chat_prompt"] == main["chat_prompt"]
    assert found["chat_prompt"].endswith("<|im_start|>assistant\n")
    assert found == main


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_greedy_answers_through_model_py_are_byte_identical(image, probes):
    found, main = probes[image]["service"], probes["main"]["service"]
    assert found["engine"] == main["engine"] == "Accelerate"
    assert [a["code"] for a in found["answers"]] == [200] * len(found["answers"])
    assert all(a["payload"] for a in found["answers"])
    assert found["answers"] == main["answers"]


@pytest.mark.parametrize("image", IMAGE_NAMES)
def test_the_unit_tests_pass_under_the_image_libraries(image, unit_runs):
    process, log = unit_runs[image]
    try:
        code = process.wait(timeout=SECONDS)
    except subprocess.TimeoutExpired:
        process.kill()
        raise
    log.seek(0)
    output = log.read()
    assert code == 0, f"{' '.join(UNIT_TESTS[image])} under the {image} image's libraries:\n" \
                      + "\n".join(output.splitlines()[-80:])
    assert " passed" in output.splitlines()[-1]


# --- the stock images: model.tar.gz with djl_stream inside, nothing installed ------------

@pytest.mark.parametrize("image, branch", [("lmi", "0.33.0-dlc"), ("neuron", "0.30.0-dlc")])
def test_the_packaged_archive_serves_on_the_stock_image_with_no_djl_stream_installed(
        image, branch, venvs, wheels, djl_src, tiny_dir, tmp_path):
    """`djl-stream package` on the stock image's libraries: the archive, unpacked as
    SageMaker unpacks it into /opt/ml/model, in the real worker of the image's branch,
    its venv without djl-stream (taken out for this test, put back after)."""
    from djl_frontend import DjlWorker
    from djl_stream.shipping.sagemaker import write_package

    venv = venvs[image, "runtime"]
    image_envs.run([venv.python, "-m", "pip", "uninstall", "--yes", "--quiet",
                    "--disable-pip-version-check", "djl-stream"])
    try:
        nowhere = subprocess.run([str(venv.python), "-c", "import djl_stream"], cwd=tmp_path,
                                 capture_output=True, text=True)
        assert "No module named 'djl_stream'" in nowhere.stderr
        archive = tmp_path / "model.tar.gz"
        assert write_package(tiny_dir, archive).vendored
        unpacked = tmp_path / "opt" / "ml" / "model"
        unpacked.mkdir(parents=True)
        with tarfile.open(archive, "r:gz") as tar:
            tar.extractall(unpacked, filter="data")
        with DjlWorker(djl_src, branch, unpacked, python=str(venv.python),
                       log_path=tmp_path / "worker.log") as worker:
            answer = worker.invoke({"inputs": "Hello there", "parameters": {"max_new_tokens": 4},
                                    "stream": True})
        log = (tmp_path / "worker.log").read_text(errors="replace")
    finally:
        image_envs.install_djl_stream(venv, wheels["djl-stream"])
    assert answer.status == 200, log[-3000:]
    lines = [json.loads(line) for line in answer.body.decode().splitlines() if line]
    # (the venv cannot import djl_stream: what served is the archive's copy)
    assert len(lines) == 4 and all(len(line["output_tokens"]) == 1 for line in lines)

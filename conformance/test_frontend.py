"""What djl-serving's front end decides before the worker's first byte, for our model
directories: which worker mode starts, and which properties the init call carries.

Computed by :mod:`djl_frontend` from the Java sources' rules; djl-stream's own emulation
(``djl_stream.serving.properties.djl_init_properties``, used by ``djl-stream serve``) must send the
same values.
"""

from __future__ import annotations

import shutil

import pytest

from djl_frontend import compose_worker_config
from djl_stream.shipping.images import IMAGES
from djl_stream.serving.properties import djl_init_properties

#: Keys the LMI recommender and PyModel add on their own (not from serving.properties).
FRONT_END_ADDITIONS = {"pipeline_parallel_degree", "max_rolling_batch_size", "gpu.minWorkers",
                       "gpu.maxWorkers", "tensor_parallel_degree", "rolling_batch", "handler"}


def without_entry_point(directory, tmp_path):
    copy = tmp_path / "no-entry-point"
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("*.safetensors"))
    properties = copy / "serving.properties"
    lines = properties.read_text().splitlines(keepends=True)
    properties.write_text("".join(l for l in lines if not l.startswith("option.entryPoint")))
    return copy


def test_model_dir_starts_the_synchronous_worker_on_the_lmi_image(embedded_dir):
    # the LMI image sets SERVING_FEATURES=vllm; serving.properties names the entry point
    config = compose_worker_config(embedded_dir, {"SERVING_FEATURES": "vllm"}, branch="0.33.0-dlc")
    assert (config.entry_point, config.async_mode) == ("model.py", False)
    assert config.init_properties["engine"] == "Python"
    assert config.init_properties["rolling_batch"] == "disable"


def test_without_an_entry_point_the_lmi_image_starts_the_async_worker(embedded_dir, tmp_path):
    directory = without_entry_point(embedded_dir, tmp_path)
    lmi = compose_worker_config(directory, {"SERVING_FEATURES": "vllm"}, branch="0.33.0-dlc")
    assert lmi.async_mode and lmi.entry_point == "model.py"
    assert lmi.recommended_entry_point == "djl_python.lmi_vllm.vllm_async_service"
    # 0.30 (the Neuron image's) has no async worker
    neuron = compose_worker_config(directory, {"SERVING_FEATURES": "vllm,lmi-dist,tnx"},
                                   branch="0.30.0-dlc")
    assert not neuron.async_mode


@pytest.mark.parametrize("environ", [
    {},
    {"OPTION_DTYPE": "bf16", "OPTION_ENGINE": "MPI", "OPTION_MAX_INPUT_LENGTH": "512",
     "OPTION_OUTPUT_FORMATTER": "sse", "SERVING_FEATURES": "vllm"},
    {"OPTION_ENTRYPOINT": "model.py", "OPTION_ASYNC_MODE": "true"},
    {"OPTION_entryPoint": "model.py", "OPTION_Max_Input_Length": "9"},
], ids=["plain", "options-from-environment", "upper-case-entry-point", "mixed-case"])
@pytest.mark.parametrize("which", ["embedded", "tiny"])
def test_djl_stream_serve_sends_the_init_call_djl_serving_sends(request, which, environ):
    directory = request.getfixturevalue(f"{which}_dir")
    ours = djl_init_properties(directory, environ)
    assert ours.pop("model_dir") == str(directory.resolve())  # the worker adds it too
    theirs = compose_worker_config(directory, environ, branch="0.33.0-dlc").init_properties
    assert {key: theirs.get(key) for key in ours} == ours
    assert set(theirs) - set(ours) <= FRONT_END_ADDITIONS


def test_the_neuron_image_compiles_the_shapes_its_dockerfile_sets(embedded_dir):
    """On an inf2.xlarge (2 NeuronCores) djl-serving 0.30 fills in n_positions, the tensor
    parallel degree and the batch size by its heuristics unless they are set: the
    Dockerfile's ENV sets them, and they are what the init call carries."""
    from test_docker_files import DOCKERFILES, environment, parse_dockerfile

    base = {"SERVING_FEATURES": IMAGES["neuron"].serving_features}  # the base image's ENV
    env = {**base, **environment(parse_dockerfile(DOCKERFILES["neuron"].read_text()))}
    keys = ("n_positions", "tensor_parallel_degree", "max_rolling_batch_size")
    guessed = compose_worker_config(embedded_dir, base, branch="0.30.0-dlc",
                                    neuron_cores=2).init_properties
    image = compose_worker_config(embedded_dir, env, branch="0.30.0-dlc",
                                  neuron_cores=2).init_properties
    assert {key: image[key] for key in keys} == {key: env[f"OPTION_{key.upper()}"] for key in keys}
    assert {key: guessed.get(key) for key in keys} != {key: image[key] for key in keys}

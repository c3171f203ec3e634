"""``djl-stream check``: the real model/ passes; each kind of broken directory fails with a
line that says what is wrong and what to write instead.

Broken directories are built from model/'s own model.py and serving.properties, with
placeholder weight files: the check looks for files, it does not load them.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from djl_stream import cli
from djl_stream.shipping.check import FAIL, OK, WARN, CheckReport, check_model_dir

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "model"
#: What the images in docker/ set; the directory is then complete as it ships.
CONTAINER_ENV = {"OPTION_ROLLING_BATCH": "disable"}


def make_model_dir(tmp_path: Path, properties: str | None = None, *, weights: bool = True,
                   model_py: str | None = None) -> Path:
    directory = tmp_path / "model"
    directory.mkdir(parents=True)
    if model_py is None:
        shutil.copy(MODEL_DIR / "model.py", directory / "model.py")
    elif model_py:
        (directory / "model.py").write_text(textwrap.dedent(model_py))
    text = (MODEL_DIR / "serving.properties").read_text() if properties is None \
        else textwrap.dedent(properties)
    (directory / "serving.properties").write_text(text)
    if weights:
        (directory / "config.json").write_text('{"model_type": "llama"}')
        (directory / "model.safetensors").write_bytes(b"placeholder")
        (directory / "tokenizer.json").write_text("{}")
    return directory


def line(report: CheckReport, subject: str, status: str = FAIL) -> str:
    found = [f.message for f in report.findings if f.subject == subject and f.status == status]
    assert found, f"no {status} line for {subject}:\n{report.render()}"
    return found[0]


# -- the real model directory --

def test_the_real_model_directory_passes(embedded_model_dir: Path) -> None:
    report = check_model_dir(embedded_model_dir, environ=CONTAINER_ENV)
    assert report.ok, report.render()
    assert not report.warnings, report.render()
    assert "model.py imports in" in line(report, "entry point", OK)
    assert line(report, "output formatter", OK) == "jsonlines (application/jsonlines)"
    assert "model.safetensors" in line(report, "weights", OK)


def test_the_cli_prints_one_line_per_check_and_exits_0(embedded_model_dir: Path,
                                                        capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTION_ROLLING_BATCH", "disable")
    assert cli.main(["check", str(embedded_model_dir)]) == 0
    out = capsys.readouterr().out
    assert "✓ engine" in out and "✓ handle" in out
    assert out.rstrip().endswith("OK: ready to ship")


# -- serving.properties --

def test_a_typo_in_an_option_fails_with_the_closest_name(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.dtpye=fp16\n")
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert not report.ok
    assert line(report, "option.dtpye") == "unknown property; did you mean option.dtype?"


def test_a_bad_dtype_names_the_valid_ones(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.dtype=fp8\n")
    message = line(check_model_dir(directory, environ=CONTAINER_ENV), "option.dtype")
    assert message == "expected one of fp32, fp16, bf16, auto, got 'fp8'"


def test_every_bad_option_gets_its_own_line(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, """\
        engine=Python
        option.max_input_length=lots
        option.enable_streaming=maybe
        option.default_max_new_tokens=4096
        """)
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert line(report, "option.max_input_length") == "expected an integer, got 'lots'"
    assert line(report, "option.enable_streaming") == "expected true or false, got 'maybe'"
    assert "must not exceed option.max_new_tokens_limit" in line(
        report, "option.default_max_new_tokens")
    assert len(report.failures) == 3


def test_option_environment_variables_are_checked_under_their_own_name(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    report = check_model_dir(directory, environ={**CONTAINER_ENV, "OPTION_MAX_NEW_TOKEN": "9"})
    assert "did you mean option.max_new_tokens_limit?" in line(report, "OPTION_MAX_NEW_TOKEN")


def test_framework_keys_are_djl_servings_and_typed(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, """\
        engine=Python
        job_queu_size=10
        dtype=fp16
        max_batch_delay=soon
        """)
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert line(report, "job_queu_size") == \
        "unknown djl-serving property; did you mean job_queue_size?"
    assert line(report, "dtype") == \
        "unknown djl-serving property; it is a djl-stream option: write option.dtype"
    assert line(report, "max_batch_delay") == "expected an integer, got 'soon'"


def test_dynamic_batching_fails_because_djl_refuses_it_with_streaming(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\nbatch_size=4\nmax_batch_delay=100\n")
    assert "refuses streaming" in line(check_model_dir(directory, environ=CONTAINER_ENV),
                                       "batch_size")


def test_engine_python_is_expected(tmp_path: Path) -> None:
    unset = make_model_dir(tmp_path / "a", "option.dtype=fp16\n")
    report = check_model_dir(unset, environ=CONTAINER_ENV)
    assert report.ok and "set engine=Python" in line(report, "engine", WARN)
    mpi = make_model_dir(tmp_path / "b", "engine=MPI\n")
    assert "set engine=Python" in line(check_model_dir(mpi, environ=CONTAINER_ENV), "engine")


@pytest.mark.parametrize("engine", ["transformers-neuronx", "Accelerate", "accelerate"])
def test_a_stream_engine_in_djls_engine_key_points_to_option_stream_engine(
        tmp_path: Path, engine: str) -> None:
    directory = make_model_dir(tmp_path, f"engine={engine}\n")
    message = line(check_model_dir(directory, environ=CONTAINER_ENV), "engine")
    canonical = "Accelerate" if engine.lower() == "accelerate" else engine
    assert message == (f"engine={engine} is djl-serving's engine key, not djl-stream's stream "
                       f"engine: set engine=Python and option.stream_engine={canonical}")


def test_option_engine_in_the_environment_is_djls_engine_when_serving_properties_has_none(
        tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "option.dtype=fp32\n")
    mpi = check_model_dir(directory, environ={**CONTAINER_ENV, "OPTION_ENGINE": "MPI"})
    assert line(mpi, "OPTION_ENGINE") == ("OPTION_ENGINE=MPI: djl-stream's handler runs on "
                                          "djl-serving's Python engine; set OPTION_ENGINE=Python")
    stream = check_model_dir(directory, environ={**CONTAINER_ENV,
                                                 "OPTION_ENGINE": "transformers-neuronx"})
    assert line(stream, "OPTION_ENGINE").endswith(
        "set OPTION_ENGINE=Python and OPTION_STREAM_ENGINE=transformers-neuronx")
    python = check_model_dir(directory, environ={**CONTAINER_ENV, "OPTION_ENGINE": "Python"})
    assert python.ok and line(python, "OPTION_ENGINE", OK).startswith("OPTION_ENGINE=Python")
    assert not [f for f in python.warnings if f.subject == "engine"]


def test_a_stream_engine_in_option_engine_fails_even_beside_engine_python(tmp_path: Path) -> None:
    """djl-serving ignores OPTION_ENGINE when serving.properties has engine, so the stream
    engine it was meant to choose would silently not be chosen."""
    directory = make_model_dir(tmp_path)
    report = check_model_dir(directory, environ={**CONTAINER_ENV,
                                                 "OPTION_ENGINE": "transformers-neuronx"})
    assert line(report, "engine", OK).startswith("engine=Python")
    assert line(report, "OPTION_ENGINE").endswith(
        "set OPTION_STREAM_ENGINE=transformers-neuronx instead")


def test_the_old_option_engine_points_to_option_stream_engine(tmp_path: Path) -> None:
    old = make_model_dir(tmp_path / "a", "engine=Python\noption.engine=transformers-neuronx\n")
    assert line(check_model_dir(old, environ=CONTAINER_ENV), "option.engine").endswith(
        "write option.stream_engine=transformers-neuronx")
    prefixed = make_model_dir(tmp_path / "b", "option.engine=Python\n")
    assert line(check_model_dir(prefixed, environ=CONTAINER_ENV), "option.engine") == (
        "option.engine=Python: djl-serving's engine key has no option. prefix; write "
        "engine=Python")


def test_rolling_batch_left_to_lmi_is_a_warning(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.dtype=fp32\n")
    report = check_model_dir(directory, environ={})
    assert report.ok
    assert "option.rolling_batch=disable" in line(report, "option.rolling_batch", WARN)


def test_a_line_without_equals_sign_fails(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.dtype fp16\n")
    assert "has no '='" in line(check_model_dir(directory, environ=CONTAINER_ENV),
                                "serving.properties")


# -- the entry point --

def test_a_missing_model_py_fails(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, model_py="")
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert line(report, "entry point") == f"model.py is missing from {directory}"


def test_option_entry_point_names_the_file(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.entryPoint=serve.py\n")
    assert line(check_model_dir(directory, environ=CONTAINER_ENV), "entry point") == \
        f"serve.py is missing from {directory}"


def test_importing_torch_at_module_level_fails(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, model_py="""\
        import torch  # loaded three times by djl before the first request

        def handle(inputs):
            return None
        """)
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    message = line(report, "entry point")
    assert message.startswith("importing model.py imports torch")
    assert "init call" in message
    assert line(report, "handle", OK) == "model.py defines handle()"


def test_a_slow_import_that_does_no_work_passes_whatever_the_machine(tmp_path: Path) -> None:
    # a busy machine makes any import slow: time alone decides nothing
    directory = make_model_dir(tmp_path, model_py="""\
        import time
        time.sleep(2.5)

        def handle(inputs):
            return None
        """)
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert line(report, "entry point", OK).startswith("model.py imports in 2.")


@pytest.mark.parametrize("work, said", [
    ("open(os.path.join(os.path.dirname(__file__), 'model.safetensors'), 'rb').read(1)",
     "opens weight files ("),
    ("threading.Thread(target=time.sleep, args=(60,), daemon=True, name='warmup').start()",
     "leaves threads running (warmup)"),
    ("socket.getaddrinfo('localhost', 80)", "touches the network ('localhost')"),
    ("subprocess.run(['true'])", "starts processes ("),
])
def test_an_import_that_does_the_init_calls_work_fails_saying_what(tmp_path: Path, work: str,
                                                                    said: str) -> None:
    directory = make_model_dir(tmp_path, model_py=f"""\
        import os, socket, subprocess, threading, time
        {work}

        def handle(inputs):
            return None
        """)
    message = line(check_model_dir(directory, environ=CONTAINER_ENV), "entry point")
    assert message.startswith(f"importing model.py {said}"), message
    assert message.endswith("do that work in the init call (the first handle()) instead")


@pytest.fixture(scope="module")
def bare_python(tmp_path_factory: pytest.TempPathFactory) -> str:
    """An interpreter with nothing installed: neither djl_stream nor transformers."""
    bare = tmp_path_factory.mktemp("bare")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    return str(bare / "bin" / "python")


def test_the_import_finds_only_what_the_worker_would(tmp_path: Path, bare_python: str) -> None:
    # djl_stream is installed where this check runs; an interpreter without it must fail
    # the import, as the stock image does, rather than be handed this checker's copy
    directory = make_model_dir(tmp_path)
    report = check_model_dir(directory, environ=CONTAINER_ENV, python=bare_python)
    assert "ModuleNotFoundError: No module named 'djl_stream'" in line(report, "entry point")


def test_an_import_error_is_reported(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, model_py="import no_such_module_here\n")
    assert "ModuleNotFoundError: No module named 'no_such_module_here'" in line(
        check_model_dir(directory, environ=CONTAINER_ENV), "entry point")


def test_no_handle_fails(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, model_py="def predict(inputs):\n    return None\n")
    assert "defines no handle()" in line(check_model_dir(directory, environ=CONTAINER_ENV),
                                         "handle")


def test_an_unknown_formatter_fails_and_a_function_in_model_py_resolves(tmp_path: Path) -> None:
    unknown = make_model_dir(tmp_path / "a", "engine=Python\noption.output_formatter=xml\n")
    assert "unknown output_formatter 'xml'" in line(
        check_model_dir(unknown, environ=CONTAINER_ENV), "output formatter")
    custom = make_model_dir(tmp_path / "b", "engine=Python\noption.output_formatter=plain\n",
                            model_py="""\
        def plain(pieces):
            return "".join(pieces)
        plain.content_type = "text/plain"

        def handle(inputs):
            return None
        """)
    report = check_model_dir(custom, environ=CONTAINER_ENV)
    assert report.ok, report.render()
    assert line(report, "output formatter", OK) == "plain (text/plain)"


def test_an_unregistered_engine_fails_with_the_registered_ones(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.stream_engine=Acelerate\n")
    message = line(check_model_dir(directory, environ=CONTAINER_ENV), "option.stream_engine")
    assert "no stream engine 'Acelerate'" in message and "did you mean Accelerate?" in message


def test_the_check_leaves_no_pycache_behind(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    check_model_dir(directory, environ=CONTAINER_ENV)
    assert not (directory / "__pycache__").exists()


# -- the worker mode --

def test_no_entry_point_warns_that_lmi_starts_the_async_worker(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\n")
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert report.ok
    message = line(report, "option.entryPoint", WARN)
    assert message.startswith("unset: the lmi image (djl-serving 0.33.0, SERVING_FEATURES=vllm)"
                              " then starts the Python worker in async mode")
    assert message.endswith("add option.entryPoint=model.py to serving.properties (or set "
                            "OPTION_ENTRYPOINT=model.py)")
    # The Neuron image (djl-serving 0.30) has no async worker.
    neuron = check_model_dir(directory, environ=CONTAINER_ENV, images=["neuron"])
    assert not [f for f in neuron.findings if f.subject == "option.entryPoint"]


@pytest.mark.parametrize("environ", [{"OPTION_ENTRYPOINT": "model.py"},
                                     {"DJL_ENTRY_POINT": "model.py"}])
def test_an_entry_point_from_the_environment_keeps_the_sync_worker(tmp_path: Path,
                                                                   environ: dict) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\n")
    report = check_model_dir(directory, environ={**CONTAINER_ENV, **environ})
    assert line(report, "option.entryPoint", OK) == (
        "model.py: djl-serving starts the synchronous worker, which calls handle()")


def test_an_entry_point_key_in_lower_case_is_not_djl_servings_and_says_so(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.entrypoint=model.py\n")
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert line(report, "option.entrypoint", WARN) == (
        "model.py: djl-serving reads option.entryPoint only (PyModel matches the key's case), "
        "so it ignores this one and takes model.py; write option.entryPoint=model.py")
    # and so the LMI image starts the async worker, which the check must not hide
    assert line(report, "option.entryPoint", WARN).startswith("unset: the lmi image")
    assert not [f for f in report.findings
                if f.subject == "option.entryPoint" and f.status == OK]


# -- OPTION_* variables that serving.properties overrides --

def test_a_variable_serving_properties_overrides_is_a_warning_naming_both_values(
        tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.entryPoint=model.py\n"
                                         "option.rolling_batch=disable\noption.dtype=fp32\n")
    report = check_model_dir(directory, environ={"OPTION_DTYPE": "fp16",
                                                 "OPTION_ROLLING_BATCH": "disable",
                                                 "OPTION_MAX_INPUT_LENGTH": "512"})
    assert line(report, "OPTION_DTYPE", WARN) == (
        "OPTION_DTYPE=fp16 is ignored: serving.properties sets option.dtype=fp32, and "
        "djl-serving keeps serving.properties over the environment (remove option.dtype "
        "there to configure it with OPTION_DTYPE)")
    # the same value in both, or a key the file leaves alone: nothing to say
    shadowed = {f.subject for f in report.warnings}
    assert "OPTION_ROLLING_BATCH" not in shadowed and "OPTION_MAX_INPUT_LENGTH" not in shadowed


def test_the_shipped_model_directory_leaves_the_options_to_the_environment(tmp_path: Path) -> None:
    # what the README's SageMaker example sets must take effect on model/
    directory = make_model_dir(tmp_path)
    environ = {"OPTION_DTYPE": "fp16", "OPTION_TENSOR_PARALLEL_DEGREE": "2",
               "OPTION_MAX_INPUT_LENGTH": "512", "OPTION_DEFAULT_MAX_NEW_TOKENS": "20"}
    report = check_model_dir(directory, environ=environ)
    assert not [f for f in report.warnings if f.subject.startswith("OPTION_")], report.render()


# -- Neuron's compiled shapes --

SMOLLM2_CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                  "hidden_size": 576, "intermediate_size": 1536,
                  "max_position_embeddings": 8192, "num_attention_heads": 9,
                  "num_hidden_layers": 30, "num_key_value_heads": 3, "vocab_size": 49152,
                  "rope_theta": 100000.0}
NEURON_PROPERTIES = "engine=Python\noption.entryPoint=model.py\n" \
                    "option.stream_engine=transformers-neuronx\n"


def neuron_model_dir(tmp_path: Path, properties: str = NEURON_PROPERTIES) -> Path:
    directory = make_model_dir(tmp_path, properties)
    (directory / "config.json").write_text(json.dumps(SMOLLM2_CONFIG))
    return directory


def test_neuron_shapes_left_to_smart_defaults_say_what_the_image_picks(tmp_path: Path) -> None:
    report = check_model_dir(neuron_model_dir(tmp_path), environ=CONTAINER_ENV)
    assert report.ok
    n_positions = line(report, "option.n_positions", WARN)
    assert "sets it to min(max_position_embeddings, 4096) = 4096 for this model" in n_positions
    assert "a prompt plus max_new_tokens beyond it is refused" in n_positions
    assert n_positions.endswith("set option.n_positions (or OPTION_N_POSITIONS)")
    batch = line(report, "option.max_rolling_batch_size", WARN)
    assert "(32 on an inf2.xlarge's 2 NeuronCores)" in batch
    assert "compiled batch size: every request is padded to it" in batch
    tp = line(report, "option.tensor_parallel_degree", WARN)
    assert "(1 on an inf2.xlarge's 2 NeuronCores)" in tp


def test_neuron_shapes_set_in_the_environment_count_as_set(tmp_path: Path) -> None:
    environ = {**CONTAINER_ENV, "OPTION_N_POSITIONS": "2048", "OPTION_MAX_ROLLING_BATCH_SIZE": "4",
               "OPTION_TENSOR_PARALLEL_DEGREE": "1"}
    report = check_model_dir(neuron_model_dir(tmp_path), environ=environ)
    assert not report.warnings, report.render()
    assert line(report, "Neuron shapes", OK).startswith(
        "n_positions=2048, tensor_parallel_degree=1, max_rolling_batch_size=4: compiled as set")


def test_neuron_shapes_are_checked_when_asked_about_the_neuron_image(tmp_path: Path) -> None:
    directory = neuron_model_dir(tmp_path, "engine=Python\noption.entryPoint=model.py\n")
    every_image = check_model_dir(directory, environ=CONTAINER_ENV)  # a GPU model: no word
    assert not [f for f in every_image.findings if "Neuron" in f.subject or "n_positions" in f.subject]
    asked = check_model_dir(directory, environ=CONTAINER_ENV, images=["neuron"])
    assert "= 4096 for this model" in line(asked, "option.n_positions", WARN)


# -- what the image's transformers reads --

def test_rope_parameters_without_rope_theta_fail_on_both_images(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    config = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0,
                                                         "rope_type": "default"}}
    (directory / "config.json").write_text(json.dumps(config))
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    messages = [f.message for f in report.failures if f.subject == "config.json"]
    assert len(messages) == 2
    assert messages[0].startswith("on the lmi image: rope_parameters without rope_theta: "
                                  "transformers 4.51.3 reads only rope_theta")
    assert "default theta (10000.0 for Llama) instead of 100000.0: no error, wrong output" \
        in messages[0]
    assert messages[0].endswith('add "rope_theta": 100000.0 to config.json')
    assert messages[1].startswith("on the neuron image:")

    (directory / "config.json").write_text(json.dumps({**config, "rope_theta": 100000.0}))
    fixed = check_model_dir(directory, environ=CONTAINER_ENV)
    assert fixed.ok and line(fixed, "model files", OK).endswith("4.51.3 (lmi), 4.45.2 (neuron)")


@pytest.mark.parametrize("tokenizer_class, failing_images", [
    ("TokenizersBackend", ["lmi", "neuron"]),   # new in transformers 5.0
    ("MyT5Tokenizer", ["neuron"]),              # in 4.51.3, not in 4.45.2
    ("GPT2Tokenizer", []),
    ("PreTrainedTokenizerFast", []),
])
def test_a_tokenizer_class_the_images_transformers_lacks_fails(tmp_path: Path, tokenizer_class: str,
                                                               failing_images: list) -> None:
    directory = make_model_dir(tmp_path)
    (directory / "tokenizer_config.json").write_text(
        json.dumps({"tokenizer_class": tokenizer_class}))
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    failed = [f.message for f in report.failures if f.subject == "tokenizer_config.json"]
    assert [m.split(":")[0].split()[-2] for m in failed] == failing_images
    for message in failed:
        assert f"tokenizer_class {tokenizer_class}" in message
        assert f'"Tokenizer class {tokenizer_class} does not exist or is not currently ' \
               'imported."' in message


def test_a_chat_template_only_in_its_jinja_file_fails_on_transformers_before_4_47(
        tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "GPT2Tokenizer"}))
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    [message] = [f.message for f in report.failures if f.subject == "chat_template.jinja"]
    assert message.startswith("on the neuron image: the chat template is only in "
                              "chat_template.jinja, which transformers 4.45.2 does not read "
                              "(it does from 4.47.0)")
    assert message.endswith('copy the template into tokenizer_config.json as "chat_template"')
    assert check_model_dir(directory, environ=CONTAINER_ENV, images=["lmi"]).ok

    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "GPT2Tokenizer", "chat_template": "{{ messages[0]['content'] }}"}))
    assert check_model_dir(directory, environ=CONTAINER_ENV).ok


def test_the_model_files_of_a_local_model_id_are_read(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.model_id=weights\n",
                               weights=False)
    weights = directory / "weights"
    weights.mkdir()
    (weights / "config.json").write_text(json.dumps({"rope_parameters": {"rope_theta": 5e5}}))
    (weights / "model.safetensors").write_bytes(b"placeholder")
    (weights / "tokenizer.json").write_text("{}")
    report = check_model_dir(directory, environ=CONTAINER_ENV, images=["lmi"])
    assert "rope_parameters without rope_theta" in line(report, "config.json")


def test_the_report_says_whose_pins_it_checked_against(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    report = check_model_dir(directory, environ=CONTAINER_ENV, images=["lmi"])
    assert line(report, "lmi image", OK) == (
        "checked against the pins of 763104351884.dkr.ecr.us-west-2.amazonaws.com/"
        "djl-inference:0.33.0-lmi15.0.0-cu128 (djl-serving 0.33.0, transformers 4.51.3)")


def test_another_base_image_is_checked_against_its_own_transformers(tmp_path: Path) -> None:
    import transformers

    directory = make_model_dir(tmp_path)
    other = "763104351884.dkr.ecr.us-west-2.amazonaws.com/djl-inference:0.34.0-lmi16.0.0-cu128"
    report = check_model_dir(directory, environ=CONTAINER_ENV, images=["lmi"],
                             base_image=other)
    assert line(report, "lmi image", OK).startswith(
        f"{other} is not the release djl-stream's pins describe (")
    assert f"checked against its own transformers {transformers.__version__}" in \
        line(report, "lmi image", OK)
    assert f"transformers {transformers.__version__} (lmi)" in line(report, "model files", OK)


def test_another_base_image_without_transformers_to_read_is_a_warning(
        tmp_path: Path, bare_python: str) -> None:
    report = check_model_dir(make_model_dir(tmp_path), environ=CONTAINER_ENV, images=["lmi"],
                             base_image="my-registry/djl-inference:custom", python=bare_python)
    assert "which may not be this image's" in line(report, "lmi image", WARN)


def test_unknown_images_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown image"):
        check_model_dir(make_model_dir(tmp_path), environ=CONTAINER_ENV, images=["tpu"])


def test_the_cli_checks_against_the_image_asked_for(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OPTION_ROLLING_BATCH", "disable")
    directory = make_model_dir(tmp_path)
    (directory / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    assert cli.main(["check", str(directory), "--image", "lmi"]) == 0
    assert "✓ model files" in capsys.readouterr().out
    assert cli.main(["check", str(directory), "--image", "neuron"]) == 1
    out = capsys.readouterr().out
    assert "✗ chat_template.jinja" in out and "! option.n_positions" in out
    assert cli.main(["check", str(directory)]) == 1  # every image by default
    with pytest.raises(SystemExit):
        cli.main(["check", str(directory), "--image", "tpu"])
    # package checks for the image it is meant for, too
    archive = tmp_path / "m.tar.gz"
    assert cli.main(["package", str(directory), "-o", str(archive)]) == 1
    assert not archive.exists()
    assert cli.main(["package", str(directory), "-o", str(archive), "--image", "lmi"]) == 0
    assert archive.exists()


# -- weights --

def test_no_weights_and_no_model_id_fails(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, weights=False)
    message = line(check_model_dir(directory, environ=CONTAINER_ENV), "weights")
    assert message.startswith("no option.model_id and")
    assert "config.json, weights (*.safetensors or *.bin), tokenizer" in message


@pytest.mark.parametrize("model_id, status, words", [
    ("HuggingFaceTB/SmolLM2-135M-Instruct", OK, "a hub id"),
    ("s3://my-bucket/models/smollm2/", OK, "djl-serving downloads it"),
    ("s3://My_Bucket/x", FAIL, "not a well-formed S3 URI"),
    ("https://example.com/model", FAIL, "only hub ids, s3:// URIs and local paths"),
    ("./elsewhere", FAIL, "does not exist"),
    ("not a model id", FAIL, "neither an existing path"),
])
def test_model_id_forms(tmp_path: Path, model_id: str, status: str, words: str) -> None:
    directory = make_model_dir(tmp_path, f"engine=Python\noption.model_id={model_id}\n",
                               weights=False)
    assert words in line(check_model_dir(directory, environ=CONTAINER_ENV), "weights", status)


def test_a_local_model_id_must_hold_a_model(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.model_id=weights\n",
                               weights=False)
    (directory / "weights").mkdir()
    (directory / "weights" / "config.json").write_text("{}")
    message = line(check_model_dir(directory, environ=CONTAINER_ENV), "weights")
    assert message.startswith("option.model_id=weights lacks weights")


def test_weights_next_to_a_remote_model_id_are_flagged_unused(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.model_id=org/name\n")
    report = check_model_dir(directory, environ=CONTAINER_ENV)
    assert report.ok
    assert "package leaves them out" in line(report, "unused weights", WARN)


# -- the report --

def test_a_failing_directory_exits_1_with_the_reason(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OPTION_ROLLING_BATCH", raising=False)
    directory = make_model_dir(tmp_path, "engine=Python\noption.dtpye=fp16\n", weights=False)
    assert cli.main(["check", str(directory)]) == 1
    out = capsys.readouterr().out
    assert "✗ option.dtpye" in out and "did you mean option.dtype?" in out
    assert "✗ weights" in out and "! option.rolling_batch" in out
    assert out.rstrip().endswith("FAIL: 2 checks failed (2 warnings)")  # + option.entryPoint


def test_the_report_renders_in_plain_ascii_too() -> None:
    report = CheckReport("m/", [])
    report.add(OK, "engine", "engine=Python")
    report.add(FAIL, "weights", "none")
    assert report.render(symbols=False).splitlines() == [
        "djl-stream check m/", "  OK   engine  engine=Python", "  FAIL weights none",
        "FAIL: 1 check failed"]


def test_not_a_directory(tmp_path: Path) -> None:
    report = check_model_dir(tmp_path / "nope", environ={})
    assert line(report, "model directory").endswith("is not a directory")

"""``djl-stream check``: the real model/ passes; each kind of broken directory fails with a
line that says what is wrong and what to write instead.

Broken directories are built from model/'s own model.py and serving.properties, with
placeholder weight files: the check looks for files, it does not load them.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path

import pytest

from djl_stream import cli
from djl_stream.check import FAIL, OK, WARN, CheckReport, check_model_dir

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


def test_a_slow_import_fails_with_its_time(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, model_py="""\
        import time
        time.sleep(0.5)

        def handle(inputs):
            return None
        """)
    report = check_model_dir(directory, environ=CONTAINER_ENV, max_import_seconds=0.3)
    assert "(limit 0.3 s)" in line(report, "entry point")


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
    assert out.rstrip().endswith("FAIL: 2 checks failed (1 warning)")


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

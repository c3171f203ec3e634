"""SageMaker's runtime API on the local server, through real boto3 (``endpoint_url`` set,
dummy credentials, no network beyond loopback): ``invoke_endpoint``,
``invoke_endpoint_with_response_stream`` and djl-stream's own ``invoke_stream``, each
answering what ``/invocations`` answers, errors as SageMaker's ``ModelError``."""

from __future__ import annotations

import json

import boto3
import pytest

from djl_stream.shipping.client import StreamingError, invoke_stream, stream

GREEDY = {"inputs": "Once upon a time", "parameters": {"max_new_tokens": 8}}


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.fixture(scope="module")
def runtime(server):
    return boto3.client("sagemaker-runtime", endpoint_url=server.url, region_name="us-east-1",
                        aws_access_key_id="local", aws_secret_access_key="local")


def test_invoke_endpoint_answers_what_invocations_answers(server, runtime):
    request = {**GREEDY, "stream": False}
    answer = runtime.invoke_endpoint(EndpointName="my-endpoint", ContentType="application/json",
                                     Body=json.dumps(request))
    assert answer["InvokedProductionVariant"] == "AllTraffic"
    assert answer["ContentType"] == "application/json"
    direct = server.http.post("/invocations", json=request).json()
    assert json.loads(answer["Body"].read()) == direct


def test_the_response_stream_carries_each_chunk_as_a_payload_part(server, runtime):
    request = {**GREEDY, "stream": True}
    answer = runtime.invoke_endpoint_with_response_stream(
        EndpointName="my-endpoint", ContentType="application/json", Body=json.dumps(request))
    assert answer["ContentType"] == "application/jsonlines"
    parts = [event["PayloadPart"]["Bytes"] for event in answer["Body"]]
    assert len(parts) > 1  # streamed, not gathered into one event
    direct = server.http.post("/invocations", json=request).content
    assert b"".join(parts) == direct


def test_djl_stream_s_invoke_stream_reads_the_same_records_as_over_http(server, runtime):
    request = {**GREEDY, "stream": True}
    over_sagemaker = list(invoke_stream(runtime, "my-endpoint", request))
    over_http = list(stream(server.url + "/invocations", request))
    assert over_sagemaker == over_http and len(over_http) == 8


def test_an_openai_body_streams_its_server_sent_events_through_the_payload(runtime):
    answer = runtime.invoke_endpoint_with_response_stream(
        EndpointName="my-endpoint", ContentType="application/json", Body=json.dumps(
            {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, "stream": True}))
    text = b"".join(event["PayloadPart"]["Bytes"] for event in answer["Body"]).decode()
    assert answer["ContentType"] == "text/event-stream"
    assert text.rstrip().endswith("data: [DONE]")


def test_a_bad_request_is_sagemaker_s_model_error_with_the_model_s_message(runtime):
    bad = {"inputs": "Hi", "parameters": {"temperature": -1}}
    with pytest.raises(runtime.exceptions.ModelError) as refused:
        runtime.invoke_endpoint(EndpointName="e", ContentType="application/json",
                                Body=json.dumps(bad))
    error = refused.value.response
    assert error["ResponseMetadata"]["HTTPStatusCode"] == 424
    assert error["OriginalStatusCode"] == 400
    assert "parameters.temperature must be at least" in error["OriginalMessage"]
    with pytest.raises(StreamingError) as streamed:
        list(invoke_stream(runtime, "e", {**bad, "stream": True}))
    assert streamed.value.status_code == 400
    assert "parameters.temperature must be at least" in str(streamed.value)

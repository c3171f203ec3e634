"""An API key and CORS on a real server: what needs the key, the 401 in each route's own
shape (as the openai SDK, huggingface_hub and a WebSocket client see it), what stays open,
and a CORS preflight. A real browser's preflight runs in ``make browser``."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from server_process import serving
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from djl_stream.serving.access import AccessControl, access_control, warn_if_exposed

KEY = "s3cret-key"
ORIGIN = "https://app.example.com"


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, args=["--api-key", KEY, "--allowed-origins", ORIGIN]) as process:
        yield process


def bearer(key: str = KEY) -> dict:
    return {"authorization": f"Bearer {key}"}


@pytest.mark.parametrize("route", ["/ping", "/health", "/metrics", "/chat", "/docs",
                                   "/openapi.json"])
def test_health_metrics_and_pages_stay_open(server, route):
    assert server.http.get(route).status_code == 200


def test_a_request_without_the_key_is_a_401_in_djl_s_shape(server):
    body = {"inputs": "Hi", "parameters": {"max_new_tokens": 2}}
    missing = server.http.post("/invocations", json=body)
    assert missing.status_code == 401 and missing.headers["www-authenticate"] == "Bearer"
    assert missing.json() == {"code": 401, "type": "Unauthorized", "message":
                              "a valid API key is required: send Authorization: Bearer <key>"}
    wrong = server.http.post("/invocations", json=body, headers=bearer("guess"))
    assert wrong.status_code == 401 and wrong.json()["message"] == "the API key is not valid"
    assert server.http.post("/invocations", json=body, headers=bearer()).status_code == 200


def test_the_openai_sdk_sees_its_own_authentication_error(server):
    import openai

    wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="guess")
    with pytest.raises(openai.AuthenticationError) as refused:
        wrong.completions.create(model="tiny", prompt="Hi", max_tokens=2)
    assert refused.value.body["code"] == "invalid_api_key"
    right = openai.OpenAI(base_url=server.url + "/v1", api_key=KEY)
    pieces = [c.choices[0].text for c in right.completions.create(
        model="tiny", prompt="Hi", max_tokens=3, stream=True)]
    assert len(pieces) == 3


def test_huggingface_hub_sends_its_token_as_the_key(server):
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import TextGenerationError

    # The client reads TGI's error record: its own exception, with the server's message.
    with pytest.raises(TextGenerationError, match="the API key is not valid"):
        InferenceClient(base_url=server.url, api_key="guess").text_generation("Hi", max_new_tokens=2)
    answer = InferenceClient(base_url=server.url, api_key=KEY).text_generation(
        "Hi", max_new_tokens=2)
    assert isinstance(answer, str)


def test_the_chat_socket_takes_the_key_as_a_header_or_as_the_page_s_subprotocol(server):
    url = server.url.replace("http://", "ws://") + "/ws/chat"
    with pytest.raises(InvalidStatus):
        connect(url, open_timeout=60).close()
    for options in ({"additional_headers": bearer()},
                    {"subprotocols": [f"djl-stream.bearer.{KEY}"]}):
        with connect(url, open_timeout=60, **options) as socket:
            socket.send(json.dumps({"content": "Hi", "parameters": {"max_new_tokens": 2}}))
            while (message := json.loads(socket.recv(timeout=120)))["type"] == "token":
                pass
            assert message["type"] == "end"
            if "subprotocols" in options:
                assert socket.subprotocol == f"djl-stream.bearer.{KEY}"


def test_a_cors_preflight_from_an_allowed_origin_is_answered_without_the_key(server):
    preflight = server.http.options("/v1/chat/completions", headers={
        "origin": ORIGIN, "access-control-request-method": "POST",
        "access-control-request-headers": "authorization, content-type"})
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-origin"] == ORIGIN
    assert "POST" in preflight.headers["access-control-allow-methods"]
    other = server.http.options("/v1/chat/completions", headers={
        "origin": "https://elsewhere.example", "access-control-request-method": "POST"})
    assert other.status_code == 400
    assert "access-control-allow-origin" not in other.headers
    # the answer itself carries the header too, a 401 included, so the page can read it
    refused = server.http.post("/invocations", json={"inputs": "Hi"}, headers={"origin": ORIGIN})
    assert refused.status_code == 401
    assert refused.headers["access-control-allow-origin"] == ORIGIN


def test_every_route_needs_the_key_when_none_is_left_open(tiny_model_dir):
    with serving(tiny_model_dir, env={"DJL_STREAM_API_KEY": KEY}, args=["--open-routes", ""],
                 headers=bearer()) as process:  # (its readiness check needs the key)
        assert httpx.get(process.url + "/ping").status_code == 401
        assert process.http.get("/ping").status_code == 200
        assert httpx.get(process.url + "/metrics").status_code == 401


def test_a_server_beyond_loopback_without_a_key_warns(caplog):
    with caplog.at_level(logging.WARNING):
        assert warn_if_exposed("0.0.0.0", AccessControl()) is True
        assert warn_if_exposed("127.0.0.1", AccessControl()) is False
        assert warn_if_exposed("0.0.0.0", access_control(api_key="k")) is False
    assert "without an API key" in caplog.text


def test_no_key_no_origins_by_default():
    access = access_control(environ={})
    assert access.api_key is None and access.allowed_origins == ()

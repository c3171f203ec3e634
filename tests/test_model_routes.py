"""The routes clients look up besides generating, on a real server: TGI's ``/health`` and
``/info``, OpenAI's ``/v1/models/{id}`` and its error for routes it does not serve,
``/version``, ``/tokenize`` and ``/detokenize``, and the API described at ``/openapi.json``
and ``/docs``; each through the client that calls it where there is one."""

from __future__ import annotations

import re

import pytest

from djl_stream import __version__
from djl_stream.protocols.openai.request import ChatCompletionRequest


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


def test_tgi_health_and_info_through_huggingface_hub(server):
    from huggingface_hub import InferenceClient

    client = InferenceClient(model=server.url, provider="hf-inference")
    assert client.health_check() is True
    info = client.get_endpoint_info()
    assert info["model_id"] == server.model_dir.name
    assert info["max_input_tokens"] == 64  # option.max_input_length
    assert info["max_total_tokens"] == 64 + 256  # plus option.max_new_tokens_limit
    assert (info["model_dtype"], info["model_device_type"]) == ("float32", "cpu")
    assert info["version"] == __version__
    assert server.http.get("/health").content == b""


def test_openai_retrieves_the_served_model_and_is_told_what_is_not_served(server):
    import openai

    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused")
    model_id = client.models.list().data[0].id
    assert client.models.retrieve(model_id).id == model_id
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("gpt-4o")
    assert missing.value.body["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model=model_id, input="Hi")
    assert "Invalid URL (POST /v1/embeddings)" in unknown.value.body["message"]
    assert unknown.value.body["type"] == "invalid_request_error"


def test_version(server):
    assert server.http.get("/version").json() == {"version": __version__}


def test_tokenize_in_vllm_s_and_tgi_s_shapes_and_detokenize_back(server, smollm2_tokenizer):
    text = "Hello world, again"
    expected = smollm2_tokenizer(text)["input_ids"]
    vllm = server.http.post("/tokenize", json={"prompt": text}).json()
    assert vllm["tokens"] == expected and vllm["count"] == len(expected)
    assert vllm["max_model_len"] == 1024  # the tiny model's max_position_embeddings
    tgi = server.http.post("/tokenize", json={"inputs": text}).json()
    assert [token["id"] for token in tgi] == expected
    assert "".join(token["text"] for token in tgi) == text
    assert all(text[t["start"]:t["stop"]] == t["text"] for t in tgi)
    back = server.http.post("/detokenize", json={"tokens": expected}).json()
    assert back == {"prompt": smollm2_tokenizer.decode(expected)}


def test_tokenize_a_conversation_through_the_chat_template(server, smollm2_tokenizer):
    messages = [{"role": "user", "content": "Hi there"}]
    answer = server.http.post("/tokenize", json={"messages": messages}).json()
    rendered = smollm2_tokenizer.apply_chat_template(messages, tokenize=False,
                                                     add_generation_prompt=True)
    assert smollm2_tokenizer.decode(answer["tokens"]) == rendered


@pytest.mark.parametrize("route, body, message", [
    ("/tokenize", {"prompt": "Hi", "add_special_token": False},
     "add_special_token is not a known key; did you mean add_special_tokens?"),
    ("/detokenize", {"tokens": [1, -5]}, "tokens[1] must be a token id from 0 to"),
    ("/detokenize", {"tokens": "12"}, "tokens must be"),
])
def test_a_bad_query_is_a_400_naming_the_field(server, route, body, message):
    answer = server.http.post(route, json=body)
    assert answer.status_code == 400
    assert message in answer.json()["error"]["message"]


def test_a_bad_tgi_tokenize_is_answered_in_tgi_s_shape(server):
    answer = server.http.post("/tokenize", json={"inputs": 5})
    assert answer.status_code == 422  # TGI's status for a validation error
    assert "inputs" in answer.json()["error"] and answer.json()["error_type"] == "validation"


def test_the_openapi_document_is_valid_and_made_from_the_request_models(server):
    from openapi_spec_validator import validate

    document = server.http.get("/openapi.json").json()
    validate(document)
    operation = document["paths"]["/v1/chat/completions"]["post"]
    assert operation["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/ChatCompletionRequest"}
    schema = document["components"]["schemas"]["ChatCompletionRequest"]
    own = ChatCompletionRequest.model_json_schema(ref_template="#/components/schemas/{model}")
    assert schema["properties"] == own["properties"]
    served = {path for path in document["paths"]}
    assert {"/invocations", "/generate_stream", "/tokenize", "/health", "/info",
            "/v1/models/{model_id}"} <= served


def test_the_docs_page_needs_nothing_from_another_host(server):
    page = server.http.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert not re.search(r"(src|href)\s*=\s*[\"']?(https?:)?//", page.text)
    assert 'fetch("openapi.json")' in page.text

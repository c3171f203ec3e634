"""The server's API described: an OpenAPI document at ``GET /openapi.json`` and a page that
reads it at ``GET /docs``.

The request schemas are the JSON schemas of the very pydantic models that validate the
requests (djl's, OpenAI's, TGI's, the tokenizer queries'), so the document cannot drift
from what the server accepts. The page is one self-contained HTML file beside this module
(nothing fetched from another host, as the chat page).

    >>> from djl_stream.serving.server import ModelServer
    >>> from djl_stream.serving.worker import ModelWorker
    >>> document = openapi_document(ModelServer(ModelWorker("model/")).routes())
    >>> document["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    {'$ref': '#/components/schemas/ChatCompletionRequest'}
"""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any, Dict, Iterable, Optional, Tuple

from pydantic import BaseModel
from pydantic.json_schema import models_json_schema
from starlette.requests import Request
from starlette.responses import HTMLResponse
from starlette.routing import BaseRoute, Route

from djl_stream.protocols.djl.request import DjlRequest
from djl_stream.protocols.model_queries import (ChatTokenizeRequest, DetokenizeRequest,
                                                TgiTokenizeRequest, TokenizeRequest)
from djl_stream.protocols.openai.request import ChatCompletionRequest, CompletionRequest
from djl_stream.protocols.tgi.request import TgiBody

#: What each route does, and the models its request body may take (any of them).
#: A served route missing here is still listed, with its path and method only.
OPERATIONS: Dict[Tuple[str, str], Tuple[str, Tuple[type[BaseModel], ...], str]] = {
    ("/invocations", "post"): ("Generate (djl-serving's request; SageMaker's route)",
                               (DjlRequest, ChatCompletionRequest, CompletionRequest),
                               "application/jsonlines"),
    ("/predictions/{model_name}", "post"): ("Generate, for the model named", (DjlRequest,),
                                            "application/jsonlines"),
    ("/endpoints/{endpoint_name}/invocations", "post"): (
        "SageMaker's InvokeEndpoint (boto3's endpoint_url pointed here)",
        (DjlRequest, ChatCompletionRequest, CompletionRequest), "application/json"),
    ("/endpoints/{endpoint_name}/invocations-response-stream", "post"): (
        "SageMaker's InvokeEndpointWithResponseStream: each chunk a PayloadPart event",
        (DjlRequest, ChatCompletionRequest, CompletionRequest),
        "application/vnd.amazon.eventstream"),
    ("/v1/chat/completions", "post"): ("OpenAI chat completions", (ChatCompletionRequest,),
                                       "text/event-stream"),
    ("/v1/completions", "post"): ("OpenAI completions", (CompletionRequest,),
                                  "text/event-stream"),
    ("/generate", "post"): ("TGI generate", (TgiBody,), "application/json"),
    ("/generate_stream", "post"): ("TGI generate, streamed as server-sent events", (TgiBody,),
                                   "text/event-stream"),
    ("/", "post"): ("TGI's compatibility route (huggingface_hub's InferenceClient)",
                    (TgiBody,), "text/event-stream"),
    ("/tokenize", "post"): ("Tokenize a prompt or a conversation (vLLM's shape), or "
                            "TGI's inputs", (TokenizeRequest, ChatTokenizeRequest,
                                             TgiTokenizeRequest), "application/json"),
    ("/detokenize", "post"): ("The text of token ids (vLLM's shape)", (DetokenizeRequest,),
                              "application/json"),
    ("/ping", "get"): ("Health: 200 once the model is loaded, 503 before", (), "application/json"),
    ("/health", "get"): ("TGI's health: 200 without a body when ready, else 503", (),
                         "application/json"),
    ("/info", "get"): ("TGI's description of the served model and limits", (),
                       "application/json"),
    ("/version", "get"): ("The server's version", (), "application/json"),
    ("/models", "get"): ("The model and its status, as djl-serving lists it", (),
                         "application/json"),
    ("/metrics", "get"): ("Prometheus metrics", (), "text/plain"),
    ("/v1/models", "get"): ("OpenAI's model list", (), "application/json"),
    ("/v1/models/{model_id}", "get"): ("One model, as OpenAI's client retrieves it", (),
                                       "application/json"),
    ("/openapi.json", "get"): ("This document", (), "application/json"),
    ("/docs", "get"): ("A page that reads this document", (), "text/html"),
    ("/chat", "get"): ("The chat page", (), "text/html"),
    ("/", "get"): ("The chat page", (), "text/html"),
}
#: Paths that are no API of their own (the catch-all that answers unknown /v1 routes).
_UNLISTED = ("/v1/{path}",)


@functools.lru_cache(maxsize=1)
def _schemas() -> Dict[str, Any]:
    models = sorted({model for _, models, _ in OPERATIONS.values() for model in models},
                    key=lambda model: model.__name__)
    _, document = models_json_schema([(model, "validation") for model in models],
                                     ref_template="#/components/schemas/{model}")
    return document.get("$defs", {})


def _path(route: Route) -> str:
    # Starlette's converters ({model_id:path}) are no part of an OpenAPI path template.
    return route.path.replace(":path", "")


def _operation(path: str, method: str) -> Dict[str, Any]:
    summary, models, content_type = OPERATIONS.get((path, method), ("", (), "application/json"))
    operation: Dict[str, Any] = {"summary": summary or f"{method.upper()} {path}",
                                 "responses": {"200": {"description": "OK", "content": {
                                     content_type: {}}}}}
    parameters = [part[1:-1] for part in path.split("/") if part.startswith("{")]
    if parameters:
        operation["parameters"] = [{"name": name, "in": "path", "required": True,
                                    "schema": {"type": "string"}} for name in parameters]
    if models:
        refs = [{"$ref": f"#/components/schemas/{model.__name__}"} for model in models]
        schema = refs[0] if len(refs) == 1 else {"oneOf": refs}
        operation["requestBody"] = {"required": True,
                                    "content": {"application/json": {"schema": schema}}}
        operation["responses"]["400"] = {"description": "The request broke a limit or a "
                                                        "rule: the body names the field"}
    return operation


def openapi_document(routes: Iterable[BaseRoute], version: Optional[str] = None) -> Dict[str, Any]:
    """The OpenAPI 3.1 document of ``routes`` (HTTP routes; the WebSocket is described in
    the info text)."""
    from djl_stream import __version__

    paths: Dict[str, Dict[str, Any]] = {}
    for route in routes:
        if not isinstance(route, Route) or _path(route) in _UNLISTED:
            continue
        path = _path(route)
        for method in sorted(route.methods or ()):
            method = method.lower()
            if method == "head":
                continue
            paths.setdefault(path, {})[method] = _operation(path, method)
    return {
        "openapi": "3.1.0",
        "info": {"title": "djl-stream", "version": version or __version__,
                 "description": "djl-serving's HTTP contract for one model directory, plus "
                                "the routes of OpenAI's and TGI's clients. A conversation "
                                "also streams over the WebSocket at /ws/chat."},
        "paths": paths,
        "components": {"schemas": _schemas()},
    }


@functools.lru_cache(maxsize=1)
def _page_html() -> str:
    return resources.files(__package__).joinpath("api_docs.html").read_text(encoding="utf-8")


async def api_docs_page(request: Request) -> HTMLResponse:
    """The page at ``/docs``: it fetches ``/openapi.json`` from the same server."""
    return HTMLResponse(_page_html(), headers={"Cache-Control": "no-cache"})

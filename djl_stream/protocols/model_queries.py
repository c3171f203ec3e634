"""Questions about the model rather than generations: tokenize, detokenize, describe.

The routes are the ones clients already call: ``POST /tokenize`` and ``POST /detokenize``
in vLLM's shapes (``prompt`` or ``messages`` in, ``tokens`` out), ``POST /tokenize`` with
``inputs`` in TGI's (a list of ``{"id", "text", "start", "stop"}``), and ``GET /info``,
TGI's description of the served model. Each is answered by ``handle()`` like a generation
(the server names the query in the ``djl_stream_protocol`` property), so it is the
tokenizer of the replica that would generate.

    >>> TokenizeRequest.model_validate({"prompt": "Hi"}).add_special_tokens
    True
    >>> query_kind({"inputs": "Hi"}), query_kind({"prompt": "Hi"})
    ('tgi', 'vllm')
"""

from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Union

from pydantic import BaseModel, Field, ValidationError

from djl_stream.generation.errors import RequestError
from djl_stream.protocols.schema import Closed
from djl_stream.protocols.validation import describe, request_error

#: The names of the queries, as the ``djl_stream_protocol`` property carries them.
TOKENIZE, DETOKENIZE, INFO = "tokenize", "detokenize", "info"
MODEL_QUERIES = frozenset({TOKENIZE, DETOKENIZE, INFO})



class TokenizeRequest(Closed):
    """vLLM's ``POST /tokenize`` for a prompt: its tokens as the model reads them."""

    model: Optional[str] = None
    prompt: str
    add_special_tokens: bool = True


class ChatTokenizeRequest(Closed):
    """vLLM's ``POST /tokenize`` for a conversation: rendered through the chat template."""

    model: Optional[str] = None
    messages: List[Dict[str, Any]] = Field(min_length=1)
    add_generation_prompt: bool = True


class TgiTokenizeRequest(Closed):
    """TGI's ``POST /tokenize``: each token with the characters it covers."""

    inputs: str
    parameters: Optional[Dict[str, Any]] = None


class DetokenizeRequest(Closed):
    """vLLM's ``POST /detokenize``: the text of token ids."""

    model: Optional[str] = None
    tokens: List[int]


def query_kind(body: Any) -> str:
    """Whose shape a ``/tokenize`` body has: TGI's (``inputs``) or vLLM's."""
    return "tgi" if isinstance(body, dict) and "inputs" in body else "vllm"


def _validated(model: type[BaseModel], body: Any) -> Any:
    if not isinstance(body, dict):
        raise RequestError("body", f"the request body must be a JSON object, got {describe(body)}")
    try:
        return model.model_validate(body)
    except ValidationError as error:
        raise request_error(error, body, lambda parent: (model, "key")) from None


def tokenize(body: Any, tokenizer: Any, render_chat: Optional[Callable[[list], str]],
             max_model_len: Optional[int]) -> Union[Dict[str, Any], List[Dict[str, Any]]]:
    """The answer to ``POST /tokenize`` in the shape of the body's client.

    >>> tokenize({"prompt": "Hello world", "add_special_tokens": False}, tokenizer, None, 2048)
    {'count': 2, 'max_model_len': 2048, 'tokens': [19556, 905]}
    >>> [t["text"] for t in tokenize({"inputs": "Hello world"}, tokenizer, None, 2048)]
    ['Hello', ' world']
    """
    if query_kind(body) == "tgi":
        request = _validated(TgiTokenizeRequest, body)
        encoded = tokenizer(request.inputs, return_offsets_mapping=True)
        return [{"id": token, "text": request.inputs[start:stop], "start": start, "stop": stop}
                for token, (start, stop) in zip(encoded["input_ids"], encoded["offset_mapping"])]
    if isinstance(body, dict) and "messages" in body:
        chat = _validated(ChatTokenizeRequest, body)
        if render_chat is None:
            raise RequestError("messages", "the model's tokenizer has no chat template")
        ids = tokenizer(render_chat(chat.messages), add_special_tokens=False)["input_ids"]
    else:
        request = _validated(TokenizeRequest, body)
        ids = tokenizer(request.prompt, add_special_tokens=request.add_special_tokens)["input_ids"]
    return {"count": len(ids), "max_model_len": max_model_len, "tokens": list(ids)}


def detokenize(body: Any, tokenizer: Any) -> Dict[str, str]:
    """The answer to ``POST /detokenize``: ``{"prompt": text}``.

    >>> detokenize({"tokens": [19556, 905]}, tokenizer)
    {'prompt': 'Hello world'}
    """
    request = _validated(DetokenizeRequest, body)
    vocabulary = len(tokenizer)
    for index, token in enumerate(request.tokens):
        if not 0 <= token < vocabulary:
            raise RequestError(f"tokens[{index}]", f"tokens[{index}] must be a token id from 0 "
                                                   f"to {vocabulary - 1}, got {token}")
    return {"prompt": tokenizer.decode(request.tokens)}

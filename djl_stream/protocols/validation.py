"""Validation at the edge, shared by every protocol: a malformed request becomes one
:class:`RequestError` that names the field and the limit.

Each protocol validates its body with a strict pydantic model; :func:`request_error` turns
pydantic's first error into that message, with the field path written as the client wrote
it (``parameters.top_p``, ``inputs[1]``, ``messages[0].role``).

    >>> parse_json_body(b'[1, 2')
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: the request body is not valid JSON: Expecting ',' delimiter: line 1 column 6 (char 5)
"""

from __future__ import annotations

import difflib
import json
import re
from typing import Any, Callable, Optional, Sequence

from pydantic import BaseModel, ValidationError

from djl_stream.runtime.kv_memory import kv_positions
from djl_stream.generation.errors import RequestError  # noqa: F401 - the protocols' 400


_EXPECTED = {
    "int_type": "an integer",
    "float_type": "a number",
    "bool_type": "true or false",
    "string_type": "a string",
    "list_type": "a list",
    "model_type": "an object",
    "dict_type": "an object",
}
_BOUNDS = {
    "greater_than": ("gt", "greater than"),
    "greater_than_equal": ("ge", "at least"),
    "less_than": ("lt", "less than"),
    "less_than_equal": ("le", "at most"),
}


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e16:
        return str(int(value))
    return str(value)


def describe(value: Any) -> str:
    """A JSON-ish rendering of what the client sent, short enough for a message."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        text = json.dumps(value if len(value) <= 40 else value[:40] + "...", ensure_ascii=False)
        return f"{text} (a string)"
    if isinstance(value, float):
        return _number(value)
    return json.dumps(value)


def _field_path(loc: tuple[Any, ...], body: Any) -> str:
    # Walk the raw body next to the error location, dropping the index pydantic added
    # where a single string was wrapped in a list: the client wrote "inputs", not "inputs[0]".
    path, raw = "", body
    for part in loc:
        if isinstance(part, int):
            if not isinstance(raw, list):
                continue
            path += f"[{part}]"
            raw = raw[part] if 0 <= part < len(raw) else None
        else:
            path += f".{part}" if path else str(part)
            raw = raw.get(part) if isinstance(raw, dict) else None
    return path or "body"


#: For an unknown key at ``field``: the model whose keys are known there, and what one of
#: them is called ("parameter", "message key", "key").
KnownKeys = Callable[[str], tuple[type[BaseModel], str]]


def unknown_key_message(field: str, known_keys: KnownKeys) -> str:
    """``parameters.top_q is not a known parameter; did you mean top_p? known: ...``"""
    parent, _, name = field.rpartition(".")
    model, what = known_keys(parent)
    known = sorted(model.model_fields)
    close = difflib.get_close_matches(name, known, n=1)
    hint = f"did you mean {close[0]}? " if close else ""
    return f"{field} is not a known {what}; {hint}known: {', '.join(known)}"


def request_error(error: ValidationError, body: Any, known_keys: KnownKeys,
                  expected_by_field: Optional[dict[str, str]] = None) -> RequestError:
    """Pydantic's first error about ``body`` as one :class:`RequestError`.

    ``known_keys`` names the model whose keys an unknown key is compared with;
    ``expected_by_field`` words what a field takes where the type alone says too little
    (``"a string or a list of strings"``).
    """
    first = error.errors(include_url=False)[0]
    kind, ctx, value = first["type"], first.get("ctx") or {}, first.get("input")
    field = _field_path(tuple(first["loc"]), body)
    if kind == "extra_forbidden":
        message = unknown_key_message(field, known_keys)
    elif kind in _BOUNDS:
        key, words = _BOUNDS[kind]
        message = f"{field} must be {words} {_number(ctx[key])}, got {describe(value)}"
    elif kind in _EXPECTED:
        expected = (expected_by_field or {}).get(field, _EXPECTED[kind])
        message = f"{field} must be {expected}, got {describe(value)}"
    elif kind == "too_short" and ctx.get("min_length") == 1:
        message = f"{field} must not be empty"
    elif kind == "too_long":
        message = (f"{field} must have at most {ctx['max_length']} entries, "
                   f"got {ctx.get('actual_length', len(value))}")
    elif kind == "blank":
        message = f"{field} must not be empty or whitespace only"
    elif kind == "string_too_short":
        message = f"{field} must not be empty"
    elif kind == "string_too_long":
        message = (f"{field} must be at most {ctx['max_length']} characters long, "
                   f"got {len(value)}")
    elif kind == "literal_error":
        message = f"{field} must be one of {ctx['expected']}, got {describe(value)}"
    elif kind == "finite_number":
        message = f"{field} must be a finite number, got {describe(value)}"
    elif kind == "missing":
        message = f"{field} is required"
    else:
        message = f"{field}: {first['msg']}"
    return RequestError(field, message)


def parse_json_body(raw: bytes | bytearray | memoryview | str) -> Any:
    """Decode a request body; anything but UTF-8 JSON is a :class:`RequestError` on ``body``.

    ``NaN`` and ``Infinity`` are refused too: they are not JSON, only Python accepts them.

    >>> parse_json_body(b'{"inputs": "\\xe4\\xbd\\xa0\\xe5\\xa5\\xbd"}')
    {'inputs': '你好'}
    """
    if isinstance(raw, str):
        text = raw
    else:
        try:
            text = bytes(raw).decode("utf-8")
        except UnicodeDecodeError as err:
            raise RequestError("body", f"the request body is not valid JSON: it is not UTF-8 "
                                       f"(byte {err.start})") from None
    if not text.strip():
        raise RequestError("body", "the request body is not valid JSON: it is empty")

    def refuse(constant: str) -> Any:
        raise ValueError(f"{constant} is not a JSON value")

    try:
        value = json.loads(text, parse_constant=refuse)
    except ValueError as err:  # JSONDecodeError is a ValueError, and so is refuse()'s
        raise RequestError("body", f"the request body is not valid JSON: {err}") from None
    except RecursionError:
        raise RequestError("body", f"the request body is nested more than {MAX_JSON_DEPTH} "
                                   f"levels deep") from None
    check_json_values(value)
    return value


#: The deepest nesting of arrays and objects a body may have: every schema here needs 4.
MAX_JSON_DEPTH = 32
#: A UTF-16 surrogate code point on its own: JSON's ``"\ud800"`` escapes decode to one, but
#: it is not a character, so no tokenizer (and no UTF-8 encoder) can take it.
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_json_values(value: Any) -> None:
    """Refuse a decoded body nested deeper than :data:`MAX_JSON_DEPTH`, or holding a lone
    surrogate in a string or key, naming where (``messages[0].content``).

    >>> check_json_values({"inputs": ["ok", "x\\ud800y"]})
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: inputs[1] must be valid Unicode text: it holds a lone surrogate (U+D800) at character 1
    """
    stack = [("", value, 0)]
    while stack:
        path, item, depth = stack.pop()
        if isinstance(item, str):
            _check_text(path or "body", item)
            continue
        if not isinstance(item, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise RequestError(path or "body", f"the request body is nested more than "
                                               f"{MAX_JSON_DEPTH} levels deep (at {path})")
        if isinstance(item, dict):
            for key, child in item.items():
                # A key with a lone surrogate is named escaped: the answer naming it is
                # UTF-8 too.
                shown = _LONE_SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", key)
                child_path = f"{path}.{shown}" if path else shown
                _check_text(child_path, key)
                stack.append((child_path, child, depth + 1))
        else:
            stack.extend((f"{path}[{index}]", child, depth + 1)
                         for index, child in enumerate(item))


def _check_text(path: str, text: str) -> None:
    found = _LONE_SURROGATE.search(text)
    if found:
        raise RequestError(path, f"{path} must be valid Unicode text: it holds a lone "
                                 f"surrogate (U+{ord(found.group()):04X}) at character "
                                 f"{found.start()}")


def check_input_length(field: str, n_tokens: int, limit: int) -> None:
    """Refuse a prompt longer than ``option.max_input_length``.

    >>> check_input_length("inputs[0]", 5000, 4096)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: inputs[0] is 5000 tokens long; the limit (option.max_input_length) is 4096
    """
    if n_tokens > limit:
        raise RequestError(field, f"{field} is {n_tokens} tokens long; "
                                  f"the limit (option.max_input_length) is {limit}")


def check_input_characters(field: str, n_chars: int, max_input_length: int,
                           chars_per_token: int) -> None:
    """Refuse a prompt too long in characters to fit ``option.max_input_length`` tokens,
    before paying for its tokenization (a prompt of tens of megabytes takes a minute and
    gigabytes of memory to tokenize).

    ``chars_per_token`` is the most characters one token can stand for
    (:func:`djl_stream.serving.service.most_characters_per_token`), so a prompt of more than
    ``max_input_length * chars_per_token`` characters cannot fit; one of fewer is tokenized
    and counted (:func:`check_input_length`).

    >>> check_input_characters("inputs", 400_000, 4096, 81)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: inputs is 400000 characters long; the limit is 331776 characters (option.max_input_length, 4096 tokens, of at most 81 characters each)
    """
    limit = max_input_length * chars_per_token
    if n_chars > limit:
        raise RequestError(field, f"{field} is {n_chars} characters long; the limit is {limit} "
                                  f"characters (option.max_input_length, {max_input_length} "
                                  f"tokens, of at most {chars_per_token} characters each)")


def check_request_input_length(field: str, lengths: Sequence[int], limit: int) -> None:
    """Refuse a request whose prompts together exceed ``option.max_request_input_length``.

    >>> check_request_input_length("inputs", [3000, 3000, 2500], 8192)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: inputs: 3 prompts of up to 3000 tokens take 8500 tokens in all; the limit (option.max_request_input_length) is 8192
    """
    if not lengths:
        return
    total = sum(lengths)
    if total > limit:
        raise RequestError(field, f"{field}: {len(lengths)} prompts of up to {max(lengths)} "
                                  f"tokens take {total} tokens in all; the limit "
                                  f"(option.max_request_input_length) is {limit}")


def check_request_kv_positions(field: str, lengths: Sequence[int], max_new_tokens: int,
                               limit: Optional[int]) -> None:
    """Refuse a request whose KV cache would outgrow ``option.max_request_kv_tokens`` by
    its last step (``limit``; ``None``: no bound). ``field`` is the request's
    ``max_new_tokens`` field: the one a client lowers first.

    >>> check_request_kv_positions("parameters.max_new_tokens", [500] * 8, 2048, 11676)
    Traceback (most recent call last):
    ...
    djl_stream.generation.errors.RequestError: parameters.max_new_tokens: 8 prompts of 4000 tokens in all with 2048 new tokens each would hold 4000 + 8 × 2048 = 20384 KV-cache positions; the limit (option.max_request_kv_tokens) is 11676: ask for fewer new tokens or send fewer prompts
    >>> check_request_kv_positions("max_tokens", [500] * 8, 900, 11676)   # 11200 fits
    """
    if limit is None or not lengths:
        return
    positions = kv_positions(lengths, max_new_tokens)
    if positions > limit:
        raise RequestError(
            field,
            f"{field}: {_prompts(len(lengths))} of {sum(lengths)} tokens in all with "
            f"{max_new_tokens} new tokens each would hold {sum(lengths)} + {len(lengths)} × "
            f"{max_new_tokens} = {positions} KV-cache positions; the limit "
            f"(option.max_request_kv_tokens) is {limit}: ask for fewer new tokens or send "
            "fewer prompts")


def _prompts(count: int) -> str:
    return f"{count} prompt{'' if count == 1 else 's'}"

"""Tool calls on the chat route: the tools a request offers, how the prompt shows them, and
the calls read back out of the model's text.

**Offering tools.** ``tools`` (OpenAI's ``{"type": "function", "function": {name,
description, parameters}}``) go to the chat template as transformers' ``tools=``, and the
conversation's earlier calls (assistant ``tool_calls``) and results (``tool`` messages) go
in as the template expects them, arguments as objects. A template that does not render
tools gets them in a system message instead, in the Hermes format that many instruct
models learnt, and the earlier calls and results written in that format too
(:func:`chat_for_template`).

**Choosing.** :class:`ToolUse` is what ``tool_choice`` asks for:

- ``auto`` (the default with tools): the model decides; its calls are read from its text;
- ``none``: no tools in the prompt, and the text is the answer;
- ``required``: the answer is a JSON list of one or more calls to the offered functions,
  kept to that shape while decoding (:meth:`ToolUse.grammar`);
- a named function: the answer is that function's arguments, kept to its schema.

**Reading calls.** :class:`ToolCallReader` follows one choice's text as it streams, and
splits it into content and calls in the formats of the common template families:

- Hermes, Qwen 2/2.5/3 and SmolLM3: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  one block per call, after any text;
- Llama 3.1/3.2/3.3: the whole message is ``{"name": ..., "parameters": {...}}`` (several
  joined by ``;``), after ``<|python_tag|>`` or not;
- Mistral: ``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]``.

A call counts only when it names one of the request's tools; anything else stays text.

    >>> use = ToolUse.of([{"type": "function", "function": {"name": "weather"}}], "auto")
    >>> reader = ToolCallReader(use)
    >>> reader.feed('Let me look. <tool_call>{"name": "weather", "arg')
    ('Let me look. ', [])
    >>> content, deltas = reader.feed('uments": {"city": "Paris"}}</tool_call>')
    >>> deltas[0]["function"]
    {'name': 'weather', 'arguments': '{"city": "Paris"}'}
"""

from __future__ import annotations

import dataclasses
import json
import re
import secrets
import string
from typing import Annotated, Any, Dict, List, Literal, Optional, Sequence, Tuple

from pydantic import AfterValidator, BaseModel
from pydantic_core import PydanticCustomError

from djl_stream.protocols.schema import Closed
from djl_stream.protocols.validation import RequestError, describe

#: OpenAI's rule for a function's name.
NAME_PATTERN = r"[a-zA-Z0-9_.-]{1,64}"
#: A call's id: nine letters and digits, the one shape every template accepts (Mistral's
#: refuses any other).
_ID_ALPHABET = string.ascii_letters + string.digits
#: The families' markers: Hermes' tags around each call, and what may open a message of
#: calls written as JSON (Llama 3's tag, Mistral's).
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_JSON_PREFIXES = ("<|python_tag|>", "[TOOL_CALLS]")


def new_call_id() -> str:
    """A fresh tool call id.

    >>> len(new_call_id()), new_call_id().isalnum()
    (9, True)
    """
    return "".join(secrets.choice(_ID_ALPHABET) for _ in range(9))


# ---------------------------------------------------------------------------------------
# The request's shapes



def _function_name(name: Any) -> Any:
    if isinstance(name, str) and not re.fullmatch(NAME_PATTERN, name):
        raise PydanticCustomError("function_name", "must be 1 to 64 letters, digits, "
                                  "underscores, dots or dashes, got {got}",
                                  {"got": describe(name)})
    return name


class FunctionSpec(Closed):
    """A function the model may call: its name, what it does, its arguments' JSON schema."""

    name: Annotated[str, AfterValidator(_function_name)]
    description: Optional[str] = None
    parameters: Optional[Dict[str, Any]] = None
    strict: Optional[bool] = None


class ToolSpec(Closed):
    """One entry of ``tools``."""

    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(Closed):
    """The function an earlier assistant turn called, with its arguments as JSON text."""

    name: str
    arguments: str


class ToolCall(Closed):
    """One entry of an assistant message's ``tool_calls``."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


# ---------------------------------------------------------------------------------------
# What the request asks for


@dataclasses.dataclass(frozen=True)
class ToolUse:
    """The tools of one request and how the answer may use them.

    ``mode`` is ``auto``, ``required`` or ``named`` (``none`` is no :class:`ToolUse`);
    ``tools`` the functions as the chat template sees them; ``name`` the function a named
    choice calls; ``parallel`` whether a required answer may hold several calls.

    >>> use = ToolUse.of([{"type": "function", "function": {"name": "f"}}],
    ...                  {"type": "function", "function": {"name": "f"}})
    >>> use.mode, use.name, use.grammar()
    ('named', 'f', ('json_schema', '{"type": "object"}'))
    """

    mode: str
    tools: Tuple[Dict[str, Any], ...]
    name: Optional[str] = None
    parallel: bool = True

    @classmethod
    def of(cls, tools: Sequence[Any], choice: Any = None,
           parallel: Optional[bool] = None) -> Optional["ToolUse"]:
        """The :class:`ToolUse` of validated ``tools`` (plain dicts or :class:`ToolSpec`)
        and a ``tool_choice`` as the client sent it; ``None`` when no tool may be called.
        Raises :class:`RequestError` for a choice that is not one of OpenAI's shapes
        (TGI's, a function's name as a string or without ``type``, and the Responses
        API's ``{"type": "function", "name": ...}`` are taken too) or
        that the tools cannot meet."""
        specs = tuple(t.model_dump(exclude_none=True) if isinstance(t, BaseModel) else t
                      for t in tools or ())
        names = [spec["function"]["name"] for spec in specs]
        if len(set(names)) != len(names):
            duplicate = next(name for name in names if names.count(name) > 1)
            raise RequestError("tools", f"tools must have distinct names: {duplicate!r} is "
                                        "given twice")
        field, name = _named_choice(choice, names)
        if name is None and choice in ("auto", "required") and not specs:
            raise RequestError("tool_choice", f"tool_choice {choice!r} needs tools, and "
                                              "the request offers none")
        if choice == "none" or not specs and choice is None:
            return None
        parallel = True if parallel is None else parallel
        if name is None:
            return cls("required" if choice == "required" else "auto", specs, parallel=parallel)
        if name not in names:
            offered = ", ".join(names) or "none"
            raise RequestError(field, f"{field} must be one of the tools' names ({offered}), "
                                      f"got {name!r}")
        return cls("named", specs, name=name, parallel=False)

    @property
    def names(self) -> Tuple[str, ...]:
        return tuple(spec["function"]["name"] for spec in self.tools)

    def parameters(self, name: str) -> Dict[str, Any]:
        """The arguments' schema of function ``name`` (any object where it gives none)."""
        for spec in self.tools:
            if spec["function"]["name"] == name:
                return spec["function"].get("parameters") or {"type": "object"}
        raise KeyError(name)

    def grammar(self) -> Optional[Tuple[str, str]]:
        """The grammar a forced choice decodes under (as
        :data:`~djl_stream.generation.grammar.GrammarSpec`): a named function's arguments
        schema; for ``required`` a JSON list of calls, ``[{"name": ..., "arguments":
        {...}}]``, at most one unless calls may be parallel. ``auto`` constrains nothing.
        """
        if self.mode == "named":
            return "json_schema", json.dumps(self.parameters(self.name))
        if self.mode != "required":
            return None
        calls = [{"type": "object",
                  "properties": {"name": {"const": name}, "arguments": self.parameters(name)},
                  "required": ["name", "arguments"], "additionalProperties": False}
                 for name in self.names]
        schema: Dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not self.parallel:
            schema["maxItems"] = 1
        return "json_schema", json.dumps(schema)


_MODES = ("none", "auto", "required")


def _named_choice(choice: Any, names: Sequence[str]) -> Tuple[str, Optional[str]]:
    """The field and function name of a ``tool_choice`` that names a function, ``(..,
    None)`` for a mode; raises :class:`RequestError` for any other shape."""
    if choice is None or choice in _MODES:
        return "tool_choice", None
    if isinstance(choice, str):
        if choice in names:  # TGI's plain function name
            return "tool_choice", choice
    elif (isinstance(choice, dict) and set(choice) == {"type", "name"}
            and choice["type"] == "function" and isinstance(choice["name"], str)):
        return "tool_choice.name", choice["name"]  # the Responses API's shape
    elif (isinstance(choice, dict) and choice.get("type", "function") == "function"
            and set(choice) <= {"type", "function"} and isinstance(choice.get("function"), dict)
            and set(choice["function"]) == {"name"}
            and isinstance(choice["function"]["name"], str)):
        return "tool_choice.function.name", choice["function"]["name"]
    offered = f", one of the tools' names ({', '.join(names)})" if names else ""
    raise RequestError("tool_choice", f"tool_choice must be \"none\", \"auto\", \"required\""
                                      f"{offered} or {{\"type\": \"function\", \"function\": "
                                      f"{{\"name\": ...}}}}, got {describe(choice)}")


# ---------------------------------------------------------------------------------------
# The conversation as the chat template sees it


def template_renders_tools(template: Optional[str]) -> bool:
    """Whether a chat template's source shows tools to the model (reads ``tools``).

    >>> template_renders_tools("{% for m in messages %}{{ m.content }}{% endfor %}")
    False
    """
    return bool(template) and re.search(r"\btools\b", template) is not None


def _arguments_object(arguments: str) -> Any:
    # Templates write arguments with `tojson`, so they take them as objects (as vLLM
    # passes them); text that is not JSON goes as it came.
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _hermes_call(name: str, arguments: Any) -> str:
    return (f"{_HERMES_OPEN}\n"
            f"{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n"
            f"{_HERMES_CLOSE}")


def _tools_system_prompt(tools: Sequence[Dict[str, Any]]) -> str:
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return ("You may call one or more functions to answer the user. The functions are "
            f"given as JSON schemas inside <tools></tools>:\n<tools>\n{listed}\n</tools>\n"
            "To call a function, answer with a JSON object holding its name and arguments "
            "inside <tool_call></tool_call> tags, one block per call:\n"
            f"{_HERMES_OPEN}\n"
            '{"name": <function name>, "arguments": <arguments object>}\n'
            f"{_HERMES_CLOSE}")


def chat_for_template(messages: Sequence[Dict[str, Any]], use: Optional[ToolUse],
                      renders_tools: bool, takes_system: bool = True
                      ) -> Tuple[List[Dict[str, Any]], Optional[list]]:
    """The messages and ``tools`` to hand the chat template.

    ``messages`` are OpenAI's turns as dicts (``role``, ``content`` text, an assistant's
    ``tool_calls``, a tool result's ``tool_call_id`` and ``name``). A template that
    ``renders_tools`` gets them as transformers documents (calls' arguments as objects)
    and the tools as ``tools=``. Any other template gets plain turns: the tools in a
    system message (or at the start of the first user turn, where the template takes no
    system turn: ``takes_system`` false), earlier calls as Hermes blocks in the assistant's text,
    and results as a user turn of ``<tool_response>`` blocks (templates that know only
    ``user`` and ``assistant`` alternate them).

    >>> use = ToolUse.of([{"type": "function", "function": {"name": "f"}}])
    >>> turns, tools = chat_for_template([{"role": "user", "content": "Hi"}], use, False)
    >>> [t["role"] for t in turns], tools
    (['system', 'user'], None)
    """
    tools = list(use.tools) if use is not None else None
    if renders_tools:
        turns = []
        for message in messages:
            turn = dict(message)
            if turn.get("tool_calls"):
                turn["tool_calls"] = [
                    {"id": call["id"], "type": "function",
                     "function": {"name": call["function"]["name"],
                                  "arguments": _arguments_object(call["function"]["arguments"])}}
                    for call in turn["tool_calls"]]
            turns.append(turn)
        return turns, tools

    turns = []
    for message in messages:
        role, content = message["role"], message.get("content") or ""
        if role == "assistant" and message.get("tool_calls"):
            blocks = [_hermes_call(call["function"]["name"],
                                   _arguments_object(call["function"]["arguments"]))
                      for call in message["tool_calls"]]
            content = "\n".join(([content] if content else []) + blocks)
        if role == "tool":
            block = f"<tool_response>\n{content}\n</tool_response>"
            if turns and turns[-1].get("tool_results"):
                turns[-1]["content"] += "\n" + block
                continue
            turns.append({"role": "user", "content": block, "tool_results": True})
            continue
        turns.append({"role": role, "content": content})
    for turn in turns:
        turn.pop("tool_results", None)
    if tools:
        prompt = _tools_system_prompt(tools)
        if turns and turns[0]["role"] == "system":
            turns[0] = {"role": "system", "content": f"{turns[0]['content']}\n\n{prompt}"}
        elif takes_system:
            turns.insert(0, {"role": "system", "content": prompt})
        else:
            # (Gemma's templates refuse a system turn: the tools open the first user turn)
            first = next((i for i, turn in enumerate(turns) if turn["role"] == "user"), None)
            if first is None:
                turns.insert(0, {"role": "user", "content": prompt})
            else:
                turns[first] = {"role": "user",
                                "content": f"{prompt}\n\n{turns[first]['content']}"}
    return turns, None


# ---------------------------------------------------------------------------------------
# Calls read back from the text


def _as_call(item: Any, use: ToolUse) -> Optional[Tuple[str, str]]:
    """``(name, arguments JSON)`` of one parsed call object, if it calls an offered tool."""
    if not isinstance(item, dict) or item.get("name") not in use.names:
        return None
    arguments = item.get("arguments", item.get("parameters", {}))
    if isinstance(arguments, str):
        try:
            json.loads(arguments)
        except ValueError:
            return None
        return item["name"], arguments
    if not isinstance(arguments, dict):
        return None
    return item["name"], json.dumps(arguments, ensure_ascii=False)


def _json_calls(text: str, use: ToolUse) -> Optional[List[Tuple[str, str]]]:
    """The calls of a whole message written as JSON (Llama 3's objects joined by ``;``, a
    list as Mistral's), or ``None`` if it is not only calls to offered tools."""
    text = text.strip()
    for prefix in _JSON_PREFIXES:
        if text.startswith(prefix):
            text = text[len(prefix):].strip()
    decoder = json.JSONDecoder()
    items: List[Any] = []
    position = 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except ValueError:
            return None
        items.extend(value if isinstance(value, list) else [value])
        rest = text[position:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        position = len(text) - len(rest)
    calls = [_as_call(item, use) for item in items]
    if not calls or any(call is None for call in calls):
        return None
    return calls  # type: ignore[return-value]


def _held_prefix(text: str, marker: str) -> int:
    """How many characters at the end of ``text`` could begin ``marker`` (held back until
    the next piece tells)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ToolCallReader:
    """Splits one choice's streamed text into content and tool calls (see the module
    docstring); :meth:`feed` each piece, then :meth:`finish`.

    Both return ``(content, deltas)``: text to send as ``content`` now, and OpenAI's
    streamed ``tool_calls`` entries (each with its ``index``; a call's first entry carries
    its ``id``, ``type`` and ``function.name``). Text that may still turn into a call is
    held back until it is known; :attr:`calls` holds the whole calls read so far.

    >>> use = ToolUse.of([{"type": "function", "function": {"name": "f"}}], "required")
    >>> reader = ToolCallReader(use)
    >>> reader.feed('[{"name":"f","arguments":{"x":1}}]'), len(reader.finish()[1])
    (('', []), 1)
    """

    def __init__(self, use: ToolUse) -> None:
        self.use = use
        self.calls: List[Dict[str, Any]] = []
        self._held = ""
        self._started = False   # some content has gone out (a message of JSON it is not)
        self._in_block = False  # inside a Hermes block

    @property
    def called(self) -> bool:
        return bool(self.calls)

    def _call(self, name: str, arguments: str) -> Dict[str, Any]:
        call = {"index": len(self.calls), "id": new_call_id(), "type": "function",
                "function": {"name": name, "arguments": arguments}}
        self.calls.append(call)
        return call

    # -- the modes --

    def feed(self, text: str) -> Tuple[str, List[Dict[str, Any]]]:
        if self.use.mode == "named":
            return self._feed_arguments(text)
        self._held += text
        if self.use.mode == "required":
            return "", []
        return self._scan(final=False)

    def finish(self) -> Tuple[str, List[Dict[str, Any]]]:
        if self.use.mode == "named":
            return "", []
        if self.use.mode == "required":
            calls = _json_calls(self._held, self.use)
            if calls is None:  # cut short by the token limit: what came is the answer
                held, self._held = self._held, ""
                return held, []
            self._held = ""
            return "", [self._call(name, arguments) for name, arguments in calls]
        return self._scan(final=True)

    def _feed_arguments(self, text: str) -> Tuple[str, List[Dict[str, Any]]]:
        # The whole answer is the named function's arguments: they stream as they come.
        if not self.calls:
            first = self._call(self.use.name, text)
            return "", [dict(first, function=dict(first["function"]))]  # (a copy: it grows)
        if not text:
            return "", []
        self.calls[0]["function"]["arguments"] += text
        return "", [{"index": 0, "function": {"arguments": text}}]

    def _scan(self, final: bool) -> Tuple[str, List[Dict[str, Any]]]:
        content, deltas = "", []
        while True:
            if self._in_block:
                end = self._held.find(_HERMES_CLOSE)
                if end < 0:
                    if not final:
                        return content, deltas
                    # The model ended inside a block (some leave the closing tag out).
                    body, self._held = self._held, ""
                    calls = _json_calls(body, self.use)
                    if calls is None:
                        return content + _HERMES_OPEN + body, deltas
                    return content, deltas + [self._call(*call) for call in calls]
                body = self._held[:end]
                self._held = self._held[end + len(_HERMES_CLOSE):]
                self._in_block = False
                calls = _json_calls(body, self.use)
                if calls is None:
                    content += _HERMES_OPEN + body + _HERMES_CLOSE
                else:
                    deltas += [self._call(*call) for call in calls]
                    self._held = self._held.lstrip()
                continue
            if not self._started and not self.calls:
                # A message that opens with JSON may be calls written as JSON: it is held
                # whole until it ends.
                stripped = self._held.lstrip()
                if not final and (not stripped or any(
                        len(stripped) < len(prefix) and prefix.startswith(stripped)
                        for prefix in _JSON_PREFIXES)):
                    return content, deltas  # not yet known
                if stripped[:1] in ("{", "[") or stripped.startswith(_JSON_PREFIXES):
                    if not final:
                        return content, deltas
                    calls = _json_calls(self._held, self.use)
                    if calls is not None:
                        self._held = ""
                        return content, deltas + [self._call(*call) for call in calls]
            start = self._held.find(_HERMES_OPEN)
            if start >= 0:
                before = self._held[:start]
                if before.strip() or not self.calls:  # (whitespace between calls: dropped)
                    content += before
                self._held = self._held[start + len(_HERMES_OPEN):]
                self._in_block = True
                self._started = True
                continue
            keep = 0 if final else _held_prefix(self._held, _HERMES_OPEN)
            out = self._held[:len(self._held) - keep]
            if self.calls and not out.strip():
                # Only whitespace since the last call: held, and dropped at the end.
                if final:
                    self._held = ""
                return content, deltas
            self._held = self._held[len(self._held) - keep:]
            if out:
                self._started = True
                content += out
            return content, deltas


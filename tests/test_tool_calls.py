"""Tool calls on the chat route: ``tools`` shown to the model through its chat template,
``tool_choice``'s four modes, the calls read back from the text in each template family's
format, streamed as OpenAI's ``tool_calls`` deltas, and the results carried back.

The readers and the prompts are checked on their own; the rest through the real clients
(the openai SDK, and a LangChain tool-calling agent loop that runs a Python function) against
a real server on a tiny random model whose chat template renders tools, Hermes-style.
A random model calls no tool by itself, so the served calls are the forced ones
(``required`` and a named function), whose arguments the grammar keeps to the schema."""

from __future__ import annotations

import copy
import dataclasses
import json
import shutil

import httpx
import jsonschema
import openai
import pytest
from server_process import serving
from transformers import AutoTokenizer

from djl_stream.generation.errors import RequestError
from djl_stream.protocols.openai.request import parse_chat
from djl_stream.protocols.openai.tools import ToolCallReader, ToolUse, template_renders_tools
from djl_stream.protocols.protocol import ParseContext

#: A ChatML template that renders tools, calls and results as Hermes-style models learnt
#: them (written for these tests; Qwen 2.5's has the same shape).
HERMES_TEMPLATE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}You can call these functions:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
Call one as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'assistant' %}<|im_start|>assistant
{{ message.content or '' }}{% for call in message.tool_calls or [] %}<tool_call>
{{ {"name": call.function.name, "arguments": call.function.arguments} | tojson }}
</tool_call>{% endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

#: Bounded arguments, so that even a random model's forced call ends within its tokens.
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Today's weather in a city.",
    "parameters": {"type": "object",
                   "properties": {"city": {"enum": ["Paris", "Oslo", "Lima"]},
                                  "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                   "required": ["zone"], "additionalProperties": False}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def reading(text: str, use: ToolUse, piece: int = 0):
    """``text`` through a reader, whole (``piece=0``) or ``piece`` characters at a time:
    the content it let out, and the calls (name, arguments) it read."""
    reader = ToolCallReader(use)
    pieces = [text] if not piece else [text[k:k + piece] for k in range(0, len(text), piece)]
    content = "".join(reader.feed(p)[0] for p in pieces) + reader.finish()[0]
    return content, [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in reader.calls]


AUTO = ToolUse.of([WEATHER, TIME], "auto")
PARIS = ("get_weather", {"city": "Paris", "days": 1})


@pytest.mark.parametrize("text, content, calls", [
    # Hermes, Qwen 2.5/3, SmolLM3: tagged blocks after any text
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}\n'
     '</tool_call>', "", [PARIS]),
    ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
     '"days": 1}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": '
     '"CET"}}\n</tool_call>', "Let me check.\n", [PARIS, ("get_time", {"zone": "CET"})]),
    # the closing tag left out at the end of the answer
    ('<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}', "",
     [("get_time", {"zone": "UTC"})]),
    # Llama 3.1-3.3: the whole message, "parameters", several joined by ";"
    ('{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}', "", [PARIS]),
    ('<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}}; '
     '{"name": "get_weather", "parameters": {"city": "Paris", "days": 1}}', "",
     [("get_time", {"zone": "UTC"}), PARIS]),
    # Mistral: a list after [TOOL_CALLS] (or with the special token left out of the text)
    ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}]', "",
     [PARIS]),
    ('[{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\", \\"days\\": 1}"}]', "",
     [PARIS]),
    # text, and JSON that calls no offered tool, stay text
    ("It is sunny in Paris.", "It is sunny in Paris.", []),
    ('{"name": "Bob", "age": 3}', '{"name": "Bob", "age": 3}', []),
    ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>',
     '<tool_call>{"name": "launch", "arguments": {}}</tool_call>', []),
    ("Use <tool_ or <b>bold</b>.", "Use <tool_ or <b>bold</b>.", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Par',
     '<tool_call>{"name": "get_weather", "arguments": {"city": "Par', []),
])
@pytest.mark.parametrize("piece", [0, 1, 3])
def test_calls_are_read_from_each_family_s_format_whole_or_piece_by_piece(text, content, calls,
                                                                          piece):
    assert reading(text, AUTO, piece) == (content, calls)


def test_text_before_a_call_streams_before_the_call_is_complete():
    reader = ToolCallReader(AUTO)
    assert reader.feed("Checking the sky") == ("Checking the sky", [])
    assert reader.feed(" now. <tool") == (" now. ", [])
    assert reader.feed('_call>{"name": "get_time", ') == ("", [])
    content, deltas = reader.feed('"arguments": {"zone": "UTC"}}</tool_call>')
    assert content == "" and deltas[0]["index"] == 0 and deltas[0]["type"] == "function"
    assert deltas[0]["function"] == {"name": "get_time", "arguments": '{"zone": "UTC"}'}
    assert len(deltas[0]["id"]) == 9 and reader.finish() == ("", [])


def test_a_named_choice_streams_its_arguments_as_they_come():
    reader = ToolCallReader(ToolUse.of([WEATHER, TIME], {"type": "function",
                                                         "function": {"name": "get_time"}}))
    first = reader.feed('{"zone"')[1]
    assert first[0]["function"] == {"name": "get_time", "arguments": '{"zone"'}
    assert reader.feed(': "UTC"}') == ("", [{"index": 0, "function": {"arguments": ': "UTC"}'}}])
    assert reader.calls[0]["function"]["arguments"] == '{"zone": "UTC"}'


def test_a_required_answer_cut_short_is_its_text():
    use = ToolUse.of([WEATHER], "required")
    assert reading('[{"name": "get_weather", "arguments": {"ci', use) == (
        '[{"name": "get_weather", "arguments": {"ci', [])


@pytest.mark.parametrize("choice", ["get_time", {"function": {"name": "get_time"}},
                                    {"type": "function", "name": "get_time"}])
def test_tgi_s_and_the_responses_api_s_ways_of_naming_the_function_are_taken_too(choice):
    assert ToolUse.of([WEATHER, TIME], choice).name == "get_time"


def test_forced_choices_decode_under_a_grammar_of_the_call():
    named = ToolUse.of([WEATHER, TIME], {"type": "function", "function": {"name": "get_time"}})
    assert named.grammar() == ("json_schema", json.dumps(SCHEMAS["get_time"]))
    kind, text = ToolUse.of([WEATHER, TIME], "required", parallel=False).grammar()
    schema = json.loads(text)
    assert kind == "json_schema" and schema["minItems"] == schema["maxItems"] == 1
    jsonschema.validate([{"name": "get_time", "arguments": {"zone": "UTC"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "get_time", "arguments": {"city": "Paris"}}], schema)
    assert ToolUse.of([WEATHER], "auto").grammar() is None
    assert ToolUse.of([WEATHER], "none") is None


# -- the prompt --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hermes_tokenizer(smollm2_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("hermes-tokenizer")
    smollm2_tokenizer.save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.chat_template = HERMES_TEMPLATE
    return tokenizer


def context_of(tokenizer) -> ParseContext:
    def render(messages, tools=None):
        return tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                             add_generation_prompt=True)

    return ParseContext(64, 256, 8, "m", render_chat=render, check_grammar=lambda spec: None,
                        renders_tools=template_renders_tools(tokenizer.chat_template))


CONVERSATION = ASK + [
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "A1b2C3d4E", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}}]},
    {"role": "tool", "tool_call_id": "A1b2C3d4E", "content": "Sunny, 24 degrees"},
]


def test_a_template_that_renders_tools_gets_them_and_the_earlier_calls_and_results(
        hermes_tokenizer):
    prompt = parse_chat({"messages": CONVERSATION, "tools": [WEATHER]},
                        context_of(hermes_tokenizer)).prompts[0]
    assert json.dumps(WEATHER) in prompt  # through the template's own `tools` loop
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}'
            '\n</tool_call>') in prompt  # arguments as an object, as templates take them
    assert "<tool_response>\nSunny, 24 degrees\n</tool_response>" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


def test_a_template_that_knows_no_tools_gets_them_in_a_system_message(smollm2_tokenizer):
    context = context_of(smollm2_tokenizer)
    assert not context.renders_tools
    prompt = parse_chat({"messages": CONVERSATION, "tools": [WEATHER, TIME]}, context).prompts[0]
    assert prompt.startswith("<|im_start|>system\nYou may call one or more functions")
    assert json.dumps(TIME) in prompt and "<tool_call>" in prompt
    assert "<tool_response>\nSunny, 24 degrees\n</tool_response>" in prompt
    assert '{"name": "get_weather", "arguments": {"city": "Paris", "days": 1}}' in prompt


#: A template that refuses a system turn and knows no tools, as Gemma's do (written here).
GEMMA_LIKE_TEMPLATE = """\
{%- for message in messages %}
{%- if message.role == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}
<start_of_turn>{{ 'model' if message.role == 'assistant' else message.role }}
{{ message.content }}<end_of_turn>
{%- endfor %}
{%- if add_generation_prompt %}
<start_of_turn>model
{% endif %}"""


@pytest.fixture(scope="module")
def gemma_like_tokenizer(hermes_tokenizer):
    tokenizer = copy.copy(hermes_tokenizer)
    tokenizer.chat_template = GEMMA_LIKE_TEMPLATE
    return tokenizer


def test_a_template_that_refuses_a_system_turn_gets_the_tools_in_the_first_user_turn(
        gemma_like_tokenizer, hermes_tokenizer):
    from djl_stream.serving.service import StreamingService

    def takes_system(tokenizer) -> bool:  # the served model's own check
        service = StreamingService.__new__(StreamingService)
        service.tokenizer = tokenizer
        return service._template_takes_system

    assert takes_system(hermes_tokenizer) and not takes_system(gemma_like_tokenizer)
    context = dataclasses.replace(context_of(gemma_like_tokenizer), takes_system=False)
    prompt = parse_chat({"messages": ASK, "tools": [WEATHER]}, context).prompts[0]
    assert prompt.startswith("<start_of_turn>user\nYou may call one or more functions")
    assert json.dumps(WEATHER) in prompt
    assert "<tool_call>" in prompt and "What is the weather in Paris?<end_of_turn>" in prompt


def test_tool_choice_none_shows_no_tools_and_reads_no_calls(hermes_tokenizer):
    request = parse_chat({"messages": ASK, "tools": [WEATHER], "tool_choice": "none"},
                         context_of(hermes_tokenizer))
    assert "get_weather" not in request.prompts[0] and request.answer.tools is None
    assert request.parameters.grammar is None


@pytest.mark.parametrize("body, field, words", [
    ({"tool_choice": "required"}, "tool_choice", "'required' needs tools"),
    ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice",
     'must be "none", "auto", "required", one of the tools\' names (get_weather) or {"type"'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": "get_weather"}},
     "tool_choice", 'or {"type": "function", "function": {"name": ...}}, got an object'),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "fly"}}},
     "tool_choice.function.name", "must be one of the tools' names (get_weather), got 'fly'"),
    ({"tools": [WEATHER, WEATHER]}, "tools", "'get_weather' is given twice"),
    ({"tools": [{"type": "function", "function": {"description": "?"}}]},
     "tools[0].function.name", "is required"),
    ({"tools": [{"type": "function", "function": {"name": "f", "paramters": {}}}]},
     "tools[0].function.paramters", "did you mean parameters?"),
    ({"tools": [{"type": "function", "function": {"name": "two words"}}]},
     "tools[0].function.name", "two words"),
    ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "cannot be combined with a tool_choice that forces a call"),
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x", "type": "function",
                                                         "function": {"name": "f"}}]}]},
     "messages[0].tool_calls[0].function.arguments", "is required"),
])
def test_a_bad_tool_request_names_its_field(hermes_tokenizer, body, field, words):
    with pytest.raises(RequestError) as refused:
        parse_chat({"messages": ASK, **body}, context_of(hermes_tokenizer))
    assert refused.value.field == field and words in refused.value.message


# -- served, through the real clients ------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, hermes_tokenizer, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-tools")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    hermes_tokenizer.save_pretrained(folder)
    # tools make long prompts: the shared tiny server's input limit is too short for them
    properties = folder / "serving.properties"
    properties.write_text(properties.read_text().replace("option.max_input_length=64",
                                                         "option.max_input_length=1024"))
    with serving(folder) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused")


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    reply = client.chat.completions.create(
        model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=40, temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather"
    assert len(call.id) == 9 and call.id.isalnum()
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_required_calls_stream_as_tool_call_deltas_and_finish_for_tool_calls(client):
    calls, finish, sampled = {}, [], 0
    for seed in range(4):
        stream = client.chat.completions.create(
            model="tiny", messages=ASK, tools=[WEATHER, TIME], tool_choice="required",
            max_tokens=80, temperature=1.0, seed=seed, stream=True)
        for chunk in stream:
            choice = chunk.choices[0]
            assert not choice.delta.content  # nothing but the calls
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault((seed, delta.index), {"name": "", "arguments": ""})
                if delta.id:
                    entry["id"] = delta.id
                entry["name"] += delta.function.name or ""
                entry["arguments"] += delta.function.arguments or ""
            if choice.finish_reason:
                finish.append(choice.finish_reason)
        sampled += 1
    assert finish == ["tool_calls"] * sampled
    assert {seed for seed, _ in calls} == set(range(sampled))
    for call in calls.values():
        assert call["name"] in SCHEMAS and len(call["id"]) == 9
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


def test_a_streamed_named_call_s_arguments_add_up_to_the_unstreamed_ones(client):
    params = dict(model="tiny", messages=ASK, tools=[WEATHER, TIME], max_tokens=40,
                  temperature=0, tool_choice={"type": "function", "function": {"name": "get_time"}})
    whole = client.chat.completions.create(**params).choices[0].message.tool_calls[0]
    deltas = [delta for chunk in client.chat.completions.create(**params, stream=True)
              for delta in chunk.choices[0].delta.tool_calls or ()]
    assert len(deltas) > 1  # the arguments streamed as they came
    assert deltas[0].function.name == "get_time" and deltas[0].id
    assert "".join(d.function.arguments or "" for d in deltas) == whole.function.arguments


def test_a_refused_tool_request_is_the_sdk_s_bad_request_error(client):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model="tiny", messages=ASK, tools=[WEATHER],
                                       tool_choice={"type": "function",
                                                    "function": {"name": "fly"}})
    assert raised.value.body["param"] == "tool_choice.function.name"


def test_a_langchain_agent_loop_calls_a_python_function_and_sends_its_result_back(
        server, hermes_tokenizer):
    from typing import Literal

    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    ran = []

    class Query(BaseModel):  # bounded, so that a random model's call ends
        city: Literal["Paris", "Oslo", "Lima"]
        days: int = Field(ge=1, le=7)

    @tool(args_schema=Query)
    def get_weather(city: str, days: int) -> str:
        """Today's weather in a city."""
        ran.append((city, days))
        return f"Sunny in {city} for {days} days, 24 degrees"

    bodies = []
    http = httpx.Client(event_hooks={"request": [lambda r: bodies.append(json.loads(r.read()))]})
    llm = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="tiny",
                     temperature=0, max_tokens=40, http_client=http)
    # The first turn must call the tool (a random model would not by itself); later turns
    # are free, and the loop ends when the model answers without a call.
    # (strict: arguments with no keys beyond the schema's, as OpenAI's strict mode has them)
    agent = llm.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    messages = [HumanMessage("What is the weather in Paris?")]
    reply = agent.invoke(messages)
    for _ in range(3):
        messages.append(reply)
        if not reply.tool_calls:
            break
        for call in reply.tool_calls:
            messages.append(ToolMessage(get_weather.invoke(call["args"]),
                                        tool_call_id=call["id"]))
        reply = llm.bind_tools([get_weather], strict=True).invoke(messages)

    assert len(ran) >= 1 and isinstance(messages[-1].content, str)
    # The tool's result went back to the server, and into the prompt the model read.
    last = bodies[-1]
    assert last["messages"][2]["role"] == "tool" and "24 degrees" in last["messages"][2]["content"]
    prompt = parse_chat(last, context_of(hermes_tokenizer)).prompts[0]
    assert f"<tool_response>\nSunny in {ran[0][0]} for {ran[0][1]} days" in prompt
    # ...after the assistant's call that asked for it
    call_turn = prompt.split("<tool_response>")[0].split("<|im_start|>assistant")[-1]
    assert '<tool_call>\n{"name": "get_weather", "arguments": {' in call_turn


def test_huggingface_hub_s_chat_completion_reads_the_calls(server):
    from huggingface_hub import InferenceClient

    tgi = InferenceClient(base_url=server.url)
    # TGI's way of naming the function: its name as a string
    reply = tgi.chat_completion(messages=ASK, tools=[WEATHER, TIME], tool_choice="get_time",
                                max_tokens=40)
    [call] = reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


@pytest.mark.embedded
def test_the_embedded_model_calls_the_tool_it_is_shown_with_the_city_it_was_asked_about(
        embedded_model_dir):
    # SmolLM2's template knows no tools: they reach it in a system message.
    city = {"type": "function", "function": {
        "name": "get_weather", "description": "Get the current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string",
                                                                 "maxLength": 20}},
                       "required": ["city"], "additionalProperties": False}}}
    with serving(embedded_model_dir) as process:
        client = openai.OpenAI(base_url=process.url + "/v1", api_key="unused")
        reply = client.chat.completions.create(
            model="model", messages=[{"role": "user", "content": "What's the weather like in "
                                                                 "Paris today?"}],
            tools=[city], tool_choice="required", temperature=0, max_tokens=40)
    [call] = reply.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

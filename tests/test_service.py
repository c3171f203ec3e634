"""model.py's handle() under djl-serving's contract: init call, requests, errors, formatters.

Each test imports a copy of model/model.py from a model directory holding the tiny random
Llama, and calls handle() with Inputs built the way djl-serving builds them.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from djl_stream.generation.scheduler import IDLE_PREFILL_FACTOR
from djl_stream.serving.inputs import Input
from djl_stream.serving.properties import djl_init_properties


def load_entry_point(model_dir: Path):
    name = f"model_under_test_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, model_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def init(module, model_dir: Path, **options: str):
    """djl's init call on ``module``: ``model_dir``'s properties, ``options`` (``option.``
    keys without their prefix) over them."""
    result = module.handle(Input(properties={**djl_init_properties(model_dir, {}), **options,
                                             "handler": "handle"}))
    assert result is None  # djl answers 204 to the init call
    return module


def request(module, body, protocol=None):
    """``body`` as handed to ``handle()``; ``protocol`` as the local server names a route's."""
    inp = Input(properties={"content-type": "application/json", "requestId": uuid.uuid4().hex})
    if protocol:
        inp.properties["djl_stream_protocol"] = protocol
    inp.add("data", json.dumps(body).encode() if not isinstance(body, bytes) else body)
    return module.handle(inp)


def scheduler_of(module):
    """The continuous-batching scheduler of the engine that module's service loaded."""
    return module._service.engine.scheduler


class Passes:
    """Records the passes the runner of ``module``'s engine runs: one list of the tokens
    each feed brings per pass."""

    def __init__(self, module):
        self.runner = runner = module._service.engine.runner
        self.seen: list[list[int]] = []
        self._real = real = runner.run

        def run(feeds):
            self.seen.append([len(f.tokens) for f in feeds])
            return real(feeds)

        runner.run = run

    def remove(self):
        self.runner.run = self._real


def body_json(output):
    return json.loads(bytes(output.content.value_at(0)))


def stream_lines(output):
    return [output.format_stream_item(item) for item in output.stream_content]


@pytest.fixture(scope="module")
def handler(tiny_model_dir):
    return init(load_entry_point(tiny_model_dir), tiny_model_dir)


def variant_dir(tmp_path: Path, tiny_model_dir: Path, extra_code: str, extra_properties: str) -> Path:
    directory = tmp_path / "variant"
    shutil.copytree(tiny_model_dir, directory)
    with open(directory / "model.py", "a") as f:
        f.write(extra_code)
    with open(directory / "serving.properties", "a") as f:
        f.write(extra_properties)
    return directory


def test_importing_model_py_loads_nothing(tiny_model_dir):
    module = load_entry_point(tiny_model_dir)
    assert module._service.model is None


def test_the_load_builds_what_the_first_request_would_build(tiny_model_dir):
    # The protocols (their modules imported), the parse context and the longest token's
    # length (the whole vocabulary read) are built by the load's warm-up parse, not on the
    # first client's time (about 50 ms of SmolLM2's first request before).
    module = init(load_entry_point(tiny_model_dir), tiny_model_dir)
    built = set(vars(module._service))
    assert {"protocols", "parse_context", "characters_per_token"} <= built
    assert request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).code == 200


@pytest.mark.fast_path  # (djl-stream's KV cache, which the model's own forward does not use)
@pytest.mark.parametrize("setting, reuses", [({}, True),
                                             ({"enable_prefix_caching": "false"}, False)])
def test_a_repeated_prompt_reuses_its_keys_and_values_unless_turned_off(tiny_model_dir, setting,
                                                                         reuses):
    module = init(load_entry_point(tiny_model_dir), tiny_model_dir, **setting)
    body = {"inputs": "The quick brown fox", "parameters": {"max_new_tokens": 3}}
    answers = [request(module, body) for _ in range(2)]
    assert [a.code for a in answers] == [200, 200]
    assert (module._service.engine.runner.tokens_reused > 0) is reuses


def test_limits_that_refuse_the_warm_up_request_still_load(tiny_model_dir):
    # "Hello" in SmolLM2's chat template is far more than 4 tokens: the load's warm-up
    # parse is refused, and the model loads and answers all the same
    module = init(load_entry_point(tiny_model_dir), tiny_model_dir, max_input_length="4",
                  apply_chat_template="true")
    answer = request(module, {"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert answer.code == 400
    assert body_json(answer)["field"] == "inputs"


def test_streaming_request_yields_json_lines_one_entry_per_prompt(handler):
    out = request(handler, {"inputs": ["Hello", "A longer prompt here"], "parameters": {"max_new_tokens": 6}})
    assert out.code == 200
    assert out.properties["content-type"] == "application/jsonlines"
    lines = stream_lines(out)
    assert len(lines) == 6
    for line in lines:
        assert line.endswith(b"\n")
        record = json.loads(line)
        assert list(record) == ["output_tokens"]
        assert len(record["output_tokens"]) == 2


def test_non_streaming_answer_is_the_concatenated_stream(handler):
    streamed = "".join(json.loads(l)["output_tokens"][0] for l in stream_lines(
        request(handler, {"inputs": "Hello", "parameters": {"max_new_tokens": 8}})))
    single = request(handler, {"inputs": "Hello", "parameters": {"max_new_tokens": 8}, "stream": False})
    assert single.properties["content-type"] == "application/json"
    assert body_json(single) == {"generated_text": streamed}
    batched = request(handler, {"inputs": ["Hello"], "parameters": {"max_new_tokens": 8}, "stream": False})
    assert body_json(batched) == {"generated_text": [streamed]}


def test_default_max_new_tokens_comes_from_the_properties(handler):
    # serving.properties of the tiny model says option.default_max_new_tokens=16
    out = request(handler, {"inputs": "Hello"})
    assert len(stream_lines(out)) == 16


def test_a_null_stop_is_no_stop(handler):
    # TGI's and OpenAI's clients send null for what they leave unset; it used to be a 424.
    out = request(handler, {"inputs": "hi", "parameters": {"stop": None, "max_new_tokens": 2},
                            "stream": False})
    assert out.code == 200, body_json(out)


@pytest.mark.parametrize(
    "body, field, words",
    [
        ({"inputs": "hi", "parameters": {"max_new_tokens": 257}}, "parameters.max_new_tokens", "256"),
        ({"inputs": "hi", "parameters": {"temperature": 0}}, "parameters.temperature", "at least 0.0001"),
        # Each of these was a 424 (the handler failed) where a 400 belongs.
        ({"inputs": "hi", "parameters": {"do_sample": True, "temperature": 1e-37}},
         "parameters.temperature", "at least 0.0001"),
        ({"inputs": "hi", "parameters": {"repetition_penalty": 1e-300}},
         "parameters.repetition_penalty", "at least 0.01"),
        ({"inputs": None}, "inputs", "required"),
        (b'{"inputs": "x\\ud800y"}', "inputs", "lone surrogate (U+D800)"),
        (b'{"messages": [{"role": "user", "content": "x\\udfffy"}]}', "messages[0].content",
         "lone surrogate (U+DFFF)"),
        (b'{"inputs": "hi", "parameters": {"stop": ["\\ud800"]}}', "parameters.stop[0]",
         "lone surrogate"),
        (b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "body", "nested more than 32"),
        ({"inputs": "hi", "parameters": {"beams": 2}}, "parameters.beams", "not a known parameter"),
        ({"inputs": ""}, "inputs", "empty"),
        ({"inputs": "word " * 100}, "inputs", "option.max_input_length) is 64"),
        # 64 tokens of SmolLM2's are at most 64 * 81 characters: refused by length alone
        ({"inputs": "a" * 6000}, "inputs", "the limit is 5184 characters"),
        ({"inputs": ["hi", "a" * 6000]}, "inputs[1]", "(option.max_input_length, 64 tokens"),
        # Each prompt within max_input_length, together more than a request may
        # bring (twice max_input_length by default), before any model work.
        ({"inputs": [" ".join(["word"] * 50)] * 3}, "inputs",
         "3 prompts of up to 50 tokens take 150 tokens in all; "
         "the limit (option.max_request_input_length) is 128"),
        (b"{not json", "body", "JSON"),
    ],
)
def test_bad_requests_answer_400_naming_the_field_and_the_limit(handler, body, field, words):
    out = request(handler, body)
    assert out.code == 400
    error = body_json(out)
    assert error["field"] == field
    assert words in error["message"]
    # and the next request still works
    assert request(handler, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}}).code == 200


class CountingTokenizer:
    """The model's tokenizer, counting the texts it is asked to tokenize."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.texts = 0

    def __call__(self, texts, *args, **kwargs):
        self.texts += len(texts) if isinstance(texts, list) else 1
        return self.tokenizer(texts, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_a_prompt_too_long_in_characters_is_refused_without_tokenizing_it(handler, monkeypatch):
    # A 50 MB prompt was tokenized (a minute of CPU, 7 GB) before its
    # length was checked. Whatever the tokenizer, a token stands for at most as many
    # characters as its longest vocabulary entry: SmolLM2's is 81 (a newline, 80 spaces).
    service = handler._service
    counting = CountingTokenizer(service.tokenizer)
    monkeypatch.setattr(service, "tokenizer", counting)
    refused = request(handler, {"inputs": "a" * 5_000_000, "stream": False})
    assert refused.code == 400
    assert body_json(refused)["message"] == (
        "inputs is 5000000 characters long; the limit is 5184 characters "
        "(option.max_input_length, 64 tokens, of at most 81 characters each)")
    assert counting.texts == 0
    # The bound is no tighter than the tokenizer: "Hi" and 63 of its longest token are
    # 5105 characters in 64 tokens: tokenized (by the length check, then the engine), served.
    longest = "\n" + " " * 80
    fits = request(handler, {"inputs": "Hi" + longest * 63, "parameters": {"max_new_tokens": 1},
                             "stream": False})
    assert fits.code == 200, body_json(fits)
    assert counting.texts > 0


def test_messages_use_the_chat_template(tmp_path, tiny_model_dir):
    # djl's format for messages (by default a messages body is an OpenAI chat completion)
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.chat_protocol=djl\n")
    handler = init(load_entry_point(directory), directory)
    tokenizer = handler._service.tokenizer
    messages = [{"role": "user", "content": "Hi there"}]
    via_messages = body_json(request(handler, {"messages": messages, "parameters": {"max_new_tokens": 6}, "stream": False}))
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    via_inputs = body_json(request(handler, {"inputs": rendered, "parameters": {"max_new_tokens": 6}, "stream": False}))
    assert via_messages == via_inputs


def test_sse_formatter_by_name(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.output_formatter=sse\n")
    module = init(load_entry_point(directory), directory)
    out = request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 3}})
    assert out.properties["content-type"] == "text/event-stream"
    lines = stream_lines(out)
    assert len(lines) == 3
    assert all(l.startswith(b"data: ") and l.endswith(b"\n\n") for l in lines)


def test_custom_formatter_is_a_function_in_model_py(tmp_path, tiny_model_dir):
    code = "\n\ndef plain_text(pieces):\n    return ''.join(pieces).encode('utf-8')\n"
    directory = variant_dir(tmp_path, tiny_model_dir, code, "option.output_formatter=plain_text\n")
    module = init(load_entry_point(directory), directory)
    streamed = b"".join(stream_lines(request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 5}})))
    plain = body_json(request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 5}, "stream": False}))
    assert streamed.decode() == plain["generated_text"]


FAILING_ENGINE = (
    "\n\nfrom djl_stream import register_engine\n\n"
    "@register_engine('Fails-after-two')\n"
    "def fails_after_two(model, tokenizer, inputs, **parameters):\n"
    "    if 'at once' in inputs[0]:\n"
    "        raise RuntimeError('cannot prefill')\n"
    "    yield ['a' for _ in inputs]\n"
    "    yield ['b' for _ in inputs]\n"
    "    raise RuntimeError('device lost')\n"
)


def test_an_engine_failing_mid_stream_ends_with_one_error_line(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, FAILING_ENGINE,
                            "option.stream_engine=Fails-after-two\n")
    module = init(load_entry_point(directory), directory)
    out = request(module, {"inputs": "Hello"})
    assert out.code == 200
    lines = stream_lines(out)
    assert [json.loads(line) for line in lines] == [
        {"output_tokens": ["a"]}, {"output_tokens": ["b"]}, {"error": "RuntimeError: device lost"}]


def test_a_generation_failing_before_its_first_item_is_a_424_not_a_stream(tmp_path, tiny_model_dir):
    # djl-serving would send a 200 whose body is the error text had handle() returned the
    # stream; handle() produces the first item first, so the failure is still a status
    directory = variant_dir(tmp_path, tiny_model_dir, FAILING_ENGINE,
                            "option.stream_engine=Fails-after-two\n")
    module = init(load_entry_point(directory), directory)
    out = request(module, {"inputs": "fail at once"})
    assert (out.code, out.stream_content) == (424, None)
    assert body_json(out) == {"code": 424, "message": "invoke handler failure",
                              "error": "cannot prefill"}


def test_an_engine_that_cannot_generate_fails_the_load_and_leaves_the_model_unloaded(
        tmp_path, tiny_model_dir):
    # the load's warm-up generates two tokens: an engine failing there fails the init call
    # (djl-serving then reports the model failed), and the service serves nothing
    code = ("\n\nfrom djl_stream import register_engine\n\n"
            "@register_engine('Never-generates')\n"
            "def never_generates(model, tokenizer, inputs, **parameters):\n"
            "    raise RuntimeError('no device')\n"
            "    yield []\n")
    directory = variant_dir(tmp_path, tiny_model_dir, code,
                            "option.stream_engine=Never-generates\n")
    module = load_entry_point(directory)
    with pytest.raises(RuntimeError, match="no device"):
        init(module, directory)
    assert module._service.model is None and not module._service.initialized


def test_a_formatter_failing_mid_stream_ends_it_with_one_error_line(tmp_path, tiny_model_dir):
    code = ("\n\ncalls = []\n\n"
            "def fragile(pieces):\n"
            "    calls.append(pieces)\n"
            "    if len(calls) == 2:\n"
            "        raise ValueError('cannot format')\n"
            "    return ''.join(pieces)\n")
    directory = variant_dir(tmp_path, tiny_model_dir, code, "option.output_formatter=fragile\n")
    module = init(load_entry_point(directory), directory)
    lines = stream_lines(request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 5}}))
    assert len(lines) == 2 and json.loads(lines[1]) == {"error": "ValueError: cannot format"}


def test_unknown_engine_fails_the_load_with_the_registered_names(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.stream_engine=DeepSpeed\n")
    module = load_entry_point(directory)
    with pytest.raises(ValueError, match="Accelerate"):
        init(module, directory)


def test_more_prompts_than_the_batch_holds_is_a_400(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.max_rolling_batch_size=2\n")
    module = init(load_entry_point(directory), directory)
    out = request(module, {"inputs": ["a", "b", "c"], "parameters": {"max_new_tokens": 2}})
    assert out.code == 400
    error = body_json(out)
    assert error["field"] == "inputs"
    assert "(option.max_rolling_batch_size) is 2" in error["message"]


def test_option_max_request_input_length_counts_every_prompt_token(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "",
                            "option.max_request_input_length=100\n")
    module = init(load_entry_point(directory), directory)
    passes = Passes(module)
    try:
        # 40 + 40 + 30 tokens: 110, more than the request may bring
        out = request(module, {"inputs": [" ".join(["word"] * 40)] * 2 + [" ".join(["word"] * 30)],
                               "parameters": {"max_new_tokens": 2}})
        assert out.code == 400
        assert body_json(out)["field"] == "inputs"
        assert body_json(out)["message"] == (
            "inputs: 3 prompts of up to 40 tokens take 110 tokens in all; the limit "
            "(option.max_request_input_length) is 100")
        assert passes.seen == []  # refused before any model work
        # 40 tokens and two of 1: each counted as it is, 42 (no padding to the longest)
        assert request(module, {"inputs": [" ".join(["word"] * 40), "hi", "hi"],
                                "parameters": {"max_new_tokens": 2}}).code == 200
        assert passes.seen
    finally:
        passes.remove()


def test_a_long_prompt_is_prefilled_in_chunks_of_option_max_batch_prefill_tokens(
        tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "",
                            "option.max_batch_prefill_tokens=32\noption.max_input_length=512\n"
                            "option.prefill_stall_steps=2.5\n")
    module = init(load_entry_point(directory), directory)
    scheduler = scheduler_of(module)
    assert scheduler.max_batch_prefill_tokens == 32
    assert scheduler._pacer.stall_steps == 2.5
    # alone (nothing decoding), it is read in passes of the idle budget the property sets
    assert scheduler.max_idle_prefill_tokens == IDLE_PREFILL_FACTOR * 32 == 256
    passes = Passes(module)
    body = {"inputs": "word " * 300, "parameters": {"max_new_tokens": 8}, "stream": False}
    try:
        chunked = body_json(request(module, body))
    finally:
        passes.remove()
    length = len(module._service.tokenizer(body["inputs"])["input_ids"])
    assert 256 < length <= 512
    assert passes.seen[:2] == [[256], [length - 256]]  # 2 chunks
    # then the decode steps, one token each
    assert passes.seen[2:] == [[1]] * 7
    # a budget beyond the prompt reads it in one pass, and the text is the same
    one_pass = variant_dir(tmp_path / "one-pass", tiny_model_dir, "",
                           "option.max_batch_prefill_tokens=4096\noption.max_input_length=512\n")
    assert chunked == body_json(request(init(load_entry_point(one_pass), one_pass), body))


def test_option_max_request_kv_tokens_bounds_prompts_times_their_whole_length(
        tmp_path, tiny_model_dir):
    # A request's KV cache holds its prompts plus max_new_tokens per prompt by its last
    # step; 32 prompts x 2,048 new tokens would be ~9 GB for SmolLM2, so a bound
    # refuses it, on every protocol, before any model work.
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.max_request_kv_tokens=400\n")
    module = init(load_entry_point(directory), directory)
    assert module._service.props.max_request_kv_tokens == 400
    words = " ".join(["word"] * 9)
    length = len(module._service.tokenizer(words)["input_ids"])
    prompts = length + len(module._service.tokenizer("hi")["input_ids"])
    passes = Passes(module)
    try:
        out = request(module, {"inputs": [words, "hi"], "parameters": {"max_new_tokens": 200}})
        assert out.code == 400
        assert body_json(out) == {
            "code": 400, "type": "RequestError", "field": "parameters.max_new_tokens",
            "message": f"parameters.max_new_tokens: 2 prompts of {prompts} tokens in all with "
                       f"200 new tokens each would hold {prompts} + 2 × 200 = {prompts + 400} "
                       "KV-cache positions; the limit (option.max_request_kv_tokens) is 400: ask "
                       "for fewer new tokens or send fewer prompts"}
        openai = request(module, {"prompt": words, "n": 2, "max_tokens": 200,
                                 "temperature": 0}, "openai-completions")
        assert openai.code == 400
        error = body_json(openai)["error"]
        assert error["param"] == "max_tokens" and "option.max_request_kv_tokens) is 400" in \
            error["message"]
        # (TGI's /generate brings one prompt, which the bound always admits: it is at
        # least max_input_length + max_new_tokens_limit, see test_properties)
        assert passes.seen == []  # every refusal came before any model work
        # one prompt of the same length fits: 1 x (length + 200) <= 400
        fits = request(module, {"inputs": words, "parameters": {"max_new_tokens": 200},
                                "stream": False})
        assert fits.code == 200
        assert passes.seen
    finally:
        passes.remove()


def test_max_request_kv_tokens_defaults_to_what_fits_in_the_weights_size(handler):
    from transformers import AutoModelForCausalLM

    service = handler._service
    # The model's weights as its checkpoint holds them, each once (a tied LM head is the
    # embedding): the served model's may be packed, or quantized with the LM head as a
    # second copy, and the bound must not change with that.
    checkpoint = AutoModelForCausalLM.from_pretrained(service.props.model_dir)
    weights = sum(p.numel() * p.element_size() for p in checkpoint.parameters())
    assert weights > 0
    config = service.model.config
    per_position = (config.num_hidden_layers * 2 * config.num_key_value_heads
                    * (config.hidden_size // config.num_attention_heads) * 4)
    assert service.props.max_request_kv_tokens == max(64 + 256,
                                                      int(0.75 * weights) // per_position)


def test_a_full_queue_answers_503_and_serving_goes_on(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "",
                            "option.max_rolling_batch_size=1\njob_queue_size=1\n")
    module = init(load_entry_point(directory), directory)
    scheduler = scheduler_of(module)
    running = request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 256}})
    assert running.code == 200  # running: the batch of one is full
    # handle() returns once the request's first item exists, so the waiting one is asked
    # from a thread of its own, as a server would
    waiting = {}
    thread = threading.Thread(target=lambda: waiting.update(out=request(
        module, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})))
    thread.start()
    while scheduler.waiting_size < 1:
        assert thread.is_alive(), "the second request did not wait"
        time.sleep(0.01)
    refused = request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 2}})
    assert refused.code == 503
    assert body_json(refused)["type"] == "ServiceUnavailableException"
    assert "job_queue_size" in body_json(refused)["message"]
    running.stream_content.close()
    thread.join(60)
    assert len(stream_lines(waiting["out"])) == 2


def test_dynamic_batching_input_is_refused_with_a_clear_400(handler):
    inp = Input(properties={"batch_size": "2", "content-type": "application/json"})
    inp.add("batch_000_data", json.dumps({"inputs": "a"}).encode())
    inp.add("batch_001_data", json.dumps({"inputs": "b"}).encode())
    out = handler.handle(inp)
    assert out.code == 400
    assert body_json(out)["field"] == "batch_size"


def test_a_batch_size_header_does_not_make_a_request_a_batch(handler):
    # djl-serving turns every HTTP header into a property, so a client can send the
    # property the front end uses for dynamic batches; only the front end prefixes the
    # content keys (batch_000.data), so a lone request stays a request.
    inp = Input(properties={"batch_size": "2", "content-type": "application/json"})
    inp.add("data", json.dumps({"inputs": "a", "parameters": {"max_new_tokens": 2},
                                "stream": False}).encode())
    out = handler.handle(inp)
    assert out.code == 200, body_json(out)
    assert "generated_text" in body_json(out)

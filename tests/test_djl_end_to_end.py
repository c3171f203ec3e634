"""djl's schema end to end: the newer parameters and per-token details through model.py's
handle() on the tiny model, with the Accelerate engine's real token ids, log-probabilities
and finish reasons. (``djl-stream serve`` sends handle()'s chunks as they are; its own
tests cover the HTTP side.)"""

from __future__ import annotations

import json
import math

import pytest

from logit_bias import LogitBias
from test_service import body_json, init, load_entry_point, request, stream_lines, variant_dir

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def handler(tiny_model_dir):
    # the model's eager forward: LogitBias tilts the logits through a hook on lm_head,
    # which a compiled decode step (option.compile) runs without calling
    return init(load_entry_point(tiny_model_dir), tiny_model_dir, compile="false")


@pytest.fixture(scope="module")
def eos_id(handler) -> int:
    return handler._service.tokenizer.eos_token_id


def records(output) -> list[dict]:
    assert output.code == 200, body_json(output)
    return [json.loads(line) for line in stream_lines(output)]


def answer(module, body) -> dict:
    output = request(module, {**body, "stream": False})
    assert output.code == 200, body_json(output)
    return body_json(output)


def details_stream(module, body) -> tuple[list[list], list[dict]]:
    """The token records per prompt, and the closing details, of a details stream."""
    lines = records(request(module, body))
    *steps, last = lines
    assert all(list(line) == ["tokens"] for line in steps) and list(last) == ["details"]
    n = len(last["details"])
    return [[s["tokens"][i] for s in steps if s["tokens"][i] is not None] for i in range(n)], \
        last["details"]


# -- details ----------------------------------------------------------------------------


def test_a_details_stream_adds_up_to_the_text_stream(handler):
    body = {"inputs": [PROMPT, "Hello"], "parameters": {"max_new_tokens": 6}}
    text_lines = records(request(handler, body))
    tokens, details = details_stream(handler, {**body, "parameters": {"max_new_tokens": 6,
                                                                      "details": True}})
    tokenizer = handler._service.tokenizer

    for i, prompt in enumerate(body["inputs"]):
        assert "".join(t["text"] for t in tokens[i]) == "".join(
            line["output_tokens"][i] for line in text_lines)
        assert details[i] == {"finish_reason": "length", "generated_tokens": len(tokens[i]),
                              "prompt_tokens": len(tokenizer(prompt)["input_ids"])}
        assert len(tokens[i]) == 6
        assert all(isinstance(t["id"], int) and t["special"] is False for t in tokens[i])


def test_streamed_logprobs_are_numbers_at_most_zero_and_equal_to_the_json_answers(handler):
    body = {"inputs": [PROMPT, "Hi"], "parameters": {"max_new_tokens": 8, "details": True}}
    tokens, details = details_stream(handler, body)
    single = answer(handler, body)

    assert single["details"][0]["finish_reason"] == details[0]["finish_reason"]
    for i in range(2):
        logprobs = [t["logprob"] for t in tokens[i]]
        assert all(isinstance(lp, float) and lp <= 0 for lp in logprobs)
        in_json = single["details"][i]["tokens"]
        assert [t["id"] for t in in_json] == [t["id"] for t in tokens[i]]
        # the same computation both ways; approx only so a BLAS that splits sums
        # differently between runs cannot make it flaky
        assert [t["logprob"] for t in in_json] == pytest.approx(logprobs, abs=1e-5)
        assert "".join(t["text"] for t in in_json) == single["generated_text"][i]


def test_greedy_top_logprobs_start_with_the_chosen_token(handler):
    tokens, _ = details_stream(handler, {"inputs": PROMPT,
                                         "parameters": {"max_new_tokens": 4, "top_logprobs": 3}})
    tokenizer = handler._service.tokenizer

    for token in tokens[0]:
        top = token["top_logprobs"]
        assert len(top) == 3
        assert (top[0]["id"], top[0]["logprob"]) == (token["id"], token["logprob"])
        assert [t["logprob"] for t in top] == sorted((t["logprob"] for t in top), reverse=True)
        for alternative in top:
            assert alternative["text"] == tokenizer.decode([alternative["id"]])
        # a distribution: the three best hold at most all of the mass
        assert sum(math.exp(t["logprob"]) for t in top) <= 1 + 1e-6


def test_the_json_answer_of_one_prompt_has_one_details_object(handler):
    body = answer(handler, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3, "details": True}})
    assert isinstance(body["generated_text"], str)
    assert body["details"]["generated_tokens"] == 3 == len(body["details"]["tokens"])


def test_sse_with_details_frames_every_record_as_an_event(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.output_formatter=sse\n")
    module = init(load_entry_point(directory), directory)
    output = request(module, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3,
                                                                "details": True}})
    chunks = stream_lines(output)

    assert output.properties["content-type"] == "text/event-stream"
    assert all(c.startswith(b"data: ") and c.endswith(b"\n\n") for c in chunks)
    last = json.loads(chunks[-1][len(b"data: "):])
    assert last["details"][0]["generated_tokens"] == 3 and len(chunks) == 4


def test_the_jsonlines_details_formatter_gives_details_by_default(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "",
                            "option.output_formatter=jsonlines_details\n")
    module = init(load_entry_point(directory), directory)
    tokens, details = details_stream(module, {"inputs": PROMPT,
                                              "parameters": {"max_new_tokens": 3}})
    assert all(t["logprob"] <= 0 for t in tokens[0]) and details[0]["generated_tokens"] == 3

    lines = records(request(module, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3,
                                                                       "details": False}}))
    assert [list(line) for line in lines] == [["output_tokens"]] * 3
    assert answer(module, {"inputs": PROMPT, "parameters": {"max_new_tokens": 3}}).keys() == {
        "generated_text"}


def test_a_custom_formatter_streams_no_details_but_answers_them_in_json(tmp_path, tiny_model_dir):
    code = "\n\ndef plain_text(pieces):\n    return ''.join(pieces)\n"
    directory = variant_dir(tmp_path, tiny_model_dir, code, "option.output_formatter=plain_text\n")
    module = init(load_entry_point(directory), directory)
    refused = request(module, {"inputs": PROMPT, "parameters": {"details": True}})
    assert refused.code == 400 and body_json(refused)["field"] == "parameters.details"
    body = answer(module, {"inputs": PROMPT, "parameters": {"max_new_tokens": 2, "details": True}})
    assert body["details"]["generated_tokens"] == 2


# -- the newer parameters ---------------------------------------------------------------


def test_min_new_tokens_holds_the_end_of_sequence_back(handler, eos_id):
    model = handler._service.model
    with LogitBias(model, token_id=eos_id, bias=50.0):
        eager = answer(handler, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8,
                                                                  "details": True}})
        held = answer(handler, {"inputs": PROMPT, "parameters": {"max_new_tokens": 8,
                                                                 "min_new_tokens": 4,
                                                                 "details": True}})
    assert [t["id"] for t in eager["details"]["tokens"]] == [eos_id]
    assert eager["details"]["finish_reason"] == "eos_token"
    ids = [t["id"] for t in held["details"]["tokens"]]
    assert len(ids) == 5 and eos_id not in ids[:4] and ids[4] == eos_id
    assert held["details"]["finish_reason"] == "eos_token"
    assert held["details"]["tokens"][-1]["special"] is True


def test_ignore_eos_runs_to_max_new_tokens_and_eos_adds_no_text(handler, eos_id):
    model = handler._service.model
    with LogitBias(model, token_id=eos_id, bias=50.0):
        tokens, details = details_stream(handler, {"inputs": PROMPT, "parameters": {
            "max_new_tokens": 5, "ignore_eos": True, "details": True}})
    assert details[0]["finish_reason"] == "length" and details[0]["generated_tokens"] == 5
    assert all(t["id"] == eos_id and t["special"] and t["text"] == "" for t in tokens[0])


def test_seed_samples_exactly_as_manual_seed(handler):
    params = {"max_new_tokens": 8, "do_sample": True, "temperature": 1.5}
    via_seed = answer(handler, {"inputs": PROMPT, "parameters": {**params, "seed": 11}})
    via_manual = answer(handler, {"inputs": PROMPT, "parameters": {**params, "manual_seed": 11}})
    other = answer(handler, {"inputs": PROMPT, "parameters": {**params, "seed": 12}})
    assert via_seed == via_manual
    assert via_seed != other  # the seed is really used (a random 49k vocabulary at T=1.5)


def test_return_full_text_starts_with_the_prompt_as_sent(tmp_path, tiny_model_dir):
    # with the chat template on, the model sees the rendered turn; the client gets back
    # what it sent
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.apply_chat_template=true\n")
    module = init(load_entry_point(directory), directory)
    params = {"max_new_tokens": 5}
    plain = answer(module, {"inputs": [PROMPT, "Hi"], "parameters": params})
    full = answer(module, {"inputs": [PROMPT, "Hi"],
                           "parameters": {**params, "return_full_text": True}})
    assert full["generated_text"] == [PROMPT + plain["generated_text"][0],
                                      "Hi" + plain["generated_text"][1]]
    lines = records(request(module, {"inputs": [PROMPT, "Hi"],
                                     "parameters": {**params, "return_full_text": True}}))
    assert ["".join(line["output_tokens"][i] for line in lines) for i in range(2)] == \
        full["generated_text"]
    assert len(lines) == 5


@pytest.mark.parametrize("body, field, words", [
    ({"inputs": "hi", "parameters": {"max_new_tokens": 4, "min_new_tokens": 5}},
     "parameters.min_new_tokens", "at most parameters.max_new_tokens (4), got 5"),
    ({"inputs": "hi", "parameters": {"min_new_tokens": 17}},
     "parameters.min_new_tokens", "(16, option.default_max_new_tokens)"),
    ({"inputs": "hi", "parameters": {"top_logprobs": 21}},
     "parameters.top_logprobs", "at most 20, got 21"),
    ({"inputs": "hi", "parameters": {"seed": 1, "manual_seed": 1}}, "parameters.seed", "not both"),
    ({"inputs": "hi", "parameters": {"ignore_eos": "yes"}},
     "parameters.ignore_eos", "must be true or false"),
    ({"inputs": "hi", "parameters": {"details": True, "return_full_text": True}},
     "parameters.return_full_text", "per-token details"),
    ({"inputs": "hi", "parameters": {"detail": True}}, "parameters.detail", "did you mean details?"),
])
def test_bad_values_of_the_newer_parameters_answer_400(handler, body, field, words):
    output = request(handler, body)
    assert output.code == 400
    error = body_json(output)
    assert error["field"] == field and words in error["message"]


def test_return_full_text_on_a_messages_body_is_a_400_that_says_why(tmp_path, tiny_model_dir):
    directory = variant_dir(tmp_path, tiny_model_dir, "", "option.chat_protocol=djl\n")
    module = init(load_entry_point(directory), directory)
    output = request(module, {"messages": [{"role": "user", "content": "Hi"}],
                              "parameters": {"return_full_text": True}})
    assert output.code == 400
    error = body_json(output)
    assert error["field"] == "parameters.return_full_text"
    assert "chat template" in error["message"]


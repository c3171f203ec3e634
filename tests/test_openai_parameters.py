"""OpenAI's sampling parameters beyond temperature and top-p, through the real ``openai``
SDK against a real server on the tiny model: ``logit_bias``, ``presence_penalty`` and
``frequency_penalty``, and ``n`` seeded choices."""

from __future__ import annotations

import openai
import pytest

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def client(tiny_server):
    return openai.OpenAI(base_url=tiny_server.url + "/v1", api_key="unused")


def tokens(client, **parameters) -> list[str]:
    """The greedy completion's tokens, as its logprobs name them."""
    answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12,
                                       temperature=0, logprobs=0, **parameters)
    return answer.choices[0].logprobs.tokens


def token_id(text: str, tokenizer) -> int:
    (only,) = tokenizer(text, add_special_tokens=False)["input_ids"]
    return only


def test_logit_bias_forces_and_bars_tokens(client, smollm2_tokenizer):
    plain = tokens(client)
    forced = token_id(" lighthouse", smollm2_tokenizer)
    assert set(tokens(client, logit_bias={str(forced): 100})) == {" lighthouse"}
    barred = token_id(plain[0], smollm2_tokenizer)
    assert tokens(client, logit_bias={str(barred): -100})[0] != plain[0]


def test_frequency_and_presence_penalties_make_repeats_rarer(client):
    plain = tokens(client)
    assert len(set(plain)) < len(plain)  # the tiny random model repeats itself
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        penalised = tokens(client, **penalty)
        assert len(set(penalised)) > len(set(plain)), (penalty, penalised, plain)
    # a negative penalty rewards repeats instead
    assert len(set(tokens(client, presence_penalty=-2.0))) <= len(set(plain))


def test_n_seeded_choices_differ_and_repeat_as_a_whole(client):
    def choices():
        answer = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8,
                                           temperature=1.0, n=3, seed=42)
        return [choice.text for choice in sorted(answer.choices, key=lambda c: c.index)]

    first = choices()
    assert len(set(first)) > 1
    assert choices() == first


def test_a_logit_bias_beyond_the_vocabulary_is_a_400_naming_it(client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=PROMPT, max_tokens=2,
                                  logit_bias={"99999999": 5})
    assert refused.value.body["param"] == "logit_bias"
    assert "logit_bias names token 99999999" in refused.value.body["message"]


def test_a_prompt_of_token_ids_is_answered_as_its_text(client, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPT)["input_ids"]
    as_text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0)
    as_ids = client.completions.create(model="tiny", prompt=ids, max_tokens=8, temperature=0)
    assert as_ids.choices[0].text == as_text.choices[0].text
    assert as_ids.usage.prompt_tokens == len(ids)
    several = client.completions.create(model="tiny", prompt=[ids, ids[:2]], max_tokens=4,
                                        temperature=0)
    assert len(several.choices) == 2


@pytest.mark.parametrize("prompt, param, message", [
    ([1, 99999999], "prompt", "prompt holds token 99999999"),
    ([1, -3], "prompt[1]", "prompt[1] must be a token id"),
    ([[1], "text"], "prompt", "not a mix of them"),
])
def test_bad_token_id_prompts_are_400s_naming_the_field(client, prompt, param, message):
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2)
    assert refused.value.body["param"] == param
    assert message in refused.value.body["message"]

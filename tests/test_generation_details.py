"""Per-token details and the length parameters of the Accelerate engine, on the tiny model:
``logprobs`` / ``top_logprobs`` against an independent forward pass, ``special``,
``min_new_tokens`` against transformers' own ``generate()``, and ``ignore_eos``."""

from __future__ import annotations

import pytest
import torch

from djl_stream import StreamingUtils
from djl_stream.generation import sampling
from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.engines.accelerate import build_sequences, encode_prompts
from djl_stream.generation.sampling import MAX_TOP_LOGPROBS, TokenChooser, token_logprobs
from djl_stream.generation.sequence import special_token_ids
from djl_stream.runtime.runner import RunnerSettings, load_runner
from logit_bias import LogitBias

PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog because",
    "Name a primary colour.",
]
EOS = 2  # the tiny model's eos_token_id (SmolLM2's <|im_end|>)
ATOL = 1e-4  # a KV-cached, batched step against one plain forward pass, in float32


@pytest.fixture(scope="module")
def runner(tiny_model):
    """The tiny model's runner (made once, outside any :class:`LogitBias`: its probe
    runs the model, and would use up a bias of a few calls)."""
    runner = load_runner(tiny_model, RunnerSettings(max_rows=8, max_positions=512))
    assert runner.path == "attention"
    return runner


def run(runner, tokenizer, groups):
    """Decode ``groups`` (a list of ``(prompts, parameters)``) in one batch, each group
    with its own parameters, by driving generate_token; every prompt's Generations."""
    sequences = []
    for g, (prompts, parameters) in enumerate(groups):
        sequences += build_sequences(runner.model, tokenizer, encode_prompts(tokenizer, prompts),
                                     request_ids=[(g, i) for i in range(len(prompts))],
                                     **parameters)
    out = {seq.request_id: [] for seq in sequences}
    batch = CausalLMBatch.from_sequences(runner, sequences)
    while batch is not None:
        generations, batch = generate_token(runner, batch)
        for generation in generations:
            out[generation.request_id].append(generation)
    assert runner.handles() == []  # every row finished and left, its cache freed
    return [[out[(g, i)] for i in range(len(prompts))] for g, (prompts, _) in enumerate(groups)]


def run_one(runner, tokenizer, prompt, **parameters):
    return run(runner, tokenizer, [([prompt], parameters)])[0][0]


def stream(model, tokenizer, prompts, **parameters):
    """Every prompt's Generations, read from the Steps of the registered stream generator
    (the scheduler's path)."""
    generator = StreamingUtils.get_stream_generator("Accelerate")
    out = [[] for _ in prompts]
    for step in generator(model, tokenizer, prompts, **parameters):
        for i, generation in enumerate(step.generations):
            if generation is not None:
                out[i].append(generation)
    return out


def reference_logprobs(model, tokenizer, prompt, token_ids):
    """log_softmax of a plain forward pass (the model's own, no cache) over prompt + generated:
    row i is the distribution the i-th generated token was chosen from."""
    prompt_ids = encode_prompts(tokenizer, [prompt])[0]
    ids = torch.tensor([prompt_ids + list(token_ids)])
    with torch.inference_mode():
        logits = model(input_ids=ids).logits[0].float()
    n = len(prompt_ids)
    return torch.log_softmax(logits[n - 1 : n - 1 + len(token_ids)], dim=-1)


# -- logprobs ----------------------------------------------------------------------------------


def test_logprobs_and_top_logprobs_are_the_models_own_log_softmax(
        runner, tiny_model, smollm2_tokenizer):
    generations = run_one(runner, smollm2_tokenizer, PROMPTS[1], max_new_tokens=12,
                          logprobs=True, top_logprobs=5)
    tokens = [g.token_id for g in generations]
    expected = reference_logprobs(tiny_model, smollm2_tokenizer, PROMPTS[1], tokens)
    for i, g in enumerate(generations):
        assert g.logprob == pytest.approx(expected[i, g.token_id].item(), abs=ATOL)
        values, ids = expected[i].topk(5)
        assert [t for t, _ in g.top_logprobs] == ids.tolist()
        assert [v for _, v in g.top_logprobs] == pytest.approx(values.tolist(), abs=ATOL)
        # most likely first, and greedy picks the most likely
        assert [v for _, v in g.top_logprobs] == sorted((v for _, v in g.top_logprobs), reverse=True)
        assert g.top_logprobs[0][0] == g.token_id
        assert g.top_logprobs[0][1] == g.logprob
        assert g.logprob < 0 and all(isinstance(v, float) for _, v in g.top_logprobs)
        assert not g.special


def test_sampled_tokens_report_the_raw_distribution_and_are_not_changed_by_asking(
        runner, tiny_model, smollm2_tokenizer):
    sampling_params = dict(max_new_tokens=10, do_sample=True, temperature=1.7, top_k=300,
                           manual_seed=11)
    plain = run_one(runner, smollm2_tokenizer, PROMPTS[2], **sampling_params)
    asked = run_one(runner, smollm2_tokenizer, PROMPTS[2], logprobs=True, **sampling_params)
    tokens = [g.token_id for g in asked]
    assert tokens == [g.token_id for g in plain]  # the seeded draw is untouched
    assert all(g.logprob is None for g in plain)
    raw = reference_logprobs(tiny_model, smollm2_tokenizer, PROMPTS[2], tokens)
    # before temperature: log_softmax(logits), not log_softmax(logits / 1.7)
    tempered = torch.log_softmax(torch.log_softmax(raw, -1) / 1.7, dim=-1)
    for i, g in enumerate(asked):
        assert g.logprob == pytest.approx(raw[i, g.token_id].item(), abs=ATOL)
        assert abs(g.logprob - tempered[i, g.token_id].item()) > 10 * ATOL
        assert g.top_logprobs == ()  # logprobs alone: no alternatives


def test_logprobs_are_the_same_alone_and_batched_with_other_requests(runner, smollm2_tokenizer):
    alone = run_one(runner, smollm2_tokenizer, PROMPTS[1], max_new_tokens=10, top_logprobs=3)
    plain_alone = run_one(runner, smollm2_tokenizer, PROMPTS[0], max_new_tokens=10)
    (plain,), (asked,), (other,) = run(runner, smollm2_tokenizer, [
        ([PROMPTS[0]], dict(max_new_tokens=10)),
        ([PROMPTS[1]], dict(max_new_tokens=10, top_logprobs=3)),
        ([PROMPTS[2]], dict(max_new_tokens=10, logprobs=True)),
    ])
    assert [g.token_id for g in asked] == [g.token_id for g in alone]
    for a, b in zip(asked, alone):
        assert a.logprob == pytest.approx(b.logprob, abs=ATOL)
        assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert [v for _, v in a.top_logprobs] == pytest.approx([v for _, v in b.top_logprobs], abs=ATOL)
    # a batch mate that asked for nothing gets nothing, and generates what it does alone
    assert [g.token_id for g in plain] == [g.token_id for g in plain_alone]
    assert all(g.logprob is None and g.top_logprobs == () for g in plain)
    assert all(g.logprob is not None and g.top_logprobs == () for g in other)


def test_the_streams_steps_carry_the_logprobs(runner, tiny_model, smollm2_tokenizer):
    streamed = stream(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=6, top_logprobs=2)
    for prompt, generations in zip(PROMPTS, streamed):
        direct = run_one(runner, smollm2_tokenizer, prompt, max_new_tokens=6, top_logprobs=2)
        assert [g.token_id for g in generations] == [g.token_id for g in direct]
        assert [g.logprob for g in generations] == pytest.approx([g.logprob for g in direct], abs=ATOL)
        assert all(len(g.top_logprobs) == 2 for g in generations)
        assert generations[-1].finish_reason == "length"


def test_greedy_rows_stay_in_the_batched_argmax(runner, smollm2_tokenizer, monkeypatch):
    # TokenChooser.choose is the per-row path; the batched argmax never calls it.
    calls = []
    real_choose = TokenChooser.choose

    def counting_choose(self, input_ids, scores):
        calls.append(self)
        return real_choose(self, input_ids, scores)

    monkeypatch.setattr(TokenChooser, "choose", counting_choose)
    run(runner, smollm2_tokenizer, [([PROMPTS[0]], dict(max_new_tokens=8)),
                                        ([PROMPTS[1]], dict(max_new_tokens=8, top_logprobs=4))])
    assert calls == []
    # a greedy min_new_tokens bars end-of-sequence ids within the batched argmax
    run(runner, smollm2_tokenizer, [([PROMPTS[0]], dict(max_new_tokens=8)),
                                        ([PROMPTS[1]], dict(max_new_tokens=8, min_new_tokens=3))])
    assert calls == []
    # beside another processor (a penalty that stays) the row takes its own path each step
    run(runner, smollm2_tokenizer, [([PROMPTS[0]], dict(max_new_tokens=8)),
                                        ([PROMPTS[1]], dict(max_new_tokens=8, min_new_tokens=3,
                                                            repetition_penalty=1.1))])
    assert len(calls) == 8


def test_token_logprobs_leaves_rows_that_did_not_ask_alone():
    logits = torch.tensor([[1.0, 2.0, 3.0], [0.5, 0.1, 0.2], [3.0, 2.0, 1.0]])
    details = token_logprobs([TokenChooser(), TokenChooser(top_logprobs=2), TokenChooser()],
                             logits, [2, 0, 0])
    assert details[0] is None and details[2] is None
    expected = torch.log_softmax(logits[1], -1)
    assert details[1].logprob == pytest.approx(expected[0].item())
    assert [t for t, _ in details[1].top] == [0, 2]
    assert token_logprobs([TokenChooser()], logits[:1], [2]) == [None]


@pytest.mark.parametrize("parameters, name", [
    ({"top_logprobs": MAX_TOP_LOGPROBS + 1}, "top_logprobs"),
    ({"top_logprobs": -1}, "top_logprobs"),
    ({"top_logprobs": 2.5}, "top_logprobs"),
    ({"min_new_tokens": -1}, "min_new_tokens"),
])
def test_nonsense_values_are_refused_before_generating(tiny_model, smollm2_tokenizer, parameters, name):
    generator = StreamingUtils.get_stream_generator("Accelerate")
    with pytest.raises(ValueError, match=name):
        generator(tiny_model, smollm2_tokenizer, ["hi"], max_new_tokens=2, **parameters)


def test_the_largest_top_logprobs_is_accepted(runner, smollm2_tokenizer):
    (g,) = run_one(runner, smollm2_tokenizer, PROMPTS[0], max_new_tokens=1,
                   top_logprobs=MAX_TOP_LOGPROBS)
    assert len(g.top_logprobs) == MAX_TOP_LOGPROBS
    assert sampling.MAX_TOP_LOGPROBS == 20


# -- special tokens ----------------------------------------------------------------------------


def test_eos_is_special_adds_no_text_and_ends_the_sequence(runner, tiny_model, smollm2_tokenizer):
    with LogitBias(tiny_model, token_id=EOS, bias=5.0):
        generations = run_one(runner, smollm2_tokenizer, PROMPTS[1], max_new_tokens=8,
                              top_logprobs=2)
    (g,) = generations
    assert (g.token_id, g.text, g.special, g.finish_reason) == (EOS, "", True, "eos")
    assert g.top_logprobs[0] == (EOS, g.logprob)  # the bias made it the most likely
    assert g.logprob > g.top_logprobs[1][1] + 3


def test_a_special_token_that_is_not_eos_is_marked_and_adds_no_text(
        runner, tiny_model, smollm2_tokenizer):
    im_start = smollm2_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert im_start in special_token_ids(smollm2_tokenizer) and im_start != EOS
    with LogitBias(tiny_model, token_id=im_start, bias=5.0):
        generations = run_one(runner, smollm2_tokenizer, PROMPTS[0], max_new_tokens=4)
    assert [g.token_id for g in generations] == [im_start] * 4
    assert all(g.special and g.text == "" for g in generations)
    assert generations[-1].finish_reason == "length"


def test_special_token_ids_include_every_added_special_token(smollm2_tokenizer):
    ids = special_token_ids(smollm2_tokenizer)
    assert set(smollm2_tokenizer.all_special_ids) <= ids
    flagged = {i for i, t in smollm2_tokenizer.added_tokens_decoder.items() if t.special}
    assert flagged <= ids
    assert smollm2_tokenizer.encode("Hello", add_special_tokens=False)[0] not in ids
    # the raw tokenizers.Tokenizer says the same
    assert special_token_ids(smollm2_tokenizer.backend_tokenizer) >= flagged


# -- min_new_tokens ----------------------------------------------------------------------------


def test_min_new_tokens_holds_eos_back_exactly_like_transformers_generate(
        runner, tiny_model, smollm2_tokenizer):
    ids = smollm2_tokenizer(PROMPTS[1], return_tensors="pt")
    with LogitBias(tiny_model, token_id=EOS, bias=5.0):
        reference = tiny_model.generate(**ids, max_new_tokens=20, min_new_tokens=5, do_sample=False,
                                        eos_token_id=EOS, pad_token_id=EOS)[0, ids["input_ids"].shape[1]:]
        generations = run_one(runner, smollm2_tokenizer, PROMPTS[1], max_new_tokens=20,
                              min_new_tokens=5)
        without = run_one(runner, smollm2_tokenizer, PROMPTS[1], max_new_tokens=20)
    assert [g.token_id for g in without] == [EOS]  # eos is what the biased model wants
    assert reference.tolist()[-1] == EOS and len(reference) == 6
    assert [g.token_id for g in generations] == reference.tolist()
    assert [g.finish_reason for g in generations] == [None] * 5 + ["eos"]
    assert not any(g.special for g in generations[:5]) and generations[5].special


def test_min_new_tokens_counts_from_each_prompts_own_length_in_a_batch_of_several_lengths(
        tiny_model, smollm2_tokenizer):
    lengths = [len(ids) for ids in encode_prompts(smollm2_tokenizer, PROMPTS)]
    assert len(set(lengths)) == len(lengths)  # every prompt has its own length
    with LogitBias(tiny_model, token_id=EOS, bias=5.0):
        streamed = stream(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=20, min_new_tokens=4)
    for generations in streamed:
        assert len(generations) == 5
        assert EOS not in [g.token_id for g in generations[:4]]
        assert generations[-1].token_id == EOS and generations[-1].finish_reason == "eos"


def test_max_new_tokens_still_ends_a_sequence_below_min_new_tokens(
        runner, tiny_model, smollm2_tokenizer):
    with LogitBias(tiny_model, token_id=EOS, bias=5.0):
        generations = run_one(runner, smollm2_tokenizer, PROMPTS[0], max_new_tokens=3,
                              min_new_tokens=10)
    assert len(generations) == 3 and EOS not in [g.token_id for g in generations]
    assert generations[-1].finish_reason == "length"


def test_greedy_rows_barring_eos_choose_in_the_batch_what_the_processor_chooses():
    """Rows whose only processor is a pending min_new_tokens take the batched argmax with
    their end-of-sequence ids barred: each row's token is the one transformers'
    processor gives it, beside plain greedy, penalised and sampled rows."""
    torch.manual_seed(0)
    logits = torch.randn(6, 50)
    logits[:, 7] = 10.0  # eos (7) is every row's argmax
    logits[4, 9] = 11.0  # except here: a barred row whose best token is not eos
    eos = {7}
    choosers = [
        TokenChooser(),
        TokenChooser(min_new_tokens=3, eos_token_ids=eos, prompt_length=2),
        TokenChooser(min_new_tokens=3, eos_token_ids={7, 8}, prompt_length=1),
        TokenChooser(min_new_tokens=3, eos_token_ids=eos, prompt_length=2, repetition_penalty=1.3),
        TokenChooser(min_new_tokens=3, eos_token_ids=eos, prompt_length=2),
        TokenChooser(min_new_tokens=3, eos_token_ids={7, 500}, prompt_length=2),  # 500: no such id
    ]
    all_ids = [[1, 2], [1, 2], [1], [1, 2], [1, 2], [1, 2]]
    assert [c.barred_ids for c in choosers] == [(), (7,), (7, 8), (), (7,), (7, 500)]
    before = logits.clone()
    tokens, failures = sampling.choose_next_tokens(choosers, logits, all_ids)
    assert failures == {} and torch.equal(logits, before)  # raw logits kept for logprobs
    one_by_one = [c.choose(torch.tensor([ids]), logits[row:row + 1])
                  for row, (c, ids) in enumerate(zip(choosers, all_ids))]
    assert tokens == one_by_one
    assert tokens[0] == 7 and tokens[4] == 9 and 7 not in tokens[1:]
    assert tokens[2] != 8


def test_a_row_that_may_end_again_leaves_the_barred_rows():
    chooser = TokenChooser(min_new_tokens=2, eos_token_ids={7}, prompt_length=1)
    logits = torch.zeros(1, 10)
    logits[0, 7] = 1.0
    assert sampling.choose_next_tokens([chooser], logits, [[1]])[0] == [0]
    chooser.note_generated(1)
    assert sampling.choose_next_tokens([chooser], logits, [[1, 0]])[0] == [0]
    chooser.note_generated(2)
    assert chooser.barred_ids == () and chooser.is_greedy
    assert sampling.choose_next_tokens([chooser], logits, [[1, 0, 0]])[0] == [7]
    sampled = TokenChooser(min_new_tokens=2, eos_token_ids={7}, do_sample=True, manual_seed=1)
    assert sampled.barred_ids == ()  # a draw keeps its own processors


# -- sampling rows drawn together ---------------------------------------------------------------

WARPINGS = [dict(temperature=0.7, top_p=0.9), dict(top_k=5), dict()]


def test_sampling_rows_with_the_same_warpers_draw_what_each_would_draw_alone():
    """Rows of one warping go through the warpers stacked; each row's token is the one
    it draws alone with the same seed, whichever rows it shares the batch with."""
    torch.manual_seed(0)
    logits = torch.randn(7, 300) * 3
    rows = [dict(WARPINGS[i % 3], do_sample=True, manual_seed=10 + i) for i in range(6)]
    rows.append(dict(do_sample=True, manual_seed=99, repetition_penalty=1.3))  # on its own
    choosers = [TokenChooser(**r) for r in rows]
    assert len({c.warping for c in choosers[:6]}) == 3 and choosers[6].warping is None
    tokens, failures = [], {}
    for _ in range(5):  # five steps: each row's generator moves on as it would alone
        step, failed = sampling.choose_next_tokens(choosers, logits, [[1, 2]] * 7)
        tokens.append(step)
        failures.update(failed)
    assert failures == {}
    for row, kwargs in enumerate(rows):
        alone = TokenChooser(**kwargs)
        drawn = [alone.choose(torch.tensor([[1, 2]]), logits[row:row + 1]) for _ in range(5)]
        assert [step[row] for step in tokens] == drawn, row
    # and the stacked warpers are those of each row alone, to the bit
    stacked = choosers[0].processors(None, logits[[0, 3]].clone())
    for i, row in enumerate((0, 3)):
        assert torch.equal(stacked[i], choosers[row].processors(None, logits[row:row + 1].clone())[0])


def test_a_draw_follows_the_distribution_and_never_takes_a_barred_token():
    chooser = TokenChooser(do_sample=True, top_k=3, manual_seed=5)
    logits = torch.log(torch.tensor([[0.05, 0.15, 0.3, 0.5]]))  # top_k=3 bars token 0
    draws = torch.tensor([sampling.choose_next_tokens([chooser], logits, [[]])[0][0]
                          for _ in range(4000)])
    counts = torch.bincount(draws, minlength=4).tolist()
    assert counts[0] == 0
    expected = [0, 0.15 / 0.95, 0.3 / 0.95, 0.5 / 0.95]
    for token in (1, 2, 3):  # within 4 standard deviations of a seeded draw's count
        sd = (4000 * expected[token] * (1 - expected[token])) ** 0.5
        assert abs(counts[token] - 4000 * expected[token]) < 4 * sd, (token, counts)


def test_an_overflowing_row_fails_alone_among_rows_of_its_warping():
    logits = torch.tensor([[0.5, 2.0, 1.0], [3.0, 1.0, 0.0]])
    choosers = [TokenChooser(do_sample=True, temperature=1e-40, manual_seed=1),
                TokenChooser(do_sample=True, temperature=1e-40, manual_seed=2)]
    logits[1] = torch.tensor([0.0, 0.0, 0.0])  # all equal: divided, still finite
    tokens, failures = sampling.choose_next_tokens(choosers, logits, [[], []])
    assert list(failures) == [0] and isinstance(failures[0], sampling.UnusableScores)
    assert tokens[1] in (0, 1, 2)


# -- ignore_eos --------------------------------------------------------------------------------


def test_ignore_eos_runs_to_max_new_tokens(tiny_model, smollm2_tokenizer):
    with LogitBias(tiny_model, token_id=EOS, bias=5.0):
        streamed = stream(tiny_model, smollm2_tokenizer, PROMPTS[:2], max_new_tokens=7,
                          ignore_eos=True)
    for generations in streamed:
        assert [g.token_id for g in generations] == [EOS] * 7
        assert all(g.special and g.text == "" for g in generations)
        assert [g.finish_reason for g in generations] == [None] * 6 + ["length"]


def test_ignore_eos_goes_on_as_the_model_would_and_eos_adds_no_text(
        runner, tiny_model, smollm2_tokenizer):
    prompt = PROMPTS[1]
    ids = smollm2_tokenizer(prompt, return_tensors="pt")
    # eos is the first token only: then the model goes on with its own distribution
    with LogitBias(tiny_model, token_id=EOS, bias=5.0, calls=1):
        reference = tiny_model.generate(**ids, max_new_tokens=10, do_sample=False, eos_token_id=None,
                                        pad_token_id=EOS)[0, ids["input_ids"].shape[1]:].tolist()
    with LogitBias(tiny_model, token_id=EOS, bias=5.0, calls=1):
        generations = run_one(runner, smollm2_tokenizer, prompt, max_new_tokens=10,
                              ignore_eos=True)
    with LogitBias(tiny_model, token_id=EOS, bias=5.0, calls=1):
        stopped = run_one(runner, smollm2_tokenizer, prompt, max_new_tokens=10)
    assert reference[0] == EOS and EOS not in reference[1:]
    assert [g.token_id for g in generations] == reference
    assert generations[0].special and generations[0].text == ""
    text = "".join(g.text for g in generations)
    assert text and text == smollm2_tokenizer.decode(reference[1:], skip_special_tokens=True)
    assert generations[-1].finish_reason == "length"
    assert [(g.token_id, g.finish_reason) for g in stopped] == [(EOS, "eos")]


def test_ignore_eos_with_a_stop_string_still_stops(runner, smollm2_tokenizer):
    full = "".join(g.text for g in run_one(runner, smollm2_tokenizer, PROMPTS[1],
                                           max_new_tokens=20, ignore_eos=True))
    stop = full[5:9]
    generations = run_one(runner, smollm2_tokenizer, PROMPTS[1], max_new_tokens=20,
                          ignore_eos=True, stop=[stop])
    assert "".join(g.text for g in generations) == full[: full.index(stop)]
    assert generations[-1].finish_reason == "stop"

"""Padding a decode step's products up to 16 rows (djl_stream/generation/row_padding.py).

The decision rule is tested with simulated timings (labelled as such: which row counts a
real trial pads depends on the CPU and on how busy it is, and no test here may depend on
wall-clock speed); the padded products and the decode step that uses them are real."""

from __future__ import annotations

import torch

from conftest import StepLogits, build_tiny_llama
from djl_stream.generation import llama_decode, row_padding
from djl_stream.generation.row_padding import (PADDED_ROWS, RowPaddedLinear, ShapeTrial,
                                               padding_trial, shape_key, shape_trial)

from test_llama_decode import run_continuous_batch


class CountingLinear(torch.nn.Linear):
    """An ``nn.Linear`` that records the row count of every input it multiplies."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rows_seen = []

    def forward(self, x):
        self.rows_seen.append(x.numel() // x.shape[-1])
        return super().forward(x)


def test_a_padded_product_gives_the_real_rows_what_the_16_row_product_gives_them():
    torch.manual_seed(0)
    layer = CountingLinear(24, 40)
    padded = RowPaddedLinear(layer, frozenset({5, 12}))
    with torch.no_grad():
        for shape in ((5, 24), (3, 4, 24)):  # 5 rows, and 12 rows as (3, 4)
            x = torch.randn(*shape)
            rows = x.numel() // 24
            wide = torch.cat([x.reshape(rows, 24), torch.zeros(PADDED_ROWS - rows, 24)])
            got = padded(x)
            assert layer.rows_seen[-1] == PADDED_ROWS
            assert got.shape == (*shape[:-1], 40)
            assert torch.equal(got.reshape(rows, 40), layer(wide)[:rows])
        x = torch.randn(7, 24)  # a count not padded: the layer's own call
        assert torch.equal(padded(x), layer(x)) and layer.rows_seen[-2:] == [7, 7]


# -- the rule, on simulated timings ----------------------------------------------------

def simulated(seconds_by_rows):
    """A ``time_call`` that answers from a table (simulated timings, not measured), and
    the row counts it was asked for."""
    asked = []

    def time_call(layer, rows):
        asked.append(rows)
        return seconds_by_rows[rows]
    return time_call, asked


def test_10_to_15_rows_are_padded_where_15_rows_cost_far_more_than_16():
    # SmolLM2's LM head on the Xeon (ms, as in the module docstring)
    time_call, asked = simulated({16: 6.4, 15: 14.2})
    trial = shape_trial(torch.nn.Linear(8, 8), torch.float32, time_call=time_call)
    assert trial.padded == frozenset(range(10, 16))
    assert asked == [16, 15] * row_padding.ROUNDS  # in turns
    assert str(trial) == "8x8: 10-15 rows padded (15 rows 14200.0 ms, 16 rows 6400.0 ms)"


def test_nothing_is_padded_where_15_rows_cost_about_what_16_do():
    time_call, _ = simulated({16: 1.0, 15: 1.2})
    trial = shape_trial(torch.nn.Linear(8, 8), torch.float32, time_call=time_call)
    assert trial.padded == frozenset()
    assert str(trial).endswith("not padded")


def test_the_fastest_of_each_count_s_timings_are_compared():
    # simulated: the first 16-row timing slow (a machine just done loading), the next fast
    timings = iter([9.0, 10.0, 5.0, 10.0, 5.0, 11.0])
    trial = shape_trial(torch.nn.Linear(8, 8), torch.float32,
                        time_call=lambda layer, rows: next(timings))
    assert trial.seconds == {16: 5.0, 15: 10.0} and trial.padded == frozenset(range(10, 16))


def test_one_layer_of_each_large_shape_is_tried(monkeypatch):
    monkeypatch.setattr(row_padding, "MIN_WEIGHT_BYTES", 64 * 64 * 4)
    small, big, big_too, other = (torch.nn.Linear(32, 32), torch.nn.Linear(64, 64),
                                  torch.nn.Linear(64, 64), torch.nn.Linear(64, 128))
    tried = []

    def time_call(layer, rows):  # simulated: every count pays
        tried.append(layer)
        return 1.0 if rows == PADDED_ROWS else 2.0
    trials = padding_trial([small, big, big_too, other], torch.float32, time_call=time_call)
    assert set(trials) == {shape_key(big), shape_key(other)}
    assert {id(layer) for layer in tried} == {id(big), id(other)}
    assert all(trial.padded == frozenset(range(10, 16)) for trial in trials.values())


def test_a_real_trial_times_a_large_layer_at_16_rows_and_below():
    # SmolLM2's LM head shape with random weights: what is padded is this machine's
    # business; that it is timed, and reported, is this test's
    layer = torch.nn.Linear(576, 49152, bias=False)
    (trial,) = padding_trial([layer], torch.float32).values()
    assert trial.shape == (49152, 576)
    assert set(trial.seconds) == {PADDED_ROWS, 15} and all(s > 0 for s in trial.seconds.values())
    assert trial.padded in (frozenset(), frozenset(range(10, 16)))


# -- the decode step with padded products ---------------------------------------------

def pad_everything(monkeypatch):
    """Make the trial pad every row count of every product (simulated: a tiny model's
    layers are below the size a real trial tries)."""
    def trial(layers, dtype, time_call=None):
        return {shape_key(layer): ShapeTrial((layer.out_features, layer.in_features),
                                             {PADDED_ROWS: 1.0, 15: 2.0},
                                             frozenset(range(1, PADDED_ROWS)))
                for layer in layers}
    monkeypatch.setattr(llama_decode, "padding_trial", trial)


def test_the_step_with_padded_products_gives_the_forward_s_tokens_and_logits(
        smollm2_tokenizer, monkeypatch):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    head_rows = []
    model.lm_head.register_forward_hook(
        lambda module, args, output: head_rows.append(args[0].numel() // args[0].shape[-1]))
    forward_logits = []
    expected_tokens, _ = run_continuous_batch(model, smollm2_tokenizer, forward_logits)

    pad_everything(monkeypatch)
    step = llama_decode.attach(model, smollm2_tokenizer)
    assert isinstance(step.lm_head, RowPaddedLinear)
    assert all(isinstance(layer[name], RowPaddedLinear) for layer in step.layers
               for name in ("q", "k", "v", "o", "gate", "up", "down"))
    step_logits = StepLogits(model, monkeypatch)
    head_rows.clear()
    tokens, _ = run_continuous_batch(model, smollm2_tokenizer)

    assert tokens == expected_tokens
    # the decode steps' LM head products ran at 16 rows (the prefills' are the forward's)
    assert head_rows.count(PADDED_ROWS) == len(step_logits.seen) > 0
    decode_forward = [logits for i, logits in enumerate(forward_logits) if i not in (0, 6)]
    for theirs, ours in zip(decode_forward, step_logits.seen, strict=True):
        assert ours.shape == theirs.shape
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_tiny_model_is_not_tried(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    step = llama_decode.attach(model, smollm2_tokenizer)
    assert not isinstance(step.lm_head, RowPaddedLinear)
    assert not any(isinstance(value, RowPaddedLinear) for layer in step.layers
                   for value in layer.values())


class BatchMeanLinear(torch.nn.Linear):
    """A product whose rows depend on their batch mates (each output less the batch's mean
    row: what activations quantized per tensor would do, more plainly)."""

    def forward(self, x):
        out = super().forward(x)
        return out - out.mean(0, keepdim=True)


def test_a_shape_whose_padded_rows_differ_is_not_padded():
    time_call, _ = simulated({16: 1.0, 15: 3.0})  # simulated: padding would pay
    faithful = shape_trial(torch.nn.Linear(8, 8), torch.float32, time_call=time_call)
    assert faithful.padded == frozenset(range(10, 16))
    unfaithful = shape_trial(BatchMeanLinear(8, 8), torch.float32, time_call=time_call)
    assert unfaithful.padded == frozenset() and str(unfaithful).endswith("not padded")


def test_a_trial_that_fails_leaves_the_step_unpadded_and_attached(smollm2_tokenizer, monkeypatch,
                                                                  caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)

    def failing(layers, dtype, time_call=None):
        raise RuntimeError("no timing here")
    monkeypatch.setattr(llama_decode, "padding_trial", failing)
    step = llama_decode.attach(model, smollm2_tokenizer)
    assert step is not None and llama_decode.step_of(model) is step
    assert not isinstance(step.lm_head, RowPaddedLinear)
    assert "timing the decode step's products failed (RuntimeError: no timing here)" in caplog.text

"""The stall bound on prefill passes (``option.prefill_stall_steps``): a pass while requests
decode takes at most that many of their decode steps, as timed.

Timing is simulated: a clock that only the test (or, through the scheduler, a forward
hook) advances, by a cost model of the shape a CPU shows (a fixed cost per pass, the
weights, plus a cost per token), so nothing here depends on the machine's speed.
"""

from __future__ import annotations

import math

import pytest

from djl_stream.generation.prefill_pacing import PrefillPacer, budget_tokens, prefill_columns

STEP = 0.060          # a decode step of the running batch, seconds
FIXED = 0.055         # what any pass costs: the weights, streamed once
PER_TOKEN = 0.004     # each prompt token of a pass, with nothing cached


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def run_pass(pacer, clock, rows, columns, cached, parity=math.inf):
    with pacer.prefill_pass(rows, columns, cached):
        clock.now += FIXED + PER_TOKEN * budget_tokens(rows, columns, cached, parity)


def run_step(pacer, clock, seconds=STEP):
    with pacer.decode_step():
        clock.now += seconds


def test_nothing_measured_yet_the_token_budget_sizes_the_pass():
    pacer = PrefillPacer(1.5, math.inf, clock=Clock())
    assert pacer.columns(budget=32, rows=1, cached=0) == 32
    assert pacer.columns(budget=32, rows=4, cached=0) == 8


def test_passes_narrow_until_each_takes_the_bound_give_or_take_a_column():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    bound = 1.5 * STEP                       # 90 ms: FIXED + 8.75 tokens
    widths, costs = [], []
    for _ in range(30):
        run_step(pacer, clock)
        width = pacer.columns(budget=32, rows=1, cached=0)
        start = clock.now
        run_pass(pacer, clock, 1, width, 0)
        widths.append(width)
        costs.append(clock.now - start)
    assert widths[0] == 32 and costs[0] > 2 * bound   # the budget alone: 183 ms
    assert widths == sorted(widths, reverse=True), widths   # never wider again
    assert all(cost <= bound + PER_TOKEN for cost in costs[12:]), costs
    assert widths[-1] == 9, widths            # within the bound give or take a column


def test_a_single_column_costing_over_half_the_bound_still_widens():
    # deep in a prompt one column costs much of the bound (the weights, attention over
    # the cache); floored, 1.6 columns' worth would keep every pass at one
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock)
    with pacer.prefill_pass(1, 1, 0):
        clock.now += 0.055                   # 1 column: 55 of the 90 ms
    assert pacer.columns(budget=32, rows=1, cached=0) == 2


def pacer_after_two_widths():
    """A pacer that timed a decode step, then passes of 32 columns (183 ms) and of 1 (59)."""
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock)
    run_pass(pacer, clock, 1, 32, 0)
    run_pass(pacer, clock, 1, 1, 0)
    return pacer


def test_a_narrow_pass_does_not_make_the_next_prompt_crawl():
    # A last column alone (or a deep one) costs about the fixed part; a cost per token
    # taken from it made the next short prompt start at 3 columns (then 5, 9, ...).
    pacer = pacer_after_two_widths()
    assert pacer.pass_cost.fixed_seconds == pytest.approx(FIXED)
    assert pacer.columns(budget=32, rows=1, cached=0) == 9   # (90 - 55) / 4 ms


def test_a_fixed_part_twice_the_bound_gets_the_bound_for_its_columns():
    # int8 weights on a CPU: a compiled step of 10 ms, an eager prefill pass of 92 ms
    # before its first token (every weight turned into floats). No width keeps a pass
    # within 15 ms; one column a pass would read a 44-token prompt in 44 such passes.
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, 0.010)
    for columns in (44, 4):
        with pacer.prefill_pass(1, columns, 0):
            clock.now += 0.092 + 0.003 * columns
    assert pacer.pass_cost.fixed_seconds == pytest.approx(0.092)
    assert pacer.columns(budget=64, rows=1, cached=0) == 5    # 15 ms / 3 ms


def test_a_fixed_part_under_twice_the_bound_keeps_the_bound():
    # the float32 defaults' case: a fixed part about the bound; the bound on top of it
    # made a running stream's worst gap beside a 4,000-token prompt 5.5-9.2 decode steps
    # (the reliability target is 4)
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, 0.020)             # a bound of 30 ms
    for columns in (44, 4):
        with pacer.prefill_pass(1, columns, 0):
            clock.now += 0.045 + 0.003 * columns
    assert pacer.columns(budget=64, rows=1, cached=0) == 1


def test_beside_a_step_a_share_twice_the_bound_gets_the_bound_too():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, 0.010)
    for columns in (44, 4):                   # the step, then an eager pass's 82 ms more
        with pacer.mixed_pass(1, columns, 0):
            clock.now += 0.010 + 0.082 + 0.003 * columns
    assert pacer.shared_cost.fixed_seconds == pytest.approx(0.082)
    assert pacer.columns(budget=64, rows=1, cached=0, beside_step=True) == 5
    # a share within the bound keeps the pass within it, as before
    for _ in range(8):
        run_step(pacer, clock, 0.080)         # the bound is now 120 ms
    assert pacer.columns(budget=64, rows=1, cached=0, beside_step=True) == 13  # 38 / 3, rounded


# -- a short prompt beside running streams (STRETCHED_PASS) --------------------------------
#
# The float32 defaults on the 2-core AMD EPYC: a compiled step of 26 ms (a bound of 39), a
# mixed pass over the eager step some 60 ms more whatever its width, 2 ms a column.
EPYC_STEP, EPYC_SHARE, EPYC_COLUMN = 0.026, 0.060, 0.002


def epyc_mixed(pacer, clock, columns):
    with pacer.mixed_pass(1, columns, 0):
        clock.now += EPYC_STEP + EPYC_SHARE + EPYC_COLUMN * columns


def epyc_pacer():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, EPYC_STEP)
    for columns in (8, 2):
        epyc_mixed(pacer, clock, columns)
    assert pacer.shared_cost.fixed_seconds == pytest.approx(EPYC_SHARE)
    return pacer


def beside_one_stream(pacer, cached, prompt_length=None):
    """Columns of a one-row chunk (64-token budget) in a mixed pass beside the stream."""
    return pacer.columns(budget=64, rows=1, cached=cached, beside_step=True,
                         prompt_length=prompt_length)


def test_a_short_prompt_stretches_its_passes_to_half_again_their_fixed_part():
    # within the bound no width fits (60 ms > 39): one column a pass, a chat prompt of
    # 38 tokens in 38 passes; stretched to 90 ms a pass, 15 columns, in 3
    pacer = epyc_pacer()
    assert beside_one_stream(pacer, 0) == 1
    assert beside_one_stream(pacer, 0, 38) == 15
    # the rest of it, from where the first pass left it
    assert beside_one_stream(pacer, 15, 38) == 15


def test_a_long_prompt_keeps_the_bound():
    # more than SHORT_PROMPT_PASSES stretched passes' worth (8 x 15 columns)
    pacer = epyc_pacer()
    assert beside_one_stream(pacer, 0, 121) == 1
    assert beside_one_stream(pacer, 2000, 4056) == 1


def test_a_fixed_part_within_two_thirds_of_the_bound_is_not_stretched():
    # the Xeon's shape: 55 ms of a 90 ms bound; stretched it would be 82.5 ms, less
    pacer = pacer_after_two_widths()
    assert pacer.columns(budget=32, rows=1, cached=0, prompt_length=20) == 9


def test_one_width_seen_a_short_prompt_tries_a_wider_pass():
    # After a long prompt read one column a pass, every pass the fit remembers had one
    # width, and no fixed part can be told from it: the stretched pass takes all of a
    # column's cost as fixed, and reads 2 columns; the fit then has the two widths it
    # needs.
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, EPYC_STEP)
    for _ in range(20):
        epyc_mixed(pacer, clock, 1)
    assert pacer.shared_cost.one_size
    assert beside_one_stream(pacer, 0, 38) == 2
    assert beside_one_stream(pacer, 0, 4056) == 1      # no: a long prompt keeps the bound
    epyc_mixed(pacer, clock, 2)
    assert not pacer.shared_cost.one_size
    assert beside_one_stream(pacer, 0, 38) == 15


def test_the_bound_scales_with_the_running_batchs_step():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, STEP)
    run_pass(pacer, clock, 1, 32, 0)
    alone = pacer.columns(budget=256, rows=1, cached=0)
    for _ in range(6):                       # a full batch steps four times as long
        run_step(pacer, clock, 4 * STEP)
    run_pass(pacer, clock, 1, alone, 0)
    assert pacer.columns(budget=256, rows=1, cached=0) > 3 * alone


def test_deep_into_a_prompt_the_same_bound_affords_fewer_columns():
    clock = Clock()
    pacer = PrefillPacer(2.0, 3000.0, clock=clock)
    run_step(pacer, clock)
    run_pass(pacer, clock, 1, 32, 0, parity=3000.0)
    shallow = pacer.columns(budget=32, rows=1, cached=0)
    deep = pacer.columns(budget=32, rows=1, cached=4000)
    assert deep == prefill_columns(shallow, 1, 4000, 3000.0) < shallow


def test_the_bound_never_widens_a_pass_beyond_the_budget():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, 10.0)              # a slow step would afford hundreds of tokens
    run_pass(pacer, clock, 1, 16, 0)
    assert pacer.columns(budget=16, rows=1, cached=0) == 16


@pytest.mark.parametrize("stall_steps", [0, 0.0, None])
def test_a_stall_bound_of_zero_leaves_the_budget_alone(stall_steps):
    clock = Clock()
    pacer = PrefillPacer(stall_steps, math.inf, clock=clock)
    run_step(pacer, clock)
    run_pass(pacer, clock, 1, 32, 0)
    assert pacer.columns(budget=32, rows=1, cached=0) == 32


def test_a_pass_is_timed_after_the_device_has_done_its_work():
    clock = Clock()
    synchronized = []

    def synchronize():                       # the kernels finish here, not at the call
        synchronized.append(clock.now)
        clock.now += 0.5

    pacer = PrefillPacer(1.5, math.inf, clock=clock, synchronize=synchronize)
    run_step(pacer, clock, 1.0)              # a bound of 1.5 s
    start = clock.now
    with pacer.prefill_pass(1, 10, 0):
        clock.now += 0.01                     # the launch returns at once
    assert synchronized == [start + 0.01]
    assert pacer.seconds_per_token == pytest.approx(0.051)


def test_a_pass_that_raises_teaches_nothing():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock)
    with pytest.raises(RuntimeError):
        with pacer.prefill_pass(1, 10, 0):
            clock.now += 5.0
            raise RuntimeError("the model failed")
    assert pacer.seconds_per_token is None


# -- a chunk beside the running batch's step (a mixed pass) --------------------------------

def run_mixed(pacer, clock, rows, columns, cached, step=STEP, parity=math.inf):
    """A mixed pass: the running batch's step, plus each token of the chunk (the weights
    are read once, for both)."""
    with pacer.mixed_pass(rows, columns, cached):
        clock.now += step + PER_TOKEN * budget_tokens(rows, columns, cached, parity)


def test_beside_a_step_a_chunk_skips_the_weights_fixed_cost():
    pacer = pacer_after_two_widths()
    # alone: (90 ms bound - 55 fixed) / 4 ms; beside a step the streams wait for one pass,
    # the chunk adds its tokens only: 90 / 4 ms
    assert pacer.columns(budget=64, rows=1, cached=0) == 9
    assert pacer.columns(budget=64, rows=1, cached=0, beside_step=True) == 22
    assert pacer.columns(budget=16, rows=1, cached=0, beside_step=True) == 16  # the budget


def test_once_mixed_passes_are_timed_their_share_sizes_the_chunk():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock)
    # nothing timed but the step: the budget
    assert pacer.columns(budget=64, rows=1, cached=0, beside_step=True) == 64
    run_mixed(pacer, clock, 1, 64, 0)           # 60 ms step + 256 ms of chunk
    assert pacer.shared_cost.seconds_per_token == pytest.approx(PER_TOKEN)
    assert pacer.columns(budget=64, rows=1, cached=0, beside_step=True) == 22
    assert pacer.pass_cost.observed is False   # a mixed pass is not a prefill pass


def test_a_mixed_pass_faster_than_the_average_step_leaves_the_budget():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    run_step(pacer, clock, 1.0)               # one slow step (a hiccup)
    run_mixed(pacer, clock, 1, 8, 0, step=0.0)   # the chunk's share reads as nothing
    assert pacer.columns(budget=32, rows=1, cached=0, beside_step=True) == 32


def test_a_step_left_uncounted_is_not_the_running_batch_s_step():
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    with pacer.decode_step() as timing:     # a compiled one-row step: 20 ms
        clock.now += 0.020
        timing.counted = False
    # nothing counted: no bound, the budget (the fast step does not make every mixed
    # pass, which runs the eager step, look like a stall)
    assert pacer.step_seconds is None and pacer.bound_seconds is None
    run_mixed(pacer, clock, 1, 8, 0)
    assert pacer.shared_cost.observed is False
    assert pacer.columns(budget=64, rows=1, cached=0, beside_step=True) == 64
    run_step(pacer, clock)                  # an eager step of the batch counts again
    assert pacer.step_seconds == pytest.approx(STEP)


def test_a_batch_that_outgrew_the_last_step_timed_alone_has_its_next_step_timed():
    # While prompts keep arriving every step is a mixed pass, and the step on record was
    # the first stream's: a one-row step of 31 ms, where 15 rows took 80 (unpacked SmolLM2,
    # Intel Xeon). Sized by it, a late prompt was read 1 to 7 columns a pass.
    clock = Clock()
    pacer = PrefillPacer(1.5, math.inf, clock=clock)
    for _ in range(5):
        with pacer.decode_step(1):
            clock.now += 0.031
    assert not pacer.step_outdated(1) and not pacer.step_outdated(1)
    assert pacer.step_outdated(2) and pacer.step_outdated(15)  # more than 1.5x the rows
    with pacer.decode_step(15):                                # timed alone, once
        clock.now += 0.080
    # the step of 15 rows is the step now, not the median with the one-row steps (31 ms)
    assert pacer.step_seconds == pytest.approx(0.080)
    assert pacer.bound_seconds == pytest.approx(1.5 * 0.080)
    assert not pacer.step_outdated(15) and not pacer.step_outdated(22)
    assert pacer.step_outdated(23)
    with pacer.decode_step(14):                                # a request left: similar
        clock.now += 0.078
    assert pacer.step_seconds == pytest.approx(0.079)
    # with the bound off, a step is never outdated (nothing sizes passes by it)
    off = PrefillPacer(0, math.inf, clock=clock)
    with off.decode_step(1):
        clock.now += 0.031
    assert not off.step_outdated(15)

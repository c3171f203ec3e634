"""The bursts a GPU load runs before the server says it is ready
(djl_stream.generation.burst_warm_up): what they send through the real stream generator and
scheduler, on the tiny random Llama on the CPU (the kernels they exist to load are CUDA's;
on a GPU machine, `benchmarks.cycle_trace` shows what they save: BENCHMARKS.md's GPU
section)."""

from __future__ import annotations

import threading
import time

import torch

from djl_stream import StreamingUtils
from djl_stream.generation.burst_warm_up import (HELD_TOKENS, NEW_TOKENS, PROMPT_WORDS,
                                                 burst_sizes, warm_up_bursts,
                                                 warm_up_prompts)
from djl_stream.generation.scheduler import (FINISHED, SchedulerObserver, add_observer,
                                             remove_observer)


class Recorder(SchedulerObserver):
    def __init__(self):
        self.lock = threading.Lock()
        self.rows, self.submitted, self.ended = [], [], []

    def request_submitted(self, stats):
        with self.lock:
            self.submitted.append(stats.prompts)

    def request_ended(self, stats):
        with self.lock:
            self.ended.append(stats)

    def batch_changed(self, state):
        with self.lock:
            self.rows.append(state.running_rows)


def test_each_burst_is_a_first_prompt_the_rest_beside_it_and_a_late_one(tiny_model,
                                                                      smollm2_tokenizer):
    generate = StreamingUtils.get_stream_generator("Accelerate")
    recorder = Recorder()
    add_observer(recorder)
    try:
        warm_up_bursts(generate, tiny_model, smollm2_tokenizer, (1, 3))
        deadline = time.monotonic() + 10  # the idle state is told after the last token
        while recorder.rows[-1] != 0 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        remove_observer(recorder)
    # requests of 1 prompt, then 1 (late); of 1, 2, then 1 (late): in that order
    assert recorder.submitted == [1, 1, 1, 2, 1]
    # each late prompt decoded beside its whole burst: 2 rows, then 4
    assert 2 in recorder.rows and 4 in recorder.rows and max(recorder.rows) == 4
    # every stream was read to its end: nothing left running, every request finished
    assert recorder.rows[-1] == 0
    assert [stats.outcome for stats in recorder.ended] == [FINISHED] * 5
    assert sorted(stats.generated_tokens for stats in recorder.ended) == sorted(
        [NEW_TOKENS, NEW_TOKENS, HELD_TOKENS, HELD_TOKENS, 2 * HELD_TOKENS])


def test_prompts_come_in_several_lengths():
    lengths = [len(prompt.split()) for prompt in warm_up_prompts(len(PROMPT_WORDS))]
    assert lengths == list(PROMPT_WORDS) and len(set(lengths)) == len(lengths)


def test_only_a_gpu_runs_bursts_and_their_late_prompt_fits_the_batch():
    assert burst_sizes(torch.device("cpu"), 64) == ()
    assert burst_sizes(torch.device("cuda", 1), 16) == (1, 3, 7, 15)
    assert burst_sizes(torch.device("cuda", 0), 15) == (1, 3, 7)

"""Decode steps in recorded buckets (:mod:`djl_stream.runtime.cuda_graphs`).

No GPU runs here, so these tests record with :class:`EagerRecorder`: the same buckets,
padding rows and static inputs a CUDA graph replays, run eagerly. What they hold is that a
step in a bucket gives the eager step's logits, that padding rows touch no row a sequence
holds, and that buckets are recorded per shape and again after the cache moves. Recording
an actual CUDA graph is only exercised on a machine with a GPU
(``benchmarks/on_a_gpu.sh``)."""

from __future__ import annotations

import logging

import pytest
import torch

from djl_stream.runtime import kv_cache
from djl_stream.runtime.cuda_graphs import (RECORD_AT_USE, EagerRecorder, GraphedDecode,
                                            bucket_of)
from djl_stream.runtime.decode_program import SWITCHED
from djl_stream.runtime.runner import Feed, RunnerSettings, load_runner
from architectures import ARCHITECTURES as ALL_ARCHITECTURES, build

ARCHITECTURES = ["llama", "mistral", "gemma2"]


def _twins(kind: str, max_rows: int = 6):
    """The same model served twice: eagerly, and with recorded buckets."""
    eager_model = build(kind, dtype=torch.float32)
    bucket_model = build(kind, dtype=torch.float32)
    settings = RunnerSettings(max_rows=max_rows, max_positions=1024)
    eager, bucketed = load_runner(eager_model, settings), load_runner(bucket_model, settings)
    graphs = GraphedDecode(bucket_model, bucketed.cache, bucketed.layer_windows,
                           recorder=EagerRecorder())
    bucketed._candidate = graphs
    return eager, bucketed, graphs


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_steps_in_buckets_give_the_eager_steps_logits_and_spare_the_rows_left_out(kind, caplog):
    eager, bucketed, graphs = _twins(kind)
    prompts = [[(7 * i + j) % 90 + 3 for j in range(length)]
               for i, length in enumerate([20, 9, 33, 14])]
    handles = {}
    for runner in (eager, bucketed):
        held = [runner.reserve() for _ in prompts]
        for handle, prompt in zip(held, prompts):
            runner.run([Feed(handle, prompt)])
        handles[id(runner)] = held
    # three rows decode; the fourth keeps its cache (and its row) through every step
    left_out = handles[id(bucketed)][3]
    kept = [buffer[bucketed.cache.row_of(left_out)].clone() for buffer in bucketed.cache.keys]
    tokens = {id(runner): [p[-1] for p in prompts[:3]] for runner in (eager, bucketed)}
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        for _ in range(6):
            logits = {}
            for runner in (eager, bucketed):
                feeds = [Feed(h, [t]) for h, t in zip(handles[id(runner)][:3],
                                                       tokens[id(runner)])]
                logits[id(runner)] = runner.run(feeds)
                tokens[id(runner)] = logits[id(runner)].argmax(-1).tolist()
            torch.testing.assert_close(logits[id(bucketed)], logits[id(eager)],
                                       rtol=1e-4, atol=1e-4)
            assert tokens[id(bucketed)] == tokens[id(eager)]
    assert SWITCHED in caplog.text and bucketed.program is graphs
    assert graphs.recorded == [(4, 256)]  # 3 rows padded to 4, under 256 columns
    row = bucketed.cache.row_of(left_out)
    for before, buffer in zip(kept, bucketed.cache.keys):
        assert torch.equal(buffer[row], before)
    assert bucketed.length(left_out) == eager.length(handles[id(eager)][3]) == 14


def test_a_step_past_a_buckets_columns_records_the_next_bucket():
    eager, bucketed, graphs = _twins("llama", max_rows=2)
    prompt = [(5 * j) % 90 + 3 for j in range(252)]
    handles = [runner.reserve() for runner in (eager, bucketed)]
    token = {}
    for runner, handle in zip((eager, bucketed), handles):
        token[id(runner)] = int(runner.run([Feed(handle, prompt)])[0].argmax())
    for _ in range(8):  # positions 252 to 259: across 256
        for runner, handle in zip((eager, bucketed), handles):
            token[id(runner)] = int(runner.run([Feed(handle, [token[id(runner)]])])[0].argmax())
        assert token[id(bucketed)] == token[id(eager)]
    assert graphs.recorded == [(1, 256), (1, 512)]


def test_a_cache_that_grows_drops_the_buckets_recorded_over_its_old_buffers(monkeypatch):
    # (a GPU's cache grows its columns; a CPU's is mapped whole unless told otherwise)
    monkeypatch.setattr(kv_cache, "reserving_is_free", lambda device: False)
    model = build("llama", dtype=torch.float32)
    runner = load_runner(model, RunnerSettings(max_rows=2, max_positions=2048))
    assert runner.cache.columns == 1024
    graphs = GraphedDecode(model, runner.cache, runner.layer_windows, recorder=EagerRecorder())
    handle = runner.reserve()
    runner.run([Feed(handle, [3, 4, 5])])
    # a bucket's first two steps are left to the eager forward; the third records it
    assert [graphs.decode([6], [3]) is None for _ in range(RECORD_AT_USE)] == [True, True, False]
    assert graphs.recorded == [(1, 256)]
    runner.cache.need_columns(1500)  # (the buffers move)
    assert graphs.decode([7], [4]) is None
    assert graphs.recorded == [] and graphs._buffers is runner.cache.keys


def test_buckets_round_rows_and_columns_up_to_powers_of_two_within_the_cache():
    assert bucket_of(1, 1, most_rows=33, most_columns=8192) == (1, 256)
    assert bucket_of(5, 257, most_rows=33, most_columns=8192) == (8, 512)
    assert bucket_of(32, 4097, most_rows=33, most_columns=8192) == (32, 8192)
    assert bucket_of(33, 100, most_rows=33, most_columns=8192) == (33, 256)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="records CUDA graphs: runs on a machine with a GPU only "
                                       "(benchmarks/on_a_gpu.sh)")


@needs_cuda
@pytest.mark.parametrize("kind", ALL_ARCHITECTURES)
def test_on_a_gpu_every_architectures_decode_steps_replay_from_cuda_graphs(kind, caplog):
    eager_model = build(kind, dtype=torch.float32).to("cuda")
    graph_model = build(kind, dtype=torch.float32).to("cuda")
    settings = RunnerSettings(max_rows=4, max_positions=512)
    eager, graphed = load_runner(eager_model, settings), load_runner(graph_model, settings)
    assert graphed.path == "attention"
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime"):
        graphed.compile_decode_step()
        streams = {}
        for runner in (eager, graphed):
            handles = [runner.reserve() for _ in range(3)]
            tokens = [int(runner.run([Feed(h, [(5 * i + j) % 200 + 3 for j in range(9 + i)])])
                          [0].argmax()) for i, h in enumerate(handles)]
            produced = [tokens]
            for _ in range(6):
                logits = runner.run([Feed(h, [t]) for h, t in zip(handles, tokens)])
                tokens = logits.argmax(-1).tolist()
                produced.append(tokens)
            streams[id(runner)] = produced
    assert SWITCHED in caplog.text, caplog.text
    assert graphed.program is not None and graphed.program.recorded == [(4, 256)]
    assert streams[id(graphed)] == streams[id(eager)]

"""Decode steps replayed from CUDA graphs (``option.decode_step`` ``auto``/``compiled`` on a
GPU, :mod:`djl_stream.generation.cuda_graphs`).

What a graph records is djl-stream's Llama decode step with its rows padded up to a bucket
and its attention over a window of the cache's columns. That padded, windowed step is
checked here on a CPU, run eagerly (``CudaGraphSteps(capture=False)``): the same tokens,
logits and cache as the model's forward through rows leaving and joining, windows
changing, and padding rows that lie over rows lent to a prompt being prefilled. The
capture and replay themselves need a CUDA GPU: those tests (marked below) are skipped
without one, and ran only where the README says they did.
"""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_llama
from test_llama_decode import PROMPTS, run_continuous_batch, sequences
from djl_stream.generation import allocators, cuda_graphs, kv_cache, llama_decode
from djl_stream.generation.batch import CausalLMBatch, generate_token, prefill_chunk

NEEDS_CUDA = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="capturing and replaying CUDA graphs needs a CUDA GPU")


def leave_and_join(model, tokenizer, device, *, room_for_rows=0):
    """test_llama_decode's rows leaving and joining, long enough to cross several windows
    (40 new tokens for the first three prompts, 20 for the one that joins)."""
    return run_continuous_batch(model, tokenizer, device=device, room_for_rows=room_for_rows,
                                new_tokens=(40, 20))


def padded_steps(model, tokenizer, **options):
    """``model`` with djl-stream's step, its decode steps run padded and windowed as a
    graph records them, without capturing (what a CPU can check)."""
    step = llama_decode.attach(model, tokenizer)
    assert step is not None
    options.setdefault("capture_after", 1)  # every step through the padded step
    step.graphs = cuda_graphs.CudaGraphSteps(step, capture=False, **options)
    return step


@pytest.fixture
def small_windows(monkeypatch):
    """Windows of 16 columns, so that a short test crosses several, and rows padded to 4
    or 8 (or the cache's capacity), so that padding rows exist."""
    monkeypatch.setattr(cuda_graphs, "COLUMN_WINDOW", 16)
    monkeypatch.setattr(cuda_graphs, "ROW_BUCKETS", (4, 8))


def test_padded_windowed_steps_give_the_forward_s_tokens_and_cache_through_leaves_and_joins(
        smollm2_tokenizer, small_windows):
    reference = build_tiny_llama(len(smollm2_tokenizer), seed=7)
    expected_tokens, expected_keys = leave_and_join(reference, smollm2_tokenizer, "cpu",
                                                    room_for_rows=5)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=7)
    step = padded_steps(model, smollm2_tokenizer)
    replayed = []
    original = step.graphs.logits
    step.graphs.logits = lambda *args: replayed.append(args[0].shape[0]) or original(*args)
    tokens, keys = leave_and_join(model, smollm2_tokenizer, "cpu", room_for_rows=5)

    assert tokens == expected_tokens
    assert [len(t) for t in tokens] == [40, 4, 40, 20]
    # every decode step went through the padded step: 3 rows, 2, then 3 again
    assert set(replayed) == {2, 3} and step.last_step_replayed
    # graphs of (rows 4 or 8) x (windows of 16 columns): several windows were crossed
    assert len({key[:2] for key in step.graphs._graphs}) >= 3
    for theirs, ours in zip(expected_keys, keys):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_padding_rows_leave_free_slots_zero(smollm2_tokenizer, small_windows):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=8)
    step = padded_steps(model, smollm2_tokenizer)
    (seq,) = sequences(smollm2_tokenizer, PROMPTS[:1], 30)
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu", room_for_rows=5)
    while batch is not None:
        _, batch = generate_token(model, batch)
        if batch is not None:
            slab = batch.past_key_values._slabs[0]
            # one row in use in a cache of 6: the step ran 4 rows, 3 of them padding
            assert slab.row_capacity == 6
            assert torch.count_nonzero(slab.keys_buffer[1:]) == 0
            assert torch.count_nonzero(slab.values_buffer[1:]) == 0
    assert step.last_step_replayed and len(seq.generated_ids) == 30


def test_padding_rows_over_rows_lent_to_a_prefill_leave_its_prompt_as_written(
        smollm2_tokenizer, monkeypatch):
    # The running row's steps are padded to the cache's 4 rows: rows 1 and 2 are lent to a
    # newcomer whose prompt is written there in chunks between those steps.
    monkeypatch.setattr(cuda_graphs, "ROW_BUCKETS", (8,))
    reference = build_tiny_llama(len(smollm2_tokenizer), seed=9)

    def alone(prompt, new_tokens):
        (seq,) = sequences(smollm2_tokenizer, [prompt], new_tokens)
        batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu")
        while batch is not None:
            _, batch = generate_token(reference, batch)
        return seq.generated_ids

    model = build_tiny_llama(len(smollm2_tokenizer), seed=9)
    step = padded_steps(model, smollm2_tokenizer)
    running_seqs = sequences(smollm2_tokenizer, PROMPTS[:1], 12)
    running = CausalLMBatch.from_sequences(running_seqs, pad_token_id=2, device="cpu",
                                           room_for_rows=3, room_on_left=32)
    for _ in range(3):
        _, running = generate_token(model, running)
    late_seqs = sequences(smollm2_tokenizer, PROMPTS[1:3], 12, first_id=10)
    newcomer = CausalLMBatch.from_sequences(late_seqs, pad_token_id=2, device="cpu",
                                            host_cache=running.past_key_values)
    slab = running.past_key_values._slabs[0]
    assert slab.row_capacity == 4  # the running row and 3 reserved
    newcomer = prefill_chunk(model, newcomer, 3)
    lent = kv_cache.layers(newcomer.past_key_values)[0].keys
    assert lent.untyped_storage().data_ptr() == slab.keys_buffer.untyped_storage().data_ptr()
    for _ in range(2):  # the running row's steps, padded to 4 rows over the lent ones
        written = kv_cache.layers(newcomer.past_key_values)[0].keys.clone()
        _, running = generate_token(model, running)
        assert step.last_step_replayed
        assert torch.equal(kv_cache.layers(newcomer.past_key_values)[0].keys, written)
    newcomer = prefill_chunk(model, newcomer, 2)
    _, running = generate_token(model, running)
    _, newcomer = generate_token(model, newcomer)  # the rest of the prompt: first tokens
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.past_key_values is running.past_key_values  # joined in place
    while batch is not None:
        _, batch = generate_token(model, batch)
    for seq, prompt in zip(running_seqs + late_seqs, PROMPTS[:3]):
        assert seq.generated_ids == alone(prompt, 12)


def test_a_graph_is_made_at_its_third_step_the_ones_before_run_eagerly(smollm2_tokenizer,
                                                                       small_windows):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=15)
    step = padded_steps(model, smollm2_tokenizer, capture_after=cuda_graphs.CAPTURE_AFTER)
    assert cuda_graphs.CAPTURE_AFTER == 3
    (seq,) = sequences(smollm2_tokenizer, PROMPTS[:1], 30)  # 6 + 30 columns: 3 windows
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu")
    _, batch = generate_token(model, batch)  # the prefill
    replayed, windows = [], []
    while batch is not None:
        windows.append(cuda_graphs.column_window(batch.past_key_values._slabs[0].end + 1,
                                                 10 ** 6))
        _, batch = generate_token(model, batch)
        replayed.append(step.last_step_replayed)
    # within each window of 16 columns, the first two steps eager, the rest replayed
    for window in sorted(set(windows)):
        flags = [r for r, w in zip(replayed, windows) if w == window]
        assert flags == [False, False] + [True] * (len(flags) - 2), (window, flags)
    assert len(step.graphs) == sum(windows.count(w) >= 3 for w in set(windows)) >= 2


def test_graphs_beyond_the_limit_are_dropped_least_recently_replayed_first(
        smollm2_tokenizer, small_windows):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=10)
    step = padded_steps(model, smollm2_tokenizer, max_graphs=2)
    (seq,) = sequences(smollm2_tokenizer, PROMPTS[:1], 60)  # ~70 columns: 5 windows
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu")
    while batch is not None:
        _, batch = generate_token(model, batch)
    assert len(step.graphs) == 2 and step.graphs.stats.dropped >= 2
    # the two kept are the last two windows
    windows = sorted(key[1] for key in step.graphs._graphs)
    assert windows[1] - windows[0] == 16


def test_a_failing_graph_step_is_dropped_and_the_eager_step_serves(smollm2_tokenizer, caplog):
    reference = build_tiny_llama(len(smollm2_tokenizer), seed=11)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=11)
    step = padded_steps(model, smollm2_tokenizer)

    def broken(*args):
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing")

    step.graphs.logits = broken

    def greedy(m):
        seqs = sequences(smollm2_tokenizer, PROMPTS[:2], 8)
        batch = CausalLMBatch.from_sequences(seqs, pad_token_id=2, device="cpu")
        while batch is not None:
            _, batch = generate_token(m, batch)
        return [s.generated_ids for s in seqs]

    assert greedy(model) == greedy(reference)
    assert step.graphs is None and not step.last_step_replayed
    assert "decode steps run eagerly from now on" in caplog.text


def test_without_a_gpu_decode_steps_are_not_replayed(tiny_model_dir):
    from djl_stream.generation.loading import load_model_and_tokenizer
    from djl_stream.serving.properties import ModelProperties

    model, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled"}
        if torch.cuda.is_available() else {"model_dir": str(tiny_model_dir)}))
    step = llama_decode.step_of(model)
    assert step is not None
    if not torch.cuda.is_available():
        assert step.graphs is None
        assert cuda_graphs.cuda_graphs_unavailable(model) == "no CUDA GPU"
    else:
        assert step.graphs is not None


# -- on a CUDA GPU: capture and replay -------------------------------------------------

@NEEDS_CUDA
def test_replayed_graphs_give_the_forward_s_greedy_tokens_on_a_gpu(smollm2_tokenizer):
    reference = build_tiny_llama(len(smollm2_tokenizer), seed=12).to("cuda")
    expected, _ = leave_and_join(reference, smollm2_tokenizer, "cuda", room_for_rows=5)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=12).to("cuda")
    step = llama_decode.attach(model, smollm2_tokenizer, cuda_graphs=True)
    assert step is not None and step.graphs is not None
    tokens, _ = leave_and_join(model, smollm2_tokenizer, "cuda", room_for_rows=5)
    assert tokens == expected
    assert step.graphs.stats.captured >= 2 and step.graphs.stats.replayed > 20
    assert step.last_step_replayed


@NEEDS_CUDA
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_in_half_precision_a_replay_gives_what_the_same_step_gives_run_eagerly(
        smollm2_tokenizer, dtype):
    # In half precision a random tiny model's top two tokens are often closer than the
    # rounding of another summation order, so the forward's greedy tokens are no fixed
    # reference (attach's probes compare logits within a tolerance). The graphs must
    # replay exactly what they recorded: the padded, windowed step run eagerly.
    eager = build_tiny_llama(len(smollm2_tokenizer), seed=13).to("cuda", dtype)
    padded_steps(eager, smollm2_tokenizer)
    expected, expected_keys = leave_and_join(eager, smollm2_tokenizer, "cuda", room_for_rows=5)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=13).to("cuda", dtype)
    step = llama_decode.attach(model, smollm2_tokenizer, cuda_graphs=True)
    assert step is not None and step.graphs is not None
    step.graphs.capture_after = 1  # every step replayed, as every step above was padded
    tokens, keys = leave_and_join(model, smollm2_tokenizer, "cuda", room_for_rows=5)
    assert tokens == expected
    for theirs, ours in zip(expected_keys, keys):
        torch.testing.assert_close(ours, theirs)
    assert step.graphs.stats.replayed > 40


@NEEDS_CUDA
def test_a_gpu_server_replays_graphs_and_eager_switches_them_off(tiny_model_dir):
    from djl_stream.generation.loading import load_model_and_tokenizer
    from djl_stream.serving.properties import ModelProperties

    for value, replayed in (("auto", True), ("eager", False)):
        model, tokenizer = load_model_and_tokenizer(ModelProperties.from_init_properties(
            {"model_dir": str(tiny_model_dir), "decode_step": value}))
        step = llama_decode.step_of(model)
        assert step is not None and (step.graphs is not None) is replayed


def test_replayed_steps_do_not_pace_the_prompts_read_beside_them(smollm2_tokenizer):
    # A replayed step costs a fraction of the eager mixed pass that reads a prompt beside
    # the running batch (3.3 ms against 18 for SmolLM2's shapes on an H200): timed as the
    # running batch's step, it would cut every such prompt into chunks of a column or two.
    from djl_stream.generation.engines.accelerate import build_sequences, encode_prompts
    from djl_stream.generation.scheduler import Scheduler

    for replayed in (True, False):
        model = build_tiny_llama(len(smollm2_tokenizer), seed=14)
        step = padded_steps(model, smollm2_tokenizer)
        if not replayed:
            step.graphs = None
        scheduler = Scheduler(model, pad_token_id=2, device="cpu", prefill_stall_steps=1.5)
        try:
            stream = scheduler.submit(build_sequences(
                model, smollm2_tokenizer, encode_prompts(smollm2_tokenizer, PROMPTS[:1]),
                max_new_tokens=6))
            steps = sum(1 for _ in stream)
        finally:
            scheduler.shutdown()
        assert steps == 6 and step.last_step_replayed is replayed
        # the eager steps were timed; the replayed ones were not (no bound: the budget)
        assert (scheduler._pacer.step_seconds is None) is replayed


def test_an_emptied_batch_keeps_the_gpu_blocks_its_graphs_were_captured_on(monkeypatch):
    # (contract: CUDA's calls are recorded, not run) PyTorch's allocator hands the next
    # batch of the same shape the same blocks only if they stay in its cache.
    emptied = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied.append(True))
    allocators.release_cached_memory(keep_gpu_blocks=True)
    assert emptied == []
    allocators.release_cached_memory()
    assert emptied == [True]


def test_a_model_replays_graphs_only_where_its_step_has_them(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=16)
    assert not llama_decode.replays_graphs(model)
    step = padded_steps(model, smollm2_tokenizer)
    assert llama_decode.replays_graphs(model)
    step.graphs = None
    assert not llama_decode.replays_graphs(model)

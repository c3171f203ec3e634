"""CausalLMBatch.filter and .concatenate: rows leave and join without changing results."""

from __future__ import annotations

import torch

from djl_stream.generation import kv_cache
from djl_stream.generation.batch import CausalLMBatch, generate_token, prefill_chunk
from djl_stream.generation.engines.accelerate import build_sequences, encode_prompts

PROMPTS = ["A", "One two three four five six seven eight nine ten", "Colours of the rainbow are"]


def new_batch(model, tokenizer, prompts, request_ids, max_new_tokens):
    sequences = build_sequences(model, tokenizer, encode_prompts(tokenizer, prompts),
                                request_ids=request_ids, max_new_tokens=max_new_tokens)
    return sequences, CausalLMBatch.from_sequences(sequences, pad_token_id=2, device="cpu")


def alone(model, tokenizer, prompt, max_new_tokens):
    (seq,), batch = new_batch(model, tokenizer, [prompt], ["x"], max_new_tokens)
    while batch is not None:
        _, batch = generate_token(model, batch)
    return seq.generated_ids


def assert_each_as_alone(model, tokenizer, batch, sequences, prompts, max_new_tokens):
    """Run ``batch`` to its end: each sequence must have generated what its prompt
    generates alone."""
    while batch is not None:
        _, batch = generate_token(model, batch)
    for seq, prompt in zip(sequences, prompts):
        assert seq.generated_ids == alone(model, tokenizer, prompt, max_new_tokens)


def test_a_finished_row_leaves_and_the_padding_it_needed_is_trimmed(tiny_model, smollm2_tokenizer):
    # the long prompt finishes first; the short ones then need none of its columns
    sequences, batch = new_batch(tiny_model, smollm2_tokenizer, PROMPTS, ["a", "b", "c"], 6)
    sequences[1].max_new_tokens = 2
    widths = []
    while batch is not None:
        _, batch = generate_token(tiny_model, batch)
        if batch is not None:
            widths.append((len(batch), batch.attention_mask.shape[1], kv_cache.seq_length(batch.past_key_values)))
    long_len = len(encode_prompts(smollm2_tokenizer, [PROMPTS[1]])[0])
    short_len = max(len(ids) for ids in encode_prompts(smollm2_tokenizer, [PROMPTS[0], PROMPTS[2]]))
    assert widths[0] == (3, long_len + 1, long_len)
    # after step 2 the long row left: the cache holds the longest remaining prompt plus
    # its first token, and the mask adds the column of the token being fed
    assert widths[1] == (2, short_len + 2, short_len + 1)
    for seq, prompt in zip(sequences, PROMPTS):
        assert seq.generated_ids == alone(tiny_model, smollm2_tokenizer, prompt, seq.max_new_tokens)


def test_a_request_prefilled_later_joins_the_running_batch(tiny_model, smollm2_tokenizer):
    running_seqs, running = new_batch(tiny_model, smollm2_tokenizer, PROMPTS[:2], ["a", "b"], 12)
    for _ in range(4):
        _, running = generate_token(tiny_model, running)
    (late,), newcomer = new_batch(tiny_model, smollm2_tokenizer, [PROMPTS[2]], ["c"], 12)
    _, newcomer = generate_token(tiny_model, newcomer)  # its prefill, as a batch of its own
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.request_ids == ["a", "b", "c"]
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + [late], PROMPTS, 12)


def test_filter_keeps_the_named_rows_only(tiny_model, smollm2_tokenizer):
    _, batch = new_batch(tiny_model, smollm2_tokenizer, PROMPTS, ["a", "b", "c"], 8)
    _, batch = generate_token(tiny_model, batch)
    kept = batch.filter(["c", "a"])
    assert kept.request_ids == ["a", "c"]
    assert kv_cache.num_rows(kept.past_key_values) == 2
    assert batch.filter([]) is None


def keys_of(batch):
    return kv_cache.layers(batch.past_key_values)[0].keys


def test_a_leaving_row_s_place_goes_to_the_last_row_and_no_other_row_moves(
        tiny_model, smollm2_tokenizer):
    prompts = PROMPTS + ["Blue", "Once upon a time"]
    sequences, batch = new_batch(tiny_model, smollm2_tokenizer, prompts, list("abcde"), 10)
    for _ in range(3):
        _, batch = generate_token(tiny_model, batch)
    before = keys_of(batch).clone()
    kept = batch.filter(["a", "c", "d", "e"])  # "b" leaves
    assert kept.request_ids == ["a", "e", "c", "d"]
    after = keys_of(kept)
    # rows a, c and d are where they were; e's cache is in b's old place (the leading
    # columns that were padding for every row left are compared from the end)
    width = after.shape[2]
    for new_row, old_row in ((0, 0), (1, 4), (2, 2), (3, 3)):
        assert torch.equal(after[new_row], before[old_row][:, -width:])
    batch = kept
    while batch is not None:
        _, batch = generate_token(tiny_model, batch)
    for seq, prompt in zip(sequences, prompts):
        if seq.request_id != "b":
            assert seq.generated_ids == alone(tiny_model, smollm2_tokenizer, prompt, 10)


def test_decode_steps_write_the_cache_in_place(tiny_model, smollm2_tokenizer):
    # DynamicCache copied every layer's whole cache into a new tensor at every step.
    _, batch = new_batch(tiny_model, smollm2_tokenizer, PROMPTS, ["a", "b", "c"], 8)
    _, batch = generate_token(tiny_model, batch)
    storage = keys_of(batch).untyped_storage().data_ptr()
    for _ in range(5):
        _, batch = generate_token(tiny_model, batch)
        assert keys_of(batch).untyped_storage().data_ptr() == storage


def test_a_longer_newcomer_hosts_the_running_rows_in_the_rows_it_reserved(tiny_model,
                                                                         smollm2_tokenizer):
    # The join of a long prompt to a short running batch copies the running rows only:
    # the newcomer's cache, already as long as the joined batch, is written in place.
    running_seqs, running = new_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"], 12)
    _, running = generate_token(tiny_model, running)
    late_seqs = build_sequences(tiny_model, smollm2_tokenizer,
                                encode_prompts(smollm2_tokenizer, PROMPTS[1:]),
                                request_ids=["b", "c"], max_new_tokens=12)
    newcomer = CausalLMBatch.from_sequences(late_seqs, pad_token_id=2, device="cpu",
                                            room_for_rows=len(running))
    _, newcomer = generate_token(tiny_model, newcomer)
    storage = keys_of(newcomer).untyped_storage().data_ptr()
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.past_key_values is newcomer.past_key_values
    assert keys_of(batch).untyped_storage().data_ptr() == storage  # nothing reallocated
    assert batch.request_ids == ["b", "c", "a"]  # the host's rows first
    padding = batch.attention_mask[2] == 0
    assert padding.sum() > 0 and not keys_of(batch)[2][:, padding[:-1]].any()
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + late_seqs, PROMPTS, 12)


def test_rows_that_leave_are_zeroed_for_the_next_to_join(tiny_model, smollm2_tokenizer):
    # A joining row is copied into rows whose columns before its own must hold zeros
    # (masked, but a NaN left there would still reach the attention output).
    _, batch = new_batch(tiny_model, smollm2_tokenizer, PROMPTS, ["a", "b", "c"], 8)
    _, batch = generate_token(tiny_model, batch)
    kept = batch.filter(["a", "c"])
    slab = kept.past_key_values._slabs[0]
    assert slab.rows == 2 and slab.row_capacity == 3
    assert not slab.keys_buffer[2, :, slab.start:slab.end].any()
    (late,), newcomer = new_batch(tiny_model, smollm2_tokenizer, ["Blue"], ["d"], 8)
    _, newcomer = generate_token(tiny_model, newcomer)
    storage = keys_of(kept).untyped_storage().data_ptr()
    batch = CausalLMBatch.concatenate([kept, newcomer])
    assert keys_of(batch).untyped_storage().data_ptr() == storage  # into the freed row
    while batch is not None:
        _, batch = generate_token(tiny_model, batch)
    assert late.generated_ids == alone(tiny_model, smollm2_tokenizer, "Blue", 8)


def test_the_cache_grows_past_what_it_reserved_keeping_every_column():
    import torch
    from djl_stream.generation.kv_cache import COLUMN_GRANULE, PreallocatedCache

    cache = PreallocatedCache(reserve_rows=3)  # one row reserved beyond the two written
    written = [torch.randn(2, 1, COLUMN_GRANULE - 1, 4), torch.randn(2, 1, 5, 4)]
    with torch.inference_mode():
        for part in written:
            keys, values = cache.update(part, -part, 0)
    assert torch.equal(keys, torch.cat(written, dim=2)) and torch.equal(values, -keys)
    slab = cache._slabs[0]
    assert slab.column_capacity > COLUMN_GRANULE and slab.row_capacity == 3
    assert not slab.keys_buffer[2, :, :slab.end].any()  # the reserved row, zero


def reserving_batch(model, tokenizer, prompts, request_ids, max_new_tokens, rows, left):
    sequences = build_sequences(model, tokenizer, encode_prompts(tokenizer, prompts),
                                request_ids=request_ids, max_new_tokens=max_new_tokens)
    return sequences, CausalLMBatch.from_sequences(sequences, pad_token_id=2, device="cpu",
                                                   room_for_rows=rows, room_on_left=left)


def test_a_longer_newcomer_joins_a_running_batch_that_stays_where_it_is(tiny_model,
                                                                       smollm2_tokenizer):
    # The running batch reserved rows and columns on the left: a newcomer longer than its
    # rows is copied into them, and nothing of the running rows moves or is reallocated.
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            12, rows=3, left=32)
    for _ in range(3):
        _, running = generate_token(tiny_model, running)
    slab = running.past_key_values._slabs[0]
    storage, start, end = keys_of(running).untyped_storage().data_ptr(), slab.start, slab.end
    before = slab.keys_buffer[0, :, start:end].clone()
    late_seqs, newcomer = new_batch(tiny_model, smollm2_tokenizer, PROMPTS[1:], ["b", "c"], 12)
    _, newcomer = generate_token(tiny_model, newcomer)
    assert newcomer.cache_length > running.cache_length
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.past_key_values is running.past_key_values
    assert keys_of(batch).untyped_storage().data_ptr() == storage  # nothing reallocated
    assert torch.equal(slab.keys_buffer[0, :, start:end], before)  # nor moved
    assert slab.start < start and slab.end == end  # the newcomer took columns on the left
    assert batch.request_ids == ["a", "b", "c"]
    # the running row reads zeros, masked, in the columns before its own
    padding = batch.attention_mask[0] == 0
    assert padding.sum() >= newcomer.cache_length - 4
    assert not keys_of(batch)[0][:, padding[:-1]].any()
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + late_seqs, PROMPTS, 12)


def test_a_join_beyond_the_reserved_room_grows_the_running_cache_once(tiny_model,
                                                                      smollm2_tokenizer):
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            10, rows=1, left=0)
    _, running = generate_token(tiny_model, running)
    late_seqs, newcomer = new_batch(tiny_model, smollm2_tokenizer, PROMPTS[1:], ["b", "c"], 10)
    _, newcomer = generate_token(tiny_model, newcomer)
    # neither has room for three rows: the one with the most rows hosts, grown
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.past_key_values is newcomer.past_key_values
    assert batch.request_ids == ["b", "c", "a"]
    slab = batch.past_key_values._slabs[0]
    assert slab.row_capacity >= 3 and slab.rows == 3
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + late_seqs, PROMPTS, 10)


def test_a_row_that_leaves_leaves_nothing_behind_for_the_next_in_its_place(tiny_model,
                                                                            smollm2_tokenizer):
    # The long row leaves: the leading columns it alone needed are trimmed, and what it
    # wrote there must not stay under the row that takes its place (a later, longer
    # newcomer would widen the columns in use over them again).
    sequences, batch = reserving_batch(tiny_model, smollm2_tokenizer, PROMPTS, ["a", "b", "c"],
                                       8, rows=2, left=32)
    _, batch = generate_token(tiny_model, batch)
    slab = batch.past_key_values._slabs[0]
    old_start = slab.start
    kept = batch.filter(["a", "c"])  # "b", the longest, leaves: "c" takes row 1
    assert slab.start > old_start and slab.rows == 2
    assert kept.request_ids == ["a", "c"]
    assert not slab.keys_buffer[1, :, :slab.start].any()  # the leaver's columns, zeroed
    assert not slab.keys_buffer[2:].any() and not slab.values_buffer[2:].any()  # free rows
    long_prompt = "A much longer prompt than any of the running ones, by far"
    late_seqs, newcomer = new_batch(tiny_model, smollm2_tokenizer, [long_prompt], ["d"], 8)
    _, newcomer = generate_token(tiny_model, newcomer)
    batch = CausalLMBatch.concatenate([kept, newcomer])
    assert batch.past_key_values is kept.past_key_values
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch,
                         [sequences[0], sequences[2], late_seqs[0]],
                         [PROMPTS[0], PROMPTS[2], long_prompt], 8)


def test_a_long_newcomer_hosts_a_short_running_row_where_that_copies_less(tiny_model,
                                                                          smollm2_tokenizer):
    # Both caches have room: the one holding more (rows × columns) hosts, so one short
    # running row is copied into a long prompt's cache, not the long prompt into it.
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            8, rows=3, left=32)
    _, running = generate_token(tiny_model, running)
    late_seqs, newcomer = reserving_batch(tiny_model, smollm2_tokenizer, PROMPTS[1:], ["b", "c"],
                                          8, rows=3, left=32)
    _, newcomer = generate_token(tiny_model, newcomer)
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.past_key_values is newcomer.past_key_values
    assert batch.request_ids == ["b", "c", "a"]
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + late_seqs, PROMPTS, 8)


def leasing_batch(model, tokenizer, prompts, request_ids, max_new_tokens, running):
    """A batch of ``prompts`` whose cache lends rows of ``running``'s (where it has room)."""
    sequences = build_sequences(model, tokenizer, encode_prompts(tokenizer, prompts),
                                request_ids=request_ids, max_new_tokens=max_new_tokens)
    return sequences, CausalLMBatch.from_sequences(sequences, pad_token_id=2, device="cpu",
                                                   host_cache=running.past_key_values)


def refuse_copies(monkeypatch):
    """Make any copy of rows into a cache at a join raise."""
    def copying(*args):
        raise AssertionError("a join copied rows")
    monkeypatch.setattr(kv_cache._Slab, "take", copying)


def test_a_newcomer_prefilled_in_rows_the_running_cache_lent_joins_without_a_copy(
        tiny_model, smollm2_tokenizer, monkeypatch):
    # Its prompt is written straight into free rows of the running cache, in chunks while
    # the running row goes on decoding: its rows end a few columns before the running
    # row's, and its join is bookkeeping (masks hide the columns in between).
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            12, rows=3, left=32)
    for _ in range(2):
        _, running = generate_token(tiny_model, running)
    slab = running.past_key_values._slabs[0]
    late_seqs, newcomer = leasing_batch(tiny_model, smollm2_tokenizer, PROMPTS[1:], ["b", "c"],
                                        12, running)
    assert newcomer.past_key_values is not running.past_key_values
    newcomer = prefill_chunk(tiny_model, newcomer, 3)
    lent = kv_cache.layers(newcomer.past_key_values)[0].keys
    assert lent.untyped_storage().data_ptr() == slab.keys_buffer.untyped_storage().data_ptr()
    for _ in range(2):  # the running row decodes between the newcomer's passes
        _, running = generate_token(tiny_model, running)
    newcomer = prefill_chunk(tiny_model, newcomer, 2)
    _, running = generate_token(tiny_model, running)
    _, newcomer = generate_token(tiny_model, newcomer)  # the rest: its first tokens
    before = slab.keys_buffer[:3, :, slab.start:slab.end].clone()
    refuse_copies(monkeypatch)
    batch = CausalLMBatch.concatenate([running, newcomer])
    assert batch.request_ids == ["a", "b", "c"]
    assert batch.past_key_values is running.past_key_values and slab.rows == 3
    assert torch.equal(slab.keys_buffer[:3, :, slab.end - before.shape[2]:slab.end], before)
    # three decode steps ran while the newcomer's prompts were read: three masked columns
    # between their end and the token fed, zeros in the cache
    assert batch.attention_mask[1:, -4:-1].eq(0).all() and batch.attention_mask[1:, -5].eq(1).all()
    assert not keys_of(batch)[1:, :, -3:].any()
    monkeypatch.undo()
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + late_seqs, PROMPTS, 12)


def test_a_dropped_prefill_s_lent_rows_are_zeroed_and_lent_again(tiny_model, smollm2_tokenizer):
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            8, rows=3, left=32)
    _, running = generate_token(tiny_model, running)
    _, newcomer = leasing_batch(tiny_model, smollm2_tokenizer, [PROMPTS[1]], ["b"], 8, running)
    newcomer = prefill_chunk(tiny_model, newcomer, 4)
    slab = running.past_key_values._slabs[0]
    assert slab.keys_buffer[1].any()
    del newcomer  # cancelled part-way through its prefill
    late_seqs, again = leasing_batch(tiny_model, smollm2_tokenizer, [PROMPTS[2]], ["c"], 8,
                                     running)
    assert not slab.keys_buffer[1:].any() and not slab.values_buffer[1:].any()
    assert running.past_key_values.tenant() is again.past_key_values
    _, again = generate_token(tiny_model, again)
    batch = CausalLMBatch.concatenate([running, again])
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, running_seqs + late_seqs,
                         [PROMPTS[0], PROMPTS[2]], 8)


def test_a_tenant_whose_place_moved_is_copied_in_and_its_lent_rows_zeroed(tiny_model,
                                                                          smollm2_tokenizer):
    # A running row leaves during the newcomer's prefill: the newcomer's rows no longer
    # follow the running ones, so it joins by a copy, as a cache of its own would.
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, PROMPTS[:2],
                                            ["a", "b"], 10, rows=3, left=32)
    _, running = generate_token(tiny_model, running)
    late_seqs, newcomer = leasing_batch(tiny_model, smollm2_tokenizer, [PROMPTS[2]], ["c"], 10,
                                        running)
    _, newcomer = generate_token(tiny_model, newcomer)
    assert running.past_key_values.tenant() is newcomer.past_key_values
    running = running.filter(["b"])
    batch = CausalLMBatch.concatenate([running, newcomer])
    slab = batch.past_key_values._slabs[0]
    assert batch.request_ids == ["b", "c"] and slab.rows == 2
    assert not slab.keys_buffer[2:].any()  # where the newcomer was written, zero again
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, [running_seqs[1]] + late_seqs,
                         PROMPTS[1:], 10)


def test_a_running_cache_without_room_lends_nothing(tiny_model, smollm2_tokenizer):
    _, running = new_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"], 8)  # no spare rows
    _, running = generate_token(tiny_model, running)
    _, newcomer = leasing_batch(tiny_model, smollm2_tokenizer, [PROMPTS[1]], ["b"], 8, running)
    assert running.past_key_values.tenant() is None
    assert newcomer.past_key_values.reserve_rows == 1  # a cache of its own


def test_a_prefill_that_loses_a_request_part_way_keeps_its_lent_rows_clean(
        tiny_model, smollm2_tokenizer):
    # Two prompts read into two lent rows; one is cancelled after the first chunk: the
    # prefill's own filter frees (zeroes) that row, and the other joins in place.
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            8, rows=3, left=32)
    _, running = generate_token(tiny_model, running)
    late_seqs, newcomer = leasing_batch(tiny_model, smollm2_tokenizer, PROMPTS[1:], ["b", "c"],
                                        8, running)
    newcomer = prefill_chunk(tiny_model, newcomer, 3)
    newcomer = newcomer.filter(["c"])
    _, running = generate_token(tiny_model, running)
    _, newcomer = generate_token(tiny_model, newcomer)
    batch = CausalLMBatch.concatenate([running, newcomer])
    slab = batch.past_key_values._slabs[0]
    assert batch.past_key_values is running.past_key_values and slab.rows == 2
    assert not slab.keys_buffer[2:].any() and not slab.values_buffer[2:].any()
    assert_each_as_alone(tiny_model, smollm2_tokenizer, batch, [running_seqs[0], late_seqs[1]],
                         [PROMPTS[0], PROMPTS[2]], 8)


def test_newcomers_take_lent_rows_one_after_another(tiny_model, smollm2_tokenizer, monkeypatch):
    running_seqs, running = reserving_batch(tiny_model, smollm2_tokenizer, [PROMPTS[0]], ["a"],
                                            8, rows=3, left=32)
    _, running = generate_token(tiny_model, running)
    refuse_copies(monkeypatch)
    joined = []
    for prompt, request_id in zip(PROMPTS[1:], ["b", "c"]):
        seqs, newcomer = leasing_batch(tiny_model, smollm2_tokenizer, [prompt], [request_id], 8,
                                       running)
        assert running.past_key_values.tenant() is newcomer.past_key_values
        _, newcomer = generate_token(tiny_model, newcomer)
        running = CausalLMBatch.concatenate([running, newcomer])
        _, running = generate_token(tiny_model, running)
        joined += seqs
    monkeypatch.undo()
    assert running.request_ids == ["a", "b", "c"]
    assert_each_as_alone(tiny_model, smollm2_tokenizer, running, running_seqs + joined, PROMPTS, 8)

"""The KV cache: rows handed out as handles, gathered for a decode step, columns that grow."""

from __future__ import annotations

import pytest
import torch

from djl_stream.runtime import kv_cache
from djl_stream.runtime.kv_cache import KVCache, LayerShape, zeroed_buffer


def cache(rows=4, columns=64, **kwargs):
    return KVCache([LayerShape(heads=2, key_dim=4, value_dim=3)] * 2, rows=rows,
                   columns=columns, dtype=torch.float32, device="cpu", **kwargs)


def write(cache, handle, length, value):
    row = cache.row_of(handle)
    for buffer in cache.keys + cache.values:
        buffer[row, :, :length] = value
    cache.append(handle, range(length))


def test_a_moved_row_takes_its_columns_along_and_every_other_row_stays():
    kv = cache()
    handles = [kv.reserve() for _ in range(4)]
    for i, handle in enumerate(handles):
        write(kv, handle, 5 + i, float(i + 1))
    kv.release(handles[1])
    assert kv.place([handles[0], handles[2], handles[3]]) == 0
    assert [kv.row_of(h) for h in (handles[0], handles[2])] == [0, 2]  # stayed
    moved = kv.row_of(handles[3])
    assert moved == 1
    for buffer in kv.keys + kv.values:
        assert bool((buffer[moved, :, :8] == 4.0).all())
    assert sorted(kv.row_of(h) for h in kv.handles()) == [0, 1, 2]


def test_rows_already_together_are_left_where_they_are():
    kv = cache()
    handles = [kv.reserve() for _ in range(4)]
    write(kv, handles[2], 3, 9.0)
    assert kv.place(handles[1:3]) == 1
    assert [kv.row_of(h) for h in handles] == [0, 1, 2, 3]


def test_a_row_outside_the_block_is_moved_out_of_the_way_not_lost():
    kv = cache()
    handles = [kv.reserve() for _ in range(4)]
    for i, handle in enumerate(handles):
        write(kv, handle, 4, float(i + 1))
    kv.place([handles[0], handles[3]])  # handles[1] holds row 1: it must go elsewhere
    assert kv.row_of(handles[3]) == 1
    elsewhere = kv.row_of(handles[1])
    assert elsewhere not in (0, 1, kv.row_of(handles[2]))
    assert bool((kv.keys[0][elsewhere, :, :4] == 2.0).all())


def test_every_row_held_is_a_clear_error():
    kv = cache(rows=2)
    kv.reserve(), kv.reserve()
    with pytest.raises(RuntimeError, match="all 2 rows"):
        kv.reserve()


def test_where_reserving_costs_memory_the_columns_grow_keeping_what_was_written(monkeypatch):
    monkeypatch.setattr(kv_cache, "reserving_is_free", lambda device: False)
    kv = cache(columns=2048, initial_columns=256)
    assert kv.columns == 256
    handle = kv.reserve()
    write(kv, handle, 200, 7.0)
    kv.need_columns(300)
    assert kv.columns >= 300
    assert bool((kv.values[1][kv.row_of(handle), :, :200] == 7.0).all())
    with pytest.raises(ValueError, match="does not fit"):
        kv.need_columns(4096)


def test_a_cpu_buffer_reads_as_zeros_and_is_resident_only_where_written():
    from conftest import resident_bytes

    before = resident_bytes()
    buffer = zeroed_buffer((64, 1024, 1024), torch.float32, "cpu")  # 256 MB of address space
    assert float(buffer[5, 7].abs().sum()) == 0.0
    buffer[0, :2] = 1.0
    assert resident_bytes() - before < 64 * 2**20


# -- prompts that begin as another did ------------------------------------------------------

def held(cache, prompt, value):
    """A row holding ``prompt``'s keys and values (every number ``value``), as a pass that
    read it leaves it."""
    handle = cache.reserve()
    row = cache.row_of(handle)
    for buffer in cache.keys + cache.values:
        buffer[row, :, :len(prompt)] = value
    cache.append(handle, prompt)
    return handle


def columns_of(cache, handle, count):
    row = cache.row_of(handle)
    return [buffer[row, :, :count].clone() for buffer in cache.keys + cache.values]


def test_a_finished_rows_columns_start_a_prompt_that_begins_as_its_did():
    kv = cache()
    first = held(kv, [5, 6, 7, 8, 9], 3.0)
    row = kv.row_of(first)
    kv.release(first)
    follow_up = kv.reserve([5, 6, 7, 8, 9, 10, 11])  # a conversation's next turn
    assert (kv.row_of(follow_up), kv.length(follow_up)) == (row, 5)  # taken over as it is
    assert all(bool((c == 3.0).all()) for c in columns_of(kv, follow_up, 5))
    assert kv.reused_positions == 5


def test_a_running_rows_columns_are_copied_for_a_prompt_that_begins_alike():
    kv = cache()
    running = held(kv, [5, 6, 7, 8, 9], 3.0)
    before = columns_of(kv, running, 5)
    other = kv.reserve([5, 6, 7, 1, 2])
    assert kv.row_of(other) != kv.row_of(running) and kv.length(other) == 3
    assert all(bool((c == 3.0).all()) for c in columns_of(kv, other, 3))
    assert all(bool((a == b).all()) for a, b in zip(before, columns_of(kv, running, 5)))


def test_a_prompt_held_whole_is_fed_its_last_token_which_gives_the_logits():
    kv = cache()
    kv.release(held(kv, [5, 6, 7], 1.0))
    assert kv.length(kv.reserve([5, 6, 7])) == 2
    assert kv.length(kv.reserve([5])) == 0  # nothing before its last token


def test_the_longest_start_wins_and_a_prompt_that_begins_otherwise_starts_empty():
    kv = cache()
    kv.release(held(kv, [5, 6], 1.0))
    kv.release(held(kv, [5, 6, 7, 8], 2.0))
    longest = kv.reserve([5, 6, 7, 8, 1])
    assert kv.length(longest) == 4
    assert all(bool((c == 2.0).all()) for c in columns_of(kv, longest, 4))
    assert kv.length(kv.reserve([9, 5, 6, 7])) == 0


def test_a_new_row_goes_where_nothing_was_left_before_it_takes_a_finished_rows_place():
    kv = cache(rows=3)
    kv.release(held(kv, [5, 6, 7], 1.0))  # row 0
    kv.release(held(kv, [8, 9, 7], 2.0))  # row 0 was kept: row 1
    assert kv.row_of(kv.reserve([1, 2, 3])) == 2
    # every free row holds something now: the one left longest ago goes first
    assert kv.row_of(kv.reserve([4, 4, 4])) == 0
    assert kv.length(kv.reserve([8, 9, 7, 1])) == 3


def test_a_row_a_move_writes_over_is_not_reused():
    kv = cache(rows=3)
    a = held(kv, [1, 2, 3], 1.0)
    b = held(kv, [5, 6, 7], 2.0)
    kv.release(a)                    # row 0 keeps [1, 2, 3]
    kv.place([b], at_start=True)     # b moves into row 0
    assert kv.length(kv.reserve([1, 2, 3, 4])) == 0
    assert kv.length(kv.reserve([5, 6, 7, 8])) == 3  # (b's, copied)


def spare_row_left_with(tokens):
    """A cache whose spare row alone holds ``tokens`` (moved there out of another row's
    way, then released)."""
    kv = cache(rows=2)
    a = held(kv, tokens, 1.0)
    b = held(kv, [5, 6, 7], 2.0)
    kv.place([b], at_start=True)     # a moves out of b's way, into the spare row
    assert kv.row_of(a) == 2
    kv.release(a)
    return kv


def test_the_spare_rows_contents_are_copied_since_it_is_never_handed_out():
    kv = spare_row_left_with([1, 2, 3])
    copied = kv.reserve([1, 2, 3, 4])
    assert (kv.row_of(copied), kv.length(copied)) == (1, 3)
    assert all(bool((c == 1.0).all()) for c in columns_of(kv, copied, 3))


def test_a_row_free_row_hands_out_is_forgotten():
    kv = spare_row_left_with([1, 2, 3])
    assert kv.free_row() == 2        # a CUDA graph's padding rows write there
    assert kv.length(kv.reserve([1, 2, 3, 4])) == 0


def test_with_reuse_turned_off_contents_are_never_reused():
    off = cache(reuse_prefixes=False)
    off.release(held(off, [5, 6, 7], 1.0))
    assert off.length(off.reserve([5, 6, 7, 8])) == 0 and off.reused_positions == 0

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
    cache.set_length(handle, length)


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

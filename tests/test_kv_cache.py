"""PreallocatedCache's storage: reserved room costs address space, not resident memory."""

from __future__ import annotations

import os

import torch

from djl_stream.generation.kv_cache import PreallocatedCache, reserving_is_free, zeroed_buffer


def resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_a_zeroed_buffer_on_a_cpu_is_resident_only_where_written():
    before = resident_bytes()
    # 32 rows × 4 heads × 8,192 columns × 64 × 4 bytes: 256 MiB of reserved room
    buffer = zeroed_buffer((32, 4, 8192, 64), torch.ones(1))
    assert not buffer[:, :, ::512].any()  # reads zeros (and reading maps no memory)
    buffer[:, :, 100:164] = 1.0  # 64 columns of every row written: 2 MiB, in 4 KiB pages
    grown = resident_bytes() - before
    assert grown < 32 * 2**20, grown
    assert float(buffer.sum()) == 32 * 4 * 64 * 64
    assert reserving_is_free("cpu") and not reserving_is_free("meta")


def test_a_cache_reserving_many_rows_and_columns_costs_what_it_holds():
    before = resident_bytes()
    cache = PreallocatedCache(reserve_rows=32, reserve_columns=2048, room_on_left=4096)
    with torch.inference_mode():
        for layer in range(8):  # 8 layers of 32 × 4 × 6,144 × 64 floats: 2 × 384 MiB reserved
            cache.update(torch.randn(1, 4, 16, 64), torch.randn(1, 4, 16, 64), layer)
    assert resident_bytes() - before < 64 * 2**20
    slab = cache._slabs[0]
    assert slab.row_capacity == 32 and slab.start == 4096


def test_free_rows_read_zeros_after_rows_leave():
    cache = PreallocatedCache(reserve_rows=4)
    with torch.inference_mode():
        cache.update(torch.randn(3, 1, 5, 2), torch.randn(3, 1, 5, 2), 0)
        cache.keep_rows([2])
    slab = cache._slabs[0]
    assert slab.rows == 1
    assert not slab.keys_buffer[1:].any() and not slab.values_buffer[1:].any()


def test_the_join_cost_benchmark_hosts_where_the_least_is_copied(embedded_model_dir):
    from benchmarks.join_cost import one_join

    many = one_join(str(embedded_model_dir), running_rows=4, running_columns=40,
                    newcomer_columns=100, batch_size=8, max_input_length=256, new_tokens=16)
    assert many["host"] == "running"  # 160 positions stay, the longer newcomer's 100 move
    one = one_join(str(embedded_model_dir), running_rows=1, running_columns=40,
                   newcomer_columns=100, batch_size=8, max_input_length=256, new_tokens=16)
    assert one["host"] == "newcomer"
    assert one["resident_growth_mib"] < 64 and one["join_ms"] >= 0


def test_no_free_reserving_where_the_kernel_counts_address_space(monkeypatch):
    from djl_stream.generation import kv_cache

    monkeypatch.setattr(kv_cache, "_overcommit_mode", lambda: "2")
    assert not kv_cache.reserving_is_free("cpu")
    monkeypatch.setattr(kv_cache, "_overcommit_mode", lambda: "0")
    assert kv_cache.reserving_is_free("cpu")

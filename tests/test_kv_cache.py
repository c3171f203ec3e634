"""PreallocatedCache's storage: reserved room costs address space, not resident memory."""

from __future__ import annotations

import resource

import torch

from conftest import resident_bytes
from djl_stream.generation import kv_cache
from djl_stream.generation.kv_cache import PreallocatedCache, reserving_is_free, zeroed_buffer


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


def page_faults_of_this_thread() -> int:
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt


def test_a_step_s_new_page_of_columns_is_resident_before_the_step_writes_it():
    # A compiled step reads a column of every row before writing it (two page faults a
    # page, inside its threads): next_columns_buffers writes the rows' new page first.
    rows, heads, layers = 3, 2, 2
    cache = PreallocatedCache(reserve_rows=8, reserve_columns=64)
    with torch.inference_mode():
        for layer in range(layers):  # 16 float32 columns of 64: the first page of each block
            cache.update(torch.randn(rows, heads, 16, 64), torch.randn(rows, heads, 16, 64), layer)
        keys, values, start, column = cache.next_columns_buffers(rows)
        assert (start, column) == (0, 16)  # the column starts the second page
        assert not any(buffer[:, :, 16:32].any() for buffer in keys + values)  # still zeros
        before = page_faults_of_this_thread()
        for buffer in keys + values:
            buffer[:rows, :, column].add_(1.0)  # as the step: read, then write
        in_use = page_faults_of_this_thread() - before
        before = page_faults_of_this_thread()
        for buffer in keys + values:
            buffer[rows:, :, column].add_(1.0)  # the free rows' pages were left alone
        free = page_faults_of_this_thread() - before
        cache.next_columns_written()
    pages = 2 * layers * heads  # keys and values: a page per row and head
    assert in_use < rows * pages // 2, in_use
    assert free >= (8 - rows) * pages, free
    assert float(cache._slabs[0].keys_buffer[:rows, :, 16].sum()) == rows * heads * 64


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
    lent = one_join(str(embedded_model_dir), running_rows=1, running_columns=40,
                    newcomer_columns=100, batch_size=8, max_input_length=256, new_tokens=16,
                    layout="lent")
    assert lent["host"] == "running" and lent["layout"] == "lent"  # written in its rows


def test_no_free_reserving_where_the_kernel_counts_address_space(monkeypatch):
    monkeypatch.setattr(kv_cache, "_overcommit_mode", lambda: "2")
    assert not kv_cache.reserving_is_free("cpu")
    monkeypatch.setattr(kv_cache, "_overcommit_mode", lambda: "0")
    assert kv_cache.reserving_is_free("cpu")


def written(rows: int, columns: int, value: float):
    return torch.full((rows, 1, columns, 8), value), torch.full((rows, 1, columns, 8), -value)


def lent_rows(running_columns: int, tenant_columns: int):
    """A running cache of one row of ``running_columns`` (ones) and a prefill's cache
    lent its next row, written over ``tenant_columns`` (threes)."""
    running = PreallocatedCache(reserve_rows=4, room_on_left=8)
    with torch.inference_mode():
        running.update(*written(1, running_columns, 1.0), 0)
        tenant = running.lease(rows=1, columns=tenant_columns)
        tenant.update(*written(1, tenant_columns, 3.0), 0)
    return running, tenant


def test_a_cache_that_must_grow_gives_its_tenant_buffers_of_its_own():
    # The running rows outgrow their columns on the right while rows lent to a prefill
    # hold its prompt: the prefill gets its own copy, the lent rows are zeroed, and the
    # prefill joins later by a copy.
    running, tenant = lent_rows(4, 6)
    lent = tenant._slabs[0].keys_buffer
    with torch.inference_mode():
        slab = running._slabs[0]
        for _ in range(slab.column_capacity - slab.end + 1):  # past the capacity: it grows
            running.update(*written(1, 1, 1.0), 0)
    assert running.tenant() is None
    assert not lent.any()  # the lent row, zero again
    assert tenant._slabs[0].keys_buffer.untyped_storage().data_ptr() != \
        slab.keys_buffer.untyped_storage().data_ptr()
    assert bool((tenant._slabs[0].keys == 3.0).all()) and tenant._slabs[0].keys.shape[2] == 6
    gaps = running.absorb([tenant])
    assert gaps == [0] and slab.rows == 2
    assert torch.equal(slab.keys[1, :, -6:], torch.full((1, 6, 8), 3.0))


def test_a_cache_lends_rows_to_one_prefill_at_a_time_and_only_with_room():
    running = PreallocatedCache(reserve_rows=2, room_on_left=4)
    with torch.inference_mode():
        running.update(*written(1, 3, 1.0), 0)
    assert running.lease(rows=2, columns=3) is None  # one free row only
    assert running.lease(rows=1, columns=8) is None  # 7 columns end at most: no room left
    tenant = running.lease(rows=1, columns=7)
    assert tenant is not None and running.lease(rows=1, columns=2) is None


def test_what_a_failed_pass_wrote_past_a_tenant_s_end_is_zeroed_at_its_join():
    running, tenant = lent_rows(4, 5)
    with torch.inference_mode():
        tenant.truncate(3)  # the pass that wrote its last 2 columns raised
        for _ in range(2):
            running.update(*written(1, 1, 1.0), 0)
        assert running.absorb([tenant]) == [2 + 2]  # the columns cut, then the steps
    slab = running._slabs[0]
    assert slab.keys[1, 0, -4:].eq(0).all()  # masked, and zero
    assert slab.keys[1, 0, -7:-4].eq(3.0).all()


def test_a_prefill_s_cache_taken_over_keeps_no_view_of_its_host_s_buffers():
    # Whoever still holds the prefill's cache after its join must not keep the host's
    # whole buffers alive once the host is gone (a 4,000-token prompt's row stayed
    # resident into the next request's lifetime, 200 MB in benchmarks.prefill_gap).
    running, tenant = lent_rows(4, 5)
    with torch.inference_mode():
        running.absorb([tenant])
    assert kv_cache.layers(tenant) == [] and not tenant._slabs
    storage = running._slabs[0].keys_buffer.untyped_storage().data_ptr()
    for layer in kv_cache._all_layers(tenant):
        assert layer.keys.untyped_storage().data_ptr() != storage


def test_a_prefill_whose_lender_is_gone_moves_into_buffers_of_its_own():
    # The running batch ended (or was split) while the prompt was read into its lent rows:
    # at its next write the prefill copies what it holds into buffers of its own, so that
    # it does not keep the gone cache's whole buffers resident (in benchmarks.prefill_gap
    # a stream admitted as the last one was being cancelled held a 4,000-token row: +200 MB).
    running, tenant = lent_rows(4, 6)
    storage = running._slabs[0].keys_buffer.untyped_storage().data_ptr()
    del running
    with torch.inference_mode():
        keys, _ = tenant.update(*written(1, 1, 5.0), 0)
    assert keys.untyped_storage().data_ptr() != storage
    assert keys[0, 0, :6].eq(3.0).all() and keys[0, 0, 6].eq(5.0).all()


def test_a_prefill_lent_rows_by_a_cache_that_moves_out_keeps_what_it_writes():
    # A prefill whose own lender was gone went on as the running batch and lent a row to
    # the next prefill; when it moved into buffers of its own, the next prefill's later
    # chunks still went to the old buffers and its join (taken as in place) lost them.
    grand = PreallocatedCache(reserve_rows=4, room_on_left=8)
    with torch.inference_mode():
        grand.update(*written(1, 4, 1.0), 0)
        orphan = grand.lease(rows=2, columns=4)
        orphan.update(*written(2, 4, 2.0), 0)
        orphan.keep_rows([0])  # one of its two requests left: a row to lend
        tenant = orphan.lease(rows=1, columns=3)
        tenant.update(*written(1, 1, 3.0), 0)  # its first chunk
        del grand
        orphan.update(*written(1, 1, 2.0), 0)  # a decode step: it moves out
        tenant.update(*written(1, 2, 4.0), 0)  # the rest of the prompt
        assert orphan.absorb([tenant]) == [0]
    slab = orphan._slabs[0]
    assert slab.keys[1, 0, -3:, 0].tolist() == [3.0, 4.0, 4.0]
    assert not slab.keys[1, 0, :-3].any()  # and nothing before its own columns

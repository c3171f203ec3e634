"""The KV cache of a batch, kept in preallocated storage that is written in place.

transformers' ``DynamicCache`` grows by concatenation: every forward pass copies each
layer's whole cache into a new tensor a column longer, and continuous batching adds more
copies (a newcomer's cache and the running one are padded to one length, then stacked).
At 2 rows of 4,000 positions of SmolLM2-135M that is 370 MB copied per decode step, and the
join of a long prompt to a running stream took 0.7-0.85 s on a 2-core machine, most of it
faulting in memory the process had never touched (issue 9's long-prompt gap).

:class:`PreallocatedCache` is a ``DynamicCache`` whose layers keep their keys and values
in buffers with room to spare, shaped ``(row capacity, heads, column capacity,
head_dim)``: each row is a slot a request holds from its join to its leaving. Rows
``[0, rows)`` and columns ``[start, end)`` are in use; the model sees them as views, so a
decode step writes one column in place (the same column of every row: rows end together,
left-padded), leading columns that became padding for every row are dropped by moving
``start``, and a row that leaves is zeroed and its place taken by the last row.

Buffers read as zeros until written (:func:`zeroed_buffer`: on a CPU, pages the kernel maps
on first write), and free rows are kept zero. That is what lets a cache reserve generously
and take in other batches without moving its own rows. :meth:`PreallocatedCache.absorb`,
the join of a newly prefilled batch to a running one, copies the newcomer's rows into free
rows, ending at the running rows' last column: a newcomer longer than the running rows lands
in columns left free before theirs (``room_on_left``), where the running rows read zeros
(masked out by their attention masks, and finite: a NaN there would still reach the
attention output). Nothing of the running rows is copied or padded, and on a CPU reserved
rows and columns cost address space, not resident memory, until a request writes them. Only
a join that exceeds what was reserved reallocates (growing by half), copying the rows in use once.

A request can take its slot on admission instead: :meth:`PreallocatedCache.lease` lends free
rows of the running cache to a prefill's cache, whose layers are views of those rows, so its
prompt is written in place, ending at most at the running rows' last column (they go on
decoding meanwhile: the prompt's rows then end a few columns before theirs, zeros in
between, masked). Its join takes the rows over as they are, copying nothing. A prefill that
is dropped frees its rows (zeroed when the cache next needs them); one whose rows no longer
follow the running ones (a running row left), or whose host must move its buffers first,
gets buffers of its own and joins by a copy, as above.

The buffers are written under ``torch.inference_mode`` (the forward pass allocates them
there, and tensors made there can be changed only there), so every method that changes them
runs in it.

transformers 4.56 moved a ``DynamicCache``'s tensors from two lists (``key_cache``,
``value_cache``) into layer objects (``cache.layers[i].keys``); the djl-serving images
carry 4.45 and 4.51. The cache overrides ``update`` (the one method every release calls,
with the same arguments) and publishes its views in whichever layout the release reads.

Example::

    >>> import torch
    >>> cache = PreallocatedCache(reserve_rows=3, reserve_columns=16)
    >>> keys, values = cache.update(torch.ones(2, 1, 4, 8), torch.ones(2, 1, 4, 8), 0)
    >>> tuple(keys.shape), seq_length(cache), num_rows(cache)
    ((2, 1, 4, 8), 4, 2)
    >>> other = PreallocatedCache()
    >>> _ = other.update(torch.full((1, 1, 3, 8), 2.0), torch.full((1, 1, 3, 8), 2.0), 0)
    >>> cache.absorb([other])              # 1 row of 3 positions joins 2 rows of 4
    [0]
    >>> layers(cache)[0].keys[2, 0, :, 0].tolist()  # left-padded with zeros
    [0.0, 2.0, 2.0, 2.0]
    >>> longer = PreallocatedCache()
    >>> _ = longer.update(torch.full((1, 1, 6, 8), 3.0), torch.full((1, 1, 6, 8), 3.0), 0)
    >>> roomy = PreallocatedCache(reserve_rows=2, room_on_left=8)
    >>> _ = roomy.update(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), 0)
    >>> roomy.absorb([longer])             # 6 positions join 2, which stay where they are
    [0]
    >>> layers(roomy)[0].keys[:, 0, :, 0].tolist()
    [[0.0, 0.0, 0.0, 0.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0, 3.0, 3.0]]
"""

from __future__ import annotations

import functools
import math
import mmap
import weakref
from typing import List, Optional, Sequence

import torch
from transformers import DynamicCache

#: Columns are reserved in multiples of this, so that a cache grows rarely.
COLUMN_GRANULE = 64
#: A buffer that must grow grows by at least half, so that growing is rare (each growth
#: copies the columns in use).
GROWTH = 1.5


class _ListLayer:
    """Layer ``index`` of a cache that keeps ``key_cache``/``value_cache`` lists
    (transformers < 4.56), with the ``keys``/``values`` of the later layer objects."""

    __slots__ = ("_cache", "_index")

    def __init__(self, cache, index: int) -> None:
        self._cache = cache
        self._index = index

    @property
    def keys(self) -> torch.Tensor:
        return self._cache.key_cache[self._index]

    @keys.setter
    def keys(self, tensor: torch.Tensor) -> None:
        self._cache.key_cache[self._index] = tensor

    @property
    def values(self) -> torch.Tensor:
        return self._cache.value_cache[self._index]

    @values.setter
    def values(self, tensor: torch.Tensor) -> None:
        self._cache.value_cache[self._index] = tensor


def _all_layers(cache) -> List:
    if hasattr(cache, "layers"):
        return list(cache.layers)
    return [_ListLayer(cache, i) for i in range(len(cache.key_cache))]


def layers(cache) -> List:
    """Each layer of ``cache`` written so far, as an object with ``keys`` and ``values``
    (the layer itself from 4.56 on, a view of the two lists before)."""
    return [layer for layer in _all_layers(cache) if getattr(layer, "keys", None) is not None
            and layer.keys.numel() > 0]


def seq_length(cache) -> int:
    """Number of positions held per row (0 for a cache never written)."""
    written = layers(cache)
    return written[0].keys.shape[2] if written else 0


def num_rows(cache) -> int:
    written = layers(cache)
    return written[0].keys.shape[0] if written else 0


def _round_up(columns: int) -> int:
    return -(-columns // COLUMN_GRANULE) * COLUMN_GRANULE


def reserving_is_free(device) -> bool:
    """Whether rows and columns a cache reserves on ``device`` cost address space only
    (resident memory only once written): true on a CPU, where :func:`zeroed_buffer` maps
    fresh pages, unless the kernel counts every mapped page against a limit
    (``vm.overcommit_memory=2``); a GPU's memory is taken whole at allocation."""
    return torch.device(device).type == "cpu" and _overcommit_mode() != "2"


@functools.lru_cache(maxsize=None)
def _overcommit_mode() -> str:
    """``vm.overcommit_memory``, read once per process (asked at every prefill)."""
    try:
        with open("/proc/sys/vm/overcommit_memory") as mode:
            return mode.read().strip()
    except OSError:  # not Linux: mapped pages are not counted up front there either
        return "0"


def columns_per_page(buffer: torch.Tensor) -> int:
    """How many columns of one row and head of a cache ``buffer`` (``(rows, heads,
    columns, head_dim)``) one memory page holds (at least 1).

    >>> columns_per_page(torch.zeros(1, 1, 64, 64))  # float32: 256 bytes a column
    16
    """
    return max(1, mmap.PAGESIZE // (buffer.shape[3] * buffer.element_size()))


def zeroed_buffer(shape: Sequence[int], like: torch.Tensor) -> torch.Tensor:
    """A tensor of ``shape`` (``like``'s dtype and device) that reads as zeros.

    On a CPU it lies on anonymous memory mapped for it: the kernel gives zero pages, and
    a page becomes resident only once written, so rows and columns a cache reserves cost
    nothing until a token is written there (``torch.zeros`` would write every page).
    Transparent huge pages are refused for it: a 2 MB page would make a whole
    ``(row, head)`` block resident for one written column. Elsewhere it is ``torch.zeros``.

    >>> zeroed_buffer((2, 3), torch.ones(1)).tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    size = math.prod(shape) * like.element_size()
    if like.device.type != "cpu" or size == 0:
        return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
    try:
        pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError):  # refused (a limit on address space), or no such flags
        return torch.zeros(tuple(shape), dtype=like.dtype, device=like.device)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    # (the tensor holds the mapping: it is unmapped when the tensor is freed)
    return torch.frombuffer(pages, dtype=like.dtype).view(tuple(shape))


class _Slab:
    """One layer's keys and values in buffers of ``(row_capacity, heads, column_capacity,
    head_dim)``; see the module docstring for the invariants. ``first[r]`` is the lowest
    column row ``r`` has written (its own padding included) and ``written_end`` one past
    the highest column any row may have written (a pass that raised half-way included):
    between them is what a row that leaves zeroes."""

    __slots__ = ("keys_buffer", "values_buffer", "rows", "start", "end", "first",
                 "room_on_left", "written_end")

    def __init__(self, keys_buffer: torch.Tensor, values_buffer: torch.Tensor,
                 room_on_left: int = 0) -> None:
        self.keys_buffer, self.values_buffer = keys_buffer, values_buffer
        self.room_on_left = room_on_left
        self.rows, self.start, self.end = 0, room_on_left, room_on_left
        self.first: List[int] = []
        self.written_end = room_on_left

    @classmethod
    def allocate(cls, like: torch.Tensor, row_capacity: int, column_capacity: int,
                 value_dim: Optional[int] = None, room_on_left: int = 0) -> "_Slab":
        """Buffers reading as zeros (:func:`zeroed_buffer`), the first write to land at
        column ``room_on_left``."""
        _, heads, _, dim = like.shape
        keys = zeroed_buffer((row_capacity, heads, column_capacity, dim), like)
        values = zeroed_buffer((row_capacity, heads, column_capacity, value_dim or dim), like)
        return cls(keys, values, room_on_left)

    @property
    def row_capacity(self) -> int:
        return self.keys_buffer.shape[0]

    @property
    def column_capacity(self) -> int:
        return self.keys_buffer.shape[2]

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def keys(self) -> torch.Tensor:
        return self.keys_buffer[:self.rows, :, self.start:self.end]

    @property
    def values(self) -> torch.Tensor:
        return self.values_buffer[:self.rows, :, self.start:self.end]

    def begin(self, rows: int, columns: int) -> None:
        """Start over empty with ``rows`` rows, room made for ``columns`` columns from
        ``room_on_left`` (a first write, or the rewrite of a pass cut back to nothing: it
        writes the same columns again)."""
        self.rows, self.first = 0, []  # (so that a reallocation copies none)
        self.start = self.end = self.room_on_left
        if rows > self.row_capacity or self.start + columns > self.column_capacity:
            self.reallocate(rows, columns)
        self.rows, self.first = rows, [self.start] * rows

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Write ``keys``/``values`` (one row each per row in use; all rows on the first
        write) after the columns in use."""
        new = keys.shape[2]
        if self.length == 0:
            self.begin(keys.shape[0], new)
        elif keys.shape[0] != self.rows:
            raise ValueError(f"{keys.shape[0]} rows written into a cache of {self.rows}")
        if self.end + new > self.column_capacity:
            self.reallocate(self.row_capacity, self.length + new)
        columns = slice(self.end, self.end + new)
        self.written_end = max(self.written_end, columns.stop)
        self.keys_buffer[:self.rows, :, columns] = keys
        self.values_buffer[:self.rows, :, columns] = values
        self.end += new

    def reallocate(self, row_capacity: int, columns_needed: int,
                   room_on_left: Optional[int] = None) -> None:
        """Move the rows and columns in use into new buffers of at least ``row_capacity``
        rows with room for ``columns_needed`` columns after ``room_on_left`` (this slab's
        own by default) free ones; either grows by :data:`GROWTH` at least when it must
        grow. The rows in use keep the columns in use only (their own padding before
        them is dropped)."""
        if room_on_left is not None:
            self.room_on_left = room_on_left
        left = self.room_on_left
        columns = self.column_capacity
        if left + columns_needed > columns:
            columns = _round_up(max(left + columns_needed, int(columns * GROWTH)))
        rows = self.row_capacity
        if row_capacity > rows:
            rows = max(row_capacity, int(rows * GROWTH))
        in_use = (slice(0, self.rows), slice(None), slice(self.start, self.end))
        self.keys_buffer = _moved(self.keys_buffer, rows, columns, in_use, left)
        self.values_buffer = _moved(self.values_buffer, rows, columns, in_use, left)
        self.start, self.end = left, left + self.length
        self.first = [self.start] * self.rows
        self.written_end = self.end

    def new_pages(self, column: int, count: int) -> Optional[slice]:
        """The columns, from ``[column, column + count)`` to the end of their last memory
        page, that lie on pages none of ``[0, column)`` is on (each row and head's block
        of columns is contiguous: a page holds :func:`columns_per_page` columns), or
        ``None`` where the columns stay on the page of ``column - 1``."""
        span = columns_per_page(self.keys_buffer)
        first_new = -(-column // span) * span
        stop = min(self.column_capacity, -(-(column + count) // span) * span)
        return slice(first_new, stop) if first_new < stop else None

    def make_resident(self, rows: int, columns: slice) -> None:
        """Write zeros over ``columns`` (:meth:`new_pages`) of rows ``[0, rows)``, before a
        step writes them itself. Zeros are what unwritten columns read, so nothing changes
        but when the pages become resident.

        Why: on a CPU the buffers are mapped lazily (:func:`zeroed_buffer`), and a
        compiled step that reads a column before writing it (the batch program keeps its
        padding rows' columns as they were) takes two page faults per page inside its
        threads, a fault for every row, head, layer, keys and values once every page of
        columns: at 16 rows of SmolLM2 in float32 (16 columns a page), 5,760 faults that
        made every 16th step 27 ms longer (80 ms against 53). Written here first, in
        bulk, they are 2,880 faults of the ordinary kind.
        """
        self.keys_buffer[:rows, :, columns].zero_()
        self.values_buffer[:rows, :, columns].zero_()

    def zero_rows(self, rows: Sequence[int]) -> None:
        """Zero what rows ``rows`` (indices of rows in use) have written: they are free."""
        for row in rows:
            written = slice(min(self.first[row], self.written_end), self.written_end)
            self.keys_buffer[row, :, written].zero_()
            self.values_buffer[row, :, written].zero_()

    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep ``rows`` (indices of rows in use), in that order, as rows ``0..len-1``;
        the rows freed are zeroed (free rows read as zeros)."""
        columns = slice(self.start, self.end)
        moved = [(target, source) for target, source in enumerate(rows) if source != target]
        if moved:
            # What a row that leaves wrote before the columns in use (its padding, trimmed
            # away) would stay under the row that takes its place: zeroed first.
            for target, _ in moved:
                if target < self.rows and self.first[target] < self.start:
                    stale = slice(self.first[target], self.start)
                    self.keys_buffer[target, :, stale].zero_()
                    self.values_buffer[target, :, stale].zero_()
            # Two operations a buffer (not one per row: a batch of 32 rows would run
            # thousands of small copies); the rows that move are read before any is written.
            device = self.keys_buffer.device
            targets = torch.tensor([t for t, _ in moved], dtype=torch.long, device=device)
            sources = torch.tensor([s for _, s in moved], dtype=torch.long, device=device)
            for buffer in (self.keys_buffer, self.values_buffer):
                window = buffer[:, :, columns]
                window.index_copy_(0, targets, window.index_select(0, sources))
        first = [self.first[row] if row == target else self.start
                 for target, row in enumerate(rows)]
        self.zero_rows(range(len(rows), self.rows))
        self.rows, self.first = len(rows), first

    def take(self, other: "_Slab") -> None:
        """Copy ``other``'s rows in after these, ending at the same column; the columns in
        use widen to the left when ``other`` is longer (the rows in use read zeros there).
        Room must have been made (:meth:`PreallocatedCache.absorb` does)."""
        needed = self.rows + other.rows
        first_column = self.end - other.length
        if needed > self.row_capacity or first_column < 0:
            raise ValueError("no room made for the rows taken in")
        rows = slice(self.rows, needed)
        columns = slice(first_column, self.end)
        self.keys_buffer[rows, :, columns] = other.keys
        self.values_buffer[rows, :, columns] = other.values
        self.first += [first_column + max(row_first - other.start, 0)
                       for row_first in other.first]
        self.start = min(self.start, first_column)
        self.rows = needed

    def copy_to_own_buffers(self) -> None:
        """Give this slab buffers of its own, of the same shape, holding what its rows in
        use wrote (its buffers were views of another cache's rows; free rows, whatever a
        prefill they lent them to wrote there, start zero)."""
        written = self.written_columns()
        in_use = (slice(0, self.rows), slice(None), written)
        rows, columns = self.row_capacity, self.column_capacity
        self.keys_buffer = _moved(self.keys_buffer, rows, columns, in_use, written.start)
        self.values_buffer = _moved(self.values_buffer, rows, columns, in_use, written.start)

    def written_columns(self) -> slice:
        """The columns any row in use may have written (an empty slice if none)."""
        if not self.rows:
            return slice(self.start, self.start)
        return slice(min(min(self.first), self.written_end), self.written_end)


class _Lease:
    """Rows ``[first_row, first_row + rows)`` of a cache's buffers lent to the cache of a
    prefill (the tenant, held weakly: a prefill that is dropped ends its lease), which
    writes its prompts there in place (:meth:`PreallocatedCache.lease`). ``slabs`` are the
    tenant's, one per layer, over ``views`` of the ``lent`` buffers (the lender's at the
    time); ``columns`` is the span the tenant may write."""

    __slots__ = ("tenant", "first_row", "slabs", "views", "lent", "columns")

    def __init__(self, tenant: "PreallocatedCache", first_row: int, slabs: List[_Slab],
                 lent: List[_Slab], columns: slice) -> None:
        self.tenant = weakref.ref(tenant)
        self.first_row = first_row
        self.slabs = slabs
        self.views = [(slab.keys_buffer, slab.values_buffer) for slab in slabs]
        self.lent = [(slab.keys_buffer, slab.values_buffer) for slab in lent]
        self.columns = columns

    def tenant_in_place(self) -> bool:
        """Whether every tenant layer still writes into the views it was lent (it would
        have moved out only by growing, which a lease's rows and columns are sized to
        avoid)."""
        return all(slab.keys_buffer is keys and slab.values_buffer is values
                   for slab, (keys, values) in zip(self.slabs, self.views))

    def in_place(self, lender: Sequence[_Slab]) -> bool:
        """Whether the tenant's rows are in ``lender``'s (the lender's slabs') buffers:
        the tenant writes where it was lent, and the lender's buffers are the ones lent
        (a lender that moved its buffers, however, left the tenant's rows behind)."""
        return self.tenant_in_place() and all(
            slab.keys_buffer is keys and slab.values_buffer is values
            for slab, (keys, values) in zip(lender, self.lent))

    def clear(self, *, keep_for_tenant: bool) -> None:
        """Zero what the tenant wrote in the lent rows (they are free again); with
        ``keep_for_tenant``, first give the tenant buffers of its own holding it (it goes
        on as a cache of its own, joined later by a copy)."""
        in_place = self.tenant_in_place()
        for slab, views in zip(self.slabs, self.views):
            written = slab.written_columns() if in_place else self.columns
            if keep_for_tenant and in_place:
                slab.copy_to_own_buffers()
            for view in views:
                view[:, :, written].zero_()
        tenant = self.tenant()
        if tenant is not None:
            tenant._lender = None


def _moved(buffer: torch.Tensor, rows: int, columns: int, in_use: tuple,
           at_column: int) -> torch.Tensor:
    """A new ``(rows, heads, columns, dim)`` buffer reading as zeros but for
    ``buffer[in_use]``, at row 0 and column ``at_column``."""
    moved = zeroed_buffer((rows, buffer.shape[1], columns, buffer.shape[3]), buffer)
    kept = buffer[in_use]
    moved[:kept.shape[0], :, at_column:at_column + kept.shape[2]] = kept
    return moved


def choose_host(caches: Sequence["PreallocatedCache"]) -> int:
    """Which of ``caches`` (written, to be joined into one) should take in the others:
    one that lent rows to another of them (:meth:`~PreallocatedCache.lease`: its tenant's
    rows are in place already); else, of those with room for all their rows and their
    longest (:meth:`~PreallocatedCache.has_room_for`), the one holding the most (rows ×
    columns), so that the least is copied; where none has room, the one with the most
    rows (it grows). The first wins a tie.

    >>> small, big = PreallocatedCache(reserve_rows=4), PreallocatedCache(reserve_rows=4)
    >>> _ = small.update(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), 0)
    >>> _ = big.update(torch.ones(1, 1, 5, 8), torch.ones(1, 1, 5, 8), 0)
    >>> choose_host([small, big])   # the longer one (no room on the left in the other)
    1
    """
    for index, cache in enumerate(caches):
        if any(other is cache.tenant() for other in caches):
            return index
    rows = sum(num_rows(cache) for cache in caches)
    longest = max(seq_length(cache) for cache in caches)
    roomy = [i for i, cache in enumerate(caches) if cache.has_room_for(rows, longest)]
    if roomy:
        return max(roomy, key=lambda i: num_rows(caches[i]) * seq_length(caches[i]))
    return max(range(len(caches)), key=lambda i: num_rows(caches[i]))


class PreallocatedCache(DynamicCache):
    """A ``DynamicCache`` whose layers are written in place; see the module docstring.

    ``reserve_rows`` and ``reserve_columns`` are what the first write reserves at least:
    rows for batches expected to join this one, columns for the tokens its requests may
    still generate; ``room_on_left`` columns are left free before the first write, for
    longer rows to join without moving these. Each grows when exceeded.
    """

    def __init__(self, reserve_rows: int = 0, reserve_columns: int = 0,
                 room_on_left: int = 0) -> None:
        super().__init__()
        self.reserve_rows = reserve_rows
        self.reserve_columns = reserve_columns
        self.room_on_left = room_on_left
        self._slabs: List[Optional[_Slab]] = []
        self._lease: Optional[_Lease] = None
        #: The cache whose rows this one's buffers are (:meth:`lease`), held weakly.
        self._lender: Optional[weakref.ReferenceType] = None

    # -- what the model calls ---------------------------------------------------------

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args, **kwargs):
        if self._lender is not None:
            self._leave_a_gone_lender()
        while len(self._slabs) <= layer_idx:
            self._slabs.append(None)
        slab = self._slabs[layer_idx]
        if slab is None:
            slab = self._slabs[layer_idx] = self._new_slab(
                key_states, key_states.shape[0], key_states.shape[2],
                value_dim=value_states.shape[3])
        elif slab.length == 0 or slab.end + key_states.shape[2] > slab.column_capacity:
            self._end_lease()  # the buffers are about to be replaced
        slab.append(key_states, value_states)
        return self._publish(layer_idx)

    def _new_slab(self, like: torch.Tensor, rows: int, columns: int,
                  value_dim: Optional[int] = None) -> _Slab:
        """A layer's buffers for a first write of ``rows`` × ``columns``, with the rows and
        columns this cache reserves."""
        return _Slab.allocate(
            like, max(self.reserve_rows, rows),
            _round_up(self.room_on_left + max(self.reserve_columns, columns)),
            value_dim=value_dim, room_on_left=self.room_on_left)

    def _publish(self, index: int):
        """Make layer ``index`` of the release's own layout show the slab's views, and
        return them."""
        slab = self._slabs[index]
        keys, values = slab.keys, slab.values
        if hasattr(self, "layers"):
            while len(self.layers) <= index:
                self.layers.append(self.layer_class_to_replicate())
            layer = self.layers[index]
            if not layer.is_initialized:
                layer.lazy_initialization(keys, values)
        else:
            while len(self.key_cache) <= index:
                self.key_cache.append(torch.tensor([]))
                self.value_cache.append(torch.tensor([]))
            layer = _ListLayer(self, index)
        layer.keys, layer.values = keys, values
        return keys, values

    def _publish_all(self) -> None:
        for index, slab in enumerate(self._slabs):
            if slab is not None:
                self._publish(index)

    def _written(self) -> List[_Slab]:
        return [slab for slab in self._slabs if slab is not None]

    # -- what continuous batching calls ----------------------------------------------

    @torch.inference_mode()
    def keep_rows(self, rows: Sequence[int]) -> None:
        """Keep only the batch rows ``rows`` (ints), in that order."""
        for slab in self._written():
            slab.keep_rows(rows)
        self._publish_all()

    @torch.inference_mode()
    def next_columns_buffers(self, rows: int, count: int = 1, *, layers: int = 0,
                             like: Optional[torch.Tensor] = None):
        """For a step that writes the cache itself (:mod:`~djl_stream.generation.llama_decode`:
        a decode step's column, a prompt chunk's ``count`` columns): each layer's whole key
        and value buffers, the first column in use and the first column the step writes
        (the same in every layer); they join the columns in use at
        :meth:`next_columns_written`. Room is made for them first, as :meth:`update`
        makes it. A cache never written is allocated
        first: ``layers`` layers of buffers of ``like``'s dtype, device, heads and head
        size (``like`` is shaped ``(any, heads, any, head_dim)``)."""
        if self._lender is not None:
            self._leave_a_gone_lender()
        slabs = self._slabs
        if not slabs and layers and like is not None:
            slabs = self._slabs = [self._new_slab(like, rows, count) for _ in range(layers)]
        if not slabs or any(slab is None for slab in slabs):
            raise ValueError("every layer must be written before a decode step")
        if slabs[0].length == 0 and all(slab.length == 0 for slab in slabs):
            for slab in slabs:  # a first write (or a rewrite after a cut back to nothing)
                slab.begin(rows, count)
        first = slabs[0]
        if any((slab.rows, slab.start, slab.end) != (rows, first.start, first.end)
               for slab in slabs):
            raise ValueError(f"a step of {rows} rows over a cache whose layers hold "
                             f"(rows, start, end) {[(x.rows, x.start, x.end) for x in slabs]}")
        if any(slab.end + count > slab.column_capacity for slab in slabs):
            self._end_lease()
            # every layer moves together, so that they keep one start and end
            for slab in slabs:
                slab.reallocate(slab.row_capacity, slab.length + count)
        # Every layer has the same columns and pages: asked once a step, not per layer.
        # (On a CPU the buffers are mapped lazily: zeroed_buffer.)
        new_pages = (first.new_pages(first.end, count)
                     if rows and first.keys_buffer.device.type == "cpu" else None)
        for slab in slabs:
            slab.written_end = max(slab.written_end, slab.end + count)
            if new_pages is not None:
                slab.make_resident(rows, new_pages)
        return ([slab.keys_buffer for slab in slabs], [slab.values_buffer for slab in slabs],
                first.start, first.end)

    def next_columns_written(self, count: int = 1) -> None:
        """The ``count`` columns :meth:`next_columns_buffers` made room for now hold every
        layer's keys and values: they join the columns in use."""
        for slab in self._slabs:
            slab.end += count
        self._publish_all()

    def trim_left(self, columns: int) -> None:
        """Drop the first ``columns`` positions of every row (padding no row attends to)."""
        if columns <= 0:
            return
        for slab in self._written():
            slab.start += min(columns, slab.length)
        self._publish_all()

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` positions of every layer (layers that hold no more are
        left alone): undoes what a forward pass that raised half-way wrote."""
        for slab in self._written():
            slab.end = min(slab.end, slab.start + length)
        self._publish_all()

    @torch.inference_mode()
    def copy_rows(self, rows: Sequence[int]) -> "PreallocatedCache":
        """A new cache holding a copy of the batch rows ``rows``; this one is left as it
        was."""
        copy = PreallocatedCache(reserve_columns=self.reserve_columns)
        for layer_index, slab in enumerate(self._slabs):
            if slab is not None:
                index = torch.tensor(list(rows), dtype=torch.long, device=slab.keys.device)
                copy.update(slab.keys.index_select(0, index), slab.values.index_select(0, index),
                            layer_index)
        return copy

    def has_room_for(self, rows: int, columns: int) -> bool:
        """Whether :meth:`absorb` can take in rows up to ``rows`` in all, of up to
        ``columns`` positions, without reallocating."""
        return all(rows <= slab.row_capacity and columns <= slab.end for slab in self._written())

    # -- lending rows to a prefill --------------------------------------------------------

    def tenant(self) -> Optional["PreallocatedCache"]:
        """The cache this one lent rows to (:meth:`lease`), while it lives."""
        return self._lease.tenant() if self._lease is not None else None

    @torch.inference_mode()
    def lease(self, rows: int, columns: int) -> Optional["PreallocatedCache"]:
        """A cache for a prefill of ``rows`` rows of up to ``columns`` positions whose
        buffers are free rows of this one, or ``None`` where this cache has not the room
        (or lent rows already).

        The prefill writes its prompts in place, ending at most at the column these rows
        end at now (this cache's rows go on decoding meanwhile, so the prompts may end a
        few columns before theirs): its join (:meth:`absorb`) is then bookkeeping, not a
        copy, and the columns between the prompts' end and this cache's (zeros) are
        masked (``absorb`` says how many). A prefill that is dropped frees its rows
        (zeroed when this cache next needs them); where this cache must move its buffers
        or take in another batch first, the prefill is given buffers of its own (one
        copy, as any join costs) and joins by a copy.

        >>> running = PreallocatedCache(reserve_rows=4, room_on_left=8)
        >>> _ = running.update(torch.ones(1, 1, 2, 8), torch.ones(1, 1, 2, 8), 0)
        >>> prefill = running.lease(rows=1, columns=5)
        >>> _ = prefill.update(torch.full((1, 1, 5, 8), 3.0), torch.full((1, 1, 5, 8), 3.0), 0)
        >>> _ = running.update(torch.ones(1, 1, 1, 8), torch.ones(1, 1, 1, 8), 0)  # a step
        >>> running.absorb([prefill])      # no copy: 1 column between its end and theirs
        [1]
        >>> layers(running)[0].keys[:, 0, :, 0].tolist()
        [[0.0, 0.0, 0.0, 1.0, 1.0, 1.0], [3.0, 3.0, 3.0, 3.0, 3.0, 0.0]]
        """
        if self._lender is not None:
            self._leave_a_gone_lender()
        self._reclaim_lease()
        slabs = self._written()
        if (self._lease is not None or not slabs or len(slabs) != len(self._slabs)
                or not self.has_room_for(num_rows(self) + rows, columns)):
            return None
        first_row, end = slabs[0].rows, slabs[0].end
        tenant = PreallocatedCache()
        tenant._slabs = [
            _Slab(slab.keys_buffer[first_row:first_row + rows],
                  slab.values_buffer[first_row:first_row + rows], room_on_left=end - columns)
            for slab in slabs]
        self._lease = _Lease(tenant, first_row, list(tenant._slabs), slabs,
                             slice(end - columns, end))
        tenant._lender = weakref.ref(self)
        return tenant

    def _leave_a_gone_lender(self) -> None:
        """Where the cache that lent this one its rows is gone (its batch ended or was
        split while this prefill was under way), copy what this cache holds into buffers
        of its own: its views would keep the lender's whole buffers resident."""
        if self._lender() is None:
            self._lender = None
            self._end_lease()  # (a prefill it lent rows to moves out too)
            for slab in self._written():
                slab.copy_to_own_buffers()

    def _reclaim_lease(self) -> None:
        """End the lease of a tenant that was dropped: its rows are zeroed."""
        if self._lease is not None and self._lease.tenant() is None:
            self._lease.clear(keep_for_tenant=False)
            self._lease = None

    def _end_lease(self) -> None:
        """End any lease before this cache moves its buffers or fills its free rows: a
        living tenant gets buffers of its own (a copy of what it wrote)."""
        if self._lease is not None:
            self._lease.clear(keep_for_tenant=self._lease.tenant() is not None)
            self._lease = None

    def _settle_tenant(self, tenant: "PreallocatedCache") -> Optional[int]:
        """Make the tenant's rows, written in place right after these, rows of this
        cache; return how many columns its rows end before these (or ``None``, leaving
        everything as it was, where they are not in place)."""
        lease = self._lease
        mine, theirs = self._written(), tenant._written()
        if (not lease.in_place(mine) or lease.first_row != mine[0].rows
                or len(theirs) != len(mine) or not theirs[0].rows
                or any(t.end > m.end for m, t in zip(mine, theirs))):
            return None
        gap = mine[0].end - theirs[0].end
        for slab, lent in zip(mine, theirs):
            # A pass that raised may have written past the tenant's end: the masked
            # columns between its end and these rows' end must read as zeros.
            leftover = slice(lent.end, max(lent.written_end, lent.end))
            lent.keys_buffer[:, :, leftover].zero_()
            lent.values_buffer[:, :, leftover].zero_()
            slab.first += lent.first
            slab.start = min(slab.start, lent.start)
            slab.rows += lent.rows
        tenant._forget_buffers()  # (its rows are this cache's now)
        self._lease = None
        return gap

    def _forget_buffers(self) -> None:
        """Drop every view of the buffers: whoever still holds this cache must not keep
        them (a lender's whole buffers, once its rows were taken over) alive."""
        self._slabs, self._lender = [], None
        for layer in _all_layers(self):
            layer.keys = layer.values = torch.empty(0)

    # -- joins ---------------------------------------------------------------------------

    @torch.inference_mode()
    def absorb(self, others: Sequence["PreallocatedCache"]) -> List[int]:
        """Take in the rows of ``others``, after this cache's rows, each ending at the
        column these end at (the left padding a batch needs when caches of different
        lengths are stacked), and return, for each of ``others``, how many columns its
        rows end before these (masked: not 0 only for rows written in place through
        :meth:`lease`, the first of ``others``).

        The rows in use stay where they are: a longer cache's rows land in columns before
        theirs, which they read as zeros, masked. Rows lent to the first of ``others``
        are taken over as they are. Others are copied; only where the rows or the columns
        on the left reserved do not suffice are the buffers reallocated (grown by
        :data:`GROWTH`), and the rows in use copied once."""
        if self._lender is not None:
            self._leave_a_gone_lender()
        self._reclaim_lease()
        gaps = [0] * len(others)
        others = list(others)
        if others and self._lease is not None and others[0] is self.tenant():
            gap = self._settle_tenant(others[0])
            if gap is not None:
                gaps[0], others[0] = gap, None
        written = [other for other in others if other is not None and other._written()]
        if not written:
            self._publish_all()
            return gaps
        self._end_lease()  # (a tenant not taken in above must not be overwritten)
        rows = num_rows(self) + sum(num_rows(other) for other in written)
        longest = max(seq_length(other) for other in written)
        slabs = self._written()
        if not self.has_room_for(rows, longest):
            for slab in slabs:
                needed_on_left = longest - slab.length
                room = (slab.start if slab.start >= needed_on_left
                        else needed_on_left + int(longest * (GROWTH - 1)))
                # (the columns on the right, for the tokens still to come, are kept)
                slab.reallocate(rows, slab.length + slab.column_capacity - slab.end,
                                room_on_left=room)
        for other in written:
            for slab, theirs in zip(self._slabs, other._slabs):
                if slab is not None and theirs is not None:
                    slab.take(theirs)
        self._publish_all()
        return gaps

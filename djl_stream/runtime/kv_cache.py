"""The KV cache: one row of every layer's key and value buffers per sequence, written in place.

Each layer keeps its keys and values in two buffers shaped ``(rows, kv_heads, columns,
head_dim)``. A sequence holds one row from its admission to its end, and writes the keys
and values of its position ``p`` into column ``p``: a column *is* a position. So rows of
different lengths need no padding and no shifting, a row that joins a running batch
lands in the columns it would use alone, and a sliding window is counted in positions
exactly as the model counts it. A row attends to its own columns ``[0, length)``;
whatever an earlier occupant left beyond them is never read.

Rows are handed out as *handles* (:meth:`KVCache.reserve`), and a handle's physical row
may change: a decode step reads the rows of its batch as one contiguous block of the
buffers (a view, no copy), so :meth:`KVCache.place` moves rows into such a block when the
batch's membership changed (a row left, a prompt joined), copying each moved row's
columns in use once.

The cache also knows which token each column of a row holds, and keeps what a finished
sequence's row held until the row is needed again. A new sequence whose prompt begins
with tokens some row holds, a running sequence's or a finished one's (the same system
prompt, the earlier turns of a conversation, a retried request), starts with those
columns (:meth:`KVCache.reserve` with its prompt): it takes a finished row over as it
is, or copies the columns from a running one, and its prompt is read from there on. A
key or value at position ``p`` depends on the tokens up to ``p`` alone, so the columns
are the ones its own pass would write, up to the rounding of a pass of another shape.

On a CPU the buffers lie on freshly mapped anonymous memory (:func:`zeroed_buffer`): a
page becomes resident only once a token is written there, so the cache can reserve every
row and column the server may ever need at no cost. Elsewhere (a GPU's memory is taken
whole at allocation) the columns grow when a row needs more (:meth:`KVCache.need_columns`).

Example::

    >>> import torch
    >>> cache = KVCache([LayerShape(heads=2, key_dim=4, value_dim=4)] * 3, rows=4,
    ...                 columns=16, dtype=torch.float32, device="cpu")
    >>> a, b = cache.reserve(), cache.reserve()
    >>> cache.row_of(a), cache.row_of(b)
    (0, 1)
    >>> c = cache.reserve()
    >>> cache.append(c, [7, 8, 9]); cache.release(b)
    >>> cache.place([a, c])       # c moves into b's row, next to a's
    0
    >>> cache.row_of(c)
    1
"""

from __future__ import annotations

import collections
import dataclasses
import math
import mmap
from typing import Dict, List, Optional, Sequence, Tuple

import torch

#: Columns are allocated in multiples of this where they grow (on a GPU).
COLUMN_GRANULE = 256


@dataclasses.dataclass(frozen=True)
class LayerShape:
    """What one attention layer stores per position: ``heads`` key/value heads of
    ``key_dim`` and ``value_dim`` numbers, on ``device`` (``None``: the cache's)."""

    heads: int
    key_dim: int
    value_dim: int
    device: Optional[str] = None


def zeroed_buffer(shape: Sequence[int], dtype: torch.dtype, device) -> torch.Tensor:
    """A tensor of ``shape`` that reads as zeros, resident only where written on a CPU.

    On a CPU it lies on anonymous memory mapped for it: the kernel maps zero pages as they
    are first written, so rows and columns reserved cost address space, not memory
    (``torch.zeros`` would write every page). Transparent huge pages are refused for it: a
    2 MB page would make a whole block of columns resident for one token. Elsewhere, or
    where the mapping is refused, it is ``torch.zeros``.

    >>> zeroed_buffer((2, 3), torch.float32, "cpu").tolist()
    [[0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]
    """
    device = torch.device(device)
    size = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or size == 0:
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    try:
        pages = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except (OSError, AttributeError, ValueError):
        return torch.zeros(tuple(shape), dtype=dtype, device=device)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):
        try:
            pages.madvise(mmap.MADV_NOHUGEPAGE)
        except OSError:  # a kernel without transparent huge pages
            pass
    # (the tensor holds the mapping: it is unmapped when the tensor is freed)
    return torch.frombuffer(pages, dtype=dtype).view(tuple(shape))


def reserving_is_free(device) -> bool:
    """Whether rows and columns reserved on ``device`` cost address space only: on a CPU,
    unless the kernel counts every mapped page against a limit (``vm.overcommit_memory=2``)."""
    if torch.device(device).type != "cpu":
        return False
    try:
        with open("/proc/sys/vm/overcommit_memory", encoding="ascii") as mode:
            return mode.read().strip() != "2"
    except OSError:  # not Linux: mapped pages are not counted up front there either
        return True


class KVCache:
    """Every layer's keys and values, one row per sequence; see the module docstring.

    ``rows`` is the most sequences held at once. One more row is kept free, so that
    :meth:`place` can always move a row out of the way. ``columns`` is the most positions
    a row may hold; where reserving is not free the buffers start with fewer and grow.
    ``reuse_prefixes=False`` turns the reuse of other rows' columns off.
    """

    def __init__(self, layers: Sequence[LayerShape], *, rows: int, columns: int,
                 dtype: torch.dtype, device, initial_columns: Optional[int] = None,
                 reuse_prefixes: bool = True) -> None:
        self.layer_shapes = list(layers)
        self.rows = rows
        self.max_columns = columns
        self.dtype = dtype
        self.device = torch.device(device)
        free = reserving_is_free(self.device)
        start = columns if free or initial_columns is None else min(columns, initial_columns)
        self.keys: List[torch.Tensor] = []
        self.values: List[torch.Tensor] = []
        self._allocate(_round_up(start, columns))
        self._row_of: Dict[int, int] = {}
        # The tokens whose keys and values a handle's columns hold (its length is theirs);
        # and for a row no handle holds, what its columns still hold since its last holder
        # left, the longest left first to go.
        self._tokens: Dict[int, List[int]] = {}
        self._left: "collections.OrderedDict[int, List[int]]" = collections.OrderedDict()
        self.reuse_prefixes = reuse_prefixes
        #: Positions new rows started with, taken from other rows instead of computed.
        self.reused_positions = 0
        self._next_handle = 0

    @property
    def columns(self) -> int:
        """Positions each row can hold now."""
        return self.keys[0].shape[2] if self.keys else 0

    def _allocate(self, columns: int) -> None:
        keys, values = [], []
        for shape in self.layer_shapes:
            device = shape.device or self.device
            keys.append(zeroed_buffer((self.rows + 1, shape.heads, columns, shape.key_dim),
                                      self.dtype, device))
            values.append(zeroed_buffer((self.rows + 1, shape.heads, columns, shape.value_dim),
                                        self.dtype, device))
        if self.keys:  # growing: the columns written so far come along
            used = max(map(len, [*self._tokens.values(), *self._left.values()]), default=0)
            for old, new in zip(self.keys + self.values, keys + values):
                new[:, :, :used].copy_(old[:, :, :used])
        self.keys, self.values = keys, values

    # -- rows ---------------------------------------------------------------------------

    def reserve(self, prompt: Sequence[int] = ()) -> int:
        """A handle to a free row. It is empty (length 0), unless a row holds the first
        tokens of ``prompt``: then it holds their keys and values already, all of them but
        the prompt's last at most, and its :meth:`length` says how many. Raises
        ``RuntimeError`` when every row is held.

        >>> cache = KVCache([LayerShape(1, 2, 2)], rows=2, columns=8, dtype=torch.float32,
        ...                 device="cpu")
        >>> a = cache.reserve([5, 6, 7])
        >>> cache.append(a, [5, 6, 7, 8]); cache.release(a)     # a prompt and one new token
        >>> b = cache.reserve([5, 6, 7, 8, 9])                  # a conversation's next turn
        >>> cache.length(b), cache.row_of(b)                    # a's row, taken over
        (4, 0)
        >>> c = cache.reserve([5, 6, 1])                        # copied from b's row
        >>> cache.length(c), cache.row_of(c)
        (2, 1)
        """
        taken = set(self._row_of.values())
        free = [r for r in range(self.rows) if r not in taken]
        if not free:
            raise RuntimeError(f"all {self.rows} rows of the KV cache are in use")
        source, reused = self._longest_prefix(prompt) if self.reuse_prefixes else (None, 0)
        row = source if source in free and source in self._left else self._emptiest(free)
        self._left.pop(row, None)
        handle = self._next_handle
        self._next_handle += 1
        self._row_of[handle] = row
        self._tokens[handle] = list(prompt[:reused])
        self.reused_positions += reused
        if reused and source != row:
            with torch.inference_mode():
                for buffer in self.keys + self.values:
                    buffer[row, :, :reused].copy_(buffer[source, :, :reused])
        return handle

    def _longest_prefix(self, prompt: Sequence[int]) -> Tuple[Optional[int], int]:
        """The row holding the longest start of ``prompt`` (its last token excepted: its
        pass gives the logits), and how many tokens of it; a finished row wins a tie,
        since it is taken over with no copy. ``(None, 0)`` where no row holds any."""
        limit = len(prompt) - 1
        best: Tuple[Optional[int], int] = (None, 0)
        if limit < 1:
            return best
        prompt = list(prompt)
        held = [(self._row_of[h], tokens) for h, tokens in self._tokens.items()]
        for row, tokens in [*self._left.items(), *held]:
            count = common_prefix_length(tokens, prompt, limit)
            if count > best[1]:
                best = (row, count)
        return best

    def _emptiest(self, free: List[int]) -> int:
        """Of ``free`` rows, one whose columns nobody may want (the first such), else the
        one left longest ago."""
        unwanted = next((r for r in free if r not in self._left), None)
        if unwanted is not None:
            return unwanted
        return next(r for r in self._left if r in free)

    def release(self, handle: int) -> None:
        """Give the row back; its contents stay for a later prompt that begins the same
        way, until another holder overwrites them."""
        row = self._row_of.pop(handle, None)
        tokens = self._tokens.pop(handle, None)
        if row is not None and tokens:
            self._left[row] = tokens
            self._left.move_to_end(row)

    def row_of(self, handle: int) -> int:
        return self._row_of[handle]

    def length(self, handle: int) -> int:
        """Positions the row holds."""
        return len(self._tokens[handle])

    def append(self, handle: int, tokens: Sequence[int]) -> None:
        """Say the keys and values of ``tokens`` were written after the row's end."""
        self._tokens[handle].extend(map(int, tokens))

    def handles(self) -> List[int]:
        """Every handle held."""
        return list(self._row_of)

    @property
    def held(self) -> int:
        """Rows held now."""
        return len(self._row_of)

    def place(self, handles: Sequence[int], *, at_start: bool = False) -> int:
        """Make ``handles`` occupy consecutive rows (in any order) and return the first;
        read each one's row with :meth:`row_of` after.

        Where they already do (from row 0, with ``at_start``), nothing moves. Otherwise
        they are gathered into rows ``[0, len(handles))``: those already there stay, each one beyond moves into a
        hole (a row of another sequence there is moved out of the way first), so that a
        batch that lost a row costs the copy of one row, not of all the rows after it.

        >>> cache = KVCache([LayerShape(1, 2, 2)], rows=4, columns=4, dtype=torch.float32,
        ...                 device="cpu")
        >>> h = [cache.reserve() for _ in range(4)]
        >>> cache.place([h[1], h[2]])   # rows 1 and 2 already follow each other
        1
        >>> cache.place([h[0], h[2], h[3]])   # h[3] moves in, h[1] moves out of its way
        0
        >>> [cache.row_of(x) for x in h]
        [0, 4, 2, 1]
        """
        rows = sorted(self._row_of[h] for h in handles)
        if not rows or (rows[-1] - rows[0] == len(rows) - 1 and (rows[0] == 0 or not at_start)):
            return rows[0] if rows else 0
        size = len(handles)
        inside = {self._row_of[h] for h in handles if self._row_of[h] < size}
        holes = iter(r for r in range(size) if r not in inside)
        for handle in handles:
            if self._row_of[handle] < size:
                continue
            target = next(holes)
            occupant = next((h for h, r in self._row_of.items() if r == target), None)
            if occupant is not None:
                self._move(occupant, self._free_row(avoid=size))
            self._move(handle, target)
        return 0

    def free_row(self) -> int:
        """A row no handle holds (there always is one: the spare row), for the caller to
        write into: what a finished sequence left there is forgotten.

        >>> KVCache([LayerShape(1, 2, 2)], rows=2, columns=4, dtype=torch.float32,
        ...         device="cpu").free_row()
        2
        """
        row = self._free_row(avoid=self.rows)
        self._left.pop(row, None)
        return row

    def _free_row(self, avoid: int) -> int:
        """A row no handle holds, at or after ``avoid`` where one is (the spare row always
        is), one that holds nothing a later prompt may want where there is a choice."""
        taken = set(self._row_of.values())
        free = [r for r in range(self.rows + 1) if r not in taken]
        after = [r for r in free if r >= avoid] or free[-1:]
        return next((r for r in after if r not in self._left), after[0])

    def _move(self, handle: int, row: int) -> None:
        source, used = self._row_of[handle], len(self._tokens[handle])
        self._left.pop(row, None)
        if used:
            with torch.inference_mode():
                for buffer in self.keys + self.values:
                    buffer[row, :, :used].copy_(buffer[source, :, :used])
        self._row_of[handle] = row

    # -- columns ------------------------------------------------------------------------

    def need_columns(self, columns: int) -> None:
        """Make room for ``columns`` positions per row, growing the buffers (a copy of the
        columns written) where they are shorter. Raises ``ValueError`` beyond the most a
        row may hold."""
        if columns <= self.columns:
            return
        if columns > self.max_columns:
            raise ValueError(f"a sequence of {columns} positions does not fit in the KV "
                             f"cache's {self.max_columns}")
        self._allocate(_round_up(max(columns, 2 * self.columns), self.max_columns))

    def tokens_held(self) -> int:
        """Positions written, over every row held."""
        return sum(map(len, self._tokens.values()))


def common_prefix_length(a: List[int], b: List[int], limit: int) -> int:
    """How many leading items the lists ``a`` and ``b`` share, at most ``limit`` (a binary
    search over slice comparisons, which run in C: prompts may be thousands of tokens).

    >>> common_prefix_length([1, 2, 3, 4], [1, 2, 9], 10), common_prefix_length([1, 2], [1, 2], 1)
    (2, 1)
    """
    low, high = 0, min(len(a), len(b), limit)
    while low < high:
        middle = (low + high + 1) // 2
        if a[:middle] == b[:middle]:
            low = middle
        else:
            high = middle - 1
    return low


def _round_up(columns: int, most: int) -> int:
    return min(most, -(-columns // COLUMN_GRANULE) * COLUMN_GRANULE)

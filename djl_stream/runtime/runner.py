"""Running the model: one forward pass over the tokens any mix of sequences feeds.

A :class:`ModelRunner` owns a model and its KV cache. The scheduling side hands it
:class:`Feed`\\ s, each the next tokens of one sequence (a prompt, part of one, or one
decoded token), and gets back the logits of each feed's last token where it asked for
them: :meth:`ModelRunner.run` is prefill, decode and mixed passes alike.

Two runners share that interface:

* :class:`AttentionRunner`, the fast path for every model whose attention goes through
  transformers' ``AttentionInterface``: the model's own forward runs once over all the
  feeds' tokens, flattened into one sequence, and its attention reads and writes
  djl-stream's :class:`~djl_stream.runtime.kv_cache.KVCache` (see
  :mod:`djl_stream.runtime.attention`);
* :class:`ForwardRunner`, for any other model: each sequence keeps the cache its model's
  forward makes, and each feed runs its own forward pass.

:func:`load_runner` chooses. It tries the fast path on a short probe and keeps it only where
the model computes the same logits through it as through its own attention, so a model
whose attention does something the runtime does not know (shared key and value layers,
chunked attention, layers on several devices) is served correctly by its own forward,
with the reason in one log line.

Example::

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16,
    ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2)).eval()
    >>> runner = load_runner(model, RunnerSettings(max_rows=4, max_positions=64))
    >>> runner.path
    'attention'
    >>> a, b = runner.reserve(), runner.reserve()
    >>> runner.run([Feed(a, [5, 6, 7]), Feed(b, [8, 9])]).shape   # two prompts
    torch.Size([2, 64])
    >>> runner.run([Feed(a, [3]), Feed(b, [4])]).shape              # a decode step
    torch.Size([2, 64])
    >>> runner.length(a), runner.length(b)
    (4, 3)
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from typing import Callable, Dict, Iterator, List, Optional, Sequence

import torch

from djl_stream.runtime import attention
from djl_stream.runtime.attention import AttentionLayout, block_mask, forward_with_layout
from djl_stream.runtime.decode_program import NOT_USED, SWITCHED, distinct_windows
from djl_stream.runtime.kv_cache import KVCache, LayerShape

logger = logging.getLogger(__name__)

#: Tokens of the probe that checks the fast path against the model's own attention; longer
#: where the model slides a shorter window, so that the window is tested too.
PROBE_TOKENS = 12
#: The fast path is kept where its logits on the probe are within this share of the
#: largest logit of the model's own (per dtype: sums in another order differ by more in
#: half precision).
PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2, torch.bfloat16: 5e-2}


@dataclasses.dataclass(frozen=True)
class Feed:
    """The next ``tokens`` of the sequence holding ``handle``, and whether the logits of the
    last of them are wanted (not for a prompt chunk that is not its prompt's last)."""

    handle: int
    tokens: Sequence[int]
    logits: bool = True


@dataclasses.dataclass(frozen=True)
class RunnerSettings:
    """The most sequences held at once (``max_rows``), the most positions one may
    reach (``max_positions``: its prompt and its new tokens), and whether a prompt that
    begins as another did reuses its keys and values (``reuse_prefixes``; see
    :mod:`djl_stream.runtime.kv_cache`)."""

    max_rows: int = 32
    max_positions: int = 8192
    reuse_prefixes: bool = True


class ModelRunner:
    """What both runners offer; see the module docstring."""

    #: ``"attention"`` (the fast path) or ``"forward"`` (the model's forward per sequence).
    path = ""
    #: Whether one pass can carry decode tokens and prompt chunks of several sequences at
    #: once (a mixed pass) at the cost of about one: the weights are read once for all.
    mixes_passes = False

    def __init__(self, model) -> None:
        self.model = model
        self.device = _input_device(model)
        self._abandon: Optional[Callable[[], bool]] = None

    @contextlib.contextmanager
    def abandoned_if(self, abandon: Callable[[], bool]) -> Iterator[None]:
        """Passes run inside this block stop between two layers once ``abandon()`` is true,
        raising :class:`~djl_stream.runtime.attention.PassAbandoned` (no cache grows): a
        long prompt's pass need not run to its end for a client that left. Only the
        attention path can stop a pass part-way; the forward path runs each to its end.

        >>> runner = ModelRunner(torch.nn.Linear(1, 1))
        >>> with runner.abandoned_if(lambda: True):
        ...     runner._abandon()
        True
        """
        self._abandon = abandon
        try:
            yield
        finally:
            self._abandon = None

    def reserve(self, prompt: Sequence[int] = ()) -> int:
        """A handle for a new sequence's cache. Where the runner holds the keys and values
        of ``prompt``'s first tokens already (another sequence's prompt began the same way),
        the cache starts with them: :meth:`length` says how many, and the sequence feeds the
        rest of its prompt."""
        raise NotImplementedError

    def release(self, handle: int) -> None:
        """The sequence left: its cache is free."""
        raise NotImplementedError

    def length(self, handle: int) -> int:
        """Positions the sequence's cache holds."""
        raise NotImplementedError

    def run(self, feeds: Sequence[Feed]) -> torch.Tensor:
        """One pass over ``feeds``: the logits ``(k, vocab)`` of the last token of each
        feed that wants them, in order. Each feed's tokens join its cache; where the pass
        raises, no cache has grown (what it wrote past a cache's end is never read)."""
        raise NotImplementedError

    @property
    def tokens_held(self) -> int:
        """Positions the caches hold, over every sequence."""
        raise NotImplementedError

    @property
    def tokens_reused(self) -> int:
        """Prompt positions new caches started with, reused from other sequences' caches
        instead of computed (see :meth:`reserve`), since the runner was made."""
        return 0

    def handles(self) -> List[int]:
        """Every handle held."""
        raise NotImplementedError

    def compile_decode_step(self, root=None):
        """Start getting a compiled decode step (see :class:`AttentionRunner`); nothing
        here."""
        return None

    def close(self) -> None:
        """Stop whatever the runner runs in the background."""

    def release_all_but(self, live) -> None:
        """Release every handle not in ``live`` (after a failure dropped batches whole)."""
        for handle in self.handles():
            if handle not in live:
                self.release(handle)


@dataclasses.dataclass
class ProgramSlot:
    """One compiled decode step a runner may run: for steps of up to ``rows`` rows
    (``None``: every row count), once ``candidate`` (ready, not yet checked against an
    eager step) has become ``program``."""

    rows: Optional[int]
    candidate: object = None
    program: object = None

    @property
    def said(self) -> str:
        """How the load log names this step (nothing for the one of every row count)."""
        return f" of up to {self.rows} rows" if self.rows else ""


class AttentionRunner(ModelRunner):
    """The model's forward over flattened feeds, its attention on the runner's KV cache."""

    path = "attention"
    mixes_passes = True

    def __init__(self, model, settings: RunnerSettings, layers: Sequence[LayerShape],
                 windows: Sequence[Optional[int]], dtype: torch.dtype) -> None:
        """``windows``: each layer's sliding window (``None``: full attention)."""
        super().__init__(model)
        self.settings = settings
        self.layer_windows = tuple(windows)
        self.windows = distinct_windows(self.layer_windows)
        self.cache = KVCache(layers, rows=settings.max_rows, columns=settings.max_positions,
                             dtype=dtype, device=self.device, initial_columns=1024,
                             reuse_prefixes=settings.reuse_prefixes)
        self._keep_logits = _logits_keyword(model)
        self._no_mask = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=self.device)
        # compiled decode steps: the one of every row count, and where the model streams its
        # float weights, the one of few rows (see decode_program's module docstring)
        self._slots = [ProgramSlot(None)]
        self._builds = None        # what is getting them (decode_program.ProgramBuilds)

    # -- the compiled decode step ---------------------------------------------------------

    @property
    def program(self):
        """The compiled decode step of every row count, once checked (``None`` before)."""
        return self._slots[0].program

    @program.setter
    def program(self, program) -> None:
        self._slots[0].program = program

    @property
    def _candidate(self):
        return self._slots[0].candidate

    @_candidate.setter
    def _candidate(self, candidate) -> None:
        self._slots[0].candidate = candidate

    @property
    def programs_in_use(self) -> List[Optional[int]]:
        """The most rows of each compiled step that decode steps run (``None``: every row
        count), checked and in use."""
        return [slot.rows for slot in self._slots if slot.program is not None]

    def geometry(self):
        """The KV cache's shapes, as a compiled decode step reads them."""
        from djl_stream.runtime.decode_program import CacheGeometry

        cache = self.cache
        return CacheGeometry(
            rows=cache.rows + 1, columns=cache.columns,
            layers=tuple((s.heads, s.key_dim, s.value_dim) for s in cache.layer_shapes),
            layer_windows=self.layer_windows, dtype=str(cache.dtype).replace("torch.", ""))

    def compile_decode_step(self, root=None):
        """Get the compiled decode steps in the background (from the cache, or compiled by
        a process of their own, one after the other); a decode step runs the one made for
        its row count once that one gives the eager step's logits. Only on a CPU, whose
        cache's columns never grow (the programs' shapes are fixed). Returns what is
        getting them (the same on a second call), ``None`` where nothing is."""
        from djl_stream.runtime.decode_program import ProgramBuilds

        if self.device.type == "cuda":
            self._record_cuda_graphs()
            return None
        if self._builds is not None or self.device.type != "cpu" or self.program is not None:
            return self._builds
        plans: List[Optional[int]] = [None]
        few_rows = rows_of_a_streaming_program(self.model)
        if few_rows:
            self._slots.append(ProgramSlot(few_rows))
            # compiled first: a lone stream, the commonest load, gains the most from it,
            # and a step of many rows loses less meanwhile to the eager one
            plans.insert(0, few_rows)
        self._builds = ProgramBuilds(self.model, self.geometry(), plans, root=root)
        self._builds.start()
        return self._builds

    def _record_cuda_graphs(self) -> None:
        """On a GPU: decode steps replayed from CUDA graphs, recorded per bucket as steps
        need them (:mod:`djl_stream.runtime.cuda_graphs`); the first is checked against
        the eager step as a compiled program is."""
        from djl_stream.runtime.cuda_graphs import GraphedDecode

        if self.program is None and self._candidate is None:
            self._candidate = GraphedDecode(self.model, self.cache, self.layer_windows)
            logger.info("decode steps will be replayed from CUDA graphs, recorded per "
                        "bucket of rows and columns as steps need them")

    def close(self) -> None:
        if self._builds is not None:
            self._builds.stop()

    def _slot_for(self, rows: int) -> Optional["ProgramSlot"]:
        """The slot whose program (or program to check) runs a step of ``rows`` rows: the
        one made for the fewest rows that covers them and has one."""
        if self._builds is not None:
            for slot in self._slots:
                if slot.candidate is None and slot.program is None:
                    slot.candidate = self._builds.take(slot.rows)
        covering = [slot for slot in self._slots
                    if (slot.rows is None or rows <= slot.rows)
                    and (slot.program is not None or slot.candidate is not None)]
        return min(covering, key=lambda slot: slot.rows or float("inf"), default=None)

    def _run_program(self, program, block: List[Feed],
                     positions: List[int]) -> Optional[torch.Tensor]:
        """The block's logits (in block order) from the compiled step, its rows ``[0, n)``
        at ``positions``; ``None`` where the program leaves this step to the eager
        forward."""
        cache = self.cache
        count = len(block)
        ids = [int(f.tokens[0]) for f in block]
        decode = getattr(program, "decode", None)
        if decode is not None:  # (CUDA graphs: the program keeps its own inputs)
            return decode(ids, positions)
        rows = list(range(count))
        device = self.device
        position_tensor = torch.tensor([positions], dtype=torch.long, device=device)
        span = max(positions) + 1
        masks = [block_mask(position_tensor[0], span, window) for window in self.windows]
        with torch.inference_mode():
            logits = program(torch.tensor([ids], dtype=torch.long, device=device),
                             position_tensor, torch.tensor(rows, dtype=torch.long, device=device),
                             masks, cache.keys, cache.values)
        return logits

    def _decode_with_program(self, feeds: Sequence[Feed]) -> Optional[torch.Tensor]:
        """Run a decode step of single-token ``feeds`` through the compiled step made for
        its row count where there is one (checking a new one against this step's eager
        logits first); ``None`` where the eager path runs it."""
        cache = self.cache
        if not all(len(f.tokens) == 1 for f in feeds):
            return None
        slot = self._slot_for(len(feeds))
        if slot is None:
            return None
        span = max(cache.length(f.handle) for f in feeds) + 1
        if span >= cache.columns or len(feeds) > cache.rows:
            return None
        cache.place([f.handle for f in feeds], at_start=True)
        block = sorted(feeds, key=lambda f: cache.row_of(f.handle))
        positions = [cache.length(f.handle) for f in block]
        if slot.program is None:
            return self._check(slot, feeds, block, positions)
        try:
            logits = self._run_program(slot.program, block, positions)
        except Exception as error:  # noqa: BLE001 - the eager step goes on serving
            slot.program = None
            logger.warning("the compiled decode step%s failed (%s: %s); %s", slot.said,
                           type(error).__name__, error, NOT_USED)
            return None
        if logits is None:  # (a step the program leaves to the eager forward)
            return None
        for feed in feeds:
            cache.append(feed.handle, feed.tokens)
        if len(logits) == len(feeds) and all(a is b for a, b in zip(block, feeds)):
            return logits  # (already in the feeds' order: indexing would copy them all)
        where = {id(f): i for i, f in enumerate(block)}
        return logits[[where[id(f)] for f in feeds]]

    def _check(self, slot: "ProgramSlot", feeds: Sequence[Feed], block: List[Feed],
               positions: List[int]) -> torch.Tensor:
        """Run this step eagerly and through ``slot``'s candidate program; the program
        serves later steps only where it gave the same logits. Returns the eager ones."""
        program = slot.candidate
        # The program first: both write this step's keys and values at the same places, so
        # the eager step's, written last, are the ones kept, even where the program's were
        # wrong (and the program is not used).
        try:
            compiled = self._run_program(program, block, positions)
        except Exception as error:  # noqa: BLE001 - the eager step goes on serving
            slot.candidate = None
            logger.warning("the compiled decode step%s failed (%s: %s); %s", slot.said,
                           type(error).__name__, error, NOT_USED)
            compiled = None
        eager = self._run_eager(feeds)
        if compiled is None:  # (not ready for this step's shape: check at a later one)
            return eager
        order = [block.index(f) for f in feeds]
        difference = float((compiled[order].float() - eager.float()).abs().max())
        tolerance = (PROBE_TOLERANCE.get(eager.dtype, 5e-2)
                     * max(1.0, float(eager.abs().max())))
        slot.candidate = None
        if difference <= tolerance:
            slot.program = program
            logger.info("%s%s (its logits within %.2g of the eager step's)", SWITCHED,
                        slot.said, difference)
        else:
            logger.warning("the logits of the compiled decode step%s differ from the eager "
                           "step's by %.3g: %s", slot.said, difference, NOT_USED)
        return eager

    def reserve(self, prompt: Sequence[int] = ()) -> int:
        return self.cache.reserve(prompt)

    def release(self, handle: int) -> None:
        self.cache.release(handle)

    def length(self, handle: int) -> int:
        return self.cache.length(handle)

    @property
    def tokens_held(self) -> int:
        return self.cache.tokens_held()

    @property
    def tokens_reused(self) -> int:
        return self.cache.reused_positions

    def handles(self) -> List[int]:
        return self.cache.handles()

    def run(self, feeds: Sequence[Feed]) -> torch.Tensor:
        if not feeds:
            raise ValueError("a pass needs at least one feed")
        logits = self._decode_with_program(feeds)
        return logits if logits is not None else self._run_eager(feeds)

    def _run_eager(self, feeds: Sequence[Feed]) -> torch.Tensor:
        # (the model's forward reads the attention implementation its config names; the
        # compiled program holds its own, and needs no guard)
        with ATTENTION_SWITCH.passing():
            return self._forward_feeds(feeds)

    def _forward_feeds(self, feeds: Sequence[Feed]) -> torch.Tensor:
        cache = self.cache
        singles = [f for f in feeds if len(f.tokens) == 1]
        block: List[Feed] = []
        if len(singles) > 1:
            start = cache.place([f.handle for f in singles])
            block = sorted(singles, key=lambda f: cache.row_of(f.handle))
        elif singles:
            block, start = singles, cache.row_of(singles[0].handle)
        in_block = {id(f) for f in block}
        chunks = [f for f in feeds if id(f) not in in_block]
        ids: List[int] = []
        rows: List[int] = []
        positions: List[int] = []
        where: Dict[int, int] = {}  # id(feed) -> index of its last token in the pass
        spans = []
        for feed in block + chunks:
            first = cache.length(feed.handle)
            count = len(feed.tokens)
            ids.extend(int(t) for t in feed.tokens)
            rows.extend([cache.row_of(feed.handle)] * count)
            positions.extend(range(first, first + count))
            where[id(feed)] = len(ids) - 1
            spans.append(first + count)
        cache.need_columns(max(spans))
        device = self.device
        position_tensor = torch.tensor(positions, dtype=torch.long, device=device)
        chunk_tuples = []
        offset = len(block)
        for feed in chunks:
            count = len(feed.tokens)
            chunk_tuples.append((offset, offset + count, cache.row_of(feed.handle),
                                 cache.length(feed.handle)))
            offset += count
        layout = AttentionLayout(
            rows=torch.tensor(rows, dtype=torch.long, device=device),
            positions=position_tensor, keys=cache.keys, values=cache.values,
            layer_windows=self.layer_windows, block_start=start if block else 0,
            block_rows=len(block), chunks=chunk_tuples, abandon=self._abandon)
        if block:
            block_positions = position_tensor[:len(block)]
            span = max(spans[:len(block)])
            layout.block_masks = {window: block_mask(block_positions, span, window)
                                  for window in self.windows}
        wanted = [where[id(f)] for f in feeds if f.logits]
        logits = self._forward(ids, position_tensor, layout, wanted)
        for feed in feeds:
            cache.append(feed.handle, feed.tokens)
        return logits

    def _forward(self, ids: List[int], positions: torch.Tensor, layout: AttentionLayout,
                 wanted: List[int]) -> torch.Tensor:
        device = self.device
        kwargs = {}
        index = torch.tensor(wanted or [len(ids) - 1], dtype=torch.long, device=device)
        if self._keep_logits:
            kwargs[self._keep_logits] = index
        with torch.inference_mode():
            outputs = forward_with_layout(
                self.model, layout,
                input_ids=torch.tensor([ids], dtype=torch.long, device=device),
                position_ids=positions.unsqueeze(0), attention_mask=self._no_mask,
                use_cache=False, **kwargs)
        if layout.attended < len(self.layer_windows):
            # (such a layer attended its own tokens alone, with no cache: its logits are wrong)
            raise NotImplementedError(
                f"{len(self.layer_windows) - layout.attended} of its "
                f"{len(self.layer_windows)} layers attended without the KV cache's layout")
        logits = outputs.logits[0]
        if not self._keep_logits or logits.shape[0] != index.shape[0]:
            logits = logits[index]
        return logits[:len(wanted)]


class ForwardRunner(ModelRunner):
    """Each sequence through the model's own forward and the cache it makes, one forward
    pass per feed: correct for any causal LM, batched for none."""

    path = "forward"

    def __init__(self, model, reason: str = "") -> None:
        super().__init__(model)
        self.reason = reason
        self._caches: Dict[int, object] = {}
        self._lengths: Dict[int, int] = {}
        self._next = 0

    def reserve(self, prompt: Sequence[int] = ()) -> int:
        # (each sequence's cache is its model's own object: nothing is shared between them)
        handle, self._next = self._next, self._next + 1
        self._caches[handle] = None
        self._lengths[handle] = 0
        return handle

    def release(self, handle: int) -> None:
        self._caches.pop(handle, None)
        self._lengths.pop(handle, None)

    def length(self, handle: int) -> int:
        return self._lengths[handle]

    @property
    def tokens_held(self) -> int:
        return sum(self._lengths.values())

    def handles(self) -> List[int]:
        return list(self._lengths)

    def run(self, feeds: Sequence[Feed]) -> torch.Tensor:
        from djl_stream.runtime.forward_kwargs import cache_kwarg, cache_of

        results = []
        grown = []
        with torch.inference_mode():
            for feed in feeds:
                cache = self._caches[feed.handle]
                ids = torch.tensor([list(feed.tokens)], dtype=torch.long, device=self.device)
                kwargs = cache_kwarg(self.model, cache) if cache is not None else {}
                outputs = self.model(input_ids=ids, use_cache=True, **kwargs)
                grown.append((feed, cache_of(outputs)))
                if feed.logits:
                    results.append(outputs.logits[0, -1])
        for feed, cache in grown:  # (only once every feed ran)
            self._caches[feed.handle] = cache
            self._lengths[feed.handle] += len(feed.tokens)
        return torch.stack(results) if results else torch.empty(0)


class AttentionSwitch:
    """Passes share it; switching a model's attention implementation takes it alone.

    A runner's passes read the attention implementation that the model's config names,
    and loading a runner switches it (its probe runs the model through its own attention
    first). djl's one-call adapter loads a runner per call, so under djl-serving's async
    worker a new call's load can meet another call's passes on the same model: they must
    not overlap. The thread that switches may run passes of its own meanwhile (the probe's).

    >>> switch = AttentionSwitch()
    >>> with switch.switching(), switch.passing():
    ...     "the probe's own pass"
    "the probe's own pass"
    """

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._passes = 0
        self._switcher: Optional[int] = None

    @contextlib.contextmanager
    def passing(self) -> Iterator[None]:
        with self._condition:
            me = threading.get_ident()
            self._condition.wait_for(lambda: self._switcher in (None, me))
            self._passes += 1
        try:
            yield
        finally:
            with self._condition:
                self._passes -= 1
                self._condition.notify_all()

    @contextlib.contextmanager
    def switching(self) -> Iterator[None]:
        with self._condition:
            self._condition.wait_for(lambda: self._switcher is None)
            self._switcher = threading.get_ident()
            self._condition.wait_for(lambda: self._passes == 0)
        try:
            yield
        finally:
            with self._condition:
                self._switcher = None
                self._condition.notify_all()


#: One for the process: a switch is rare (a runner's load) and a pass takes it shared.
ATTENTION_SWITCH = AttentionSwitch()


def rows_of_a_streaming_program(model) -> Optional[int]:
    """The most rows of the compiled decode step whose products stream ``model``'s weights
    (:func:`~djl_stream.runtime.linear_layers.streamed_rows` of their dtype), or ``None``
    where it gets none: only packed layers that kept their float weights, and int8
    weights, have both a streamed and a blocked product.

    >>> rows_of_a_streaming_program(torch.nn.Linear(4, 4)) is None
    True
    """
    from djl_stream.runtime.int8 import quantized_method
    from djl_stream.runtime.linear_layers import streamed_rows
    from djl_stream.runtime.packed_linear import PackedLinear

    kept = [m.weight.dtype for m in model.modules()
            if isinstance(m, PackedLinear) and m.weight is not None]
    if kept:
        return streamed_rows(kept[0])
    if quantized_method(model) == "int8":
        return streamed_rows(torch.int8)
    return None


def load_runner(model, settings: RunnerSettings = RunnerSettings()) -> ModelRunner:
    """The fast path for ``model`` where it computes the model's own logits (checked on a
    probe), the model's forward otherwise; the choice and its reason are logged once."""
    reason = _why_not_the_fast_path(model)
    runner: Optional[ModelRunner] = None
    with ATTENTION_SWITCH.switching():
        _pack_linear_layers(model)
        _weights_on_huge_pages(model)
        if reason is None:
            try:
                runner, reason = _probed_attention_runner(model, settings)
            except Exception as error:  # noqa: BLE001 - any failure means: not this path
                reason = (f"its forward failed on djl-stream's KV cache "
                          f"({type(error).__name__}: {error})")
                runner = None
        if runner is None:
            attention.restore_attention(model)
    if runner is not None:
        logger.info("%s runs on djl-stream's KV cache (one forward pass for every batch, "
                    "through transformers' attention interface)", type(model).__name__)
        return runner
    logger.info("%s runs its own forward for each sequence, unbatched: %s",
                type(model).__name__, reason)
    return ForwardRunner(model, reason)


def _pack_linear_layers(model) -> None:
    """Lay the weights of the model's linear layers out for oneDNN where they sit on a CPU
    that has it, keeping the float weights too where both fit in memory (see
    :mod:`djl_stream.runtime.packed_linear`); said once per model."""
    from djl_stream.runtime.linear_layers import layers_that_stay_float
    from djl_stream.runtime.packed_linear import (float_weights_fit_twice, pack_linear_layers,
                                                  packing_unavailable)

    if _input_device(model).type != "cpu":
        return
    kept = layers_that_stay_float(model, "weights reordered for oneDNN")
    keep = float_weights_fit_twice(model)
    packed = pack_linear_layers(model, keep_float_weights=keep, leaving_out=kept)
    if packed:
        logger.info("%d linear layers' weights reordered for oneDNN's matrix product%s",
                    packed, "; their float weights kept for decode steps of few rows" if keep
                    else "; their float weights let go (both would take more than half of "
                    "the memory available)")
    elif any(type(m) is torch.nn.Linear for m in model.modules()):
        dtype = next(model.parameters()).dtype
        logger.info("linear layers left as they are: %s",
                    packing_unavailable(dtype) or "their weights cannot be reordered")


def _weights_on_huge_pages(model) -> None:
    """On a CPU, the weights the linear layers kept (and every other parameter) moved onto
    transparent huge pages (see :mod:`djl_stream.runtime.weight_pages`); said once."""
    from djl_stream.runtime.weight_pages import move_weights_to_huge_pages

    if _input_device(model).type != "cpu":
        return
    moved = move_weights_to_huge_pages(model)
    if moved.bytes:
        logger.info("%.0f MB of weights moved onto memory advised for transparent huge "
                    "pages", moved.bytes / 1e6)
    else:
        logger.info("weights left on the pages they lie on: %s", moved.reason)


def _why_not_the_fast_path(model) -> Optional[str]:
    missing = attention.interface_available()
    if missing:
        return missing
    if getattr(model.config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"its layers are spread over {len(devices)} devices"
    if not hasattr(model.config, "_attn_implementation"):
        return "its config names no attention implementation"
    cache_layers = _cache_layers(model.config)
    stateful = _layers_keeping_a_state(cache_layers)
    if stateful:
        return _stateful_layers(model.config, len(cache_layers), stateful)
    return None


def _cache_layers(config) -> list:
    try:
        from transformers import DynamicCache

        return DynamicCache(config=config).layers
    except Exception:  # noqa: BLE001 - a config transformers cannot lay a cache out for
        return []


def _layers_keeping_a_state(cache_layers: list) -> List[int]:
    """The layers that keep a recurrent or convolutional state, by the cache transformers
    lays out for the model's config (``cache_layers``): Falcon-H1 runs a state-space mixer beside attention in every
    layer, where the probe's few tokens may not tell (its attention is called by every
    layer). Empty where this transformers has no such cache layers."""
    try:
        from transformers.cache_utils import LinearAttentionCacheLayerMixin
    except ImportError:
        return []
    return [index for index, layer in enumerate(cache_layers)
            if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _probed_attention_runner(model, settings: RunnerSettings):
    """Run a probe through the model's own attention, recording what each layer passes
    its attention (shapes, sliding window); then through the runner, and compare."""
    from transformers import AttentionInterface

    attention.restore_attention(model)
    present = model.config._attn_implementation or "eager"
    own = attention._fallback_for(model, present)
    seen: Dict[int, tuple] = {}

    def recording(module, query, key, value, attention_mask, **kwargs):
        index = getattr(module, "layer_idx", None)
        if index is None:
            raise NotImplementedError("an attention layer without a layer_idx")
        seen[index] = (LayerShape(key.shape[1], key.shape[3], value.shape[3]),
                       kwargs.get("sliding_window"), key.dtype)
        return own(module, query, key, value, attention_mask, **kwargs)

    probe_name = "djl_stream_probe"
    AttentionInterface.register(probe_name, recording)
    try:
        from transformers.masking_utils import (ALL_MASK_ATTENTION_FUNCTIONS,
                                                AttentionMaskInterface)
        if present in ALL_MASK_ATTENTION_FUNCTIONS:
            AttentionMaskInterface.register(probe_name, ALL_MASK_ATTENTION_FUNCTIONS[present])
    except ImportError:
        pass
    windows_in_config = _configured_windows(model.config)
    short = min((w for w in windows_in_config if w), default=None)
    length = PROBE_TOKENS if not short or short >= 64 else max(PROBE_TOKENS, short + 6)
    vocab = model.get_input_embeddings().weight.shape[0]
    device = _input_device(model)
    ids = (torch.arange(length, device=device) * 7 + 3) % vocab
    model.config._attn_implementation = probe_name
    try:
        with torch.inference_mode():
            reference = model(input_ids=ids.unsqueeze(0)).logits[0, -3:].float()
    finally:
        model.config._attn_implementation = present
    layers = getattr(model.config, "num_hidden_layers", None)
    if not seen:
        return None, ("no layer of it calls attention through transformers' attention "
                      "interface (attention code of its own, or no attention at all)")
    if layers and set(seen) < set(range(layers)):  # (some layers only: a hybrid)
        return None, _stateful_layers(model.config, layers,
                                      [i for i in range(layers) if i not in seen])
    if sorted(seen) != list(range(len(seen))) or (layers and len(seen) != layers):
        return None, (f"its attention was called for layers {sorted(seen)}, not once per "
                      "layer with a layer index")
    shapes = [seen[i][0] for i in range(len(seen))]
    windows = [seen[i][1] if seen[i][1] is not None else
               (windows_in_config[i] if i < len(windows_in_config) else None)
               for i in range(len(seen))]
    dtype = seen[0][2]
    attention.use_attention(model)
    runner = AttentionRunner(model, settings, shapes, windows, dtype)
    handle = runner.reserve()
    tokens = ids.tolist()
    try:
        got = torch.cat([runner.run([Feed(handle, tokens[:-2])]),
                         runner.run([Feed(handle, tokens[-2:-1])]),
                         runner.run([Feed(handle, tokens[-1:])])]).float()
    finally:
        runner.release(handle)
    tolerance = PROBE_TOLERANCE.get(dtype, 5e-2) * max(1.0, float(reference.abs().max()))
    difference = float((got - reference).abs().max())
    if not difference <= tolerance:
        attention.restore_attention(model)
        return None, (f"its logits through djl-stream's KV cache differ from its own by "
                      f"{difference:.3g} (tolerance {tolerance:.3g})")
    return runner, None


def _stateful_layers(config, layers: int, stateful: Sequence[int]) -> str:
    """Why a model some of whose layers keep a state instead of keys and values, or beside
    them (a hybrid: Jamba, Qwen3-Next, LFM2, Falcon-H1), cannot take the fast path, naming
    those layers' kinds where its config lists them."""
    types = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    kinds = sorted({str(types[i]) for i in stateful}) if types and len(types) == layers else []
    named = f" ({', '.join(kinds)})" if kinds else ""
    verb = "keeps" if len(stateful) == 1 else "keep"
    return (f"{len(stateful)} of its {layers} layers{named} {verb} a state of their own "
            "(recurrent or convolutional) instead of keys and values or beside them, which "
            "djl-stream's KV cache does not hold")


def _configured_windows(config) -> List[Optional[int]]:
    """Each layer's sliding window by the config's own rules, for models that apply it in
    their mask rather than pass it to attention: ``layer_types`` where the config lists
    them, else one window for every layer where ``sliding_window`` is set (and
    ``use_sliding_window`` does not turn it off)."""
    window = getattr(config, "sliding_window", None)
    layers = getattr(config, "num_hidden_layers", 0) or 0
    types = getattr(config, "layer_types", None)
    if types:
        return [window if kind == "sliding_attention" else None for kind in types]
    if window and getattr(config, "use_sliding_window", True):
        return [window] * layers
    return [None] * layers


def _logits_keyword(model) -> Optional[str]:
    from djl_stream.runtime.forward_kwargs import logits_keyword

    return logits_keyword(model)


def _input_device(model) -> torch.device:
    try:
        return model.get_input_embeddings().weight.device
    except AttributeError:
        return next(model.parameters()).device

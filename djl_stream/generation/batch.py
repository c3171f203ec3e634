"""A batch of sequences, and the forward passes that grow it.

A :class:`CausalLMBatch` is the scheduling side's view of some sequences: each one's
:class:`~djl_stream.generation.sequence.GenerationSequence`, its handle in the
:class:`~djl_stream.runtime.runner.ModelRunner` that holds its KV cache, and what it
feeds next (the prompt tokens not read yet, or the token it chose last). Nothing here
knows tensors beyond logits: the runner places every sequence's cache, so a batch is
rows of handles, merged by concatenating lists (:meth:`CausalLMBatch.concatenate`: how a
prefilled request joins the running batch) and narrowed by dropping rows
(:meth:`CausalLMBatch.filter`: a finished or abandoned request's cache is freed at once).

Every pass is one call of :meth:`~djl_stream.generation.batch.ModelRunner.run` over
:class:`~djl_stream.runtime.runner.Feed`\\ s: :func:`generate_token` (a decode step, or
the last part of a prompt, which chooses the first tokens), :func:`prefill_chunk` (a part
of the prompts, nothing chosen: chunked prefill), and :func:`mixed_pass` (a running batch's
decode step and a chunk of prompts in one pass, so the weights are read once for both).
The prompts of one batch are read in step and end together: a chunk of ``columns``
feeds each prompt its share of the last ``columns`` columns it would have if the prompts
were aligned on their ends, so every row chooses its first token in the same pass.

Example::

    batch = CausalLMBatch.from_sequences(runner, sequences)
    while batch is not None:
        generations, batch = generate_token(runner, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, List, Optional, Sequence, Tuple

import torch

from djl_stream.generation.sampling import choose_next_tokens, token_logprobs
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.step import Generation
from djl_stream.runtime.runner import Feed, ModelRunner


@dataclasses.dataclass
class CausalLMBatch:
    """Sequences that step together; see the module docstring.

    ``pending[i]`` holds the prompt tokens row ``i`` has not fed yet; once the prompts are
    read it is empty and ``next_tokens[i]`` is the token the row feeds at its next step.
    """

    runner: ModelRunner
    sequences: List[GenerationSequence]
    handles: List[int]
    pending: List[List[int]]
    next_tokens: List[int]

    @property
    def request_ids(self) -> List[Hashable]:
        return [seq.request_id for seq in self.sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def decoding(self) -> bool:
        """Whether every prompt is read: the next pass is a decode step."""
        return not any(self.pending)

    @property
    def prefilled(self) -> bool:
        """Whether the runner holds anything of this batch (a part-way prefill counts)."""
        return any(self.runner.length(h) for h in self.handles)

    @property
    def columns_to_feed(self) -> int:
        """Tokens per row the next pass feeds at most: the prompt columns left before the
        first token, 1 once decoding."""
        return max((len(p) for p in self.pending), default=0) or 1

    @property
    def cache_length(self) -> int:
        """The most positions any row's cache holds."""
        return max((self.runner.length(h) for h in self.handles), default=0)

    @property
    def cached_tokens(self) -> int:
        """Positions this batch's caches hold, over every row."""
        return sum(self.runner.length(h) for h in self.handles)

    @classmethod
    def from_sequences(cls, runner: ModelRunner,
                       sequences: Sequence[GenerationSequence]) -> "CausalLMBatch":
        """A batch ready for prefill, each sequence with a cache of its own in ``runner``
        (holding its prompt's first tokens already where another prompt began the same
        way: those are not fed again)."""
        if not sequences:
            raise ValueError("a batch needs at least one sequence")
        for seq in sequences:
            if not seq.prompt_ids:
                raise ValueError(f"sequence {seq.request_id!r} has an empty prompt")
        handles: List[int] = []
        try:
            for seq in sequences:
                handles.append(runner.reserve(seq.prompt_ids))
        except Exception:
            for handle in handles:
                runner.release(handle)
            raise
        # (a cache may start with the keys and values of its prompt's first tokens)
        pending = [list(s.prompt_ids[runner.length(h):]) for s, h in zip(sequences, handles)]
        return cls(runner, list(sequences), handles, pending, [0] * len(sequences))

    def release(self) -> None:
        """Free every row's cache (the batch is dropped)."""
        for handle in self.handles:
            self.runner.release(handle)
        self.handles = []
        self.sequences = []

    def filter(self, request_ids: Iterable[Hashable]) -> Optional["CausalLMBatch"]:
        """This batch restricted to ``request_ids`` (None when none is left); the rows that
        leave free their caches at once."""
        keep = set(request_ids)
        rows = [i for i, seq in enumerate(self.sequences) if seq.request_id in keep]
        for i, handle in enumerate(self.handles):
            if i not in rows:
                self.runner.release(handle)
        if not rows:
            return None
        return self._rows(rows)

    def split(self, groups: Sequence[Iterable[Hashable]]) -> List["CausalLMBatch"]:
        """One batch per group of request ids, each with the same rows' caches (to run
        requests apart after a failed step)."""
        parts = []
        for group in groups:
            keep = set(group)
            parts.append(self._rows([i for i, seq in enumerate(self.sequences)
                                     if seq.request_id in keep]))
        return parts

    def _rows(self, rows: List[int]) -> "CausalLMBatch":
        return CausalLMBatch(self.runner, [self.sequences[i] for i in rows],
                             [self.handles[i] for i in rows], [self.pending[i] for i in rows],
                             [self.next_tokens[i] for i in rows])

    @classmethod
    def concatenate(cls, batches: Sequence[Optional["CausalLMBatch"]]) -> "CausalLMBatch":
        """One batch holding every row of ``batches`` (all decoding), in order."""
        batches = [b for b in batches if b is not None]
        if len(batches) == 1:
            return batches[0]
        if not all(b.decoding for b in batches):
            raise ValueError("only batches whose prompts are read can be concatenated")
        first = batches[0]
        return cls(first.runner, [s for b in batches for s in b.sequences],
                   [h for b in batches for h in b.handles],
                   [p for b in batches for p in b.pending],
                   [t for b in batches for t in b.next_tokens])

    def chunk_feeds(self, columns: int) -> List[Feed]:
        """The feeds of the next ``columns`` prompt columns (the prompts aligned on their
        ends); the last chunk wants every row's logits."""
        width = self.columns_to_feed
        last = columns >= width
        feeds = []
        for handle, pending in zip(self.handles, self.pending):
            count = len(pending) - (width - columns)
            if count > 0:
                feeds.append(Feed(handle, pending[:count], logits=last))
        return feeds

    def after_chunk(self, columns: int) -> "CausalLMBatch":
        """This batch once :meth:`chunk_feeds` of ``columns`` ran."""
        width = self.columns_to_feed
        pending = [p[max(0, len(p) - (width - columns)):] if len(p) > width - columns else p
                   for p in self.pending]
        return dataclasses.replace(self, pending=pending)

    def decode_feeds(self) -> List[Feed]:
        return [Feed(h, [t]) for h, t in zip(self.handles, self.next_tokens)]


def generate_token(runner: ModelRunner,
                   batch: CausalLMBatch) -> Tuple[List[Generation], Optional[CausalLMBatch]]:
    """One forward pass: a decode step, or the rest of the prompts, which chooses the first
    tokens.

    Returns each row's :class:`Generation` and the batch for the next step (None when every
    row finished); finished rows have left it (their caches freed). A row that cannot
    choose or record its token (its own parameters made its scores unusable, say) gets a
    Generation with an ``error`` and leaves; the others go on. What raises here is the
    pass's, before any sequence changed.
    """
    if batch.decoding:
        logits = runner.run(batch.decode_feeds())
        return _advance(batch, _choose(batch, logits))
    logits = runner.run(batch.chunk_feeds(batch.columns_to_feed))
    return _advance(batch.after_chunk(batch.columns_to_feed), _choose(batch, logits))


def prefill_chunk(runner: ModelRunner, batch: CausalLMBatch, columns: int) -> CausalLMBatch:
    """Feed the next ``columns`` prompt columns of ``batch`` (at least one is left for
    :func:`generate_token`, which chooses the first tokens) and return the batch that
    feeds the rest."""
    if not 0 < columns < batch.columns_to_feed:
        raise ValueError(f"a prefill chunk feeds 1 to {batch.columns_to_feed - 1} columns "
                         f"of this batch, not {columns}")
    runner.run(batch.chunk_feeds(columns))
    return batch.after_chunk(columns)


def mixed_pass(
    runner: ModelRunner, running: CausalLMBatch, prefill: CausalLMBatch, columns: int
) -> Tuple[List[Generation], Optional[CausalLMBatch], List[Generation], Optional[CausalLMBatch]]:
    """``running``'s decode step and ``columns`` prompt columns of ``prefill`` in one pass.

    Returns what :func:`generate_token` returns for ``running``, then for ``prefill``: its
    first tokens and its batch at its first decode step when ``columns`` were the last of
    its prompts, else no generations and the batch that feeds the rest."""
    decode = running.decode_feeds()
    chunk = prefill.chunk_feeds(columns)
    logits = runner.run(decode + chunk)
    generations, running_next = _advance(running, _choose(running, logits[:len(decode)]))
    rest = prefill.after_chunk(columns)
    if columns < prefill.columns_to_feed:
        return generations, running_next, [], rest
    first, prefill_next = _advance(rest, _choose(prefill, logits[len(decode):]))
    return generations, running_next, first, prefill_next


@dataclasses.dataclass
class _Choice:
    """The tokens chosen for each row of a batch from its logits."""

    tokens: List[int]
    failures: dict
    details: list


def _choose(batch: CausalLMBatch, logits: torch.Tensor) -> _Choice:
    """Each row's next token (batched operations: what raises here is the batch's)."""
    with torch.inference_mode():
        choosers = [seq.chooser for seq in batch.sequences]
        tokens, failures = choose_next_tokens(choosers, logits,
                                              [seq.all_ids for seq in batch.sequences])
        details = token_logprobs(choosers, logits, tokens)
    return _Choice(tokens, failures, details)


def _advance(batch: CausalLMBatch,
             choice: _Choice) -> Tuple[List[Generation], Optional[CausalLMBatch]]:
    """Record each row's chosen token (a row that cannot fails alone) and make the batch
    of the next step, finished rows removed."""
    generations = []
    for row, (seq, token, detail) in enumerate(zip(batch.sequences, choice.tokens,
                                                   choice.details)):
        if row in choice.failures:
            generations.append(seq.fail(choice.failures[row]))
            continue
        try:
            generations.append(seq.append(token) if detail is None
                               else seq.append(token, detail.logprob, detail.top))
        except Exception as error:  # noqa: BLE001 - this row fails, its batch mates go on
            generations.append(seq.fail(error))
    next_batch = dataclasses.replace(batch, pending=[[] for _ in batch.sequences],
                                     next_tokens=list(choice.tokens))
    if not any(g.finished for g in generations):
        return generations, next_batch
    alive = [seq.request_id for seq in batch.sequences if not seq.finished]
    return generations, next_batch.filter(alive)

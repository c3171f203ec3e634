"""The running batch of a causal LM, and the step that grows it by one token.

The whole state of a batch is one :class:`CausalLMBatch`: the tokens to feed next, the
attention mask over every cached position, the position ids, the KV cache, and the
:class:`~djl_stream.generation.sequence.GenerationSequence` of each row. :func:`generate_token` is the
only function that runs the model: it takes a batch and returns what each row produced and
the batch for the next step, with finished rows already removed. Rows of different lengths
are left-padded; the mask hides the padding and the position ids count real tokens only,
so every row computes what it would compute alone.

:meth:`CausalLMBatch.filter` drops rows (finished or abandoned requests) and the padding
columns no remaining row needs; :meth:`CausalLMBatch.concatenate` merges batches, which is
how a newly prefilled request joins a running batch (continuous batching). The KV cache is
a :class:`~djl_stream.generation.kv_cache.PreallocatedCache`, written in place: a decode
step writes one column, a merge copies one batch's rows into the free rows of the other's
cache.

A long prompt need not be prefilled in one forward pass: :func:`prefill_chunk` feeds the
leading columns of a batch's prompts through the model and keeps the rest for later, so
the prefill can be spread over several scheduler steps (chunked prefill) while a running
batch goes on decoding between them; the last part goes through :func:`generate_token`,
which chooses the first tokens. Where the model runs djl-stream's Llama step, a chunk can
share one forward pass with a running batch's decode step instead (:func:`mixed_pass`).

Example::

    batch = CausalLMBatch.from_sequences(sequences, pad_token_id=tokenizer.pad_token_id,
                                         device=model.device)
    while batch is not None:
        generations, batch = generate_token(model, batch)
"""

from __future__ import annotations

import dataclasses
from typing import Hashable, Iterable, List, Optional, Sequence, Tuple

import torch
from djl_stream.generation import kv_cache, llama_decode
from djl_stream.generation.forward_kwargs import cache_kwarg, last_logits_only
from djl_stream.generation.kv_cache import PreallocatedCache
from djl_stream.generation.sampling import choose_next_tokens, token_logprobs
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.generation.step import Generation


@dataclasses.dataclass
class CausalLMBatch:
    """Everything a decode step needs; see the module docstring.

    Before the first step (prefill) ``input_ids`` holds the left-padded prompts and
    ``past_key_values`` is empty; after it, ``input_ids`` is ``(batch, 1)``: the last chosen
    token of each row. Part-way through a chunked prefill, the cache holds the prompt
    columns fed so far and ``input_ids`` the rest. ``attention_mask`` always covers the
    cache plus ``input_ids``.
    """

    sequences: List[GenerationSequence]
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    past_key_values: PreallocatedCache

    @property
    def request_ids(self) -> List[Hashable]:
        return [seq.request_id for seq in self.sequences]

    def __len__(self) -> int:
        return len(self.sequences)

    @property
    def prefilled(self) -> bool:
        """Whether the cache holds anything (a part-way chunked prefill counts)."""
        return kv_cache.seq_length(self.past_key_values) > 0

    @property
    def columns_to_feed(self) -> int:
        """Tokens per row the next forward pass feeds: the prompt columns left before the
        first token, 1 once decoding."""
        return self.input_ids.shape[1]

    @classmethod
    def from_sequences(
        cls,
        sequences: Sequence[GenerationSequence],
        *,
        pad_token_id: int,
        device: torch.device | str,
        room_for_rows: int = 0,
        room_on_left: int = 0,
        host_cache: Optional[PreallocatedCache] = None,
    ) -> "CausalLMBatch":
        """A batch ready for prefill: prompts left-padded to the longest one.

        With ``host_cache`` (the running batch's), the prompts are written into free
        rows of that cache where it has the room
        (:meth:`~djl_stream.generation.kv_cache.PreallocatedCache.lease`): a request
        takes its slot on admission, and its join copies nothing. Otherwise its KV cache
        is its own and reserves columns for the longest prompt plus the most new tokens
        any row may generate, ``room_for_rows`` more rows, and ``room_on_left`` columns
        before its own, so that rows up to that much longer can join this batch without
        moving its rows (see :meth:`concatenate`).
        """
        if not sequences:
            raise ValueError("a batch needs at least one sequence")
        width = max(len(seq.prompt_ids) for seq in sequences)
        input_ids = torch.full((len(sequences), width), pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, seq in enumerate(sequences):
            n = len(seq.prompt_ids)
            if n == 0:
                raise ValueError(f"sequence {seq.request_id!r} has an empty prompt")
            input_ids[row, width - n :] = torch.tensor(seq.prompt_ids, dtype=torch.long)
            attention_mask[row, width - n :] = 1
        # Positions count real tokens only, so a padded row sees the positions it would
        # see alone; padding positions are clamped to 0 and masked out anyway.
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        cache = None if host_cache is None else host_cache.lease(len(sequences), width)
        if cache is None:
            cache = PreallocatedCache(
                reserve_rows=len(sequences) + room_for_rows,
                reserve_columns=width + max(seq.max_new_tokens for seq in sequences),
                room_on_left=room_on_left)
        return cls(
            sequences=list(sequences),
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=cache,
        )

    def filter(self, request_ids: Iterable[Hashable]) -> Optional["CausalLMBatch"]:
        """This batch restricted to ``request_ids``, or None.

        Freed rows leave the KV cache at once, and so do the leading columns that were
        padding for every row that stays. A row that stays keeps its place, except that
        the last rows move into the places of those that left (:func:`_fill_holes`): a
        leaving row costs the copy of at most one other row's cache, not of every row
        behind it.
        """
        rows = self._rows_of(request_ids)
        if not rows:
            return None
        if len(rows) == len(self.sequences):
            return self
        return self._with_rows(_fill_holes(rows), self.past_key_values, select_in_cache=True)

    def split(self, groups: Sequence[Iterable[Hashable]]) -> List["CausalLMBatch"]:
        """One batch per group of request ids, each with a copy of its rows of the cache,
        leaving this batch as it was (to run requests apart after a failed step)."""
        parts = []
        for group in groups:
            rows = self._rows_of(group)
            parts.append(self._with_rows(rows, self.past_key_values.copy_rows(rows)))
        return parts

    def after_prompt_columns(self, columns: int) -> "CausalLMBatch":
        """This batch once its next ``columns`` prompt columns are in its cache (a prefill
        chunk fed them): the same cache and mask, the rest of the prompt to feed."""
        return dataclasses.replace(self, input_ids=self.input_ids[:, columns:],
                                   position_ids=self.position_ids[:, columns:])

    @property
    def cache_length(self) -> int:
        """Positions the KV cache holds per row (0 before prefill)."""
        return kv_cache.seq_length(self.past_key_values)

    def truncate_cache(self, length: int) -> None:
        """Cut the KV cache back to ``length`` positions: undoes what a forward pass that
        raised half-way wrote into the layers it reached."""
        self.past_key_values.truncate(length)

    def _rows_of(self, request_ids: Iterable[Hashable]) -> List[int]:
        keep = set(request_ids)
        return [i for i, seq in enumerate(self.sequences) if seq.request_id in keep]

    def _with_rows(self, rows: List[int], past_key_values,
                   select_in_cache: bool = False) -> "CausalLMBatch":
        """The batch of ``rows`` around ``past_key_values``, which holds just those rows
        (or all of this batch's, with ``select_in_cache``: it keeps ``rows`` only);
        leading columns that are padding for every row leave the mask and cache."""
        index = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        attention_mask = self.attention_mask.index_select(0, index)
        input_ids = self.input_ids.index_select(0, index)
        position_ids = self.position_ids.index_select(0, index)
        unused = _leading_unused_columns(attention_mask)
        if unused:
            attention_mask = attention_mask[:, unused:]
            # The unused columns come out of the cache first, then (before the prefill, or
            # part-way through a chunked one) out of the prompt columns still to feed.
            from_cache = min(unused, kv_cache.seq_length(past_key_values))
            past_key_values.trim_left(from_cache)
            input_ids = input_ids[:, unused - from_cache:]
            position_ids = position_ids[:, unused - from_cache:]
        if select_in_cache:
            # After the trim: only the columns the remaining rows need are moved.
            past_key_values.keep_rows(rows)
        return CausalLMBatch(
            sequences=[self.sequences[i] for i in rows],
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
        )

    @classmethod
    def concatenate(cls, batches: Sequence["CausalLMBatch"]) -> "CausalLMBatch":
        """One batch holding every row of ``batches`` (all prefilled).

        One batch's cache hosts the others: of those whose caches have the rows and the
        columns on the left they need, the one holding the most (rows × columns), so that
        the least is copied; where none has, the one with the most rows (its cache grows).
        Its rows come first and stay where they are; the others' rows follow in order,
        copied into its free rows, all ending at one column
        (:meth:`~djl_stream.generation.kv_cache.PreallocatedCache.absorb`); the masks hide
        the columns before a row's own. So many running rows stay where they are when a
        longer prompt joins them, and one short running row is copied into a long
        prompt's cache rather than the other way round. A batch prefilled in rows its
        host lent it (:meth:`from_sequences`' ``host_cache``) is not copied at all: its
        rows join as they are, masked over the columns the host decoded meanwhile.
        """
        batches = [b for b in batches if b is not None]
        if len(batches) == 1:
            return batches[0]
        if not all(b.prefilled and b.columns_to_feed == 1 for b in batches):
            raise ValueError("only prefilled batches can be concatenated")
        host = batches[kv_cache.choose_host([b.past_key_values for b in batches])]
        tenant = host.past_key_values.tenant()
        # (the host's tenant, whose rows are in place after the host's, comes first)
        others = sorted((b for b in batches if b is not host),
                        key=lambda b: b.past_key_values is not tenant)
        lengths = [b.cache_length for b in [host] + others]
        gaps = [0] + host.past_key_values.absorb([b.past_key_values for b in others])
        joined = host.cache_length
        batches = [host] + others
        return cls(
            sequences=[seq for b in batches for seq in b.sequences],
            input_ids=torch.cat([b.input_ids for b in batches], dim=0),
            attention_mask=torch.cat(
                [_placed_mask(b.attention_mask, joined - length - gap, gap)
                 for b, length, gap in zip(batches, lengths, gaps)], dim=0),
            position_ids=torch.cat([b.position_ids for b in batches], dim=0),
            past_key_values=host.past_key_values,
        )


def _placed_mask(mask: torch.Tensor, left: int, gap: int) -> torch.Tensor:
    """The attention mask of a decoding batch (its cached columns, then the token fed)
    once its rows sit in a joined cache: ``left`` masked columns before its own, ``gap``
    between its own and the token fed.

    >>> _placed_mask(torch.tensor([[1, 1, 1]]), left=2, gap=1).tolist()
    [[0, 0, 1, 1, 0, 1]]
    """
    if not left and not gap:
        return mask
    rows = mask.shape[0]
    return torch.cat([mask.new_zeros((rows, left)), mask[:, :-1], mask.new_zeros((rows, gap)),
                      mask[:, -1:]], dim=1)


def _fill_holes(kept: Sequence[int]) -> List[int]:
    """Which old row each new row of a batch keeping rows ``kept`` (ascending) is: a kept
    row below the new row count stays where it is, the kept rows beyond it fill the
    places left free, in order.

    >>> _fill_holes([0, 2, 3, 4])   # row 1 left: the last row takes its place
    [0, 4, 2, 3]
    >>> _fill_holes([1, 2])         # row 0 and the last left
    [2, 1]
    """
    count = len(kept)
    staying = set(kept)
    movers = iter(row for row in kept if row >= count)
    return [row if row in staying else next(movers) for row in range(count)]


def _leading_unused_columns(attention_mask: torch.Tensor) -> int:
    """How many leading columns are padding in every row. The last column (the token
    being fed) is real in every row, so this never reaches the end."""
    used = attention_mask.any(dim=0)
    return int(used.int().argmax().item())


def generate_token(
    model, batch: CausalLMBatch
) -> Tuple[List[Generation], Optional[CausalLMBatch]]:
    """Run one forward pass: prefill for a new batch, one decode step otherwise.

    Returns each row's :class:`Generation` and the batch for the next step (None when every
    row finished). A row that cannot choose or record its token (its own parameters made
    its scores unusable, say) gets a Generation with an ``error`` and leaves the batch;
    the others go on. What raises here is the batch's: the forward pass or a batched
    operation, before any sequence changed. A decode step runs djl-stream's own step where
    one is attached (:mod:`~djl_stream.generation.llama_decode`), the model's forward
    otherwise. Only the last position's logits are computed (``logits_to_keep=1``), so
    a long prompt does not pay for a vocabulary projection of every prompt token. Rows
    whose request asked for ``logprobs`` / ``top_logprobs`` get them in their
    :class:`Generation` (see :func:`~djl_stream.generation.sampling.token_logprobs`).
    """
    own_step = llama_decode.step_of(model)
    with torch.inference_mode():
        if own_step is not None and own_step.accepts(batch):
            logits = own_step.logits(batch)
        else:
            logits = forward_logits(model, batch)
    return _advance(batch, _choose(batch, logits))


def mixed_pass(
    model, running: CausalLMBatch, prefill: CausalLMBatch, columns: int
) -> Tuple[List[Generation], Optional[CausalLMBatch], List[Generation], Optional[CausalLMBatch]]:
    """``running``'s decode step and ``columns`` prompt columns of ``prefill`` in one
    forward pass (the weights are read once for both), through the model's Llama step
    (:meth:`~djl_stream.generation.llama_decode.LlamaDecodeStep.mixed_logits`; see
    :func:`mixed_pass_possible`).

    Returns what :func:`generate_token` returns for ``running``, then for ``prefill``:
    its first tokens and its batch at its first decode step when ``columns`` were the last
    of its prompts, else no generations and the batch that feeds the rest (as
    :func:`prefill_chunk` returns it). As there, what raises is the pass's, before any
    sequence changed; the caches may then hold columns past their ends (see
    :meth:`CausalLMBatch.truncate_cache`).
    """
    running_logits, prefill_logits = llama_decode.step_of(model).mixed_logits(
        running, prefill, columns)
    running_choice = _choose(running, running_logits)
    prefill_choice = None if prefill_logits is None else _choose(prefill, prefill_logits)
    generations, running = _advance(running, running_choice)
    if prefill_choice is None:
        return generations, running, [], prefill.after_prompt_columns(columns)
    return (generations, running) + _advance(prefill, prefill_choice)


def mixed_pass_possible(model, running: CausalLMBatch, prefill: CausalLMBatch) -> bool:
    """Whether :func:`mixed_pass` can run ``running``'s decode step with a chunk of
    ``prefill`` (a model with djl-stream's Llama step, a running batch at a decode step,
    a prefill whose cache is one of this project's)."""
    own_step = llama_decode.step_of(model)
    return (own_step is not None and own_step.accepts(running)
            and isinstance(prefill.past_key_values, PreallocatedCache))


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
    device = batch.attention_mask.device
    next_batch = CausalLMBatch(
        sequences=batch.sequences,
        input_ids=torch.tensor(choice.tokens, dtype=torch.long, device=device).unsqueeze(1),
        attention_mask=torch.cat(
            [batch.attention_mask, batch.attention_mask.new_ones((len(batch), 1))], dim=1
        ),
        position_ids=batch.position_ids[:, -1:] + 1,
        past_key_values=batch.past_key_values,  # written in place by the forward pass
    )
    if not any(g.finished for g in generations):
        return generations, next_batch
    alive = [seq.request_id for seq in batch.sequences if not seq.finished]
    return generations, next_batch.filter(alive)


def forward_logits(model, batch: CausalLMBatch) -> torch.Tensor:
    """The model's forward over ``batch`` (its cache gains the columns fed): the logits
    ``(rows, vocab)`` of each row's last position."""
    with torch.inference_mode():
        outputs = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            use_cache=True,
            **cache_kwarg(model, batch.past_key_values),
            **last_logits_only(model),
        )
    return outputs.logits[:, -1, :]


def prefill_chunk(model, batch: CausalLMBatch, columns: int) -> CausalLMBatch:
    """Feed the next ``columns`` prompt columns of ``batch`` through the model, adding them
    to its KV cache, and return the batch that feeds the rest.

    Part of a chunked prefill: no logits are computed (the decoder runs without the LM
    head) and no token is chosen, so at least one column must be left for
    :func:`generate_token`, which finishes the prefill. ``batch`` is spent: its cache is
    the returned batch's. Each column sees exactly what it sees in a one-pass prefill:
    the mask covers the cached columns plus the new ones, and the position ids are the
    prompt's own.
    """
    if not 0 < columns < batch.columns_to_feed:
        raise ValueError(f"a prefill chunk feeds 1 to {batch.columns_to_feed - 1} columns "
                         f"of this batch, not {columns}")
    cached = batch.cache_length
    with torch.inference_mode():
        forward, extra = _without_lm_head(model)
        forward(
            input_ids=batch.input_ids[:, :columns],
            attention_mask=batch.attention_mask[:, :cached + columns],
            position_ids=batch.position_ids[:, :columns],
            use_cache=True,
            **cache_kwarg(forward, batch.past_key_values),
            **extra,
        )
    return batch.after_prompt_columns(columns)


def _without_lm_head(model):
    """The model's decoder (``model.base_model``: the transformer without the LM head), or
    the model itself asked for the fewest logits where it has no separate decoder."""
    decoder = getattr(model, "base_model", None)
    if decoder is not None and decoder is not model:
        return decoder, {}
    return model, last_logits_only(model)

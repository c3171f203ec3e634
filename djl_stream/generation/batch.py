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
how a newly prefilled request joins a running batch (continuous batching).

A long prompt need not be prefilled in one forward pass: :func:`prefill_chunk` feeds the
leading columns of a batch's prompts through the model and keeps the rest for later, so
the prefill can be spread over several scheduler steps (chunked prefill) while a running
batch goes on decoding between them; the last part goes through :func:`generate_token`,
which chooses the first tokens.

Example::

    batch = CausalLMBatch.from_sequences(sequences, pad_token_id=tokenizer.pad_token_id,
                                         device=model.device)
    while batch is not None:
        generations, batch = generate_token(model, batch)
"""

from __future__ import annotations

import dataclasses
import inspect
import weakref
from typing import Dict, Hashable, Iterable, List, Optional, Sequence, Tuple

import torch
from transformers import DynamicCache

from djl_stream.generation import kv_cache
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
    past_key_values: DynamicCache

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
    ) -> "CausalLMBatch":
        """A batch ready for prefill: prompts left-padded to the longest one."""
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
        return cls(
            sequences=list(sequences),
            input_ids=input_ids.to(device),
            attention_mask=attention_mask.to(device),
            position_ids=position_ids.to(device),
            past_key_values=DynamicCache(),
        )

    def filter(self, request_ids: Iterable[Hashable]) -> Optional["CausalLMBatch"]:
        """This batch restricted to ``request_ids`` (in their current order), or None.

        Freed rows leave the KV cache at once, and so do the leading columns that were
        padding for every row that stays.
        """
        rows = self._rows_of(request_ids)
        if not rows:
            return None
        if len(rows) == len(self.sequences):
            return self
        index = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
        kv_cache.select_rows(self.past_key_values, index)
        return self._with_rows(rows, index, self.past_key_values)

    def split(self, groups: Sequence[Iterable[Hashable]]) -> List["CausalLMBatch"]:
        """One batch per group of request ids, each with a copy of its rows of the cache,
        leaving this batch as it was (to run requests apart after a failed step)."""
        parts = []
        for group in groups:
            rows = self._rows_of(group)
            index = torch.tensor(rows, dtype=torch.long, device=self.attention_mask.device)
            parts.append(self._with_rows(rows, index,
                                         kv_cache.copy_rows(self.past_key_values, index)))
        return parts

    @property
    def cache_length(self) -> int:
        """Positions the KV cache holds per row (0 before prefill)."""
        return kv_cache.seq_length(self.past_key_values)

    def truncate_cache(self, length: int) -> None:
        """Cut the KV cache back to ``length`` positions: undoes what a forward pass that
        raised half-way wrote into the layers it reached."""
        kv_cache.truncate(self.past_key_values, length)

    def _rows_of(self, request_ids: Iterable[Hashable]) -> List[int]:
        keep = set(request_ids)
        return [i for i, seq in enumerate(self.sequences) if seq.request_id in keep]

    def _with_rows(self, rows: List[int], index: torch.Tensor, past_key_values) -> "CausalLMBatch":
        """The batch of ``rows`` around ``past_key_values``, which already holds just those
        rows; leading columns that are padding for every row leave the mask and cache."""
        attention_mask = self.attention_mask.index_select(0, index)
        input_ids = self.input_ids.index_select(0, index)
        position_ids = self.position_ids.index_select(0, index)
        unused = _leading_unused_columns(attention_mask)
        if unused:
            attention_mask = attention_mask[:, unused:]
            # The unused columns come out of the cache first, then (before the prefill, or
            # part-way through a chunked one) out of the prompt columns still to feed.
            from_cache = min(unused, kv_cache.seq_length(past_key_values))
            kv_cache.trim_left(past_key_values, from_cache)
            input_ids = input_ids[:, unused - from_cache:]
            position_ids = position_ids[:, unused - from_cache:]
        return CausalLMBatch(
            sequences=[self.sequences[i] for i in rows],
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            past_key_values=past_key_values,
        )

    @classmethod
    def concatenate(cls, batches: Sequence["CausalLMBatch"]) -> "CausalLMBatch":
        """One batch holding every row of ``batches`` (all prefilled), in order.

        Shorter caches are padded on the left to the longest one; their mask hides the
        new columns.
        """
        batches = [b for b in batches if b is not None]
        if len(batches) == 1:
            return batches[0]
        if not all(b.prefilled and b.columns_to_feed == 1 for b in batches):
            raise ValueError("only prefilled batches can be concatenated")
        past = max(kv_cache.seq_length(b.past_key_values) for b in batches)
        masks = []
        for b in batches:
            missing = past - kv_cache.seq_length(b.past_key_values)
            kv_cache.pad_left(b.past_key_values, missing)
            masks.append(torch.nn.functional.pad(b.attention_mask, (missing, 0), value=0))
        return cls(
            sequences=[seq for b in batches for seq in b.sequences],
            input_ids=torch.cat([b.input_ids for b in batches], dim=0),
            attention_mask=torch.cat(masks, dim=0),
            position_ids=torch.cat([b.position_ids for b in batches], dim=0),
            past_key_values=kv_cache.concatenate_rows([b.past_key_values for b in batches]),
        )


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
    operation, before any sequence changed. Only the last position's logits are computed (``logits_to_keep=1``), so
    a long prompt does not pay for a vocabulary projection of every prompt token. Rows
    whose request asked for ``logprobs`` / ``top_logprobs`` get them in their
    :class:`Generation` (see :func:`~djl_stream.generation.sampling.token_logprobs`).
    """
    with torch.inference_mode():
        outputs = model(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            past_key_values=batch.past_key_values,
            use_cache=True,
            **last_logits_only(model),
        )
        logits = outputs.logits[:, -1, :]
        choosers = [seq.chooser for seq in batch.sequences]
        tokens, failures = choose_next_tokens(choosers, logits,
                                              [seq.all_ids for seq in batch.sequences])
        details = token_logprobs(choosers, logits, tokens)
    generations = []
    for row, (seq, token, detail) in enumerate(zip(batch.sequences, tokens, details)):
        if row in failures:
            generations.append(seq.fail(failures[row]))
            continue
        try:
            generations.append(seq.append(token) if detail is None
                               else seq.append(token, detail.logprob, detail.top))
        except Exception as error:  # noqa: BLE001 - this row fails, its batch mates go on
            generations.append(seq.fail(error))
    device = batch.attention_mask.device
    next_batch = CausalLMBatch(
        sequences=batch.sequences,
        input_ids=torch.tensor(tokens, dtype=torch.long, device=device).unsqueeze(1),
        attention_mask=torch.cat(
            [batch.attention_mask, batch.attention_mask.new_ones((len(batch), 1))], dim=1
        ),
        position_ids=batch.position_ids[:, -1:] + 1,
        past_key_values=outputs.past_key_values,
    )
    if not any(g.finished for g in generations):
        return generations, next_batch
    alive = [seq.request_id for seq in batch.sequences if not seq.finished]
    return generations, next_batch.filter(alive)


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
        outputs = forward(
            input_ids=batch.input_ids[:, :columns],
            attention_mask=batch.attention_mask[:, :cached + columns],
            position_ids=batch.position_ids[:, :columns],
            past_key_values=batch.past_key_values,
            use_cache=True,
            **extra,
        )
    return dataclasses.replace(
        batch,
        input_ids=batch.input_ids[:, columns:],
        position_ids=batch.position_ids[:, columns:],
        past_key_values=outputs.past_key_values,
    )


def _without_lm_head(model):
    """The model's decoder (``model.base_model``: the transformer without the LM head), or
    the model itself asked for the fewest logits where it has no separate decoder."""
    decoder = getattr(model, "base_model", None)
    if decoder is not None and decoder is not model:
        return decoder, {}
    return model, last_logits_only(model)


_LOGITS_KWARG: "weakref.WeakKeyDictionary[object, Dict[str, int]]" = weakref.WeakKeyDictionary()


def last_logits_only(model) -> Dict[str, int]:
    """``{"logits_to_keep": 1}`` where the model's forward accepts it (older
    transformers named it ``num_logits_to_keep``), else nothing."""
    try:
        return _LOGITS_KWARG[model]
    except (KeyError, TypeError):
        pass
    params = inspect.signature(model.forward).parameters
    kwargs: Dict[str, int] = {}
    for name in ("logits_to_keep", "num_logits_to_keep"):
        if name in params:
            kwargs = {name: 1}
            break
    try:
        _LOGITS_KWARG[model] = kwargs
    except TypeError:
        pass
    return kwargs

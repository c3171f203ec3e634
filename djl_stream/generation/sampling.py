"""Choosing the next token of one sequence, with transformers' logits processors.

Each request in a batch keeps its own sampling parameters and its own random generator, so
batch mates never change each other's results: a seeded request samples the same tokens
alone or among fifteen others. Greedy rows without a repetition penalty need no processor
at all, and :func:`choose_next_tokens` takes their argmax for the whole batch in one call.

Example::

    >>> import torch
    >>> chooser = TokenChooser(do_sample=True, temperature=0.7, top_k=50, manual_seed=1)
    >>> chooser.is_greedy
    False
    >>> scores = torch.tensor([[0.0, 5.0, 1.0]])
    >>> TokenChooser().choose(torch.tensor([[7]]), scores)
    1
"""

from __future__ import annotations

from typing import List, Optional, Sequence

import torch
from transformers import (
    LogitsProcessorList,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)


class TokenChooser:
    """Next-token choice for one sequence: processors, then argmax or a seeded draw.

    ``do_sample=False`` means greedy decoding, as in transformers' ``generate()``: the
    sampling warpers (temperature, top-k, top-p, typical-p) only apply when sampling; the
    repetition penalty applies in both modes.
    """

    def __init__(
        self,
        *,
        do_sample: bool = False,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        typical_p: float = 1.0,
        repetition_penalty: float = 1.0,
        manual_seed: Optional[int] = None,
        device: torch.device | str = "cpu",
    ):
        self.do_sample = do_sample
        processors = LogitsProcessorList()
        if repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(penalty=repetition_penalty))
        if do_sample:
            if temperature != 1.0:
                processors.append(TemperatureLogitsWarper(temperature))
            if top_k > 0:
                processors.append(TopKLogitsWarper(top_k=top_k))
            if top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=top_p))
            if typical_p < 1.0:
                processors.append(TypicalLogitsWarper(mass=typical_p))
        self.processors = processors
        self.needs_input_ids = repetition_penalty != 1.0
        self.generator: Optional[torch.Generator] = None
        if do_sample:
            self.generator = torch.Generator(device=device)
            if manual_seed is None:
                self.generator.seed()
            else:
                self.generator.manual_seed(manual_seed)

    @property
    def is_greedy(self) -> bool:
        """True when the choice is a plain argmax of the raw logits."""
        return not self.do_sample and not self.processors

    def choose(self, input_ids: Optional[torch.Tensor], scores: torch.Tensor) -> int:
        """Pick the next token from ``scores`` (shape ``(1, vocab)``) given the
        sequence so far ``input_ids`` (shape ``(1, length)``; only read by processors
        that need it, such as the repetition penalty)."""
        scores = scores.float()
        if self.processors:
            scores = self.processors(input_ids, scores)
        if not self.do_sample:
            return int(scores.argmax(dim=-1).item())
        probs = torch.softmax(scores, dim=-1)
        return int(torch.multinomial(probs, 1, generator=self.generator).item())


def choose_next_tokens(
    choosers: Sequence[TokenChooser],
    logits: torch.Tensor,
    all_ids: Sequence[Sequence[int]],
) -> List[int]:
    """Next token of every row of ``logits`` (``(batch, vocab)``).

    Greedy rows share one batched argmax and a single device-to-host copy; the others go
    through their own processors, one row at a time.
    """
    tokens = logits.argmax(dim=-1).tolist()
    for row, chooser in enumerate(choosers):
        if chooser.is_greedy:
            continue
        ids = None
        if chooser.needs_input_ids:
            ids = torch.tensor([list(all_ids[row])], dtype=torch.long, device=logits.device)
        tokens[row] = chooser.choose(ids, logits[row : row + 1])
    return tokens

"""Choosing the next token of one sequence, with transformers' logits processors.

Each request in a batch keeps its own sampling parameters and its own random generator, so
batch mates never change each other's results: a seeded request samples the same tokens
alone or among fifteen others. Greedy rows without a repetition penalty need no processor
at all, and :func:`choose_next_tokens` takes their argmax for the whole batch in one call
(a pending ``min_new_tokens`` bars the end-of-sequence ids there); sampling rows with the
same warpers go through them in one call and draw apart. :func:`token_logprobs` reports
log-probabilities for the rows that asked for them, and only for those.

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

import dataclasses
import math
from typing import AbstractSet, Dict, List, Mapping, Optional, Sequence, Tuple

import torch
from transformers import (
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
)

#: The most alternatives a request may ask for per token (``top_logprobs``), as in
#: OpenAI's API and vLLM's default ``max_logprobs``.
MAX_TOP_LOGPROBS = 20


class UnusableScores(ValueError):
    """A row's processed scores leave nothing to choose from: a NaN, a +inf, or every
    token at -inf. Its own parameters overflowed (a tiny temperature or repetition
    penalty), so that row fails and its batch mates go on."""


def check_scores(scores: torch.Tensor) -> None:
    """Raise :class:`UnusableScores` unless ``scores`` (one row) can be sampled from.

    One device-to-host sync; -inf entries are fine (barred tokens) as long as one is not.

    >>> check_scores(torch.tensor([[0.0, float("-inf")]]))
    >>> check_scores(torch.tensor([[float("inf"), 1.0]]))
    Traceback (most recent call last):
    ...
    djl_stream.generation.sampling.UnusableScores: the sampling parameters made the scores non-finite (NaN or infinite): use a larger temperature or repetition_penalty
    """
    unusable = (torch.isnan(scores).any() | torch.isposinf(scores).any()
                | torch.isneginf(scores).all())
    if bool(unusable):
        raise UnusableScores("the sampling parameters made the scores non-finite (NaN or "
                             "infinite): use a larger temperature or repetition_penalty")


class PresenceFrequencyPenalty(LogitsProcessor):
    """OpenAI's ``presence_penalty`` and ``frequency_penalty``, over the tokens generated so
    far (never the prompt's, as vLLM counts them): each token's logit loses ``presence``
    once it has appeared, and ``frequency`` for every time it has. transformers has no
    processor for these additive penalties (its repetition penalty scales instead).

    >>> penalty = PresenceFrequencyPenalty(presence=0.5, frequency=1.0, prompt_length=1)
    >>> penalty(torch.tensor([[0, 2, 2]]), torch.zeros(1, 3)).tolist()
    [[0.0, 0.0, -2.5]]
    """

    def __init__(self, presence: float, frequency: float, prompt_length: int) -> None:
        self.presence, self.frequency = float(presence), float(frequency)
        self.prompt_length = prompt_length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        generated = input_ids[:, self.prompt_length:]
        if generated.shape[1] == 0:
            return scores
        counts = torch.zeros_like(scores).scatter_add_(
            1, generated, torch.ones(generated.shape, dtype=scores.dtype, device=scores.device))
        return scores - self.frequency * counts - self.presence * (counts > 0).to(scores.dtype)


class TokenChooser:
    """Next-token choice for one sequence: processors, then argmax or a seeded draw.

    ``do_sample=False`` means greedy decoding, as in transformers' ``generate()``: the
    sampling warpers (temperature, top-k, top-p, typical-p) only apply when sampling; the
    penalties (``repetition_penalty``, OpenAI's ``presence_penalty`` and
    ``frequency_penalty``), ``logit_bias`` (token id -> a number added to its logit, as
    OpenAI's: -100 bars a token, 100 all but forces it) and ``grammar`` (a
    :class:`~djl_stream.generation.grammar.RowGrammar`: only what it allows next) apply in
    both modes.

    ``min_new_tokens`` keeps every id of ``eos_token_ids`` from being chosen before that
    many tokens follow the prompt, through transformers'
    ``MinNewTokensLengthLogitsProcessor``, which counts the new tokens as the length of the
    ids it is given minus ``prompt_length``; so the sequence hands it prompt and generated
    ids together (``needs_input_ids``), and tells the chooser after every token
    (:meth:`note_generated`) so that the processor, once it has nothing left to forbid,
    leaves and a greedy row goes back to the batched argmax. Until then a greedy row with
    no other processor is still chosen in the batch (:attr:`barred_ids`): the processor's
    own pass over a row costs a dozen vocabulary-wide operations, a large part of a small
    model's step once many rows carry one (``python -m benchmarks.sampling`` shows it).

    ``logprobs`` / ``top_logprobs`` (at most :data:`MAX_TOP_LOGPROBS`) ask
    :func:`token_logprobs` for the chosen token's log-probability and that many most
    likely alternatives; they never change which token is chosen.

    >>> chooser = TokenChooser(min_new_tokens=2, eos_token_ids={2}, prompt_length=3)
    >>> chooser.choose(torch.tensor([[5, 6, 7]]), torch.tensor([[0.0, 1.0, 9.0]]))  # eos barred
    1
    >>> chooser.barred_ids
    (2,)
    >>> chooser.note_generated(2); chooser.is_greedy, chooser.barred_ids
    (True, ())
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
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        logit_bias: Optional[Mapping[int, float]] = None,
        grammar: Optional[LogitsProcessor] = None,
        manual_seed: Optional[int] = None,
        min_new_tokens: int = 0,
        eos_token_ids: AbstractSet[int] = frozenset(),
        prompt_length: int = 0,
        logprobs: bool = False,
        top_logprobs: int = 0,
        device: torch.device | str = "cpu",
    ):
        if isinstance(min_new_tokens, bool) or not isinstance(min_new_tokens, int) or min_new_tokens < 0:
            raise ValueError(f"min_new_tokens must be an integer of at least 0, got {min_new_tokens!r}")
        if (isinstance(top_logprobs, bool) or not isinstance(top_logprobs, int)
                or not 0 <= top_logprobs <= MAX_TOP_LOGPROBS):
            raise ValueError(
                f"top_logprobs must be an integer from 0 to {MAX_TOP_LOGPROBS}, got {top_logprobs!r}")
        self.do_sample = do_sample
        processors = LogitsProcessorList()
        # transformers' generate() order: penalties, length constraints, then the warpers.
        if repetition_penalty != 1.0:
            processors.append(RepetitionPenaltyLogitsProcessor(penalty=repetition_penalty))
        counted = bool(presence_penalty or frequency_penalty)
        if counted:
            processors.append(PresenceFrequencyPenalty(presence_penalty, frequency_penalty,
                                                       prompt_length))
        if logit_bias:
            # One-token sequences only: the processor then never reads the input ids.
            processors.append(SequenceBiasLogitsProcessor(
                sequence_bias=[[[int(token)], float(bias)] for token, bias in logit_bias.items()]))
        # The grammar bars tokens after the biases (a bias cannot lift a barred token) and
        # before the warpers (which then share the probability among allowed tokens only).
        self.grammar = grammar
        if grammar is not None:
            processors.append(grammar)
        self._min_new_tokens: Optional[MinNewTokensLengthLogitsProcessor] = None
        self.min_new_tokens = min_new_tokens if eos_token_ids else 0
        self._eos_ids = tuple(sorted(int(i) for i in eos_token_ids))
        if self.min_new_tokens:
            self._min_new_tokens = MinNewTokensLengthLogitsProcessor(
                prompt_length_to_skip=prompt_length,
                min_new_tokens=min_new_tokens,
                eos_token_id=list(self._eos_ids),
                device=str(device),
            )
            processors.append(self._min_new_tokens)
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
        self._warpers = (temperature, top_k, top_p, typical_p) if do_sample else None
        # Processors of its own (state or values no other row shares).
        self._biased = bool(logit_bias) or grammar is not None
        # Processors that read the sequence so far, not only its scores.
        self._repetition_penalty = repetition_penalty != 1.0 or counted
        self.needs_input_ids = self._repetition_penalty or self._min_new_tokens is not None
        self.top_logprobs = top_logprobs
        self.logprobs = bool(logprobs) or top_logprobs > 0
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

    @property
    def barred_ids(self) -> Tuple[int, ...]:
        """The end-of-sequence ids that a greedy row's argmax must skip while its
        ``min_new_tokens`` is pending and it has no other processor (what
        :func:`choose_next_tokens` does for such rows in one batched operation); ``()``
        for every other row."""
        if self.do_sample or self._min_new_tokens is None or len(self.processors) != 1:
            return ()
        return self._eos_ids

    @property
    def warping(self) -> Optional[Tuple[float, int, float, float]]:
        """``(temperature, top_k, top_p, typical_p)`` of a sampling row whose processors
        are those warpers alone (no repetition penalty, no pending ``min_new_tokens``):
        rows with the same warping share one pass of the warpers in
        :func:`choose_next_tokens`, each drawing from its own row with its own generator.
        ``None`` for every other row."""
        if self._warpers is None or self.needs_input_ids or self._biased:
            return None
        return self._warpers

    def note_token(self, token_id: int) -> None:
        """The sequence took ``token_id``: its grammar, if any, follows it."""
        if self.grammar is not None:
            self.grammar.advance(token_id)

    def note_generated(self, count: int) -> None:
        """The sequence now holds ``count`` new tokens: drop the ``min_new_tokens``
        processor once it can no longer forbid anything (it would be a no-op)."""
        if self._min_new_tokens is not None and count >= self.min_new_tokens:
            self.processors = LogitsProcessorList(
                p for p in self.processors if p is not self._min_new_tokens)
            self._min_new_tokens = None
            self.needs_input_ids = self._repetition_penalty

    def choose(self, input_ids: Optional[torch.Tensor], scores: torch.Tensor) -> int:
        """Pick the next token from ``scores`` (shape ``(1, vocab)``) given the
        sequence so far ``input_ids`` (shape ``(1, length)``, prompt included; only read
        by processors that need it, such as the repetition penalty)."""
        scores = scores.float()
        if self.processors:
            scores = self.processors(input_ids, scores)
        return self.pick(scores)

    def pick(self, scores: torch.Tensor) -> int:
        """The token chosen from ``scores`` (``(1, vocab)``) its processors have already
        been through: their argmax, or a draw with this row's generator
        (:func:`draw_from`)."""
        check_scores(scores)
        if not self.do_sample:
            return int(largest_at(scores).item())
        return draw_from(torch.softmax(scores, dim=-1), self.generator)


def largest_at(scores: torch.Tensor) -> torch.Tensor:
    """Where each row of ``scores`` is largest: the first such index where several tie,
    as ``argmax`` (and so ``generate()``'s greedy search) answers.

    Through ``max``, whose indices are the same: on a CPU, ``argmax`` over a large
    vocabulary takes several times as long, which is most of a tiny model's step
    (``python -m benchmarks.sampling`` times the greedy rows).

    >>> largest_at(torch.tensor([[1.0, 7.0, 7.0], [9.0, 0.0, 9.0]])).tolist()
    [1, 0]
    """
    return scores.max(dim=-1).indices


def draw_from(probs: torch.Tensor, generator: Optional[torch.Generator]) -> int:
    """One token drawn from ``probs`` (``(1, vocab)``, summing to 1): where a uniform
    draw falls on their cumulative sum.

    ``torch.multinomial``, which ``generate()`` calls, prepares a sampler over the whole
    vocabulary for every draw; one search of the cumulative sum costs a small part of
    that, for every sampling row of every step (``python -m benchmarks.sampling``). The
    uniform is kept below the total, so a token of probability 0 (cut by top-k or top-p)
    is never the one drawn.

    >>> probs = torch.tensor([[0.0, 0.25, 0.0, 0.75]])
    >>> sorted({draw_from(probs, torch.Generator().manual_seed(s)) for s in range(50)})
    [1, 3]
    """
    cumulative = probs.cumsum(dim=-1)
    total = cumulative[:, -1:]
    uniform = torch.rand(total.shape, generator=generator, device=probs.device,
                         dtype=probs.dtype) * total
    uniform = torch.minimum(uniform, torch.nextafter(total, torch.zeros_like(total)))
    return int(torch.searchsorted(cumulative, uniform, right=True).item())


def choose_next_tokens(
    choosers: Sequence[TokenChooser],
    logits: torch.Tensor,
    all_ids: Sequence[Sequence[int]],
) -> Tuple[List[int], Dict[int, Exception]]:
    """Next token of every row of ``logits`` (``(batch, vocab)``), and the rows that
    could not choose one, with why.

    Greedy rows share one batched argmax and a single device-to-host copy, and so do
    greedy rows whose only processor is a pending ``min_new_tokens``
    (:attr:`TokenChooser.barred_ids`: their argmax skips the end-of-sequence ids).
    Sampling rows whose processors are the same warpers (:attr:`TokenChooser.warping`)
    go through them together, then each draws with its own generator; the others (a
    repetition penalty, a pending ``min_new_tokens`` while sampling) go through their own
    processors, one row at a time. A row whose processors or
    draw raise (:class:`UnusableScores`, or anything else its parameters cause) is
    reported instead of failing the batch: a request's parameters can only end that
    request.

    >>> logits = torch.tensor([[0.0, 5.0, 9.0], [0.0, 5.0, 9.0]])
    >>> barring = TokenChooser(min_new_tokens=4, eos_token_ids={2}, prompt_length=1)
    >>> choose_next_tokens([TokenChooser(), barring], logits, [[7], [7]])
    ([2, 1], {})
    """
    tokens = largest_at(logits).tolist()
    failures: Dict[int, Exception] = {}
    # one pass sorts the rows: greedy (done above), barring, warped together, alone
    barring: Dict[int, Tuple[int, ...]] = {}
    warped: Dict[Tuple[float, int, float, float], List[int]] = {}
    alone: List[int] = []
    for row, chooser in enumerate(choosers):
        if chooser.is_greedy:
            continue
        barred, warping = chooser.barred_ids, chooser.warping
        if barred:
            barring[row] = barred
        elif warping is not None:
            warped.setdefault(warping, []).append(row)
        else:
            alone.append(row)
    if barring:
        for row, token in zip(barring, _argmax_barring(logits, barring)):
            tokens[row] = token
    for rows in warped.values():
        _draw_warped(choosers, rows, logits, tokens, failures)
    for row in alone:
        chooser = choosers[row]
        try:
            ids = None
            if chooser.needs_input_ids:
                ids = torch.tensor([list(all_ids[row])], dtype=torch.long,
                                   device=logits.device)
            tokens[row] = chooser.choose(ids, logits[row : row + 1])
        except Exception as error:  # noqa: BLE001 - this row fails, its batch mates go on
            failures[row] = error
    return tokens, failures


def _draw_warped(choosers: Sequence[TokenChooser], rows: List[int], logits: torch.Tensor,
                 tokens: List[int], failures: Dict[int, Exception]) -> None:
    """Draw the tokens of ``rows``, sampling rows with the same warping
    (:attr:`TokenChooser.warping`): their warpers run once over the rows stacked (top-p
    sorts each row of the vocabulary, and one sort of the stack costs less than one per
    row), then each row draws with its own generator."""
    try:
        index = torch.tensor(rows, dtype=torch.long, device=logits.device)
        scores = logits.index_select(0, index).float()
        processors = choosers[rows[0]].processors
        if processors:
            scores = processors(None, scores)
    except Exception as error:  # noqa: BLE001 - these rows fail, the others go on
        failures.update((row, error) for row in rows)
        return
    for i, row in enumerate(rows):
        try:
            tokens[row] = choosers[row].pick(scores[i : i + 1])
        except Exception as error:  # noqa: BLE001 - this row fails, its batch mates go on
            failures[row] = error


def _argmax_barring(logits: torch.Tensor, barring: Dict[int, Tuple[int, ...]]) -> List[int]:
    """The argmax of each row of ``barring`` (row -> ids it bars) over ``logits`` with
    those ids at -inf, as ``MinNewTokensLengthLogitsProcessor`` sets them (a copy: the
    raw logits stay as they are for :func:`token_logprobs`); an id beyond the vocabulary,
    which the processor's mask would not match, is skipped."""
    vocab = logits.shape[-1]
    barring = {row: [t for t in ids if 0 <= t < vocab] for row, ids in barring.items()}
    rows = list(barring)
    scores = logits.index_select(0, torch.tensor(rows, device=logits.device)).float()
    at_row = [i for i, row in enumerate(rows) for _ in barring[row]]
    at_id = [token for row in rows for token in barring[row]]
    scores[at_row, at_id] = -math.inf
    return largest_at(scores).tolist()


@dataclasses.dataclass(frozen=True)
class TokenLogprobs:
    """The chosen token's log-probability and the ``(token_id, logprob)`` pairs of the
    most likely tokens, most likely first (empty unless ``top_logprobs`` was asked)."""

    logprob: float
    top: Tuple[Tuple[int, float], ...] = ()


def token_logprobs(
    choosers: Sequence[TokenChooser],
    logits: torch.Tensor,
    tokens: Sequence[int],
) -> List[Optional[TokenLogprobs]]:
    """Log-probabilities of the chosen ``tokens`` for the rows whose chooser asked
    (``logprobs`` or ``top_logprobs``), None for the others.

    They are the model's own distribution for the step: ``log_softmax`` of the raw logits
    in float32, *before* the repetition penalty, ``min_new_tokens``, temperature, top-k,
    top-p and typical-p. That is what vLLM reports by default (its V1 engine's
    ``logprobs_mode="raw_logprobs"``) and what OpenAI's API describes. text-generation-
    inference reports the distribution after its repetition penalty and warpers instead;
    for greedy requests without a repetition penalty the two agree. A token barred by
    ``min_new_tokens`` keeps its real log-probability in ``top``.

    Rows that did not ask cost nothing: the others' logits are gathered, normalised and
    copied to the host in a few batched operations.

    >>> chooser = TokenChooser(top_logprobs=2)
    >>> logits = torch.log(torch.tensor([[0.2, 0.5, 0.3]]))
    >>> [(d.logprob, d.top) for d in token_logprobs([chooser], logits, [2])]  # doctest: +ELLIPSIS
    [(-1.20..., ((1, -0.69...), (2, -1.20...)))]
    """
    rows = [row for row, chooser in enumerate(choosers) if chooser.logprobs]
    details: List[Optional[TokenLogprobs]] = [None] * len(choosers)
    if not rows:
        return details
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen_ids = torch.tensor([tokens[row] for row in rows], dtype=torch.long,
                              device=logits.device)
    chosen = logprobs.gather(1, chosen_ids.unsqueeze(1)).squeeze(1).tolist()
    k = max(choosers[row].top_logprobs for row in rows)
    top_values: List[List[float]] = [[] for _ in rows]
    top_ids: List[List[int]] = [[] for _ in rows]
    if k:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)  # sorted, largest first
        top_values, top_ids = values.tolist(), ids.tolist()
    for i, row in enumerate(rows):
        n = choosers[row].top_logprobs
        details[row] = TokenLogprobs(
            float(chosen[i]), tuple(zip(top_ids[i][:n], top_values[i][:n])))
    return details

"""How many prompt columns the next prefill pass feeds, while other requests decode.

A prefill pass and a decode step take turns (see :mod:`djl_stream.generation.scheduler`), so
a running stream waits one pass plus its own step between two tokens. Two bounds size the
pass, and the narrower wins:

* the **token budget** (``option.max_batch_prefill_tokens``), scaled down as the prompt gets
  deeper, because a column attends to every column before it
  (:func:`prefill_columns`, :func:`attention_parity_context`): a cost model from the
  model's shape, the same on every machine;
* the **stall bound** (``option.prefill_stall_steps``): a pass may take at most that many
  of the running batch's decode steps, *as measured* (:class:`PrefillPacer`), unless
  its fixed part alone is well beyond that (:data:`OUT_OF_REACH`), or near it while a
  short prompt is read (:data:`STRETCHED_PASS`). The cost model
  cannot know what a pass costs on this machine: a pass streams all the weights once, like
  a decode step, whatever its width, and attention over thousands of cached columns has
  costs of its own: deep into a 4,000-token prompt, the 13 columns the budget of 32 affords
  there can take several decode steps, and a single column one.

The pacer keeps the median of the last few decode steps' seconds, and fits what a pass
costs as a fixed part plus a part per budget token (rows × columns × the depth factor):
a pass streams all the weights once whatever its width, so on a CPU a one-column pass can
cost half of what a 32-column one does. The fit is a least-squares line over the
passes timed so far, recent ones weighing most (:class:`PassCostModel`), and the next pass
gets as many budget tokens as fit in ``stall_steps`` decode steps after the fixed part.
A cost per token alone (each pass's seconds over its tokens) overstates what a wider pass
costs after a narrow one: after a single deep column, the next short prompt would be read
two columns at a time, then five, and so on. Until passes
of two widths have been seen, the fit is that cost per token. Widths are rounded, not
floored: floored, a single column that costs more than half the bound would never become
two.

Example, with a clock that the "model" below advances:

>>> now = [0.0]
>>> pacer = PrefillPacer(stall_steps=2.0, parity_context=float("inf"), clock=lambda: now[0])
>>> with pacer.decode_step():
...     now[0] += 0.05                       # a 50 ms decode step
>>> pacer.columns(budget=32, rows=1, cached=0)    # nothing measured yet: the budget
32
>>> with pacer.prefill_pass(rows=1, columns=32, cached=0):
...     now[0] += 0.05 + 32 * 0.003          # 146 ms: the weights, then 3 ms a column
>>> pacer.columns(budget=32, rows=1, cached=0)    # one size seen: 32 x 100 / 146 ms
22
>>> with pacer.prefill_pass(rows=1, columns=22, cached=0):
...     now[0] += 0.05 + 22 * 0.003          # 116 ms
>>> pacer.columns(budget=32, rows=1, cached=0)    # two: (100 - 50 ms fixed) / 3 ms
17
"""

from __future__ import annotations

import collections
import contextlib
import math
import statistics
import time
from typing import Callable, Deque, Iterator, Optional

from djl_stream.runtime.kv_memory import attention_shape

#: ``option.prefill_stall_steps`` when unset: a running stream waits at most this many of
#: its decode steps for one prefill pass, so about 2.5 between two tokens, which leaves
#: room for a busy machine's noise under the reliability target of 4 (RELIABILITY.md).
DEFAULT_PREFILL_STALL_STEPS = 1.5
#: The running batch's step is the median of its last this many decode steps. A median,
#: not a moving average: the steps just before a long prompt arrives are slowed by the
#: server reading that request (the same two cores), and with mixed passes no step runs
#: alone until the prompt is read, so that slowed figure would size every chunk of it.
STEP_WINDOW = 9
#: A running batch this many times the rows of the last step timed alone has outgrown that
#: step's time (:meth:`PrefillPacer.step_outdated`): the next step runs alone, to be timed.
#: While prompts keep arriving every step is a mixed pass, never timed alone, and the step
#: time on record would stay that of a batch of far fewer rows: each chunk beside a step
#: would read as costing the difference, and a prompt arriving then would be read a few
#: columns a pass.
STEP_GROWTH = 1.5
#: How much each older pass counts in the cost fit, against 1 for the newest: a pass's
#: cost changes with the prompt's depth, so the last few count most.
FORGETTING = 0.7

#: A pass whose fixed part alone is this many times what the bound allows it cannot be
#: kept near the bound by any width, and one column a pass pays that fixed part once per
#: prompt column: its chunk gets the bound's worth of columns on top of the fixed part
#: instead. That is the case where an eager pass costs several compiled steps (int8
#: weights turned into floats in every eager pass, say): one column a pass would keep a
#: prompt waiting for seconds. Twice the bound, not once: an eager chunk beside a compiled
#: step can cost about the bound by itself, and the bound on top of it would double a
#: running stream's worst gap beside a long prompt (the reliability target,
#: RELIABILITY.md).
OUT_OF_REACH = 2.0
#: A short prompt read beside running streams (:data:`SHORT_PROMPT_PASSES`) may have
#: passes this many times their fixed part, where that is more than the bound allows
#: (and at most the fixed part plus the bound): at least a third of each pass then reads
#: its columns. A mixed pass runs the eager forward, whose fixed part beside a compiled
#: step can be about the bound, so within the bound it would feed one column a pass, and a
#: chat prompt arriving beside one stream would be read in dozens of passes rather than a
#: few, for about the same worst gap of the running stream.
STRETCHED_PASS = 1.5
#: A prompt is short, for :data:`STRETCHED_PASS`, when stretched passes read all of it
#: in at most this many: a running stream meets at most that many longer gaps for it. A
#: long prompt keeps the bound from its first column to its last: with every prompt's
#: passes stretched, a running stream's worst gap beside a prompt of thousands of tokens
#: would pass the reliability target (RELIABILITY.md).
SHORT_PROMPT_PASSES = 8


def attention_parity_context(model) -> float:
    """The context length at which a prompt column's attention costs as many
    floating-point operations as the rest of its forward pass (``inf`` where the model's
    config does not say enough to tell).

    A column's matrix products take about 2 FLOPs per weight outside the embeddings; its
    attention over ``context`` cached columns takes about 4 × ``context`` × the attention
    width (query heads × head size) per layer (scores, then the weighted sum of values).
    SmolLM2-135M (106 M weights outside its embeddings, 30 layers of 576) reaches parity at
    about 3,070 columns: by this count a prefill chunk read at the end of a 4,000-token
    prompt costs 2.3 times one read at its start (``python -m benchmarks.prefill_gap``
    shows what a CPU does).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> config = LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=128,
    ...                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    >>> round(attention_parity_context(LlamaForCausalLM(config)))
    288
    """
    # (imported here: it imports torch, which model.py's import must not pull in)
    from djl_stream.runtime.packed_linear import packed_weight_count

    shape = attention_shape(getattr(model, "config", None))
    if shape is None:
        return math.inf
    ends = [module for module in (model.get_input_embeddings(), model.get_output_embeddings())
            if module is not None]
    embeddings = {id(p) for module in ends for p in module.parameters()}
    weights = sum(p.numel() for p in model.parameters()
                  if id(p) not in embeddings and p.dim() > 1)
    weights += packed_weight_count(model, leaving_out=ends)  # (not among the parameters)
    attention_flops_per_context_column = 4 * shape.heads * shape.head_dim * shape.layers
    return 2 * weights / attention_flops_per_context_column if weights else math.inf


def prefill_columns(budget: float, rows: int, cached: int, parity_context: float) -> int:
    """How many prompt columns the next prefill pass of ``rows`` rows feeds, ``cached``
    columns already in their KV cache, so that it costs about what ``budget`` tokens cost
    with nothing cached (see :func:`attention_parity_context`).

    ``max_batch_prefill_tokens`` is what a running stream can afford to wait between two
    tokens; a chunk deep into a long prompt attends to everything before it, so it gets
    fewer columns, and the wait stays the same from the first chunk to the last. At least
    one column, so that every prefill ends.

    >>> prefill_columns(64, 1, 0, 3000.0), prefill_columns(64, 1, 3000, 3000.0)
    (64, 32)
    >>> prefill_columns(64, 4, 1000, float("inf")), prefill_columns(64, 64, 4000, 100.0)
    (16, 1)
    """
    return max(1, int(budget / budget_tokens(rows, 1, cached, parity_context)))


def budget_tokens(rows: int, columns: int, cached: int, parity_context: float) -> float:
    """What a pass of ``rows`` × ``columns`` after ``cached`` columns costs, in tokens of
    the budget (prompt tokens fed with nothing cached): the inverse of
    :func:`prefill_columns`.

    >>> budget_tokens(2, 16, 3000, 3000.0)
    64.0
    """
    return rows * columns * (1 + cached / parity_context)


class PassCostModel:
    """Seconds a prefill pass takes for its budget tokens: ``fixed + per_token × tokens``,
    fitted by least squares over the passes observed, each older one weighing
    :data:`FORGETTING` times the next.

    While every pass seen had about the same size (their spread under a tenth of their
    mean), the two parts cannot be told apart and the model is a cost per token alone.

    >>> model = PassCostModel()
    >>> model.observe(32, 0.070); model.seconds_per_token   # one size: 70 ms / 32
    0.0021875
    >>> model.observe(1, 0.037); round(model.fixed_seconds, 3), round(model.seconds_per_token, 5)
    (0.036, 0.00106)
    >>> round(model.tokens_within(0.090))       # what a 90 ms pass can feed
    51
    """

    def __init__(self, forgetting: float = FORGETTING):
        self.forgetting = forgetting
        self._weight = self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: float, seconds: float) -> None:
        f = self.forgetting
        self._weight = f * self._weight + 1.0
        self._x = f * self._x + tokens
        self._y = f * self._y + seconds
        self._xx = f * self._xx + tokens * tokens
        self._xy = f * self._xy + tokens * seconds

    @property
    def observed(self) -> bool:
        return self._weight > 0

    def _size_moments(self) -> tuple[float, float]:
        """The mean size of the passes seen and its spread (variance), each weighed."""
        mean_x = self._x / self._weight
        return mean_x, self._xx / self._weight - mean_x * mean_x

    def _fit(self) -> tuple[float, float]:
        mean_x, spread = self._size_moments()
        mean_y = self._y / self._weight
        if not self.one_size:
            slope = (self._xy / self._weight - mean_x * mean_y) / spread
            fixed = mean_y - slope * mean_x
            if slope > 0 and fixed >= 0:
                return fixed, slope
        return 0.0, self._y / self._x  # one size seen, or a fit noise bent: per token alone

    @property
    def fixed_seconds(self) -> float:
        return self._fit()[0]

    @property
    def fixed_at_most(self) -> float:
        """The fixed part, or while every pass seen had about the same size (no fixed part
        can be told apart), the most it can be: all of that size's cost.

        >>> model = PassCostModel()
        >>> model.observe(1, 0.040); model.fixed_seconds, model.fixed_at_most
        (0.0, 0.04)
        """
        return self._y / self._weight if self.one_size else self.fixed_seconds

    @property
    def one_size(self) -> bool:
        """Whether every pass seen (weighed by :data:`FORGETTING`) had about the same
        size: their spread under a tenth of their mean."""
        if not self._weight:
            return False
        mean_x, spread = self._size_moments()
        return spread <= (0.1 * mean_x) ** 2

    @property
    def seconds_per_token(self) -> float:
        return self._fit()[1]

    def tokens_within(self, seconds: float) -> float:
        """Budget tokens a pass of ``seconds`` feeds (0 when the fixed part alone exceeds it)."""
        fixed, per_token = self._fit()
        if per_token <= 0:
            return math.inf  # nothing measurable per token (a chunk beside a step, say)
        return max(0.0, (seconds - fixed) / per_token)


class StepTiming:
    """What :meth:`PrefillPacer.decode_step` yields: set ``counted`` to false to leave the
    step out of the running batch's step time."""

    def __init__(self) -> None:
        self.counted = True


class PrefillPacer:
    """Sizes prefill passes so that one takes at most ``stall_steps`` decode steps of the
    running batch, from the times it measures (see the module docstring).

    ``stall_steps`` of 0 (or ``None``) turns the bound off: passes are sized by the token
    budget alone. ``clock`` is a monotonic clock in seconds; ``synchronize``, where given,
    is called before a pass's end is read (on CUDA, kernels run after the call returns:
    ``torch.cuda.synchronize``; a decode step synchronizes anyway, reading its tokens).
    """

    def __init__(self, stall_steps: Optional[float], parity_context: float, *,
                 clock: Callable[[], float] = time.perf_counter,
                 synchronize: Optional[Callable[[], None]] = None):
        self.stall_steps = stall_steps or 0.0
        self.parity_context = parity_context
        self.clock = clock
        self.synchronize = synchronize
        #: (rows, seconds) of the last decode steps timed alone (rows ``None`` where the
        #: caller did not say)
        self._recent_steps: Deque[tuple] = collections.deque(maxlen=STEP_WINDOW)
        #: What a prefill pass costs, fitted from the passes timed so far.
        self.pass_cost = PassCostModel()
        #: What a prompt chunk adds to a decode step it shares a pass with (a mixed
        #: pass's time beyond the running batch's step), fitted likewise.
        self.shared_cost = PassCostModel()

    @property
    def seconds_per_token(self) -> Optional[float]:
        """What one more budget token adds to a pass, as fitted (``None`` before any pass)."""
        return self.pass_cost.seconds_per_token if self.pass_cost.observed else None

    @property
    def step_seconds(self) -> Optional[float]:
        """The running batch's decode step, seconds: the median of the last
        :data:`STEP_WINDOW` timed, those of a batch of about the newest one's rows (within
        :data:`STEP_GROWTH` of it: the steps of a smaller batch say little of a larger
        one's); ``None`` before any."""
        if not self._recent_steps:
            return None
        newest = self._recent_steps[-1][0]
        return statistics.median(seconds for rows, seconds in self._recent_steps
                                 if _similar(rows, newest))

    def step_outdated(self, rows: int) -> bool:
        """Whether a running batch of ``rows`` rows has outgrown the last step timed
        alone (:data:`STEP_GROWTH`): its next decode step should then run alone, timed,
        rather than in a mixed pass (with the bound off, never)."""
        if not self.stall_steps or not self._recent_steps:
            return False
        timed = self._recent_steps[-1][0]
        return timed is not None and rows > STEP_GROWTH * timed

    @property
    def bound_seconds(self) -> Optional[float]:
        """How long a pass may take now, or ``None`` (no bound, or no step timed yet)."""
        if not self.stall_steps or self.step_seconds is None:
            return None
        return self.stall_steps * self.step_seconds

    def columns(self, budget: int, rows: int, cached: int, *,
                beside_step: bool = False, prompt_length: Optional[int] = None) -> int:
        """Columns for the next pass of ``rows`` rows after ``cached`` columns, a decode
        step of the running batch waiting on it: the token budget's, or fewer where the
        timed passes say that many would stall the running batch too long.

        ``beside_step``: the chunk shares one pass with the running batch's decode step
        (a mixed pass): the streams then wait for that pass alone, so the chunk may add
        the bound to the step, and it does not pay for reading the weights again. Its
        cost is what mixed passes were seen to add to a step, or, before any was timed,
        a prefill pass's cost without its fixed part.

        ``prompt_length``: the columns of the prompts being read, all of them (cached and
        still to feed); where given, a short prompt's passes may stretch beyond the bound
        (:data:`STRETCHED_PASS`)."""
        by_budget = prefill_columns(budget, rows, cached, self.parity_context)
        bound = self.bound_seconds
        if bound is None:
            return by_budget
        if beside_step and self.shared_cost.observed:
            cost, skips_fixed_part = self.shared_cost, False
        elif self.pass_cost.observed:
            # (a chunk beside a step, costed as a pass of its own: the step reads the weights)
            cost, skips_fixed_part = self.pass_cost, beside_step
        else:
            return by_budget
        per_column = budget_tokens(rows, 1, cached, self.parity_context)
        fixed = cost.fixed_seconds
        within = bound + (fixed if skips_fixed_part else 0.0)
        if fixed >= OUT_OF_REACH * within:
            # no width keeps the pass within the bound: see OUT_OF_REACH
            within = fixed + bound
        elif prompt_length is not None:
            # a short prompt may stretch its passes: see STRETCHED_PASS
            most_fixed = cost.fixed_at_most
            stretched = min(STRETCHED_PASS * most_fixed, most_fixed + bound)
            # (one size seen: what a wider pass reads is unknown, the budget's at most;
            # the stretched pass is then the other size the fit needs)
            readable = (by_budget if cost.one_size
                        else cost.tokens_within(stretched) / per_column)
            if stretched > within and prompt_length <= SHORT_PROMPT_PASSES * readable:
                within = stretched
        tokens = cost.tokens_within(within)
        return max(1, round(min(by_budget, tokens / per_column)))

    @contextlib.contextmanager
    def decode_step(self, rows: Optional[int] = None) -> Iterator["StepTiming"]:
        """Time the decode step run inside (the running batch's, of ``rows`` rows), unless
        the code inside sets the yielded :class:`StepTiming`'s ``counted`` to false.

        A step is not counted where it ran a way that a pass beside a prompt cannot come
        near (a step replayed from a CUDA graph, several times quicker than the eager
        forward every mixed pass runs): counted, the bound would split every prompt read
        beside a stream into chunks each costing a whole eager pass. With no step
        counted, the bound is off."""
        timing = StepTiming()
        start = self.clock()
        yield timing
        if timing.counted:
            self._recent_steps.append((rows, self.clock() - start))

    @contextlib.contextmanager
    def prefill_pass(self, rows: int, columns: int, cached: int) -> Iterator[None]:
        """Time the prefill pass run inside: ``rows`` × ``columns`` fed after ``cached``."""
        with self._timed() as seconds:
            yield
        self.pass_cost.observe(budget_tokens(rows, columns, cached, self.parity_context),
                               seconds[0])

    @contextlib.contextmanager
    def mixed_pass(self, rows: int, columns: int, cached: int) -> Iterator[None]:
        """Time a mixed pass run inside: the running batch's decode step plus ``rows`` ×
        ``columns`` prompt columns after ``cached``. What it took beyond a decode step
        (:attr:`step_seconds`) is the chunk's share. While mixed passes run, no decode
        step runs alone, so that figure lags a batch that grew, and the share reads high;
        once the batch has outgrown it by :data:`STEP_GROWTH`, the scheduler runs a step
        alone to time it (:meth:`step_outdated`)."""
        with self._timed() as seconds:
            yield
        if self.step_seconds is not None:
            self.shared_cost.observe(budget_tokens(rows, columns, cached, self.parity_context),
                                     max(0.0, seconds[0] - self.step_seconds))

    @contextlib.contextmanager
    def _timed(self) -> Iterator[list]:
        """Seconds the code inside took, the device's work done (in the list yielded,
        once it ends; nothing when the code raises)."""
        seconds: list = []
        start = self.clock()
        yield seconds
        if self.synchronize is not None:
            self.synchronize()
        seconds.append(self.clock() - start)


def _similar(rows: Optional[int], newest: Optional[int]) -> bool:
    """Whether a step of ``rows`` rows says how long one of ``newest`` rows takes (either
    unknown: yes)."""
    if rows is None or newest is None:
        return True
    return max(rows, newest) <= STEP_GROWTH * min(rows, newest)

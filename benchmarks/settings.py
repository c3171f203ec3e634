"""The settings of one benchmark run and the prompts it sends.

Parsed once from the command line into a frozen :class:`Settings`; ``--quick`` only changes
the defaults, so a flag given explicitly always wins.

Example::

    >>> s = Settings.resolve(model_dir="model", quick=True)
    >>> s.new_tokens, s.concurrency, s.repetitions, s.concurrency_repetitions
    (8, (1, 2, 4), 1, 1)
    >>> Settings.resolve(model_dir="model", quick=True, new_tokens=16).new_tokens
    16
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

#: Requests that SmolLM2-135M-Instruct answers at length: greedy decoding runs well past
#: 160 tokens on each without an end-of-sequence token, so every row produces exactly the
#: tokens asked for. The single-stream rows use the first; concurrent client i sends
#: ``PROMPTS[i % len(PROMPTS)]`` (prompts of different lengths, as real traffic has).
PROMPTS = (
    "Write a long, detailed essay about the history of the Roman Empire.",
    "Explain in detail how a steam engine works, step by step.",
    "Describe the water cycle in detail for a school textbook.",
    "Write a detailed travel guide to Japan.",
)

# Sized so that ``make bench`` stays under 10 minutes on a 2-core CPU (about 15 tokens/s
# single-stream): the Jina way re-runs the prompt for every token (about 30 s for 128
# tokens), and one-at-a-time serving of 1+2+4+8+16 clients is 31 requests in a row.
_DEFAULTS = dict(
    new_tokens=128,
    concurrency=(1, 2, 4, 8, 16),
    concurrency_new_tokens=32,
    repetitions=5,
    jina_repetitions=1,
    concurrency_repetitions=2,
)
_QUICK = dict(
    new_tokens=8,
    concurrency=(1, 2, 4),
    concurrency_new_tokens=4,
    repetitions=1,
    jina_repetitions=1,
    concurrency_repetitions=1,
)


@dataclasses.dataclass(frozen=True)
class Settings:
    """Everything that decides what a run measures.

    Attributes:
        model_dir: the model directory the server serves and the in-process rows load.
        new_tokens: tokens each single-stream row generates (forced, see the report).
        concurrency: numbers of concurrent HTTP clients, ascending.
        concurrency_new_tokens: tokens each concurrent client asks for.
        repetitions: interleaved repetitions of the single-stream rows; the report gives
            medians.
        jina_repetitions: repetitions of the (slow) Jina row, the first ones of the
            interleaved sequence; at most ``repetitions``.
        concurrency_repetitions: interleaved repetitions of the load tests.
        device: ``auto`` (CUDA when available), ``cpu``, ``cuda`` or ``cuda:N``.
        dtype: ``auto`` (what ``serving.properties`` says), ``fp32``, ``fp16``, ``bf16``.
        threads: ``torch.set_num_threads`` for both processes; None leaves torch's default.
        skip_http: measure the in-process rows only.
        quick: a smoke run with tiny settings; its figures mean nothing.
        warmup_tokens: tokens of the untimed warm-up call before each row's first run.
        max_rows: the most requests the continuous-batching server decodes together, its
            ``option.max_rolling_batch_size`` (:func:`server_max_rows`); clients past it
            wait for a row. ``None``: not known (no cap assumed).
    """

    model_dir: str
    new_tokens: int
    concurrency: tuple[int, ...]
    concurrency_new_tokens: int
    repetitions: int
    jina_repetitions: int
    concurrency_repetitions: int
    device: str = "auto"
    dtype: str = "auto"
    threads: Optional[int] = None
    skip_http: bool = False
    quick: bool = False
    warmup_tokens: int = 2
    output: str = "BENCHMARKS.md"
    plot: str = "benchmarks/concurrency.png"
    max_rows: Optional[int] = None

    @classmethod
    def resolve(
        cls,
        *,
        model_dir: str,
        quick: bool = False,
        new_tokens: Optional[int] = None,
        concurrency: Optional[Sequence[int]] = None,
        concurrency_new_tokens: Optional[int] = None,
        repetitions: Optional[int] = None,
        jina_repetitions: Optional[int] = None,
        concurrency_repetitions: Optional[int] = None,
        **rest,
    ) -> "Settings":
        """Settings from explicit values, falling back on the quick or full defaults."""
        preset = _QUICK if quick else _DEFAULTS
        chosen = dict(
            new_tokens=new_tokens,
            concurrency=tuple(sorted(set(concurrency))) if concurrency else None,
            concurrency_new_tokens=concurrency_new_tokens,
            repetitions=repetitions,
            jina_repetitions=jina_repetitions,
            concurrency_repetitions=concurrency_repetitions,
        )
        values = {k: preset[k] if v is None else v for k, v in chosen.items()}
        values["jina_repetitions"] = min(values["jina_repetitions"], values["repetitions"])
        for name in ("new_tokens", "concurrency_new_tokens", "repetitions", "jina_repetitions",
                     "concurrency_repetitions"):
            if values[name] < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {values[name]}")
        if min(values["concurrency"]) < 1:
            raise ValueError(f"--concurrency values must be at least 1, got {values['concurrency']}")
        rest.setdefault("max_rows", server_max_rows(model_dir))
        return cls(model_dir=model_dir, quick=quick, **values, **rest)

    @property
    def late_arrival_clients(self) -> int:
        """Clients already decoding when the late request arrives: one less than the
        largest concurrency, or than the server's :attr:`max_rows` where that is fewer (so
        that the late request finds a row free and joins the running batch, rather than
        waiting behind clients that wait for rows themselves).

        >>> Settings("model", 8, (1, 16), 4, 1, 1, 1).late_arrival_clients
        15
        >>> Settings("model", 8, (1, 16, 64), 4, 1, 1, 1, max_rows=32).late_arrival_clients
        31
        """
        return late_clients(max(self.concurrency) - 1, self.max_rows)


def late_clients(asked: int, max_rows: Optional[int]) -> int:
    """The clients already decoding when a late request arrives: ``asked``, but no more
    than leave the late request a row of the server's ``max_rows`` (past them it would
    wait for rows to free up, not join the running batch); ``None``: no cap known.

    >>> late_clients(63, 32), late_clients(15, 32), late_clients(0, 32), late_clients(63, None)
    (31, 15, 0, 63)
    """
    return asked if max_rows is None else min(asked, max_rows - 1)


def server_max_rows(model_dir: str) -> Optional[int]:
    """``option.max_rolling_batch_size`` of a server started on ``model_dir`` (its
    ``serving.properties``, else ``OPTION_MAX_ROLLING_BATCH_SIZE`` in this environment, else
    the default), or ``None`` where the properties do not parse.

    >>> server_max_rows("/nowhere")
    32
    """
    from djl_stream.serving.properties import ModelProperties, djl_init_properties

    try:
        init = djl_init_properties(model_dir)
        return ModelProperties.from_init_properties(init).max_rolling_batch_size
    except Exception:  # noqa: BLE001 - the server will say what is wrong; the run goes on
        return None

"""``BENCHMARKS.md`` and the concurrency plot, written from a run's :class:`Results`.

Example::

    plot_concurrency(results, Path("benchmarks/concurrency.png"))
    Path("BENCHMARKS.md").write_text(markdown(results, evaluate(results), command, plot))
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable, List, Optional, Sequence

from .inprocess import Row
from .results import CONTINUOUS, MODES, ONE_AT_A_TIME, Results, ratio
from .settings import PROMPTS
from .targets import Check


def _missing(x: Optional[float]) -> bool:
    return x is None or (isinstance(x, float) and math.isnan(x))


def rate(x: Optional[float]) -> str:
    return "—" if _missing(x) else f"{x:.1f}"


def ms(x: Optional[float]) -> str:
    return "—" if _missing(x) else f"{x * 1e3:.0f} ms" if x >= 0.01 else f"{x * 1e3:.1f} ms"


def times(x: Optional[float]) -> str:
    return "—" if _missing(x) else f"{x:.2f}×"


def mb(x: Optional[int]) -> str:
    return "—" if x is None else f"{x / 1e6:.0f} MB"


def _table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> List[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _same_text(text: Optional[str], reference: Optional[str]) -> str:
    if text is None or reference is None:
        return "—"
    if text == reference:
        return "yes"
    at = next((i for i, (a, b) in enumerate(zip(text, reference)) if a != b),
              min(len(text), len(reference)))
    return f"no (from char {at})"


def _single_rows(results: Results) -> List[Row]:
    return [row for row in results.rows if results.single.get(row.key)]


def single_stream_section(results: Results) -> List[str]:
    s = results.settings
    reference = results.single_text("generate")
    body = []
    for row in _single_rows(results):
        ttft = results.single_median(row.key, "ttft")
        itl50, itl99 = (results.single_median(row.key, f) for f in ("itl_p50", "itl_p99"))
        tokens = results.single_tokens(row.key)
        count = f"{tokens}" + ("" if tokens == s.new_tokens else " ⚠")
        body.append([
            row.label,
            rate(results.single_median(row.key, "tokens_per_s")),
            times(results.single_ratio(row.key, "generate")),
            ms(ttft) if row.granularity != "none" else f"— (all at {ms(results.single_median(row.key, 'wall'))})",
            ms(itl50) + (" ¹" if row.granularity == "chunk" else ""),
            ms(itl99) + (" ¹" if row.granularity == "chunk" else ""),
            count,
            "(reference)" if row.key == "generate" else _same_text(results.single_text(row.key), reference),
        ])
    lines = [f"## Single stream: {s.new_tokens} new tokens, one prompt", ""]
    lines += _table(["row", "tokens/s", "× generate()", "time to first token", "ITL p50",
                     "ITL p99", "tokens", "same text as generate()"], body)
    lines += ["", "Medians over the repetitions. Tokens/s is new tokens over the whole call, "
              "prefill included, for every row. ITL is the gap between two consecutive "
              "pieces reaching the caller. "
              "¹ `TextIteratorStreamer` hands out whole words, so its gaps are between words, "
              "not tokens. ⚠ fewer tokens than asked (the model ended the answer).", ""]
    lines += [f"- **{row.label}**: {row.how}" for row in _single_rows(results)] + [""]
    lines += _overhead_lines(results)
    return lines


def _overhead_lines(results: Results) -> List[str]:
    floor = results.single_median("bare_loop", "itl_p50")
    floor_ttft = results.single_median("bare_loop", "ttft")
    if _missing(floor):
        return []
    lines = ["Per-step cost over the bare loop (ITL p50 difference; TTFT difference):", ""]
    for key, label in (("djl_stream", "djl-stream in-process"), ("http", "djl-stream over HTTP"),
                       ("ray", "Ray Serve way (per word)"), ("jina", "Jina way")):
        itl = results.single_median(key, "itl_p50")
        if _missing(itl):
            continue
        ttft = results.single_median(key, "ttft")
        lines.append(f"- {label}: {(itl - floor) * 1e3:+.1f} ms per step "
                     f"({(itl / floor - 1) * 100:+.0f} %), TTFT {(ttft - floor_ttft) * 1e3:+.1f} ms")
    return lines + [""]


def concurrency_section(results: Results, plot_link: Optional[str]) -> List[str]:
    s = results.settings
    lines = [f"## Concurrent clients over HTTP: {s.concurrency_new_tokens} new tokens each", ""]
    if not results.concurrency:
        return lines + ["Not measured (`--skip-http`).", ""]
    if plot_link:
        lines += [f"![aggregate tokens/s, TTFT and ITL against concurrent clients]({plot_link})", ""]
    body = []
    for clients in s.concurrency:
        for mode in MODES:
            agg = results.load_median(mode, clients, "aggregate")
            body.append([
                str(clients), mode, rate(agg),
                times(ratio(agg, results.load_median(ONE_AT_A_TIME, clients, "aggregate"))),
                times(ratio(agg, results.load_median(mode, 1, "aggregate"))),
                ms(results.load_median(mode, clients, "ttft_p50")),
                ms(results.load_median(mode, clients, "ttft_p99")),
                ms(results.load_median(mode, clients, "itl_p50")),
                ms(results.load_median(mode, clients, "itl_p99")),
            ])
    lines += _table(["clients", "serving", "aggregate tokens/s", "× one at a time",
                     "× 1 client", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], body)
    lines += ["", "All clients are released together (a barrier), each on its own connection; "
              "client *i* sends prompt *i* mod 4. Aggregate tokens/s is every token received "
              "over the span from the first request sent to the last line received. "
              "Percentiles pool every request (TTFT) or every gap (ITL) of one repetition; "
              "the table gives their median over repetitions. *Continuous batching* is the "
              "server as configured by default; *one at a time* is the same server started "
              "with `OPTION_MAX_ROLLING_BATCH_SIZE=1` (djl's sync-engine behaviour: a request "
              "waits until the one before it has finished).", ""]
    over = [c for c in s.concurrency if s.max_rows is not None and c > s.max_rows]
    if over:
        lines += [f"The continuous-batching server decodes at most {s.max_rows} requests "
                  f"together (`option.max_rolling_batch_size={s.max_rows}`): at "
                  f"{', '.join(map(str, over))} clients the others wait for a row, so the "
                  "first tokens of the later ones come after the first ones' last, and the "
                  f"ITL is that of steps of {s.max_rows} rows at most.", ""]
    errors = results.load_errors()
    if errors:
        lines += [f"**{len(errors)} request(s) failed**, first: `{errors[0]}`", ""]
    return lines


def late_arrival_section(results: Results) -> List[str]:
    s = results.settings
    lines = ["## Late arrival", ""]
    late = results.late.get(CONTINUOUS)
    if not late:
        return lines + ["Not measured.", ""]
    solo, step, late_ttft = (results.solo_ttft(CONTINUOUS), results.solo_itl(CONTINUOUS),
                             results.late_ttft(CONTINUOUS))
    extra = (late_ttft - solo) / step if step else math.nan
    capped = s.late_arrival_clients + 1 < max(s.concurrency)  # (held under the row cap)
    lines += [f"With {s.late_arrival_clients} clients decoding ({s.concurrency_new_tokens} "
              "new tokens each, every one of them past its second token), one more request "
              "arrives on the continuous-batching server"
              + (f" (one less than its {s.max_rows} rows, `option.max_rolling_batch_size`, "
                 "so that the late request joins the running batch rather than waiting for "
                 "a row)" if capped else "") + ".", ""]
    lines += _table(["", "median", "in solo decode steps"], [
        ["solo TTFT (1 client, idle server)", ms(solo), "—" if not step else f"{solo / step:.1f}"],
        ["late arrival TTFT", ms(late_ttft), "—" if not step else f"{late_ttft / step:.1f}"],
        ["difference", ms(late_ttft - solo), "—" if _missing(extra) else f"{extra:+.1f}"],
    ])
    lines += ["", f"A decode step is the solo ITL p50 ({ms(step)}). Individual late TTFTs: "
              + ", ".join(ms(t.ttft) for t in late) + ". One at a time needs no separate "
              "measurement: a late request waits for every request ahead of it, which is "
              f"its TTFT p99 at {max(s.concurrency)} clients above.", ""]
    return lines


def memory_section(results: Results) -> List[str]:
    lines = ["## Memory (resident set size)", ""]
    body = [[m.process,
             mb(m.before.rss if m.before else None), mb(m.after.rss if m.after else None),
             "—" if m.growth is None else f"{m.growth / 1e6:+.0f} MB",
             mb(m.after.peak if m.after else None)] for m in results.memory]
    lines += _table(["process", "before", "after", "change", "peak (VmHWM)"], body)
    lines += ["", "Before: the model loaded and warmed up; after: every row of that process "
              "done, and servers idle for a second (the decode loop returns freed memory "
              "once the batch empties, just after the last line is sent). In-process rows "
              "share the benchmark process; each server is its own process "
              "(`/proc/PID/status` `VmRSS`).", ""]
    for process, trace in results.memory_trace.items():
        values = ", ".join(mb(m.rss if m else None) for m in trace)
        lines.append(f"- {process}, RSS after each load-test repetition: {values}")
    if results.memory_trace:
        lines += ["", "RSS that keeps growing from one repetition to the next is a leak; RSS "
                  "that stops growing is the allocator keeping the largest batch's working "
                  "set (KV cache and activations) for reuse.", ""]
    return lines


#: Where the project says what misses each target that is missed (relative to the
#: repository root, where BENCHMARKS.md is written).
WHY_MISSED = "docs/performance.md#targets-missed-and-why"


def targets_section(checks: Sequence[Check]) -> List[str]:
    lines = ["## Targets", ""]
    lines += [f"- **{c.verdict}** {c.target}: {c.measured}" for c in checks]
    return lines + ["", "Computed from the medians below, never asserted: a missed target "
                    "is reported here and the run still succeeds. What misses one: "
                    f"[Targets missed, and why]({WHY_MISSED}).", ""]


#: Entries of ``Results.machine`` that describe the run, reported in their own lines.
_RUN_FACTS = frozenset({"date", "model dtype", "model device", "prompt tokens"})


def setup_section(results: Results, command: str) -> List[str]:
    s, m = results.settings, results.machine
    lines = ["## Setup", ""]
    lines += [f"- **{name}**: {value}" for name, value in m.items() if name not in _RUN_FACTS]
    lines += [
        f"- **command**: `{command}` (what `make bench` runs, plus any flags)",
        f"- **model**: `{s.model_dir}`, dtype `{m.get('model dtype', s.dtype)}`, device "
        f"`{m.get('model device', s.device)}`",
        f"- **single stream**: {s.new_tokens} new tokens, greedy, prompt: "
        f"\"{PROMPTS[0]}\" (through the chat template, {m.get('prompt tokens', '?')} tokens)",
        f"- **concurrency**: {', '.join(map(str, s.concurrency))} clients, "
        f"{s.concurrency_new_tokens} new tokens each; late arrival: "
        f"{s.late_arrival_clients} + 1 clients",
        f"- **repetitions**: single stream {s.repetitions} (the slow Jina row: the first "
        f"{s.jina_repetitions}), load tests {s.concurrency_repetitions}; interleaved (every "
        "row once, then every row again, ...; every client count on both servers, then "
        "the late arrival, then again); each figure is the median over repetitions; every "
        f"row and server ran once, untimed, with {s.warmup_tokens} tokens before the first",
        "",
        "How every row produces exactly N tokens: decoding is greedy; the `generate()`-based "
        "rows pass `min_new_tokens=N, max_new_tokens=N` (the Jina way passes 1 and 1 on "
        "each call), which masks the end-of-sequence ids; the bare loop never checks them. "
        "djl-stream (in-process and HTTP) is measured as it runs in production, "
        "end-of-sequence ids active, with `max_new_tokens=N`, on prompts the model answers "
        "at length (greedy output has no end-of-sequence token within the first 160 "
        "tokens); the *tokens* columns show the count every row actually produced, and "
        "*same text as generate()* that they produced the same tokens.",
        "",
        "All rows load the model the way the server does (same weights, `dtype` rule and "
        "chat-template rendering of the prompt). The servers are started with "
        "`python -m djl_stream serve MODEL_DIR --port P` on a free loopback port and are "
        "ready when `GET /ping` "
        "answers 200; both stay up for the whole run and are idle while the other one, "
        "or an in-process row, is measured. The model is loaded, and every in-process "
        "row runs, in a thread that ends with it, and djl-stream's scheduler is shut down "
        "after its row: each way computes with the only OpenMP thread pool alive, as in a "
        "process of its own (a second live pool throttles the first; see "
        "`loading.in_passing_thread`).",
        "",
    ]
    return lines


def repetitions_section(results: Results) -> List[str]:
    lines = ["<details><summary>Per-repetition values</summary>", ""]
    for row in _single_rows(results):
        values = ", ".join(f"{t.tokens_per_s:.1f}" for t in results.single[row.key])
        lines.append(f"- {row.label}: tokens/s {values}")
    for (mode, clients), runs in sorted(results.concurrency.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        values = ", ".join(f"{r.aggregate_tokens_per_s:.1f}" for r in runs)
        lines.append(f"- {clients} clients, {mode}: aggregate tokens/s {values}")
    return lines + ["", "</details>", ""]


def markdown(results: Results, checks: Sequence[Check], command: str,
             plot_link: Optional[str]) -> str:
    s = results.settings
    minutes, seconds = divmod(int(round(results.elapsed_s)), 60)
    lines = ["# Benchmarks", ""]
    if s.quick:
        lines += ["> **Quick smoke run** (`--quick`): tiny settings to check that the "
                  "benchmark works; its figures mean nothing. Run `make bench` for real ones.", ""]
    lines += [f"Measured on {results.machine.get('date', '?')} with `{command}`, "
              f"in {minutes} min {seconds} s, on {results.machine.get('cpu', '?')}"
              f" (GPU: {results.machine.get('gpu', 'none')}).", ""]
    lines += [f"> Note: {note}" for note in results.notes] + ([""] if results.notes else [])
    lines += targets_section(checks)
    lines += single_stream_section(results)
    lines += concurrency_section(results, plot_link)
    lines += late_arrival_section(results)
    lines += memory_section(results)
    lines += setup_section(results, command)
    lines += repetitions_section(results)
    return "\n".join(lines).rstrip() + "\n"


def plot_concurrency(results: Results, path: Path) -> bool:
    """Aggregate tokens/s, TTFT and ITL against concurrent clients, one line per way of
    serving; False (nothing written) without concurrency results or matplotlib."""
    if not results.concurrency:
        return False
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        results.notes.append("matplotlib is not installed, so there is no plot "
                             "(`pip install matplotlib`, or `pip install -e '.[dev]'`).")
        return False
    s = results.settings
    levels = list(s.concurrency)
    figure, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    colours = {CONTINUOUS: "tab:blue", ONE_AT_A_TIME: "tab:orange"}
    # TTFT on a log scale: one at a time queues, so its TTFT grows a hundredfold and would
    # flatten the other curve.
    panels = (
        ("aggregate tokens/s", [("aggregate", "-", "")], 1.0, False),
        ("time to first token (ms, log scale)",
         [("ttft_p50", "-", "p50"), ("ttft_p99", "--", "p99")], 1e3, True),
        ("inter-token latency (ms)", [("itl_p50", "-", "p50"), ("itl_p99", "--", "p99")], 1e3, False),
    )
    for axis, (title, series, scale, log_y) in zip(axes, panels):
        for mode in MODES:
            for figure_name, style, suffix in series:
                values = [results.load_median(mode, c, figure_name) * scale for c in levels]
                axis.plot(levels, values, style, marker="o", color=colours[mode],
                          label=f"{mode} {suffix}".strip())
        axis.set_xscale("log", base=2)
        if log_y:
            axis.set_yscale("log")
        axis.set_xticks(levels, [str(c) for c in levels])
        axis.set_xlabel("concurrent clients")
        axis.set_title(title)
        axis.grid(True, alpha=0.3)
        axis.legend(fontsize=8)
    axes[0].set_ylim(bottom=0)
    axes[2].set_ylim(bottom=0)
    figure.suptitle(f"djl-stream over HTTP: {Path(s.model_dir).resolve().name}, "
                    f"{results.machine.get('model device', s.device)}, "
                    f"{s.concurrency_new_tokens} new tokens per client "
                    f"(median of {s.concurrency_repetitions})")
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return True


def link(target: Path, document: Path) -> str:
    """``target`` as a relative link from ``document``'s folder."""
    return Path(os.path.relpath(target.resolve(), document.resolve().parent)).as_posix()


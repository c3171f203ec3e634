"""``python -m reliability.run``: the reliability suite against a real ``djl-stream serve``,
written to ``RELIABILITY.md``.

It runs the hostile-input catalogue (:mod:`.catalogue`, every case judged by
:mod:`.probe`), then the scenarios (:mod:`.scenarios`) on servers configured for each: the
model's own limits for streams, a long prompt and a soak; a batch of one and a small queue
for a flood and a queued client; short HTTP timeouts for slowloris; a fresh server for
the largest request the limits allow (its peak resident size is that request's) and one
for SIGTERM. Targets are judged and written, never asserted: the exit status is 0 whatever the
verdicts (``make reliability``); ``tests/test_reliability.py`` runs a short version.

Examples::

    python -m reliability.run --model-dir model                 # make reliability
    python -m reliability.run --model-dir model --quick         # a few minutes
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
from pathlib import Path
from typing import List, Mapping, Optional, Sequence

from benchmarks.http_load import ServerProcess
from benchmarks.machine import describe

from . import scenarios
from .catalogue import CASES, SERVER_FLAGS, SERVER_OPTIONS, Case
from .probe import Verdict, judge, send
from .report import write_report

#: Server flags of the slowloris server: a short header timeout, so the run is short.
SLOWLORIS_FLAGS = ("--timeout-header", "2")


class Server(ServerProcess):
    """benchmarks' server process, addressed by its base URL for the catalogue."""

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def run_catalogue(server: Server, cases: Sequence[Case] = CASES) -> List[tuple[Case, Verdict]]:
    results = []
    for case in cases:
        try:
            verdict = judge(case, send(case, server.base_url))
        except Exception as error:  # noqa: BLE001 - a case that breaks the probe is a finding
            verdict = Verdict(False, f"{type(error).__name__}: {error}")
        results.append((case, verdict))
    return results


def start(model_dir: Path, name: str, workdir: Path, options: Mapping[str, str] = {},
          flags: Sequence[str] = ()) -> Server:
    """A server for ``with``: it starts on entering and stops on leaving."""
    return Server(model_dir, name=name, workdir=workdir, options=options, flags=flags)


def run(model_dir: Path, quick: bool, workdir: Path) -> dict:
    sizes = dict(streams=8 if quick else 64, tokens=16 if quick else 32,
                 soak=60 if quick else 1000, flood=12 if quick else 40, slowloris=20 if quick else 200)
    results: dict = {"sizes": sizes, "findings": []}
    findings: List[scenarios.Finding] = results["findings"]

    with start(model_dir, "catalogue", workdir, SERVER_OPTIONS, SERVER_FLAGS) as server:
        results["catalogue"] = run_catalogue(server)

    limit = int(server_option(model_dir, "max_new_tokens_limit", "2048"))
    main_options = {"max_rolling_batch_size": str(max(32, sizes["streams"]))}
    with start(model_dir, "main", workdir, main_options) as server:
        step_s = scenarios.decode_step_s(server.url)
        results["decode_step_s"] = step_s
        findings.append(scenarios.concurrent_streams(server, sizes["streams"], sizes["tokens"]))
        findings.append(scenarios.poisoned_request(server, sizes["tokens"]))
        findings.extend(scenarios.disconnects(server, step_s, limit))
        findings.append(scenarios.slow_reader(server, sizes["tokens"]))
        max_input = int(server_option(model_dir, "max_input_length", "4096"))
        findings.append(scenarios.long_prompt_arrival(server, max_input, step_s))
        findings.append(scenarios.soak(server, sizes["soak"]))

    # A server of its own, with the model's own limits: its peak is this request's alone.
    with start(model_dir, "largest", workdir) as server:
        # two prompts near max_input_length (4096) are over the bound with max_new_tokens_limit
        shape = dict(rows=32, prompt_words=60) if quick else dict(rows=2, prompt_words=3900)
        findings.append(scenarios.largest_request(server, max_new_tokens_limit=limit, **shape))

    queue_options = {"max_rolling_batch_size": "1", "job_queue_size": "4"}
    with start(model_dir, "queue", workdir, queue_options) as server:
        findings.append(scenarios.queued_disconnect(server, limit))
        findings.append(scenarios.flood(server, sizes["flood"], 4))

    with start(model_dir, "slowloris", workdir, flags=SLOWLORIS_FLAGS) as server:
        findings.append(scenarios.slowloris(server, sizes["slowloris"],
                                            float(SLOWLORIS_FLAGS[1])))

    server = start(model_dir, "sigterm", workdir).start()
    try:
        findings.append(scenarios.sigterm_during_streams(server, sizes["tokens"]))
    finally:
        server.stop()
    return results


def server_option(model_dir: Path, name: str, default: str) -> str:
    from djl_stream.serving.properties import read_serving_properties
    return read_serving_properties(model_dir).get(f"option.{name}", default)


def main(argv: Optional[Sequence[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=Path("model"))
    parser.add_argument("--quick", action="store_true", help="smaller sizes, a few minutes")
    parser.add_argument("--out", type=Path, default=Path("RELIABILITY.md"))
    args = parser.parse_args(argv)
    started = datetime.datetime.now(datetime.timezone.utc)
    with tempfile.TemporaryDirectory(prefix="djl-stream-reliability-") as work:
        results = run(args.model_dir, args.quick, Path(work))
    results["machine"] = describe()
    results["started"] = started
    results["model_dir"] = args.model_dir
    results["quick"] = args.quick
    write_report(args.out, results)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()

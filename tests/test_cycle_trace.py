"""benchmarks.cycle_trace: the scheduler's passes timed from inside, on the tiny model (CPU).

The tool exists for a GPU (see its docstring); here it is checked to time what the
scheduler runs, to report a burst's rounds and a late arrival, and to leave the scheduler
as it found it."""

from __future__ import annotations

from benchmarks import cycle_trace
from djl_stream.generation import scheduler as scheduler_module
from djl_stream.generation.batch import CausalLMBatch


def test_a_round_reports_the_passes_that_read_the_burst_and_a_late_arrival(tiny_model_dir,
                                                                           capsys):
    decode, concatenate = (scheduler_module.Scheduler._decode,
                           CausalLMBatch.__dict__["concatenate"])
    cycle_trace.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--clients", "3",
                      "--decode-step", "eager",
                      "--tokens", "4", "--late", "2", "--late-rounds", "1"])
    out = capsys.readouterr().out
    burst, late = out.split("## ")[1:3]
    assert burst.startswith("3 clients:") and "totals: " in burst
    # every prompt of the round was read by some prefill pass (alone or beside a step; a
    # prompt read in two chunks is named by both passes)
    read = sum(int(line.split(" prompts")[0].split()[-1]) for line in burst.splitlines()
               if line.startswith("  +") and " prefill " in line)
    assert read >= 3, burst
    # 4 tokens a client, the first from a prefill: at least 3 decode steps were timed (how
    # many more depends on when the scheduler's thread sees the clients' prompts and ends)
    decodes = int(burst.split("decode ")[1].split("x")[0])
    assert 3 <= decodes <= 3 * 4, burst
    assert late.startswith("2 clients + 1 late:") and "late arrival's" in late
    # the wrappers are gone once the trace ends
    assert scheduler_module.Scheduler._decode is decode
    assert CausalLMBatch.__dict__["concatenate"] is concatenate


def test_a_late_round_leaves_its_late_request_a_row(tiny_model_dir, capsys, monkeypatch):
    # past option.max_rolling_batch_size the late request would wait for a row to free
    # up instead of joining the running batch: the round runs one client less than it
    assert "max_rolling_batch_size" not in (tiny_model_dir / "serving.properties").read_text()
    monkeypatch.setenv("OPTION_MAX_ROLLING_BATCH_SIZE", "3")
    cycle_trace.main(["--model-dir", str(tiny_model_dir), "--device", "cpu", "--clients", "",
                      "--decode-step", "eager", "--tokens", "4", "--late", "5",
                      "--late-rounds", "1"])
    out = capsys.readouterr().out
    assert ("--late 5: 2 clients instead, one less than option.max_rolling_batch_size (3)"
            in out), out
    assert out.split("## ")[1].startswith("2 clients + 1 late:"), out


def test_a_pass_counts_the_collector_s_pauses_inside_it():
    import gc

    with cycle_trace.CycleTrace() as trace:
        with trace._timing("decode", "test"):
            gc.collect()
    (timed,) = trace.passes
    assert timed.gc > 0 and 2 in timed.gc_generations
    assert timed.cpu > 0 and timed.wall >= timed.gc
    assert gc.callbacks.count(trace._on_collection) == 0

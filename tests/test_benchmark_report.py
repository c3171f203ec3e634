"""``make bench`` against the server's row cap (``option.max_rolling_batch_size``): the late
arrival keeps its early clients within the cap, so that the late request joins a running
batch instead of queueing behind clients that wait for rows, and the report says where
clients outnumber the rows. (Timings are made up; no server runs.)"""

from __future__ import annotations

from benchmarks.http_load import LoadResult
from benchmarks.measure import StreamTiming
from benchmarks.report import concurrency_section, late_arrival_section, setup_section
from benchmarks.results import CONTINUOUS, ONE_AT_A_TIME, Results
from benchmarks.settings import Settings, server_max_rows


def _load(clients: int) -> LoadResult:
    arrivals = tuple(0.01 * i for i in range(1, 5))
    return LoadResult(clients, (StreamTiming(0.0, arrivals, arrivals[-1], 4),) * clients)


def _results(concurrency, max_rows) -> Results:
    settings = Settings("model", 8, tuple(concurrency), 4, 1, 1, 1, max_rows=max_rows)
    results = Results(settings, machine={})
    for clients in concurrency:
        for mode in (CONTINUOUS, ONE_AT_A_TIME):
            results.concurrency[(mode, clients)] = [_load(clients)]
    results.late[CONTINUOUS] = [StreamTiming(0.0, (0.05,), 0.05, 1)]
    return results


def test_clients_past_the_row_cap_are_said_to_wait_and_the_late_arrival_stays_within_it():
    results = _results((1, 4, 16, 64), max_rows=32)
    assert results.settings.late_arrival_clients == 31
    concurrency = "\n".join(concurrency_section(results, None))
    assert ("decodes at most 32 requests together (`option.max_rolling_batch_size=32`): "
            "at 64 clients the others wait for a row") in concurrency
    late = "\n".join(late_arrival_section(results))
    assert late.startswith("## Late arrival\n\nWith 31 clients decoding")
    assert "one less than its 32 rows" in late
    assert "late arrival: 31 + 1 clients" in "\n".join(setup_section(results, "make bench"))


def test_within_the_row_cap_nothing_is_said_of_it():
    results = _results((1, 2, 4, 8, 16), max_rows=32)
    assert results.settings.late_arrival_clients == 15
    text = "\n".join(concurrency_section(results, None) + late_arrival_section(results))
    assert "max_rolling_batch_size=" not in text and "one less than its" not in text
    assert "With 15 clients decoding" in text


def test_the_row_cap_is_the_servers_own_from_its_properties_or_environment(tmp_path,
                                                                            monkeypatch):
    monkeypatch.delenv("OPTION_MAX_ROLLING_BATCH_SIZE", raising=False)
    assert server_max_rows(str(tmp_path)) == 32  # the default
    monkeypatch.setenv("OPTION_MAX_ROLLING_BATCH_SIZE", "12")
    assert server_max_rows(str(tmp_path)) == 12
    # serving.properties wins over the environment, as in djl-serving
    (tmp_path / "serving.properties").write_text("option.max_rolling_batch_size=8\n")
    assert server_max_rows(str(tmp_path)) == 8
    assert Settings.resolve(model_dir=str(tmp_path), quick=True).max_rows == 8

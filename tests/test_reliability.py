"""The reliability suite's short version (``make reliability`` runs the long one and
writes RELIABILITY.md): every hostile input of the catalogue gets its documented status and
JSON shape from a real server on the tiny model, and the scenarios' verdicts that do not
depend on the machine's speed hold (texts equal, a poison fails alone, nothing runs for a
client that left, a flood is refused in JSON, SIGTERM drains). Times are reported by the
long run, never asserted here.
"""

from __future__ import annotations

import pytest

from reliability import scenarios
from reliability.catalogue import CASES, SERVER_FLAGS, SERVER_OPTIONS
from reliability.probe import judge, send
from reliability.run import start


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("reliability")


@pytest.fixture(scope="module")
def catalogue_server(tiny_model_dir, workdir):
    with start(tiny_model_dir, "catalogue", workdir, SERVER_OPTIONS, SERVER_FLAGS) as server:
        yield server


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_each_hostile_input_gets_its_documented_answer(catalogue_server, case):
    verdict = judge(case, send(case, catalogue_server.base_url))
    assert verdict.ok, verdict.detail


def test_the_server_served_the_whole_catalogue_without_an_internal_error(catalogue_server):
    assert catalogue_server.process.poll() is None
    log = catalogue_server.log_path.read_text(errors="replace")
    assert "Traceback" not in log and " 500 " not in log


@pytest.fixture(scope="module")
def server(tiny_model_dir, workdir):
    with start(tiny_model_dir, "main", workdir, {"max_rolling_batch_size": "16"}) as server:
        yield server


def test_concurrent_greedy_streams_each_get_their_solo_text(server):
    finding = scenarios.concurrent_streams(server, clients=8, tokens=12)
    assert finding.passed, finding


def test_a_poisoned_request_fails_alone(server):
    finding = scenarios.poisoned_request(server, tokens=12)
    assert finding.passed, finding


def test_nothing_keeps_running_for_a_client_that_left(server):
    for finding in scenarios.disconnects(server, step_s=0.01, tokens=256):
        # asked for 256 tokens: it stopped (how soon, in steps, is the long run's figure)
        assert finding.figures.get("time until idle", "never") != "never", finding
        assert float(finding.figures["decode steps after leaving"]) < 100, finding


def test_a_slow_reader_does_not_change_a_neighbours_text(server):
    finding = scenarios.slow_reader(server, tokens=12)
    assert finding.passed, finding


def test_a_soak_loses_no_request(server):
    finding = scenarios.soak(server, requests=24)
    assert finding.figures["failed"] == "0", finding


@pytest.fixture(scope="module")
def queue_server(tiny_model_dir, workdir):
    options = {"max_rolling_batch_size": "1", "job_queue_size": "4"}
    with start(tiny_model_dir, "queue", workdir, options) as server:
        yield server


def test_a_queued_client_that_left_is_never_prefilled(queue_server):
    finding = scenarios.queued_disconnect(queue_server, tokens=256)
    assert finding.passed, finding


def test_a_flood_is_refused_in_json_and_the_rest_served(queue_server):
    finding = scenarios.flood(queue_server, clients=12, tokens=4)
    assert finding.passed, finding


def test_sigterm_lets_running_streams_finish_and_exits_0(tiny_model_dir, workdir):
    server = start(tiny_model_dir, "sigterm", workdir).start()
    try:
        # long enough that the streams are still running when the refused request comes:
        # once they end, the server stops listening, and the request would find no one
        finding = scenarios.sigterm_during_streams(server, tokens=200)
    finally:
        server.stop()
    assert finding.passed, finding


def test_slowloris_connections_are_answered_408_and_closed(tiny_model_dir, workdir):
    with start(tiny_model_dir, "slowloris", workdir, flags=("--timeout-header", "1")) as server:
        finding = scenarios.slowloris(server, connections=20, header_timeout_s=1)
    assert finding.passed, finding


def test_the_largest_request_the_limits_allow_is_served_and_one_more_is_refused(
        tiny_model_dir, workdir):
    # the tiny model's own bound (from its weights' size) is beyond what 32 prompts of 64
    # tokens with 256 new tokens can reach, so this server sets a small one
    with start(tiny_model_dir, "largest", workdir, {"max_request_kv_tokens": "400"}) as server:
        finding = scenarios.largest_request(server, rows=4, prompt_words=10,
                                            max_new_tokens_limit=256)
    assert finding.passed, finding
    assert "of 400 allowed; answered 200" in finding.figures["request"]

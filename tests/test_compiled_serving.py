"""``option.decode_step=compiled`` through a real server: the one-row program is compiled
(or loaded from the cache) while the model loads (``/ping`` answers 503 until it is done),
and a stream decoded by it has the text the eager step gives, token by token.

The model is the tiny random Llama (its program compiles in seconds, into the test
session's cache); the embedded model's compiled step is measured by ``make bench-peers``
instead (about 90 s of compiling at the first start)."""

from __future__ import annotations

import time

import pytest
from server_process import ServerProcess

from djl_stream.generation.packed_linear import packing_unavailable

pytestmark = pytest.mark.skipif(packing_unavailable() is not None,
                                reason=f"this PyTorch cannot prepack: {packing_unavailable()}")

#: deadlines for a busy machine, not speed targets
LOAD_TIMEOUT = 600.0
PROMPT = "Once upon a time, in a land far away, there lived"


def greedy_stream(server: ServerProcess) -> list:
    """The tokens of one greedy stream of 40 new tokens, as streamed."""
    body = {"inputs": PROMPT, "parameters": {"max_new_tokens": 40, "do_sample": False,
                                             "ignore_eos": True}}
    with server.http.stream("POST", "/invocations", json=body) as response:
        assert response.status_code == 200
        lines = [line for line in response.iter_lines() if line]
    return lines


def test_the_compiled_step_is_built_while_ping_is_503_and_streams_the_eager_step_s_text(
        tiny_model_dir, one_row_cache):
    # (layers left plain whatever this CPU's packing trial would say: both programs run)
    compiled = ServerProcess(tiny_model_dir, env={"OPTION_DECODE_STEP": "compiled",
                                                  "OPTION_PREPACK_WEIGHTS": "false"})
    try:
        assert compiled.first_ping().status_code in (200, 503)
        deadline = time.monotonic() + LOAD_TIMEOUT
        while (ping := compiled.http.get("/ping")).status_code == 503:
            assert ping.json()["modelStatus"] == "LOADING"
            assert time.monotonic() < deadline, compiled.logs()
            time.sleep(0.2)
        assert ping.status_code == 200
        # compiled (or loaded from the session's cache) at load: the line is there by the
        # first 200, not written by the first request
        # (option.compiled_weights=shared, the default: the few-rows and 16-row programs too)
        assert ("one-row, 2- to 6-row and 7- to 16-row decode steps run the compiled programs"
                in compiled.logs())
        compiled_lines = greedy_stream(compiled)
        logs = compiled.logs()
    finally:
        compiled.stop()
    assert "run the eager step from now on" not in logs  # the graph served every step

    eager = ServerProcess(tiny_model_dir, env={"OPTION_DECODE_STEP": "eager"})
    try:
        eager.wait_ready(timeout=LOAD_TIMEOUT)
        eager_lines = greedy_stream(eager)
    finally:
        eager.stop()
    assert len(compiled_lines) >= 30  # a line per decode iteration, bar bytes held back
    assert compiled_lines == eager_lines

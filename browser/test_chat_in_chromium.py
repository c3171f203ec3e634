"""The chat page of ``djl-stream serve`` in a real headless Chromium, against the embedded
model: a question's answer grows on screen, stop frees the server's row, a follow-up uses
the first answer, and errors read as messages. Each test saves a screenshot."""

from __future__ import annotations

import re
import time

import pytest

from page import (DEADLINE, answer_text, ask, errors, finished, gauge, last_answer, open_page,
                  streaming, tokens_shown, wait_for)
from server_process import ServerProcess


@pytest.fixture(scope="module")
def server(embedded_model_dir):
    process = ServerProcess(embedded_model_dir).wait_ready(timeout=300)
    yield process
    process.stop()


@pytest.fixture()
def page(browser, server):
    return open_page(browser, server)


def running_rows(server) -> float:
    return gauge(server, "djl_stream_batch_rows")


def test_an_answer_grows_on_screen_and_shows_its_timings(page, screenshots):
    ask(page, "What is the capital of France? Answer in two sentences.", max_new_tokens=48)
    seen = set()
    end = time.monotonic() + DEADLINE
    while not finished(page) and time.monotonic() < end:
        text = page.execute_script(
            "const a = document.querySelectorAll('.assistant .text');"
            "return a.length ? a[a.length - 1].textContent : '';")
        if text:
            seen.add(len(text))
    assert finished(page)
    assert len(seen) >= 3, f"the answer appeared in {len(seen)} steps: {sorted(seen)}"
    answer = last_answer(page)
    assert "Paris" in answer_text(page)
    stats = answer.find_element("css selector", ".stats").text
    assert re.search(r"first token \d+ ms · [\d.]+ tokens/s · \d+ tokens · ended: ", stats), stats
    page.save_screenshot(str(screenshots / "answer.png"))


def test_stop_ends_the_answer_and_frees_the_servers_row(page, server, screenshots):
    ask(page, "Write a long story about a dragon who learns to bake bread.", max_new_tokens=400)
    wait_for(lambda: tokens_shown(page) >= 3)
    assert running_rows(server) == 1
    page.find_element("id", "stop").click()
    wait_for(lambda: finished(page))
    answer = last_answer(page)
    assert answer.get_attribute("data-finish") == "cancelled"
    assert "stopped" in answer.find_element("css selector", ".stats").text
    assert int(answer.get_attribute("data-tokens")) < 400
    wait_for(lambda: running_rows(server) == 0)
    page.save_screenshot(str(screenshots / "stopped.png"))


def test_a_follow_up_uses_the_first_answer(page, screenshots):
    ask(page, "My name is Ada. Please remember it.", max_new_tokens=24)
    wait_for(lambda: finished(page))
    ask(page, "What is my name?", max_new_tokens=16)
    wait_for(lambda: finished(page) and len(page.find_elements("css selector", ".assistant")) == 2)
    assert "Ada" in answer_text(page)
    page.save_screenshot(str(screenshots / "conversation.png"))


def test_a_bad_parameter_reads_as_a_message_and_the_chat_goes_on(page, screenshots):
    ask(page, "Hello!", max_new_tokens=-5)
    error = wait_for(lambda: errors(page))[-1]
    assert "max_new_tokens" in error.text and "Error 400" in error.text
    assert not streaming(page)
    page.save_screenshot(str(screenshots / "error.png"))
    ask(page, "Say hello.", max_new_tokens=8)
    wait_for(lambda: finished(page))
    assert answer_text(page).strip()

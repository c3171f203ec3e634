"""Driving the chat page in the browser: what a user does (ask, stop) and what they see
(the last answer, whether it ended, error messages), and the server's running rows."""

from __future__ import annotations

import re
import time

#: A deadline for what the page waits on, not a speed target: the machine may be busy.
DEADLINE = 120.0


def wait_for(condition, deadline: float = DEADLINE, every: float = 0.05):
    """``condition()``'s first true value, asked every ``every`` seconds."""
    end = time.monotonic() + deadline
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"not met within {deadline} s")


def open_page(browser, server, path: str = "/chat"):
    """The page of ``server``, loaded and idle, its conversation empty."""
    browser.get(server.url + path)
    wait_for(lambda: browser.execute_script("return document.body.dataset.streaming") == "no")
    browser.find_element("id", "reset").click()
    return browser


def ask(page, question: str, *, max_new_tokens: int, temperature: float = 0.0) -> None:
    """Set the parameters, type ``question`` and press Send."""
    for field, value in (("max-new-tokens", max_new_tokens), ("temperature", temperature)):
        element = page.find_element("id", field)
        element.clear()
        element.send_keys(str(value))
    page.find_element("id", "prompt").send_keys(question)
    page.find_element("id", "send").click()


def last_answer(page):
    return page.find_elements("css selector", ".assistant")[-1]


def answer_text(page) -> str:
    return last_answer(page).find_element("css selector", ".text").text


def tokens_shown(page) -> int:
    answers = page.find_elements("css selector", ".assistant")
    return int(answers[-1].get_attribute("data-tokens") or 0) if answers else 0


def finished(page) -> bool:
    """Whether the last answer has ended (its end message arrived)."""
    answers = page.find_elements("css selector", ".assistant")
    return bool(answers) and answers[-1].get_attribute("data-finish") is not None


def errors(page) -> list:
    return page.find_elements("css selector", ".error")


def streaming(page) -> bool:
    return page.execute_script("return document.body.dataset.streaming") == "yes"


def gauge(server, name: str) -> float:
    """One of the server's Prometheus gauges (``djl_stream_batch_rows``, say), summed over
    its labels (the model's)."""
    metrics = server.http.get("/metrics").text
    values = re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.MULTILINE)
    return sum(float(value) for value in values) if values else float("nan")

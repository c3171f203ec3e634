"""CORS in a real browser: a page served from another origin calls the server with an API
key, so Chromium sends its own preflight (``OPTIONS`` with ``Origin``) first. The allowed
origin gets its answer; a page from an origin the server does not list is stopped by the
browser. A screenshot of each page is saved."""

from __future__ import annotations

import functools
import http.server
import threading

import pytest

from page import wait_for
from server_process import free_port, serving

KEY = "browser-key"
PAGE = """<!doctype html><html><body><p id="result">calling…</p><script>
fetch("{server}/v1/completions", {{method: "POST",
  headers: {{"content-type": "application/json", "authorization": "Bearer {key}"}},
  body: JSON.stringify({{prompt: "Hello", max_tokens: 3, temperature: 0}})}})
  .then(r => r.json())
  .then(j => {{ document.body.dataset.result = "answered: " + j.choices[0].text; }})
  .catch(e => {{ document.body.dataset.result = "blocked: " + e; }})
  .finally(() => {{ document.getElementById("result").textContent = document.body.dataset.result; }});
</script></body></html>"""


@pytest.fixture(scope="module")
def page_host(tmp_path_factory):
    """A plain static web server on another port: another origin than the model server."""
    folder = tmp_path_factory.mktemp("cors-page")
    port = free_port()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(folder))
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield folder, port
    httpd.shutdown()


def test_a_page_from_an_allowed_origin_gets_its_answer_and_another_origin_is_blocked(
        browser, embedded_model_dir, page_host, screenshots):
    folder, port = page_host
    allowed = f"http://127.0.0.1:{port}"
    with serving(embedded_model_dir, args=["--api-key", KEY, "--allowed-origins", allowed]) as server:
        (folder / "call.html").write_text(PAGE.format(server=server.url, key=KEY))
        since = len(server.logs())

        browser.get(f"{allowed}/call.html")
        result = wait_for(lambda: browser.find_element("tag name", "body").get_attribute(
            "data-result"))
        browser.save_screenshot(str(screenshots / "cors-allowed-origin.png"))
        assert result.startswith("answered: "), result
        # The browser's own preflight, answered without the key, then the call with it.
        server.wait_for_log("OPTIONS /v1/completions 200", since)
        server.wait_for_log("POST /v1/completions 200", since)

        # "localhost" is another origin than "127.0.0.1" for the same page host.
        browser.get(f"http://localhost:{port}/call.html")
        result = wait_for(lambda: browser.find_element("tag name", "body").get_attribute(
            "data-result"))
        browser.save_screenshot(str(screenshots / "cors-other-origin.png"))
        assert result.startswith("blocked: "), result

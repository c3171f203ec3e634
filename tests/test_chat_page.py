"""The chat page at ``GET /`` and ``GET /chat`` (:mod:`djl_stream.serving.chat_page`),
over a real server: served as HTML, and self-contained (nothing fetched from another
host). The page's behaviour in a browser is ``make browser``'s (``browser/``)."""

from __future__ import annotations

import re

import pytest

from djl_stream.serving.chat_page import page_html


@pytest.fixture(scope="module")
def server(tiny_server):
    return tiny_server


@pytest.mark.parametrize("path", ["/", "/chat"])
def test_the_page_is_served_as_html(server, path):
    response = server.http.get(path)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/html")
    assert response.text == page_html()
    assert "/ws/chat" in response.text


def test_the_page_fetches_nothing_from_another_host():
    html = page_html()
    assert not re.search(r"""(src|href)\s*=\s*["'](https?:)?//""", html, re.IGNORECASE)
    assert not re.search(r"""@import|url\(\s*["']?(https?:)?//""", html, re.IGNORECASE)
    # every script and style is inline
    assert "<script src" not in html and "<link" not in html
    # the socket and the model list are asked of the server the page came from
    assert "location.host" in html and 'fetch("/v1/models")' in html


def test_posting_to_the_root_is_still_tgis_route(server):
    # (GET / is the page; POST / stays huggingface_hub's TGI route)
    response = server.http.post("/", json={"inputs": "Hi", "parameters": {"max_new_tokens": 2}})
    assert response.status_code == 200
    assert "generated_text" in response.json()[0]

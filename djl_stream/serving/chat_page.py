"""The chat page of ``djl-stream serve``: ``GET /`` and ``GET /chat``.

One self-contained HTML file (``chat_page.html`` beside this module: its script and style
inline, nothing fetched from another host, no build step), served as it is. The page talks
to :mod:`djl_stream.serving.chat_socket` over ``/ws/chat`` on the server it came from: it
shows each answer growing as tokens arrive, keeps the conversation, stops an answer on
request, sends max new tokens and temperature with each turn, and shows each answer's time
to first token and tokens per second. Errors the socket reports, and a connection that
closes, appear in the page as messages.

Example::

    curl -s localhost:8080/chat | head -3
"""

from __future__ import annotations

import functools
from importlib import resources

from starlette.requests import Request
from starlette.responses import HTMLResponse

#: Where the page is served.
CHAT_PAGE_PATHS = ("/", "/chat")


@functools.lru_cache(maxsize=1)
def page_html() -> str:
    """The page's HTML, read from the package once.

    >>> page_html().startswith("<!doctype html>")
    True
    """
    return resources.files(__package__).joinpath("chat_page.html").read_text(encoding="utf-8")


async def chat_page(request: Request) -> HTMLResponse:
    """The page (no caching rules: it is small, and a newer server may serve a newer one)."""
    return HTMLResponse(page_html(), headers={"Cache-Control": "no-cache"})

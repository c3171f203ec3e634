"""Protocols: what a client sends and what it gets back, one wire format per package.

``djl``: djl-serving's ``{"inputs", "parameters"}`` body and its ``{"output_tokens": [...]}``
JSON lines (or SSE). Each protocol parses its request body into typed objects at the edge
and formats the engine's steps into bytes.
"""

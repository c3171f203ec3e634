"""text-generation-inference's API: ``POST /generate``, ``POST /generate_stream`` and ``POST /``.

The shapes are TGI's router's (``router/src/lib.rs``, ``server.rs``), so that
``huggingface_hub.InferenceClient.text_generation`` and other TGI clients work unchanged:

- :mod:`.request`: the ``{"inputs", "parameters", "stream"}`` body, validated with pydantic;
- :mod:`.writers`: token records, the server-sent events of a stream, the JSON answer and
  TGI's ``{"error", "error_type"}`` errors;
- :mod:`.protocol`: the three routes as :class:`~djl_stream.protocols.protocol.Protocol`\\ s.
"""

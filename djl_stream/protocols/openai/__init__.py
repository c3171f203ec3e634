"""OpenAI's wire format: ``/v1/chat/completions`` and ``/v1/completions``.

``request.py`` validates the bodies (pydantic) into a
:class:`~djl_stream.protocols.request.GenerationRequest`; ``responses.py`` follows the
choices through the decode steps and writes log-probabilities, usage and errors;
``protocol.py`` holds the two protocols and their server-sent-events stream.
"""

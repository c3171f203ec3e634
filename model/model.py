"""djl-serving entry point for this model directory.

djl imports this file three times at start-up, so it only creates the (empty) service;
the model loads on the first ``handle()`` call, the init call carrying the properties of
``serving.properties``. Inside the djl-serving container ``djl_python``'s ``Input`` and
``Output`` are used; elsewhere (``djl-stream serve``) djl-stream's own.

A custom output formatter is any function here taking the list of new text pieces of one
decode iteration and returning bytes or str; select it with
``option.output_formatter=<function name>`` in ``serving.properties``.
"""

from djl_stream.serving.service import StreamingService

_service = StreamingService(entry_module=__name__)


def handle(inputs):
    """djl-serving's handler: ``None`` for the init call, an ``Output`` otherwise."""
    return _service.handle(inputs)

"""djl-stream beside its peers (llama.cpp, ``transformers serve``, Ray Serve) in one run:
``python -m benchmarks.peers`` (``make bench-peers``); see :mod:`.run`."""

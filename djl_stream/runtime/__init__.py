"""Running the model: the KV cache, attention over it, and the forward passes.

This side knows tensors, caches and layers, never requests: the scheduling side
(:mod:`djl_stream.generation`) decides which tokens each pass feeds and hands them to a
:class:`~djl_stream.runtime.runner.ModelRunner`.
"""

"""Generation: the model core. Loading weights, the running batch and its KV cache,
choosing tokens, stopping, incremental detokenization, the continuous-batching scheduler,
and the stream engines behind the ``StreamingUtils`` registry.

Nothing here knows about HTTP or djl-serving's ``Input``/``Output``: an engine takes prompts
and parameters and yields, per decode step, the new text of each prompt.
"""

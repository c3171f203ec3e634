"""Serving: djl-serving's side of ``model.py``. Its ``Input``/``Output``, the handler service
behind ``handle()`` and its replies, the model properties, and the local server that
emulates djl-serving's worker and front end (``djl-stream serve``).
"""

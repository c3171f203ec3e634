"""Shipping: getting a model directory to where it runs, and reading what it sends back.
``djl-stream check`` and the facts of the djl-serving images it checks against, the
embedded default model, SageMaker packaging and deployment, and the streaming client.
"""

"""Benchmarks of djl-stream against the usual ways of streaming a transformers model.

``python -m benchmarks.run --model-dir model`` (``make bench``) measures, in one run on one
machine, with the same model and prompts and interleaved repetitions:

- single-stream rows in-process (:mod:`benchmarks.inprocess`): ``generate()`` (the
  baseline), a bare KV-cache loop (the floor), the Jina and Ray Serve tutorials' ways, and
  djl-stream's stream generator;
- djl-stream's real server over HTTP (:mod:`benchmarks.http_load`): one client, then 1…16
  concurrent clients with continuous batching against one-at-a-time serving, and a late
  arrival joining a busy batch;

and writes ``BENCHMARKS.md`` and ``benchmarks/concurrency.png`` (:mod:`benchmarks.report`),
with the targets of :mod:`benchmarks.targets` as pass/fail lines.
"""

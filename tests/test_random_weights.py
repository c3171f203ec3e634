"""``benchmarks/random_weights.py``: a model directory with another's shapes and random
weights, for timing where the real weights cannot go (the GPU figures in BENCHMARKS.md)."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file

from benchmarks import random_weights


def test_the_copy_has_the_model_s_files_and_shapes_and_other_weights(tiny_model_dir, tmp_path):
    source = Path(shutil.copytree(tiny_model_dir, tmp_path / "source"))
    (source / ".embedded").write_text("{}")  # as the embedded model's marker
    target = random_weights.make(source, tmp_path / "random", dtype="fp32", seed=1)
    for name in ("config.json", "tokenizer.json", "model.py", "serving.properties"):
        assert (target / name).read_bytes() == (source / name).read_bytes()
    assert not (target / ".embedded").exists()  # it is not the embedded model
    assert "for timing only" in (target / random_weights.MARKER).read_text()
    theirs, ours = load_file(source / "model.safetensors"), load_file(
        target / "model.safetensors")
    assert {k: v.shape for k, v in ours.items()} == {k: v.shape for k, v in theirs.items()}
    assert not torch.equal(ours["model.embed_tokens.weight"], theirs["model.embed_tokens.weight"])

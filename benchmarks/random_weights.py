"""``python -m benchmarks.random_weights SOURCE TARGET``: a model directory shaped exactly like
``SOURCE`` (its config, tokenizer, ``model.py`` and ``serving.properties``) whose weights
are random, for timing on a machine the real weights cannot reach.

A decode step's time depends on the model's shapes and dtype, not on its weights' values,
so speed figures taken on such a copy hold for the real model; its text is noise, so no
greedy-text or quality figure may be taken from it (the benchmarks' token counts still
hold: requests are fixed-length or capped). This project's GPU figures were taken this
way: the GPU machine it is lent has no network and takes 64 MiB of files per call, less
than SmolLM2-135M's weights.

Example::

    python -m benchmarks.random_weights model /tmp/smollm2-random --dtype bf16
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import List, Optional

#: Files of the source directory that are weights (not copied).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".gguf", ".pt")
#: Files of the source directory not copied besides: the embedded model's marker (this is
#: not the embedded model).
NOT_COPIED = (".embedded",)
#: A marker written into the target, so that nobody takes its text for the model's.
MARKER = "RANDOM_WEIGHTS"


def make(source: Path, target: Path, dtype: str = "bf16", seed: int = 0) -> Path:
    """Copy ``source`` without its weights into ``target`` and save random weights of the
    same shapes there (``dtype``: ``bf16``, ``fp16`` or ``fp32``)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    target.mkdir(parents=True, exist_ok=True)
    for path in source.iterdir():
        if (path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES)
                and path.name not in NOT_COPIED):
            shutil.copy(path, target / path.name)
    config = AutoConfig.from_pretrained(source)
    torch.manual_seed(seed)
    dtypes = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
    from djl_stream.runtime.loading import dtype_keyword

    model = AutoModelForCausalLM.from_config(config, **{dtype_keyword(): dtypes[dtype]})
    model.save_pretrained(target)
    (target / MARKER).write_text(
        f"random weights in the shapes of {source} (seed {seed}): for timing only\n")
    return target


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.random_weights",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: Optional[List[str]] = None) -> None:
    args = build_parser().parse_args(argv)
    print(f"wrote {make(args.source, args.target, args.dtype, args.seed)}")


if __name__ == "__main__":
    main()

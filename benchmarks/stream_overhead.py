"""``python -m benchmarks.stream_overhead``: what serving costs per streamed token when many
clients stream at once, apart from the model.

The server runs a tiny random Llama (2 layers, 64 wide, the embedded model's tokenizer), so
that a decode step is cheap (64 rows: about 8 ms on one CPU thread, most of it the LM
head over the tokenizer's 49,152 tokens) and much of what is measured is the server's own
work: the scheduler's bookkeeping, detokenizing, the formatter, the HTTP layer handing
every token of every stream to its socket. With ``--vocab 512`` the tokenizer is instead a
byte-level BPE of 512 tokens trained here on this project's README (the ``tokenizers``
library), so that the LM head costs next to nothing either: a step of 64 rows takes about
1.3 ms, as SmolLM2's replayed steps take a few milliseconds on a GPU, and what is left is
the server. ``--clients`` clients (threads of this process, each on its own connection,
released together) each stream ``--tokens`` tokens (``ignore_eos``), ``--rounds`` times,
after one client alone. Reported per round: the tokens/s all clients received, the pooled
inter-token gap (ITL) p50, and the CPU seconds the server process and this process (the
clients) spent per token.

The server gets one torch thread (``OMP_NUM_THREADS=1``): OpenMP's threads spin while they
wait for work, which would count as the server's CPU time without being any of its work.
Both processes share the machine's cores, so on a 2-core machine the figures move with
what else runs; compare runs of one sitting (``git stash`` or a worktree for the other
side), not against a figure from another day.

Example::

    python -m benchmarks.stream_overhead --clients 64 --tokens 128 --rounds 4
    python -m benchmarks.stream_overhead --vocab 512    # the server alone, nearly
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import List, Optional

from benchmarks import http_load
from benchmarks.measure import process_cpu_seconds


def small_tokenizer(vocab: int, text_file: Path):
    """A byte-level BPE tokenizer of ``vocab`` tokens (three of them special: padding,
    start and end) trained on ``text_file``'s lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        text_file.read_text(encoding="utf-8").splitlines(),
        trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<pad>", "<s>", "</s>"],
                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def write_tiny_model(directory: Path, tokenizer_dir: str, batch_rows: int,
                     vocab: Optional[int] = None) -> Path:
    """A model directory holding a 2-layer random Llama with ``tokenizer_dir``'s tokenizer
    (or, with ``vocab``, a :func:`small_tokenizer` of that many tokens), served raw (no
    chat template) with room for ``batch_rows`` rows."""
    import shutil

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = (small_tokenizer(vocab, Path(__file__).parent.parent / "README.md") if vocab
                 else AutoTokenizer.from_pretrained(tokenizer_dir))
    # The tests' tiny Llama (tests/conftest.py's build_tiny_llama) written again on purpose:
    # make conformance runs tests/ under the images' libraries without benchmarks/ on the
    # path, and a benchmark should not import a test's conftest.
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True)).eval()
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    shutil.copy(Path(tokenizer_dir) / "model.py", directory / "model.py")
    (directory / "serving.properties").write_text(
        "engine=Python\noption.dtype=fp32\noption.apply_chat_template=false\n"
        f"option.max_rolling_batch_size={batch_rows}\noption.max_input_length=64\n"
        "option.max_new_tokens_limit=1024\n", encoding="utf-8")
    return directory


def one_round(server: http_load.ServerProcess, clients: int, tokens: int) -> dict:
    bodies = [{"inputs": f"Client {i} asks a question about streaming",
               "parameters": {"max_new_tokens": tokens, "ignore_eos": True}, "stream": True}
              for i in range(clients)]
    server_before, clients_before = process_cpu_seconds(server.pid), time.process_time()
    load = http_load.run_concurrent(server.url, bodies)
    server_cpu = process_cpu_seconds(server.pid) - server_before
    clients_cpu = time.process_time() - clients_before
    return {"tokens_per_s": load.aggregate_tokens_per_s,
            "itl_p50_ms": load.inter_token(50) * 1e3,
            "server_us_per_token": server_cpu / load.tokens * 1e6,
            "clients_us_per_token": clients_cpu / load.tokens * 1e6,
            "errors": len(load.errors)}


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.stream_overhead",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--clients", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=None,
                        help="a BPE tokenizer of VOCAB tokens trained on README.md instead "
                             "of the embedded model's (default: the embedded model's)")
    parser.add_argument("--tokenizer-dir", default="model",
                        help="a model directory whose tokenizer and model.py the tiny model takes")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="stream-overhead-") as work:
        model_dir = write_tiny_model(Path(work) / "tiny", args.tokenizer_dir, args.clients,
                                     args.vocab)
        server = http_load.ServerProcess(model_dir, name="tiny", workdir=Path(work),
                                         env={"OMP_NUM_THREADS": "1"})
        server.start()
        try:
            one_round(server, min(args.clients, 4), 8)  # warm-up
            solo = one_round(server, 1, args.tokens)
            print(f"one client: {solo['tokens_per_s']:.1f} tokens/s, ITL p50 "
                  f"{solo['itl_p50_ms']:.2f} ms", flush=True)
            rounds = []
            for index in range(1, args.rounds + 1):
                rounds.append(one_round(server, args.clients, args.tokens))
                r = rounds[-1]
                print(f"[{index}/{args.rounds}] {args.clients} clients: "
                      f"{r['tokens_per_s']:7.1f} tokens/s, ITL p50 {r['itl_p50_ms']:5.2f} ms, "
                      f"server {r['server_us_per_token']:5.1f} us of CPU a token, "
                      f"clients {r['clients_us_per_token']:5.1f}"
                      + (f", {r['errors']} errors" if r["errors"] else ""), flush=True)
        finally:
            server.stop()
    median = {key: statistics.median(r[key] for r in rounds) for key in rounds[0]}
    print(f"median of {len(rounds)}: {median['tokens_per_s']:.1f} tokens/s, ITL p50 "
          f"{median['itl_p50_ms']:.2f} ms, server {median['server_us_per_token']:.1f} us "
          f"of CPU a token, clients {median['clients_us_per_token']:.1f}")
    if any(r["errors"] for r in rounds):
        sys.exit("some requests failed: see the server's log above")


if __name__ == "__main__":
    main()

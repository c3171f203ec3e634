"""How long a running stream waits while a long prompt is admitted.

:func:`long_prompt_gap` starts ``djl-stream serve MODEL_DIR`` (with ``options`` as
``OPTION_*`` variables), streams one request that decodes on and on, and once it is
decoding sends a prompt of ``prompt_tokens`` tokens (``prompts`` copies of it in one
request) for ``new_tokens`` tokens (4 by default: with one, the request ends at its
prefill and never joins the running batch, whose join is part of what a stream waits for). It returns, per round, the running stream's worst inter-token gap
from that moment until the long request has been answered, in seconds and in decode steps
(the stream's median gap alone, over HTTP), how many tokens the stream got meanwhile, how
long the long request took, and the server's resident size: after loading and its peak.
Figures only, never a verdict: the reliability report compares them with its targets.

Example (the figures of the chunked-prefill change came from these)::

    python -m benchmarks.prefill_gap --model-dir model --prompt-tokens 4000
    python -m benchmarks.prefill_gap --model-dir model --prompt-tokens 4000 \\
        --option max_batch_prefill_tokens=128 --prompts 2
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Mapping, Optional

import httpx

from .http_load import ServerProcess
from .measure import ProcessMemory

RUNNING_BODY = {"inputs": "Tell me a long story.", "stream": True,
                "parameters": {"max_new_tokens": 2000, "ignore_eos": True}}
WORDS = ("The history of the city begins with a small settlement by the river, where "
         "fishermen and traders met every spring.").split()


def prompt_of(tokenizer, tokens: int) -> str:
    """Plain text of ``tokens`` tokens (give or take the chat template the server adds)."""
    text = " ".join(WORDS[i % len(WORDS)] for i in range(tokens))
    return tokenizer.decode(tokenizer(text)["input_ids"][:tokens])


def _stream(url: str, arrivals: List[float], stop: threading.Event,
            parameters: Optional[dict] = None) -> None:
    body = dict(RUNNING_BODY, parameters={**RUNNING_BODY["parameters"], **(parameters or {})})
    with httpx.Client(timeout=900) as client, client.stream("POST", url, json=body) as answer:
        for line in answer.iter_lines():
            if line.strip():
                arrivals.append(time.perf_counter())
            if stop.is_set():
                break


def long_prompt_gap(model_dir: str | Path, *, prompt_tokens: int = 4000, prompts: int = 1,
                    new_tokens: int = 4, options: Optional[Mapping[str, str]] = None,
                    rounds: int = 2) -> Dict:
    """See the module docstring; ``options`` are model properties without ``option.``."""
    from transformers import AutoTokenizer

    text = prompt_of(AutoTokenizer.from_pretrained(str(model_dir)), prompt_tokens)
    with tempfile.TemporaryDirectory() as workdir, \
            ServerProcess(model_dir, name="prefill-gap", workdir=Path(workdir),
                          options=options) as server:
        loaded = ProcessMemory.of(server.pid)
        alone: List[float] = []
        _stream(server.url, alone, threading.Event(), {"max_new_tokens": 40})
        step = statistics.median(b - a for a, b in zip(alone[5:], alone[6:]))
        results = []
        for _ in range(rounds):
            arrivals: List[float] = []
            stop = threading.Event()
            runner = threading.Thread(target=_stream, args=(server.url, arrivals, stop))
            runner.start()
            while len(arrivals) < 10 and runner.is_alive():
                time.sleep(0.01)
            peak = [0]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    memory = ProcessMemory.of(server.pid)
                    peak[0] = max(peak[0], memory.rss if memory else 0)
                    time.sleep(0.01)

            sampler = threading.Thread(target=sample)
            sampler.start()
            sent = time.perf_counter()
            answer = httpx.post(server.url, timeout=900, json={
                "inputs": [text] * prompts if prompts > 1 else text, "stream": False,
                "parameters": {"max_new_tokens": new_tokens, "ignore_eos": True}})
            answered = time.perf_counter()
            done.set()
            stop.set()
            runner.join()
            sampler.join()
            window = [t for t in arrivals if t >= sent]
            last_before = [t for t in arrivals if t < sent][-1:]
            gaps = [b - a for a, b in zip(last_before + window, window) if a <= answered]
            worst = max(gaps) if gaps else answered - sent
            results.append({"status": answer.status_code,
                            "worst_gap_s": round(worst, 3),
                            "worst_gap_steps": round(worst / step, 1),
                            "tokens_meanwhile": len([t for t in window if t <= answered]),
                            "long_request_s": round(answered - sent, 2),
                            "rss_peak_mib": round(peak[0] / 2**20)})
    return {"prompt_tokens": prompt_tokens, "prompts": prompts, "new_tokens": new_tokens,
            "options": dict(options or {}),
            "decode_step_s": round(step, 4),
            "rss_loaded_mib": round(loaded.rss / 2**20) if loaded else None,
            "rounds": results}


def main(argv: Optional[List[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", default="model")
    parser.add_argument("--prompt-tokens", type=int, default=4000)
    parser.add_argument("--prompts", type=int, default=1)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                        help="a model property, e.g. max_batch_prefill_tokens=128")
    args = parser.parse_args(argv)
    options = dict(option.split("=", 1) for option in args.option)
    print(json.dumps(long_prompt_gap(args.model_dir, prompt_tokens=args.prompt_tokens,
                                     prompts=args.prompts, new_tokens=args.new_tokens,
                                     options=options,
                                     rounds=args.rounds), indent=2))


if __name__ == "__main__":
    main()

"""The Ray Serve streaming tutorial's way, served by real Ray Serve over HTTP.

Ray's tutorial ("Serve a Chatbot with Request and Response Streaming") streams with
transformers' ``TextIteratorStreamer``: ``generate()`` runs in a thread and a FastAPI
``StreamingResponse`` hands the streamer's text chunks (whole words) to the client. This
file is that deployment, written here for the benchmark, on the model directory's weights
in float32 on the CPU, one replica with every core, greedy, and exactly ``max_new_tokens``
tokens (``min_new_tokens`` equal to it, as the other peers are asked).

It runs in its own virtual environment (ray[serve], torch, transformers), started by
``python -m benchmarks.peers``::

    .peers/ray-serve/bin/python benchmarks/peers/ray_app.py --model-dir model --port 8000

``POST /generate`` with ``{"prompt": "...", "max_new_tokens": 64}`` streams plain text;
``GET /-/healthz`` is Ray Serve's own health route.
"""

from __future__ import annotations

import argparse
import os
import threading
import time

import ray
import torch
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from ray import serve
from transformers import AutoModelForCausalLM, AutoTokenizer, TextIteratorStreamer

app = FastAPI()


@serve.deployment(ray_actor_options={"num_cpus": os.cpu_count() or 1})
@serve.ingress(app)
class Chatbot:
    def __init__(self, model_dir: str):
        torch.set_num_threads(os.cpu_count() or 1)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    @app.post("/generate")
    def generate(self, body: dict) -> StreamingResponse:
        ids = self.tokenizer(body["prompt"], return_tensors="pt", add_special_tokens=False)
        n = int(body["max_new_tokens"])
        streamer = TextIteratorStreamer(self.tokenizer, skip_prompt=True, skip_special_tokens=True)
        kwargs = dict(**ids, streamer=streamer, max_new_tokens=n, min_new_tokens=n,
                      do_sample=False)
        threading.Thread(target=self.model.generate, kwargs=kwargs, daemon=True).start()
        return StreamingResponse(streamer, media_type="text/plain")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--port", type=int, required=True)
    args = parser.parse_args()
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False)
    serve.start(http_options={"host": "127.0.0.1", "port": args.port})
    serve.run(Chatbot.bind(os.path.abspath(args.model_dir)), route_prefix="/")
    while True:  # serve.run returns once deployed; the process must stay up
        time.sleep(3600)


if __name__ == "__main__":
    main()

"""Two replicas on a real local Ray cluster, through Ray Serve's HTTP proxy: every stream is
its solo text, requests spread over both replicas, and a replica killed mid-run loses only
its own streams, each ending with an error record, while Ray starts a new one."""

from __future__ import annotations

import collections
import json
import os
import signal
import threading
import time
from typing import Callable, Dict, List, Optional, Tuple

import httpx
import pytest

from djl_stream.serving.ray_serve import REPLICA_HEADER
from djl_stream.serving.worker import ModelWorker, next_stream_chunk

PROMPTS = ["Hi", "The quick brown fox", "Once upon a time there was", "A", "Colours",
           "One two three four", "Hello world", "Rain falls on"]
NEW_TOKENS = 24
#: The replicas ``ray_server`` deploys (conftest.py).
REPLICAS = 2


def replica_pid(header: str) -> int:
    """The process id in an ``x-djl-stream-replica`` header (``"<replica id>; pid=N"``)."""
    return int(header.rsplit("pid=", 1)[1])


@pytest.fixture(scope="module")
def solo_texts(tiny_model_dir) -> Dict[str, str]:
    """Each prompt's greedy text, streamed alone through the directory's own handle() in
    this process: no Ray, no batch."""
    worker = ModelWorker(tiny_model_dir, environ={"OPTION_COMPILE": "false"})
    assert worker.load() == "READY", worker.failure_reason
    texts = {}
    for prompt in PROMPTS:
        output = worker.invoke(worker.make_input(json.dumps(
            {"inputs": prompt, "parameters": {"max_new_tokens": NEW_TOKENS}, "stream": True}
        ).encode(), {"content-type": "application/json"}))
        text = ""
        while (chunk := next_stream_chunk(output)) is not None:
            for line in chunk.decode().splitlines():
                text += json.loads(line)["output_tokens"][0]
        texts[prompt] = text
    return texts


def djl_stream(url: str, prompt: str, max_new_tokens: int,
               on_first_record: Optional[Callable[[str], None]] = None
               ) -> Tuple[str, str, List[dict]]:
    """One streamed answer on djl's route: its text, the replica that served it, and its
    records (the token lines, and an error record if it ended with one).
    ``on_first_record`` is told the replica once the first record arrived."""
    text, records = "", []
    with httpx.stream("POST", url + "/invocations", timeout=300, json={
            "inputs": prompt, "parameters": {"max_new_tokens": max_new_tokens},
            "stream": True}) as response:
        assert response.status_code == 200, response.read()
        replica = response.headers[REPLICA_HEADER]
        for line in response.iter_lines():
            if not line:
                continue
            record = json.loads(line)
            records.append(record)
            if "output_tokens" in record:
                text += record["output_tokens"][0]
            if on_first_record is not None and len(records) == 1:
                on_first_record(replica)
    return text, replica, records


def test_concurrent_streams_are_their_solo_texts_and_spread_over_both_replicas(
        ray_server, solo_texts):
    results: Dict[str, Tuple[str, str, List[dict]]] = {}

    def client(prompt: str) -> None:
        results[prompt] = djl_stream(ray_server.url, prompt, NEW_TOKENS)

    threads = [threading.Thread(target=client, args=(prompt,)) for prompt in PROMPTS]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(300)
    assert {prompt: results[prompt][0] for prompt in PROMPTS} == solo_texts
    served = collections.Counter(results[prompt][1] for prompt in PROMPTS)
    assert len(served) == REPLICAS, f"requests per replica: {dict(served)}"


def test_the_openai_and_tgi_clients_stream_through_ray_serve_s_proxy(ray_server, solo_texts):
    from huggingface_hub import InferenceClient
    from openai import OpenAI

    prompt = PROMPTS[2]
    client = OpenAI(base_url=ray_server.url + "/v1", api_key="unused")
    pieces = [chunk.choices[0].text for chunk in client.completions.create(
        model="tiny", prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True)]
    assert "".join(pieces) == solo_texts[prompt]
    assert len(pieces) == NEW_TOKENS  # a chunk per token: the proxy does not gather them

    tgi = InferenceClient(base_url=ray_server.url)
    tokens = list(tgi.text_generation(prompt, max_new_tokens=NEW_TOKENS, stream=True))
    assert "".join(tokens) == solo_texts[prompt]


def test_a_killed_replica_loses_only_its_streams_and_ray_serve_replaces_it(ray_server):
    long = 2000
    results: Dict[int, Tuple[str, str, List[dict]]] = {}
    serving: Dict[int, str] = {}
    threads: List[threading.Thread] = []

    def start_stream() -> None:
        index, started = len(threads), threading.Event()

        def first(replica: str) -> None:
            serving[index] = replica
            started.set()

        def client() -> None:
            results[index] = djl_stream(ray_server.url, PROMPTS[index % len(PROMPTS)], long,
                                        first)

        threads.append(threading.Thread(target=client, daemon=True))
        threads[-1].start()
        assert started.wait(300), "a stream never started"

    # Streams until both replicas have some (Ray's router picks; it usually spreads them).
    while len(threads) < 4 or (len(set(serving.values())) < REPLICAS and len(threads) < 16):
        start_stream()
    assert len(set(serving.values())) == REPLICAS, serving
    victim = replica_pid(serving[0])
    os.kill(victim, signal.SIGKILL)

    for thread in threads:
        thread.join(300)
    assert not any(thread.is_alive() for thread in threads), "a stream hangs"
    lost = [i for i in results if replica_pid(results[i][1]) == victim]
    kept = [i for i in results if i not in lost]
    assert lost and kept, {i: results[i][1] for i in results}
    for i in lost:
        records = results[i][2]
        assert "ReplicaLost" in records[-1].get("error", ""), records[-1]
    for i in kept:
        assert all("error" not in record for record in results[i][2]), results[i][2][-1]

    # Ray Serve starts a new replica; new requests succeed meanwhile and after.
    seen, deadline = set(), time.monotonic() + 300
    while True:
        answer = httpx.post(ray_server.url + "/invocations", timeout=120, json={
            "inputs": "again", "parameters": {"max_new_tokens": 2}})
        assert answer.status_code == 200, answer.text
        seen.add(replica_pid(answer.headers[REPLICA_HEADER]))
        if len(seen - {victim}) == REPLICAS:
            break
        assert time.monotonic() < deadline, f"no replacement replica; served by {seen}"
        time.sleep(0.2)
    assert victim not in seen

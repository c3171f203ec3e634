"""The reliability scenarios: many clients, a poisoned one, clients that leave, a slow
reader, a long prompt, a soak, a flood, slowloris and SIGTERM, each against a real
``djl-stream serve``.

Each scenario returns a :class:`Finding`: what was measured (figures with their units) and
a verdict against its target. Nothing here asserts a time: the tests that run the quick
version check the verdicts that do not depend on the machine's speed (texts equal, errors
isolated, the server idle again, a JSON answer), and the report shows the rest.
"""

from __future__ import annotations

import dataclasses
import json
import re
import signal
import socket
import statistics
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence

import httpx

from benchmarks.http_load import ServerProcess, run_concurrent, stream_once

#: Generous deadlines for "it eventually happens" (a busy machine is slow, not broken).
DEADLINE_S = 300.0

PROMPTS = (
    "Count from 1 to 20.",
    "Name three colours.",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List the days of the week.",
    "Say hello in five languages.",
    "What is 12 times 12?",
    "Describe a cat in one sentence.",
)


@dataclasses.dataclass
class Finding:
    """One scenario's outcome: ``figures`` (name -> value with its unit, for the report),
    ``passed`` (the verdict against ``target``) and ``detail`` (why, when it failed)."""

    name: str
    target: str
    passed: bool
    figures: Dict[str, str] = dataclasses.field(default_factory=dict)
    detail: str = ""
    speed_dependent: bool = False


def greedy(prompt: str, tokens: int, stream: bool = True, **parameters) -> dict:
    return {"inputs": prompt, "stream": stream,
            "parameters": {"max_new_tokens": tokens, **parameters}}


def solo_texts(url: str, prompts: Sequence[str], tokens: int) -> List[str]:
    return [stream_once(url, greedy(p, tokens)).text for p in prompts]


# -- reading the server's own state ------------------------------------------------------

_SAMPLE = re.compile(r"^(djl_stream_[a-z_]+)(?:\{[^}]*\})? ([0-9.e+-]+)$", re.M)


def metrics(server: ServerProcess) -> Dict[str, float]:
    """The server's unlabelled djl_stream_* samples (gauges and counter totals)."""
    text = httpx.get(f"http://127.0.0.1:{server.port}/metrics", timeout=60).text
    values: Dict[str, float] = {}
    for name, value in _SAMPLE.findall(text):
        values[name] = values.get(name, 0.0) + float(value)
    return values


def idle(values: Dict[str, float]) -> bool:
    return values.get("djl_stream_batch_rows", 1) == 0 and \
        values.get("djl_stream_requests_waiting", 1) == 0


def wait_until(condition: Callable[[], bool], deadline_s: float = DEADLINE_S,
               poll_s: float = 0.01) -> Optional[float]:
    """Seconds until ``condition()`` held, or None if it never did before the deadline."""
    start = time.perf_counter()
    while time.perf_counter() - start < deadline_s:
        if condition():
            return time.perf_counter() - start
        time.sleep(poll_s)
    return None


def decode_step_s(url: str, tokens: int = 24) -> float:
    """The median gap between lines of one greedy stream alone: one decode step."""
    timing = stream_once(url, greedy(PROMPTS[0], tokens, ignore_eos=True))
    gaps = [b - a for a, b in zip(timing.arrivals, timing.arrivals[1:])]
    return statistics.median(gaps)


# -- the scenarios ------------------------------------------------------------------------

def concurrent_streams(server: ServerProcess, clients: int, tokens: int) -> Finding:
    """``clients`` greedy streams at once, each equal to its solo text."""
    prompts = [PROMPTS[i % len(PROMPTS)] + f" ({i})" for i in range(clients)]
    solo = solo_texts(server.url, prompts, tokens)
    result = run_concurrent(server.url, [greedy(p, tokens) for p in prompts])
    wrong = [i for i, (t, s) in enumerate(zip(result.timings, solo)) if t.text != s or t.error]
    return Finding(f"{clients} concurrent greedy streams", "0 lost or mixed outputs",
                   not wrong, {"streams": str(clients), "lost or mixed": str(len(wrong)),
                               "aggregate": f"{result.aggregate_tokens_per_s:.1f} tokens/s"},
                   detail=f"streams {wrong[:5]} differ from their solo text" if wrong else "")


#: The issue's poisons: each failed every co-batched stream before.
POISONS = (
    {"inputs": "Count from 1 to 100.", "stream": True, "parameters": {
        "do_sample": True, "temperature": 1e-37, "max_new_tokens": 30, "manual_seed": 1}},
    {"inputs": "Count from 1 to 100.", "stream": True, "parameters": {
        "repetition_penalty": 1e-300, "max_new_tokens": 30}},
)


def poisoned_request(server: ServerProcess, tokens: int) -> Finding:
    """Four greedy streams; once they are decoding, each poison arrives; they all finish
    with their solo texts, and the poison fails alone (a 400, or an error of its own)."""
    prompts = list(PROMPTS[:4])
    # ignore_eos: the streams run their full length, so they are still running when the
    # poisons arrive.
    solo = [stream_once(server.url, greedy(p, tokens, ignore_eos=True)).text for p in prompts]
    results: List[Optional[object]] = [None] * len(prompts)
    decoding = threading.Barrier(len(prompts) + 1)
    poison_answers: List[str] = []

    def client(i: int) -> None:
        passed = []

        def on_line() -> None:
            if not passed:
                passed.append(1)
                decoding.wait()
        results[i] = stream_once(server.url, greedy(prompts[i], tokens, ignore_eos=True),
                                 on_line=on_line)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    decoding.wait(DEADLINE_S)
    for poison in POISONS:
        answer = httpx.post(server.url, json=poison, timeout=DEADLINE_S)
        poison_answers.append(f"{answer.status_code} {answer.text[:80]}")
    for thread in threads:
        thread.join(DEADLINE_S)
    wrong = [i for i, r in enumerate(results) if r is None or r.error or r.text != solo[i]]
    poison_alone = all(not a.startswith("200") for a in poison_answers) or all(
        "error" in a for a in poison_answers)
    return Finding("poisoned request among running streams",
                   "the poison fails alone; every other stream ends with its solo text",
                   not wrong and poison_alone,
                   {"running streams": str(len(prompts)),
                    "streams hurt": str(len(wrong)),
                    "poison answers": "; ".join(poison_answers)},
                   detail=f"streams {wrong} were hurt" if wrong else "")


def _steps_after(server: ServerProcess, leave: Callable[[], None]) -> tuple:
    """Tokens generated and seconds until idle after ``leave()`` (the client going away)."""
    before = metrics(server)["djl_stream_generation_tokens_total"]
    left_at = time.perf_counter()
    leave()
    seconds = wait_until(lambda: idle(metrics(server)))
    tokens = metrics(server)["djl_stream_generation_tokens_total"] - before
    return tokens, (None if seconds is None else time.perf_counter() - left_at)


def _open_request(server: ServerProcess, body: dict) -> socket.socket:
    """A request sent on a raw socket, so that the client can vanish at any moment."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
    sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    return sock


def disconnects(server: ServerProcess, step_s: float, tokens: int) -> List[Finding]:
    """A streaming and a non-streaming client leave while their ``tokens``-long greedy
    generation runs: how many decode steps the server runs for them afterwards, and how
    long until it is idle."""
    findings = []
    long_body = greedy(PROMPTS[0], tokens, ignore_eos=True)

    def generating() -> bool:
        return metrics(server).get("djl_stream_batch_rows", 0) > 0

    for kind, body in (("streaming", long_body), ("non-streaming", {**long_body, "stream": False})):
        sock = _open_request(server, body)
        if wait_until(generating, deadline_s=60) is None:
            sock.close()
            findings.append(Finding(f"{kind} client leaves", "idle within 2 decode steps",
                                    False, detail="the request never started generating"))
            continue
        steps, seconds = _steps_after(server, sock.close)
        findings.append(_disconnect_finding(kind, steps, seconds, step_s))
    return findings


def queued_disconnect(server: ServerProcess, tokens: int) -> Finding:
    """With a batch of one held by a long stream, a second request queues; its client
    leaves; it must never be prefilled (the prompt-token counter does not move for it).
    The holder is sent away only once the server has dropped the queued request, so the
    verdict does not depend on how fast the machine is."""
    holder = _open_request(server, greedy(PROMPTS[0], tokens, ignore_eos=True))
    wait_until(lambda: metrics(server).get("djl_stream_batch_rows", 0) > 0)
    before = metrics(server)
    queued = _open_request(server, greedy(PROMPTS[1], 8))
    wait_until(lambda: metrics(server).get("djl_stream_requests_waiting", 0) > 0)
    queued.close()
    cancelled = "djl_stream_requests_cancelled_total"
    dropped = wait_until(lambda: metrics(server).get(cancelled, 0.0)
                         > before.get(cancelled, 0.0), deadline_s=60)
    holder.close()
    wait_until(lambda: idle(metrics(server)))
    prefilled = metrics(server).get("djl_stream_prompt_tokens_total", 0.0) - \
        before.get("djl_stream_prompt_tokens_total", 0.0)
    return Finding("queued client leaves", "dropped from the queue, never prefilled",
                   dropped is not None and prefilled == 0,
                   {"dropped": "yes" if dropped is not None else "no",
                    "prompt tokens prefilled for it": f"{prefilled:.0f}"},
                   detail="" if prefilled == 0 and dropped is not None
                   else "the abandoned request stayed queued or was prefilled")


def _disconnect_finding(kind: str, tokens: float, seconds: Optional[float],
                        step_s: float) -> Finding:
    steps = tokens  # one row: one token per decode step
    return Finding(f"{kind} client leaves", "idle within 2 decode steps",
                   seconds is not None and steps <= 2,
                   {"decode steps after leaving": f"{steps:.0f}",
                    "time until idle": "never" if seconds is None
                    else f"{seconds:.3f} s ({seconds / step_s:.1f} steps)"},
                   detail="" if steps <= 2 else f"it ran {steps:.0f} more steps")


def slow_reader(server: ServerProcess, tokens: int) -> Finding:
    """A client that reads one byte a second, next to a normal one: the normal one's text
    is its solo text and it finishes while the slow one is still reading."""
    solo = solo_texts(server.url, [PROMPTS[2]], tokens)[0]
    payload = json.dumps(greedy(PROMPTS[0], 200, ignore_eos=True)).encode()
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1024)
    sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                 b"\r\nContent-Length: %d\r\n\r\n" % len(payload) + payload)
    sock.recv(1)
    normal = stream_once(server.url, greedy(PROMPTS[2], tokens))
    sock.close()
    wait_until(lambda: idle(metrics(server)))
    ok = normal.text == solo and not normal.error
    return Finding("slow reader beside a normal stream",
                   "the normal stream is unaffected (its solo text)", ok,
                   {"normal stream": "solo text" if ok else f"differs: {normal.error or ''}"})


def long_prompt_arrival(server: ServerProcess, max_input_tokens: int, step_s: float) -> Finding:
    """A running stream; a prompt of the longest allowed length arrives; the worst gap
    between the running stream's lines, in decode steps."""
    running: List[object] = []
    started = threading.Event()

    def run() -> None:
        running.append(stream_once(server.url, greedy(PROMPTS[0], 120, ignore_eos=True),
                                   on_line=started.set))
    thread = threading.Thread(target=run)
    thread.start()
    started.wait(DEADLINE_S)
    time.sleep(10 * step_s)  # a few ordinary steps before the arrival
    long_prompt = " ".join(["word"] * (max_input_tokens - 40))
    arrival = time.perf_counter()
    answer = httpx.post(server.url, json=greedy(long_prompt, 4, stream=False), timeout=DEADLINE_S)
    thread.join(DEADLINE_S)
    timing = running[0]
    gaps = [(b - a, a) for a, b in zip(timing.arrivals, timing.arrivals[1:])]
    during = [gap for gap, at in gaps if at >= arrival - step_s]
    worst = max(during) if during else 0.0
    steps = worst / step_s
    return Finding("long prompt arrives beside a running stream",
                   "worst gap of the running stream <= 4 decode steps", steps <= 4,
                   {"long prompt": f"{max_input_tokens - 40}+ tokens, answered {answer.status_code}",
                    "worst gap": f"{worst:.3f} s ({steps:.1f} decode steps of {step_s * 1000:.0f} ms)"},
                   speed_dependent=True)


KV_LIMIT = re.compile(r"(\d+) prompts? of (\d+) tokens in all .* the limit "
                      r"\(option\.max_request_kv_tokens\) is (\d+)")


def largest_request(server: ServerProcess, rows: int, prompt_words: int,
                    max_new_tokens_limit: int) -> Finding:
    """The largest single request the server's limits allow, on a server that has served
    nothing else: its resident size once loaded, and its peak (``VmHWM``, which includes
    the load) after a request of ``rows`` prompts of ``prompt_words`` words whose new
    tokens fill ``option.max_request_kv_tokens`` exactly, greedy and ``ignore_eos`` so it
    runs to the last one. The bound is read from the server's own refusal of
    ``max_new_tokens_limit`` new tokens for each prompt, which must be a 400 naming it."""
    loaded = server.memory()
    prompts = [" ".join([f"word{i}"] + ["word"] * (prompt_words - 1)) for i in range(rows)]

    def body(tokens: int) -> dict:
        return {"inputs": prompts, "stream": False,
                "parameters": {"max_new_tokens": tokens, "ignore_eos": True}}
    with httpx.Client(timeout=DEADLINE_S * 4) as client:
        refused = client.post(server.url, json=body(max_new_tokens_limit))
        found = KV_LIMIT.search(refused.text) if refused.status_code == 400 else None
        if found is None:
            return Finding("largest request the limits allow", "peak RSS < 2 × RSS once loaded",
                           False, {"over the bound": f"{refused.status_code} (not a 400 naming "
                                                     "option.max_request_kv_tokens)"})
        prompt_tokens, limit = int(found.group(2)), int(found.group(3))
        tokens = min(max_new_tokens_limit, (limit - prompt_tokens) // rows)
        if tokens < 1:
            return Finding("largest request the limits allow", "peak RSS < 2 × RSS once loaded",
                           False, {"request": f"{rows} prompts of {prompt_tokens} tokens in "
                                              f"all leave no room in the bound ({limit} "
                                              "KV-cache positions): the scenario's prompts "
                                              "are too long for this model's bound"})
        answer = client.post(server.url, json=body(tokens))
    time.sleep(0.5)
    after = server.memory()
    positions = prompt_tokens + rows * tokens
    ratio = after.peak / loaded.rss if loaded and after else float("nan")
    return Finding("largest request the limits allow", "peak RSS < 2 × RSS once loaded",
                   answer.status_code == 200 and ratio < 2,
                   {"request": f"{prompt_tokens} prompt tokens + {rows} × {tokens} new tokens = "
                               f"{positions} "
                               f"KV-cache positions of {limit} allowed; answered "
                               f"{answer.status_code}",
                    "over the bound": "400 naming option.max_request_kv_tokens",
                    "RSS once loaded": f"{loaded.rss / 2**20:.0f} MB",
                    "peak": f"{after.peak / 2**20:.0f} MB ({ratio:.2f}×)",
                    "RSS after": f"{after.rss / 2**20:.0f} MB"})


def soak(server: ServerProcess, requests: int, settle_s: float = 1.0) -> Finding:
    """``requests`` short requests, four at a time; resident memory before and after."""
    before = server.memory()
    bodies = [greedy(PROMPTS[i % len(PROMPTS)], 8, stream=bool(i % 2)) for i in range(requests)]
    failures = 0
    with httpx.Client(timeout=DEADLINE_S) as client:
        lock = threading.Lock()
        queue = list(bodies)

        def worker() -> None:
            nonlocal failures
            while True:
                with lock:
                    if not queue:
                        return
                    body = queue.pop()
                response = client.post(server.url, json=body)
                if response.status_code != 200:
                    with lock:
                        failures += 1
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    time.sleep(settle_s)
    after = server.memory()
    growth = (after.rss - before.rss) / 2**20 if before and after else float("nan")
    return Finding(f"soak of {requests} requests", "RSS growth < 20 MB, no failure",
                   failures == 0 and growth < 20,
                   {"failed": str(failures), "RSS before": f"{before.rss / 2**20:.0f} MB",
                    "RSS after": f"{after.rss / 2**20:.0f} MB", "growth": f"{growth:+.1f} MB",
                    "peak": f"{after.peak / 2**20:.0f} MB"})


def flood(server: ServerProcess, clients: int, tokens: int) -> Finding:
    """More concurrent requests than the batch and the queue hold (the server runs with
    a small ``job_queue_size``): the excess get a JSON 503 at once, the rest their solo
    text, and the server serves afterwards."""
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(clients)]
    solo = {p: stream_once(server.url, greedy(p, tokens)).text for p in set(prompts)}
    answers: List[Optional[httpx.Response]] = [None] * clients
    barrier = threading.Barrier(clients)

    def client(i: int) -> None:
        barrier.wait()
        answers[i] = httpx.post(server.url, json=greedy(prompts[i], tokens, stream=False),
                                timeout=DEADLINE_S)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    refused = [a for a in answers if a.status_code == 503]
    served = [(p, a) for p, a in zip(prompts, answers) if a.status_code == 200]
    refused_json = all(a.json().get("code") == 503 for a in refused)
    wrong = [p for p, a in served if a.json()["generated_text"] != solo[p]]
    other = [a.status_code for a in answers if a.status_code not in (200, 503)]
    after = httpx.post(server.url, json=greedy(PROMPTS[0], 2, stream=False), timeout=DEADLINE_S)
    ok = refused_json and not wrong and not other and after.status_code == 200 and refused
    return Finding(f"flood of {clients} against a small queue",
                   "excess refused with a JSON 503; the rest get their solo text", bool(ok),
                   {"served": str(len(served)), "refused (503)": str(len(refused)),
                    "other statuses": str(other or "none"),
                    "served texts wrong": str(len(wrong)),
                    "next request": str(after.status_code)})


def slowloris(server: ServerProcess, connections: int, header_timeout_s: float) -> Finding:
    """``connections`` clients that start a request head and never finish it: /ping keeps
    answering meanwhile, and the server answers each a 408 and closes it once its header
    timeout has passed."""
    socks = []
    for _ in range(connections):
        sock = socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S)
        sock.sendall(b"POST /invocations HTTP/1.1\r\nHost: x\r\nX-Slow: ")
        socks.append(sock)
    start = time.perf_counter()
    ping = httpx.get(f"http://127.0.0.1:{server.port}/ping", timeout=DEADLINE_S)
    closed = answered_408 = 0
    for sock in socks:
        received = b""
        try:
            while True:
                chunk = sock.recv(4096)
                if not chunk:
                    closed += 1
                    break
                received += chunk
        except OSError:
            closed += 1
        finally:
            sock.close()
        answered_408 += received.startswith(b"HTTP/1.1 408")
    seconds = time.perf_counter() - start
    return Finding(f"slowloris with {connections} connections",
                   "/ping answers; each gets a 408 and is closed",
                   ping.status_code == 200 and closed == answered_408 == connections,
                   {"/ping during": str(ping.status_code),
                    "closed with a 408": f"{answered_408} of {connections}",
                    "all closed after": f"{seconds:.1f} s (header timeout {header_timeout_s:g} s)"})


def sigterm_during_streams(server: ServerProcess, tokens: int) -> Finding:
    """Streams running, SIGTERM: new requests get 503, running streams finish, exit 0."""
    results: List[object] = [None] * 3
    started = threading.Barrier(4)

    def client(i: int) -> None:
        first = []

        def on_line() -> None:
            if not first:
                first.append(1)
                started.wait()
        results[i] = stream_once(server.url, greedy(PROMPTS[i], tokens, ignore_eos=True),
                                 on_line=on_line)
    threads = [threading.Thread(target=client, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    started.wait(DEADLINE_S)
    server.process.send_signal(signal.SIGTERM)
    try:
        refused = httpx.post(server.url, json=greedy("Hi", 2, stream=False), timeout=30)
        refused_status = refused.status_code
    except httpx.HTTPError as error:
        refused_status = f"connection refused ({type(error).__name__})"
    for thread in threads:
        thread.join(DEADLINE_S)
    code = server.process.wait(DEADLINE_S)
    finished = sum(1 for r in results if r is not None and not r.error and r.tokens == tokens)
    ok = code == 0 and finished == 3 and refused_status == 503
    return Finding("SIGTERM during 3 streams",
                   "new requests get 503; running streams finish; exit status 0", ok,
                   {"new request": str(refused_status), "streams finished": f"{finished} of 3",
                    "exit status": str(code)})

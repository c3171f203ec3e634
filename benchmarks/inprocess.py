"""The single-stream rows that run inside the benchmark process.

Each row is one way of producing ``n`` greedy tokens for one prompt and returns the
:class:`~benchmarks.measure.StreamTiming` its caller observed:

- ``generate``: ``model.generate()`` without streaming (the baseline);
- ``bare_loop``: a hand-written loop, one forward per token over a ``DynamicCache`` with
  ``logits_to_keep=1`` and an argmax (the floor of the per-token cost);
- ``jina``: ``generate(max_new_tokens=1)`` once per token on the growing sequence, as in
  Jina's streaming tutorial (the prompt is re-run for every token);
- ``ray``: ``TextIteratorStreamer`` with ``generate()`` in a thread, as in Ray Serve's;
- ``djl_stream``: djl-stream's ``StreamingUtils.get_stream_generator("Accelerate")``.

``generate()``-based rows pass ``min_new_tokens=n`` so that no end-of-sequence token can
cut them short; the prompts (:data:`benchmarks.settings.PROMPTS`) are ones the model does
not end early, which is what keeps djl-stream's rows (whose end-of-sequence ids stay
active, as in production) at exactly ``n`` tokens too; every row reports its count.

Example::

    lm = LoadedModel.load("model")
    prompt = lm.prompt("Tell me about the sea.")
    timing = ROWS[0].run(lm, prompt, 16)
    print(timing.tokens_per_s)
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time
from typing import Any, Callable, Dict, List

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, TextIteratorStreamer

from djl_stream.generation.engines.accelerate import AccelerateEngine, AccelerateSettings
from djl_stream.runtime.forward_kwargs import cache_kwarg, last_logits_only
from djl_stream.runtime.loading import in_passing_thread, torch_dtype
from djl_stream.serving.properties import ModelProperties, djl_init_properties

from .measure import StreamTiming


def resolve_device(device: str) -> torch.device:
    """``auto`` is the first CUDA device when there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


@dataclasses.dataclass(frozen=True)
class Prompt:
    """One request as a client sends it and as the model sees it.

    ``text`` is ``request`` after the chat template, rendered exactly as djl-stream's
    service renders an ``inputs`` prompt, so in-process rows and the server see the same
    token ids.
    """

    request: str
    text: str
    ids: tuple[int, ...]


@dataclasses.dataclass
class LoadedModel:
    """The model and tokenizer of a model directory, loaded the way the server loads them
    (same weights location, same ``dtype`` rule), on ``device``."""

    model: Any
    tokenizer: Any
    device: torch.device
    properties: ModelProperties

    @classmethod
    def load(cls, model_dir: str, device: str = "auto", dtype: str = "auto") -> "LoadedModel":
        init = djl_init_properties(model_dir)
        if dtype != "auto":
            init["dtype"] = dtype
        props = ModelProperties.from_init_properties(init)
        target = resolve_device(device)

        def load():  # in a thread that ends with it, as the server loads (see _alone)
            location = props.weights_location()
            tokenizer = AutoTokenizer.from_pretrained(
                location, trust_remote_code=props.trust_remote_code)
            model = AutoModelForCausalLM.from_pretrained(
                location,
                dtype=torch_dtype(props, on_gpu=target.type == "cuda"),
                trust_remote_code=props.trust_remote_code,
            )
            return model.to(target).eval(), tokenizer

        model, tokenizer = in_passing_thread(load)
        return cls(model, tokenizer, target, props)

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def prompt(self, request: str) -> Prompt:
        """``request`` as the server would feed it to the model."""
        text = request
        wrap = self.properties.apply_chat_template
        has_template = bool(getattr(self.tokenizer, "chat_template", None))
        if has_template and (wrap is None or wrap):
            text = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": request}], tokenize=False, add_generation_prompt=True
            )
            bos = getattr(self.tokenizer, "bos_token", None)
            adds_bos = self.tokenizer("a")["input_ids"][:1] == [self.tokenizer.bos_token_id]
            if bos and adds_bos and text.startswith(bos):
                text = text[len(bos):]
        return Prompt(request, text, tuple(self.tokenizer(text)["input_ids"]))

    def input_ids(self, prompt: Prompt) -> torch.Tensor:
        return torch.tensor([prompt.ids], dtype=torch.long, device=self.device)

    def decode(self, ids: List[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def _greedy(n: int) -> Dict[str, Any]:
    """Greedy decoding of exactly ``n`` tokens in ``generate()``."""
    return dict(do_sample=False, max_new_tokens=n, min_new_tokens=n)


def run_generate(lm: LoadedModel, prompt: Prompt, n: int) -> StreamTiming:
    ids = lm.input_ids(prompt)
    start = time.perf_counter()
    out = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **_greedy(n))
    new = out[0, ids.shape[1]:].tolist()  # the copy to the host waits for the device
    end = time.perf_counter()
    return StreamTiming(start, (), end, len(new), lm.decode(new), tuple(new))


def run_bare_loop(lm: LoadedModel, prompt: Prompt, n: int) -> StreamTiming:
    model, keep = lm.model, last_logits_only(lm.model)
    ids = lm.input_ids(prompt)
    keep.update(cache_kwarg(model, DynamicCache()))
    tokens: List[int] = []
    arrivals: List[float] = []
    start = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, **keep)
        while True:
            token = out.logits[:, -1, :].argmax(dim=-1)
            tokens.append(int(token.item()))
            arrivals.append(time.perf_counter())
            if len(tokens) == n:
                break
            out = model(input_ids=token[:, None], use_cache=True, **keep)
    end = time.perf_counter()
    return StreamTiming(start, tuple(arrivals), end, n, lm.decode(tokens), tuple(tokens))


def run_jina(lm: LoadedModel, prompt: Prompt, n: int) -> StreamTiming:
    ids = lm.input_ids(prompt)
    pieces: List[str] = []
    arrivals: List[float] = []
    start = time.perf_counter()
    for _ in range(n):
        ids = lm.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **_greedy(1))
        pieces.append(lm.tokenizer.decode([int(ids[0, -1])], skip_special_tokens=True))
        arrivals.append(time.perf_counter())
    end = time.perf_counter()
    new = ids[0, len(prompt.ids):].tolist()
    return StreamTiming(start, tuple(arrivals), end, len(new), "".join(pieces), tuple(new))


def run_ray_streamer(lm: LoadedModel, prompt: Prompt, n: int) -> StreamTiming:
    ids = lm.input_ids(prompt)
    streamer = TextIteratorStreamer(lm.tokenizer, skip_prompt=True, skip_special_tokens=True)
    result: Dict[str, torch.Tensor] = {}

    def generate() -> None:
        result["out"] = lm.model.generate(
            input_ids=ids, attention_mask=torch.ones_like(ids), streamer=streamer, **_greedy(n)
        )

    pieces: List[str] = []
    arrivals: List[float] = []
    start = time.perf_counter()
    thread = threading.Thread(target=generate, name="ray-style-generate")
    thread.start()
    for piece in streamer:
        if piece:
            arrivals.append(time.perf_counter())
            pieces.append(piece)
    thread.join()
    end = time.perf_counter()
    new = result["out"][0, ids.shape[1]:].tolist()
    return StreamTiming(start, tuple(arrivals), end, len(new), "".join(pieces), tuple(new))


def djl_stream_engine(lm: LoadedModel, prompt: Prompt):
    """An engine as the server makes one (its decode step compiled where the server's is),
    ready: the compiled step loaded and checked by a short warm-up request."""
    engine = AccelerateEngine(lm.model, lm.tokenizer,
                              AccelerateSettings(compile=lm.device.type == "cpu"))
    builder = engine.runner.compile_decode_step()  # (the one the engine started)
    if builder is not None:
        builder.result()
    for _ in engine.generate([prompt.text], max_new_tokens=4):
        pass
    return engine


def run_djl_stream(lm: LoadedModel, prompt: Prompt, n: int) -> StreamTiming:
    engine = djl_stream_engine(lm, prompt)
    pieces: List[str] = []
    arrivals: List[float] = []
    try:
        start = time.perf_counter()
        for step in engine.generate([prompt.text], max_new_tokens=n):
            arrivals.append(time.perf_counter())
            pieces.append(step[0])
        end = time.perf_counter()
    finally:
        engine.shutdown()
    return StreamTiming(start, tuple(arrivals), end, len(arrivals), "".join(pieces))


@dataclasses.dataclass(frozen=True)
class Row:
    """One single-stream way of generating, as the report names and explains it.

    ``granularity`` says what an arrival is: a ``token``, a text ``chunk`` (a streamer
    that waits for whole words), or ``none`` (everything comes at the end).
    """

    key: str
    label: str
    how: str
    run: Callable[[Any, Prompt, int], StreamTiming]
    granularity: str = "token"


ROWS = (
    Row("generate", "`model.generate()`, no streaming (baseline)",
        "one `generate(max_new_tokens=N, min_new_tokens=N)` call; the text arrives at the end",
        run_generate, granularity="none"),
    Row("bare_loop", "bare forward loop, KV cache + argmax (floor)",
        "`DynamicCache`, one forward per token with `logits_to_keep=1`, argmax, `.item()`",
        run_bare_loop),
    Row("jina", "Jina tutorial: `generate(max_new_tokens=1)` per token",
        "the growing sequence goes back through `generate()` for every token (no cache kept)",
        run_jina),
    Row("ray", "Ray Serve tutorial: `TextIteratorStreamer` + thread",
        "`generate(streamer=TextIteratorStreamer)` in a thread; the streamer yields words",
        run_ray_streamer, granularity="chunk"),
    Row("djl_stream", "djl-stream engine, in-process",
        "an `AccelerateEngine` as the server makes it (its compiled decode step loaded) on the "
        "chat-rendered prompt", run_djl_stream),
)


def measure(row: Row, lm: Any, prompt: Prompt, n: int) -> StreamTiming:
    """Run ``row`` once after collecting garbage, so one row's leftovers do not bill the
    next; alone in its own OpenMP thread pool (:func:`_alone`)."""
    gc.collect()
    return _alone(row, lm, prompt, n)


def warm_up(rows: List[Row], lm: Any, prompt: Prompt, tokens: int) -> None:
    """One short untimed call of every row: first-call costs (kernel selection, allocator
    growth, lazy imports) must not land in the first repetition."""
    for row in rows:
        _alone(row, lm, prompt, tokens)


def _alone(row: Row, lm: Any, prompt: Prompt, n: int) -> StreamTiming:
    """``row`` run in a thread that ends with it: each way computes with the only GNU
    OpenMP thread pool alive, as it would in a process of its own (a second live pool
    throttles the first: :func:`~djl_stream.runtime.loading.in_passing_thread`).
    djl-stream's stream generator ends its engine, and the engine's scheduler thread with
    its pool, when its stream ends."""
    return in_passing_thread(row.run, lm, prompt, n)


"""``python -m benchmarks.grammar_masks``: what a grammar constraint (JSON schema or regex)
costs each decode step of a batch on this CPU, for three constrained-decoding libraries:
``llguidance``, ``xgrammar`` and ``outlines-core``.

Nothing here runs the model: only the tokenizer of ``--model-dir`` (SmolLM2's, ~49k tokens)
is loaded, and every step's logits are random ``[rows, vocab]`` float32 tensors, so that
what is measured is the grammar's own share of a step:

- **compile**: the schema or regex turned into the library's compiled grammar, cold, and a
  second time (a cache hit where the library keeps one; the same work again where not);
- **new_state**: one per-row matcher made from the compiled grammar;
- **mask**: each row's allowed tokens written into an int32 bitmask (``fill``), then set as
  ``-inf`` in the logits (``apply``, one torch routine shared by all libraries, since the
  three write the same bitmask layout);
- **advance**: each row's matcher fed the token chosen for it.

Rows decode until their grammar is finished (end of sequence accepted) or ``--steps``; a
finished row leaves the batch at once, as in continuous batching. The token of each row is
the argmax of its masked random logits, with, at random steps, a large bonus to the tokens
that close a string, an array or the object (and end-of-sequence), so that strings end and
rows finish in a few dozen tokens instead of filling 200 steps with one string. Choosing
the token is not timed. Each finished row's text is then checked: JSON parsed and validated
against the schema (``jsonschema``), the regex matched in full, the text decoded as strict
UTF-8; and every step, no mask may allow a special token other than end-of-sequence (a
library that reads ``<|im_start|>`` as plain text would let the model write it into a JSON
string).

Each configuration (library, grammar, way of filling, rows) runs ``--repeats`` times, each
time from a cold compile; the table gives the median over the repeats of each figure (mean,
p50 and p95 over the steps of a run). Two ways of driving a batch:

- ``loop``: one library call per row, in Python (what any library allows);
- ``batch``: the library's own batch call (llguidance's ``LLExecutor``, xgrammar's
  ``BatchGrammarMatcher``), which spreads rows over native threads.

Example::

    python -m benchmarks.grammar_masks --rows 1,4,16 --steps 200
    python -m benchmarks.grammar_masks --libs xgrammar --grammars json --whitespace flexible
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional

import torch

from benchmarks.machine import cpu_model
from benchmarks.sections import write_section

#: The section of BENCHMARKS.md this writes (make bench keeps it).
SECTION = "grammar"

#: The "Person" a structured-output request might ask for: a string, an integer, an enum and
#: an array of strings, all required, nothing else allowed.
PERSON_SCHEMA: Dict[str, Any] = {
    "title": "Person",
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "role": {"enum": ["admin", "user"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}
#: A phone-number-like regex, as in TGI's ``grammar: {"type": "regex"}``.
PHONE_REGEX = r"[0-9]{3}-[0-9]{4}"
GRAMMARS = {"json": PERSON_SCHEMA, "regex": PHONE_REGEX}

#: Texts whose single tokens close what the JSON is in the middle of; they get the bonus that
#: makes rows finish (see ``choose_tokens``).
CLOSERS = ['"', '",', '"]', '"}', '"],', '"]}', ",", "]", "}", "]}"]
#: Chance, per row and step, that the closing tokens get the bonus.
CLOSE_CHANCE = 0.2

LIBRARIES = ("llguidance", "xgrammar", "outlines-core")
DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "model"


# --------------------------------------------------------------------------------------
# The adapters: one function per library, each returning the same small interface.
# --------------------------------------------------------------------------------------

@dataclass
class Adapter:
    """One library behind the interface the benchmark drives.

    ``compile(kind, spec)`` returns a compiled grammar (``kind`` is ``"json"`` or
    ``"regex"``); ``new_state(compiled)`` a per-row state; ``fill_mask(states, bitmask,
    batched)`` writes row ``i``'s allowed tokens into ``bitmask[i]`` (int32, 32 tokens a
    word, bit ``t % 32`` of word ``t // 32`` for token ``t``); ``advance(states, tokens,
    batched)`` feeds each row its token and returns whether each was accepted;
    ``is_finished(state)`` says the row may not go on.
    """

    name: str
    version: str
    setup_s: float  # the one-time, per-tokenizer preparation, done before any compile
    compile: Callable[[str, Any], Any]
    new_state: Callable[[Any], Any]
    fill_mask: Callable[[List[Any], torch.Tensor, bool], None]
    advance: Callable[[List[Any], List[int], bool], List[bool]]
    is_finished: Callable[[Any], bool]
    has_batch_api: bool
    clear_cache: Callable[[], None] = lambda: None  # makes the next compile cold


def llguidance_adapter(tokenizer, vocab_size: int, flexible_ws: bool) -> Adapter:
    """llguidance: a Rust Earley parser over a lazily built lexer; no compiled-grammar object
    or cache: a grammar is compiled by constructing an ``LLMatcher``; further rows are
    ``deep_copy()`` of it. Masks and token consumption for a batch go through an
    ``LLExecutor``'s thread pool, with the GIL released."""
    import llguidance
    import llguidance.hf
    import llguidance.torch as llg_torch

    t0 = time.perf_counter()
    # The HF fast tokenizer is serialized to JSON and rebuilt in Rust (~1 s, once per model).
    lltok = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size)
    setup_s = time.perf_counter() - t0
    executor = llguidance.LLExecutor(num_threads=os.cpu_count())
    # Compact JSON unless asked: the default lets any run of whitespace between tokens.
    json_options = {"whitespace_flexible": flexible_ws}

    def compile(kind: str, spec: Any):
        if kind == "json":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(spec, overrides=json_options)
        else:
            grammar = llguidance.LLMatcher.grammar_from_regex(spec)
        # log_level=0: errors are read from the matcher, not printed to stderr.
        matcher = llguidance.LLMatcher(lltok, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"llguidance: {matcher.get_error()}")
        return matcher

    def new_state(template):
        return template.deep_copy()

    def fill_mask(states, bitmask, batched):
        if batched:
            llg_torch.fill_next_token_bitmask_par(
                executor, [(m, i) for i, m in enumerate(states)], bitmask)
        else:
            for i, m in enumerate(states):
                llg_torch.fill_next_token_bitmask(m, bitmask, i)

    def advance(states, tokens, batched):
        if batched:
            return llg_torch.consume_token_par(executor, list(zip(states, tokens)))
        return [m.consume_token(t) for m, t in zip(states, tokens)]

    return Adapter("llguidance", metadata.version("llguidance"), setup_s, compile, new_state,
                   fill_mask, advance, lambda m: m.is_stopped(), has_batch_api=True)


def xgrammar_adapter(tokenizer, vocab_size: int, flexible_ws: bool) -> Adapter:
    """xgrammar: a C++ pushdown automaton whose token masks are mostly precomputed at compile
    time (``CompiledGrammar``, cached by the ``GrammarCompiler``); each row is a
    ``GrammarMatcher``, and ``BatchGrammarMatcher`` fills a batch's masks on native
    threads."""
    import xgrammar as xgr

    t0 = time.perf_counter()
    # TokenizerInfo reads the vocabulary and detects byte-level BPE from the HF tokenizer;
    # vocab_size is the model's (the lm_head's), which is the width of the mask.
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    compiler = xgr.GrammarCompiler(info, max_threads=os.cpu_count(), cache_enabled=True)
    setup_s = time.perf_counter() - t0
    batcher = xgr.BatchGrammarMatcher(max_threads=os.cpu_count())

    def compile(kind: str, spec: Any):
        if kind == "json":
            # any_whitespace=False with compact separators: the same JSON as the others.
            if flexible_ws:
                return compiler.compile_json_schema(json.dumps(spec), any_whitespace=True)
            return compiler.compile_json_schema(json.dumps(spec), any_whitespace=False,
                                                separators=(",", ":"))
        return compiler.compile_regex(spec)

    def new_state(compiled):
        return xgr.GrammarMatcher(compiled)

    def fill_mask(states, bitmask, batched):
        if batched:
            batcher.batch_fill_next_token_bitmask(states, bitmask)
        else:
            for i, m in enumerate(states):
                m.fill_next_token_bitmask(bitmask, i)

    def advance(states, tokens, batched):
        if batched:
            return xgr.BatchGrammarMatcher.batch_accept_token(states, tokens)
        return [m.accept_token(t) for m, t in zip(states, tokens)]

    return Adapter("xgrammar", metadata.version("xgrammar"), setup_s, compile, new_state,
                   fill_mask, advance, lambda m: m.is_terminated(), has_batch_api=True,
                   clear_cache=compiler.clear_cache)


def gpt2_byte_decoder() -> Dict[str, int]:
    """The character each byte stands for in a byte-level BPE vocabulary (GPT-2's scheme:
    printable Latin-1 bytes stand for themselves, the others are moved to U+0100 on), as a
    map from character back to byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    decoder = {chr(b): b for b in printable}
    moved = [b for b in range(256) if b not in decoder.values()]
    decoder.update({chr(256 + n): b for n, b in enumerate(moved)})
    return decoder


@dataclass
class OutlinesRow:
    """outlines-core's ``Guide`` has no end-of-sequence transition (``advance(eos)`` raises),
    so the row itself remembers that it ended."""

    guide: Any
    ended: bool = False


def outlines_adapter(tokenizer, vocab_size: int, flexible_ws: bool) -> Adapter:
    """outlines-core: the JSON schema becomes a regex, the regex a token-level DFA
    (``Index``) over the whole vocabulary at compile time; each row is a ``Guide`` (a state
    number and a shared ``Index``). No cache, no batch call: a mask is written per row."""
    import outlines_core

    t0 = time.perf_counter()
    # Vocabulary.from_pretrained() only downloads from the Hub, so the vocabulary is built
    # here: each token's real bytes (byte-level BPE characters decoded), special tokens left
    # out, end-of-sequence given apart.
    decoder = gpt2_byte_decoder()
    special = set(tokenizer.all_special_ids) | set(getattr(tokenizer, "added_tokens_decoder", {}))
    by_bytes: Dict[bytes, List[int]] = {}
    for text, token_id in tokenizer.get_vocab().items():
        if token_id not in special:
            by_bytes.setdefault(bytes(decoder[c] for c in text), []).append(token_id)
    eos = tokenizer.eos_token_id
    vocabulary = outlines_core.Vocabulary(eos, by_bytes)
    setup_s = time.perf_counter() - t0
    # "" = no whitespace between JSON tokens (compact), as for the other two.
    whitespace = None if flexible_ws else ""
    words = (vocab_size + 31) // 32

    def compile(kind: str, spec: Any):
        if kind == "json":
            spec = outlines_core.json_schema.build_regex_from_schema(
                json.dumps(spec), whitespace_pattern=whitespace)
        return outlines_core.Index(spec, vocabulary)

    def new_state(index):
        return OutlinesRow(outlines_core.Guide(index))

    def fill_mask(states, bitmask, batched):
        for i, row in enumerate(states):
            target = bitmask[i]
            row.guide.write_mask_into(target.data_ptr(), words, 4)

    def advance(states, tokens, batched):
        accepted = []
        for row, token in zip(states, tokens):
            if token == eos:
                # End-of-sequence is allowed exactly in the DFA's final states.
                row.ended = row.guide.is_finished()
                accepted.append(row.ended)
                continue
            try:
                row.guide.advance(token, return_tokens=False)
                accepted.append(True)
            except ValueError:
                accepted.append(False)
        return accepted

    return Adapter("outlines-core", metadata.version("outlines-core"), setup_s, compile,
                   new_state, fill_mask, advance, lambda row: row.ended, has_batch_api=False)


ADAPTERS = {"llguidance": llguidance_adapter, "xgrammar": xgrammar_adapter,
            "outlines-core": outlines_adapter}


# --------------------------------------------------------------------------------------
# The decode loop.
# --------------------------------------------------------------------------------------

_BITS = torch.arange(32, dtype=torch.int32)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set to ``-inf`` the logits whose bit is 0: the bitmask is unpacked to a ``[rows,
    vocab]`` bool tensor (an arithmetic shift keeps bit 31 right for negative words)."""
    rows, vocab = logits.shape
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().view(rows, -1)[:, :vocab]
    logits.masked_fill_(~allowed, float("-inf"))


def choose_tokens(logits: torch.Tensor, closers: torch.Tensor,
                  generator: torch.Generator) -> List[int]:
    """Argmax of each row's masked logits, where some rows (``CLOSE_CHANCE``) first get a large
    bonus on the closing tokens; masked tokens stay ``-inf``, so the choice stays allowed."""
    pressed = torch.rand(logits.shape[0], generator=generator) < CLOSE_CHANCE
    if pressed.any():
        logits[pressed.nonzero(), closers] += 1000.0
    return logits.argmax(dim=1).tolist()


@dataclass
class Run:
    """The timings and outcome of one decode of a batch."""

    compile_ms: float
    cached_compile_ms: float
    new_state_ms: float
    fill_ms: List[float] = field(default_factory=list)   # per step, whole batch
    apply_ms: List[float] = field(default_factory=list)  # per step, whole batch
    mask_row_ms: List[float] = field(default_factory=list)  # per step, per active row
    advance_ms: List[float] = field(default_factory=list)  # per step, whole batch
    tokens: List[List[int]] = field(default_factory=list)  # per row, without EOS
    finished: List[bool] = field(default_factory=list)
    errors: List[str] = field(default_factory=list)
    special_steps: int = 0  # steps where some row's mask let a special token through
    specials_allowed: set = field(default_factory=set)

    @property
    def mask_ms(self) -> List[float]:
        return [f + a for f, a in zip(self.fill_ms, self.apply_ms)]


def decode(adapter: Adapter, kind: str, rows: int, steps: int, batched: bool, vocab: int,
           eos: int, closers: torch.Tensor, specials: torch.Tensor, seed: int) -> Run:
    """Compile the grammar cold, start ``rows`` matchers on it, and decode them together
    until each is finished or ``steps`` steps have run. ``specials`` are the tokenizer's
    special tokens but end-of-sequence: no grammar should let a row emit one."""
    adapter.clear_cache()
    t0 = time.perf_counter()
    compiled = adapter.compile(kind, GRAMMARS[kind])
    t1 = time.perf_counter()
    adapter.compile(kind, GRAMMARS[kind])  # the second compile: cached, if anything is
    t2 = time.perf_counter()
    states = [adapter.new_state(compiled) for _ in range(rows)]
    t3 = time.perf_counter()
    run = Run(compile_ms=(t1 - t0) * 1e3, cached_compile_ms=(t2 - t1) * 1e3,
              new_state_ms=(t3 - t2) * 1e3 / rows, tokens=[[] for _ in range(rows)],
              finished=[False] * rows)

    generator = torch.Generator().manual_seed(seed)
    # One bitmask for the largest batch; a shrinking batch uses its first rows (still
    # contiguous, as the libraries require).
    bitmask = torch.full((rows, (vocab + 31) // 32), -1, dtype=torch.int32)
    active = list(range(rows))
    for _ in range(steps):
        if not active:
            break
        n = len(active)
        live = [states[r] for r in active]
        logits = torch.randn(n, vocab, generator=generator)  # stands in for the forward
        mask = bitmask[:n]

        t0 = time.perf_counter()
        adapter.fill_mask(live, mask, batched)
        t1 = time.perf_counter()
        apply_bitmask(logits, mask)
        t2 = time.perf_counter()

        # Checked before the choice, since the choice adds to the logits.
        leaked = torch.isfinite(logits[:, specials]).any(dim=0)
        if leaked.any():
            run.special_steps += 1
            run.specials_allowed.update(specials[leaked].tolist())
        chosen = choose_tokens(logits, closers, generator)
        for i, (r, token) in enumerate(zip(active, chosen)):
            if logits[i, token] == float("-inf"):
                run.errors.append(f"row {r}: no allowed token at step {len(run.fill_ms)}")

        t3 = time.perf_counter()
        accepted = adapter.advance(live, chosen, batched)
        t4 = time.perf_counter()

        run.fill_ms.append((t1 - t0) * 1e3)
        run.apply_ms.append((t2 - t1) * 1e3)
        run.mask_row_ms.append((t2 - t0) * 1e3 / n)
        run.advance_ms.append((t4 - t3) * 1e3)

        still = []
        for r, state, token, ok in zip(active, live, chosen, accepted):
            if not ok:
                run.errors.append(f"row {r}: allowed token {token} refused by the matcher")
                continue  # the row leaves the batch, unfinished
            if token != eos:
                run.tokens[r].append(token)
            if adapter.is_finished(state):
                run.finished[r] = True
            else:
                still.append(r)
        active = still
    return run


# --------------------------------------------------------------------------------------
# Checking the outputs.
# --------------------------------------------------------------------------------------

def check_output(kind: str, data: bytes) -> Optional[str]:
    """None if a finished row's bytes are valid for its grammar, else why not."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return f"not UTF-8 ({e})"
    if kind == "regex":
        return None if re.fullmatch(PHONE_REGEX, text) else f"no full match: {text!r}"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return f"not JSON ({e}): {text[:80]!r}"
    try:
        import jsonschema
    except ImportError:  # check by hand what the schema says
        ok = (isinstance(value, dict) and set(value) == set(PERSON_SCHEMA["properties"])
              and isinstance(value["name"], str) and isinstance(value["age"], int)
              and value["role"] in ("admin", "user") and isinstance(value["tags"], list)
              and all(isinstance(t, str) for t in value["tags"]))
        return None if ok else f"does not fit the schema: {text[:80]!r}"
    try:
        jsonschema.validate(value, PERSON_SCHEMA)
    except jsonschema.ValidationError as e:
        return f"does not fit the schema ({e.message}): {text[:80]!r}"
    return None


# --------------------------------------------------------------------------------------
# Reporting.
# --------------------------------------------------------------------------------------

def p(values: List[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values``, nearest rank."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def summarize(runs: List[Run], kind: str, token_bytes: Callable[[List[int]], bytes],
              token_names: Callable[[List[int]], List[str]]) -> dict:
    """Median over the runs of each run's figures, and the outputs' validity over all runs."""
    med = statistics.median
    rows = sum(len(r.finished) for r in runs)
    finished = sum(sum(r.finished) for r in runs)
    problems = [e for r in runs for e in r.errors]
    leaked = sorted(set().union(*(r.specials_allowed for r in runs)))
    if leaked:
        steps = sum(r.special_steps for r in runs)
        problems.append(f"special tokens allowed in {steps} of {sum(len(r.fill_ms) for r in runs)}"
                        f" steps: {', '.join(token_names(leaked)[:4])}"
                        f"{' ...' if len(leaked) > 4 else ''} ({len(leaked)} in all)")
    valid = 0
    for r in runs:
        for toks, done in zip(r.tokens, r.finished):
            if done:
                why = check_output(kind, token_bytes(toks))
                if why is None:
                    valid += 1
                else:
                    problems.append(why)
    return {
        "compile": med(r.compile_ms for r in runs),
        "cached": med(r.cached_compile_ms for r in runs),
        "new_state": med(r.new_state_ms for r in runs),
        "fill": med(statistics.mean(r.fill_ms) for r in runs),
        "apply": med(statistics.mean(r.apply_ms) for r in runs),
        "mask": med(statistics.mean(r.mask_ms) for r in runs),
        "mask_p50": med(p(r.mask_ms, 0.5) for r in runs),
        "mask_p95": med(p(r.mask_ms, 0.95) for r in runs),
        "mask_row": med(statistics.mean(r.mask_row_ms) for r in runs),
        "advance": med(statistics.mean(r.advance_ms) for r in runs),
        "steps": med(len(r.fill_ms) for r in runs),
        "tokens_per_row": statistics.mean(len(t) for r in runs for t in r.tokens),
        "valid": f"{valid}/{finished}/{rows}",
        "problems": problems,
    }


def cpu_ticks() -> Optional[tuple]:
    """(busy ticks of the whole machine, ticks of this process) so far, from /proc (Linux)."""
    try:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        own = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        # user nice system idle iowait irq softirq steal ...; own: utime, stime at 12, 13.
        return sum(fields[:8]) - fields[3] - fields[4], int(own[11]) + int(own[12])
    except (OSError, ValueError, IndexError):
        return None


def main(argv: List[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.grammar_masks",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-dir", default=str(DEFAULT_MODEL_DIR),
                        help="directory with the tokenizer (default: the repo's model/)")
    parser.add_argument("--rows", default="1,4,16", help="batch sizes (default: %(default)s)")
    parser.add_argument("--steps", type=int, default=200, help="most decode steps per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration")
    parser.add_argument("--libs", default=",".join(LIBRARIES), help="libraries to measure")
    parser.add_argument("--grammars", default="json,regex", help="json, regex or both")
    parser.add_argument("--modes", default="loop,batch",
                        help="loop (a call per row), batch (the library's batch call), or both")
    parser.add_argument("--whitespace", choices=("compact", "flexible"), default="compact",
                        help="JSON between tokens: none (compact) or any (the libraries' default)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads, for the apply step (default: the CPUs, %(default)s)")
    parser.add_argument("--show-outputs", action="store_true",
                        help="print one finished row's text per configuration")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", default=None,
                        help="write the tables into this BENCHMARKS.md's grammar section")
    args = parser.parse_args(argv)

    # As many torch threads as the machine has, as the server runs (the apply step is a
    # torch kernel; on a machine other work keeps busy, fewer threads wait less).
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.model_dir)
    try:  # the mask is as wide as the model's lm_head, which may exceed the tokenizer
        vocab = max(AutoConfig.from_pretrained(args.model_dir).vocab_size, len(tokenizer))
    except (OSError, ValueError):
        vocab = len(tokenizer)
    eos = tokenizer.eos_token_id
    closer_ids = sorted({ids[0] for ids in (tokenizer.encode(c, add_special_tokens=False)
                                            for c in CLOSERS) if len(ids) == 1} | {eos})
    closers = torch.tensor(closer_ids)
    special_ids = (set(tokenizer.all_special_ids)
                   | set(getattr(tokenizer, "added_tokens_decoder", {}))) - {eos}
    specials = torch.tensor(sorted(i for i in special_ids if i < vocab), dtype=torch.long)
    decoder = gpt2_byte_decoder()

    def token_bytes(ids: List[int]) -> bytes:
        # Byte-level BPE: join each token's bytes, so that a split UTF-8 character is seen.
        return b"".join(bytes(decoder[c] for c in t) for t in tokenizer.convert_ids_to_tokens(ids))

    rows_list = [int(x) for x in args.rows.split(",")]
    kinds = args.grammars.split(",")
    modes = args.modes.split(",")
    flexible = args.whitespace == "flexible"

    print(f"CPU: {cpu_model()}, {os.cpu_count()} logical CPUs, torch threads "
          f"{torch.get_num_threads()}; torch {torch.__version__}, transformers "
          f"{metadata.version('transformers')}; vocab {vocab}; JSON whitespace {args.whitespace}; "
          f"steps <= {args.steps}, {args.repeats} repeats, medians shown\n")
    # A busy machine stretches the multi-threaded steps (a thread waits for a CPU), so the
    # CPU time that other processes took during the run is reported with the results.
    ticks_before, wall_before = cpu_ticks(), time.monotonic()

    results = []
    setups = []
    for lib in args.libs.split(","):
        adapter = ADAPTERS[lib](tokenizer, vocab, flexible)
        setups.append((adapter.name, adapter.version, adapter.setup_s * 1e3))
        for kind in kinds:
            for mode in modes:
                if mode == "batch" and not adapter.has_batch_api:
                    continue
                for rows in rows_list:
                    runs = [decode(adapter, kind, rows, args.steps, mode == "batch", vocab,
                                   eos, closers, specials, seed=args.seed + k)
                            for k in range(args.repeats)]
                    results.append((adapter, kind, mode, rows,
                                    summarize(runs, kind, token_bytes,
                                              tokenizer.convert_ids_to_tokens)))
                    if args.show_outputs:
                        done = [t for r in runs for t, f in zip(r.tokens, r.finished) if f]
                        text = token_bytes(done[0]).decode("utf-8", "replace") if done else None
                        print(f"{adapter.name} {kind} {mode} B={rows}: {text!r}")

    ticks_after, wall = cpu_ticks(), time.monotonic() - wall_before
    out: List[str] = []
    if ticks_before and ticks_after:
        # Clamped: the two counters tick apart, so an idle machine can read a little below 0.
        others = max(0, (ticks_after[0] - ticks_before[0]) - (ticks_after[1] - ticks_before[1]))
        share = others / os.sysconf("SC_CLK_TCK") / wall / (os.cpu_count() or 1)
        out += [f"Other processes used {100 * share:.0f}% of the machine's CPU time "
                f"during the {wall:.0f} s run.", ""]
    out += ["| library | version | tokenizer setup ms |", "|---|---|---:|"]
    out += [f"| {name} | {version} | {ms:.0f} |" for name, version, ms in setups]
    out += ["", "| library | grammar | mode | B | compile ms (cold / 2nd) | new_state ms/row "
            "| fill ms/step | apply ms/step | mask ms/step mean (p50 / p95) | mask ms/row "
            "| advance ms/step | steps | tokens/row | valid/finished/rows |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for adapter, kind, mode, rows, s in results:
        out.append(f"| {adapter.name} | {kind} | {mode} | {rows} "
                   f"| {s['compile']:.2f} / {s['cached']:.2f} | {s['new_state']:.3f} "
                   f"| {s['fill']:.3f} | {s['apply']:.3f} "
                   f"| {s['mask']:.3f} ({s['mask_p50']:.3f} / {s['mask_p95']:.3f}) "
                   f"| {s['mask_row']:.3f} | {s['advance']:.3f} | {s['steps']:.0f} "
                   f"| {s['tokens_per_row']:.1f} | {s['valid']} |")
    problems = [(a.name, k, m, r, s["problems"]) for a, k, m, r, s in results if s["problems"]]
    out.append("")
    if problems:
        out.append("Problems:")
        out += [f"- {name} {kind} {mode} B={rows}: {why}"
                for name, kind, mode, rows, found in problems for why in found[:2]]
    else:
        out.append("Every finished row was valid for its grammar; no allowed token was "
                   "refused; no special token was allowed.")
    print("\n".join(out))
    if args.output:
        command = " ".join(["python -m benchmarks.grammar_masks", *(argv or [])])
        write_section(Path(args.output), SECTION, "\n".join([
            "## Structured output: the grammar's cost per decode step", "",
            f"Measured with `{command}` (what `make bench-grammar` runs) on {cpu_model()}, "
            f"{os.cpu_count()} CPUs, torch {torch.__version__}: the three constrained-"
            "decoding libraries that could serve OpenAI's `response_format` and TGI's "
            "`grammar`, on SmolLM2's tokenizer, with random logits (no model), so that "
            "what is timed is the grammar's own share of a step: compiling a schema (a "
            "Person object) or a regex, a matcher per row, each step's mask filled and "
            "applied to the logits (`mask`), and each row's matcher fed its token "
            "(`advance`). `loop` drives one call per row, `batch` the library's own batch "
            "call. djl-stream uses llguidance: a new schema compiles in about a "
            "millisecond (each request may bring its own), no special token leaks into a "
            "JSON string, errors end a row rather than the batch, and one wheel covers JSON "
            "schemas, regexes and Lark grammars; its mask costs a row a fraction of a "
            "millisecond, against the tens of milliseconds of a decode step.", "",
            *out]))


if __name__ == "__main__":
    main()

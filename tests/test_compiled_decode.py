"""The one-row decode step compiled ahead of time by AOTInductor (``option.decode_step=
compiled``): the forward's tokens and logits as the cache's buffers grow, the cache on
disk (one compile for workers starting together, none at the next start, only the
constants the program reads kept), and the eager step taking over where compiling or
running the program fails.

The model is the tiny random Llama (it compiles in about 15 s here); the compiled tests
share one program through the session's cache (``one_row_cache``)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
import time
import zipfile
from pathlib import Path

import pytest
import torch

from conftest import COMPILED_SEED, StepLogits, build_tiny_llama, greedy_in_one_batch
from djl_stream.file_lock import exclusive_lock
from djl_stream.generation import compiled_decode, int8_weights, llama_decode, packed_linear
from djl_stream.generation.int8_linear import int8_matmul_unavailable, quantize_linear_layers
from djl_stream.generation.batch import CausalLMBatch, generate_token
from djl_stream.generation.packed_linear import pack_linear_layers, packing_unavailable
from djl_stream.generation.sequence import GenerationSequence
from djl_stream.serving.properties import ModelProperties

pytestmark = pytest.mark.skipif(packing_unavailable() is not None,
                                reason=f"this PyTorch cannot prepack: {packing_unavailable()}")

PROMPT = "Once upon a time, in a land far away, there lived"


def decode_alone(model, tokenizer, new_tokens, room_on_left=0):
    """One prompt decoded alone (one row) from buffers of the smallest size, so that the
    steps grow them, ``room_on_left`` columns left free before it; its tokens and the
    column capacities its cache went through."""
    seq = GenerationSequence(0, tokenizer(PROMPT)["input_ids"], tokenizer,
                             max_new_tokens=new_tokens, eos_token_ids=set(), ignore_eos=True)
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu")
    batch.past_key_values.reserve_columns = 1
    batch.past_key_values.room_on_left = room_on_left
    capacities = set()
    while batch is not None:
        _, batch = generate_token(model, batch)
        if batch is not None:
            capacities.add(batch.past_key_values._slabs[0].column_capacity)
    return seq.generated_ids, capacities


def forbid_compiling(monkeypatch):
    """Make any compile from here on fail the test: what follows must come from a cache
    or a model directory."""
    def no_compiling(*args, **kwargs):
        raise AssertionError("compiled again")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiling)


def compiled_step(model, tokenizer, monkeypatch, *, int8=False, share_weights=False,
                  matrix_products=False):
    """``model``'s step with its one-row program, compiled (or loaded from the session's
    cache) from the plain layers, as at load: before they are packed, or reading them where
    they are left plain (``share_weights``; ``int8``: from the int8 layers of ``w8a8``,
    which are not packed; ``matrix_products``: ATen's products, not reductions); and a
    list of the program's calls (their first columns attended over)."""
    one_row = compiled_decode.compile_one_row(model, share_weights=share_weights,
                                              matrix_products=matrix_products)
    assert one_row is not None and one_row.shares_weights == share_weights
    if not share_weights:
        assert (pack_linear_layers(model) == 0) if int8 else (pack_linear_layers(model) > 0)
    step = llama_decode.attach(model, tokenizer, one_row=one_row)
    assert step is not None and step.compiled
    calls = []
    run = one_row.run

    def counting(*inputs):
        calls.append(inputs[-1])
        return run(*inputs)

    monkeypatch.setattr(one_row, "run", counting)
    return step, calls


@pytest.mark.parametrize("room_on_left,share_weights,matrix_products",
                         [(0, False, False), (7, False, False), (7, True, False),
                          (7, True, True)])
def test_the_compiled_step_gives_the_forward_s_tokens_and_logits_as_its_buffers_grow(
        smollm2_tokenizer, monkeypatch, one_row_cache, room_on_left, share_weights,
        matrix_products):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    forward_logits = []
    hook = model.register_forward_hook(
        lambda module, args, kwargs, output: forward_logits.append(output.logits[:, -1].clone()),
        with_kwargs=True)
    expected, _ = decode_alone(model, smollm2_tokenizer, 80, room_on_left)
    hook.remove()

    step, calls = compiled_step(model, smollm2_tokenizer, monkeypatch,
                                share_weights=share_weights, matrix_products=matrix_products)
    step_logits = StepLogits(model, monkeypatch)
    tokens, capacities = decode_alone(model, smollm2_tokenizer, 80, room_on_left)

    assert tokens == expected
    assert len(capacities) > 1  # the buffers grew: other sizes, the same program
    # every decode step (the first token comes from the prefill), the one that writes the
    # buffers' last column among them, attending from the first column in use
    assert len(calls) == 79 and min(calls) == room_on_left and step.compiled
    assert len(step_logits.seen) == len(forward_logits) - 1
    for theirs, ours in zip(forward_logits[1:], step_logits.seen):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_workers_starting_together_compile_once_and_a_restart_loads_the_cache(
        smollm2_tokenizer, tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    models = [build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED) for _ in range(2)]
    loaded = [None, None]
    threads = [threading.Thread(target=lambda i=i: loaded.__setitem__(
        i, compiled_decode.compile_one_row(models[i], cache=cache))) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert None not in loaded
    assert sorted(one_row.from_cache for one_row in loaded) == [False, True]
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert entry.name == compiled_decode.cache_key(compiled_decode.OneRowGraph(models[0]))

    # what the entry keeps: the program without weights, and beside it the constants it
    # reads, each once: the projections and LM head in their plain layout (its one-row
    # products stream them as they are: OneRowProduct), nothing else of their size
    with zipfile.ZipFile(entry / "program.pt2") as package:
        assert not [n for n in package.namelist() if "/data/weights/" in n]
    unread = json.loads((entry / "unread.json").read_text())
    stored = torch.load(entry / "constants.pt", mmap=True, weights_only=True)
    assert not set(unread) & set(stored)
    state = compiled_decode.OneRowGraph(models[0]).state_dict()
    plain = {f"projections.{i}.{name}.weight" for i in range(2)
             for name in ("q", "k", "v", "o", "gate", "up", "down")} | {"lm_head.weight"}
    assert all(torch.equal(stored[name], state[name]) for name in plain)
    plain_bytes = sum(state[name].numel() * state[name].element_size() for name in plain)
    assert sum(t.numel() * t.element_size() for t in stored.values()) < 1.1 * plain_bytes

    # the next start: nothing is compiled, and the program gives the eager step's tokens
    forbid_compiling(monkeypatch)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    expected, _ = decode_alone(model, smollm2_tokenizer, 20)
    one_row = compiled_decode.compile_one_row(model, cache=cache)
    assert one_row is not None and one_row.from_cache
    pack_linear_layers(model)
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step.compiled
    assert decode_alone(model, smollm2_tokenizer, 20)[0] == expected
    assert step.compiled


@pytest.mark.parametrize("share_weights", [False, True])
def test_a_program_is_compiled_in_a_child_process(
        smollm2_tokenizer, tmp_path, monkeypatch, share_weights):
    """A compile leaves the compiling process holding what it made (gigabytes for
    SmolLM2 with freezing, hundreds of megabytes without), so a program, with its own copy
    of the weights or sharing the model's, is compiled in a forked child and loaded by
    this process from the cache: compiled (not from a cache), giving the eager step's
    tokens."""
    compiling = tmp_path / "compiling"
    compile_into = compiled_decode._compile_into

    def recording(graph, entry, share_weights=False):  # the real compile, its process told
        with open(compiling, "a", encoding="ascii") as told:
            told.write(f"{os.getpid()}\n")
        compile_into(graph, entry, share_weights)

    monkeypatch.setattr(compiled_decode, "_compile_into", recording)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 4)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    one_row = compiled_decode.compile_one_row(model, share_weights=share_weights,
                                              cache=tmp_path / "cache")
    assert one_row is not None and not one_row.from_cache
    assert one_row.shares_weights == share_weights
    (pid,) = [int(line) for line in compiling.read_text().split()]
    assert pid != os.getpid()
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step.compiled
    assert decode_alone(model, smollm2_tokenizer, 12)[0] == expected
    assert step.compiled


class UnpicklableError(Exception):
    """An exception that pickle refuses (it holds a lock)."""

    def __init__(self, message):
        super().__init__(message)
        self.lock = threading.Lock()


def _no_room(graph, entry, share_weights=False):
    raise RuntimeError("no room left on the device")


def _unpicklable(graph, entry, share_weights=False):
    raise UnpicklableError("held a lock")


def _killed(graph, entry, share_weights=False):
    os._exit(3)  # as a child killed half-way through


@pytest.mark.parametrize("compile_into,said", [
    (_no_room, "(RuntimeError: no room left on the device)"),  # as in-process
    (_unpicklable, "(RuntimeError: UnpicklableError: held a lock)"),
    (_killed, "(RuntimeError: the child process exited with 3)")])
def test_a_child_compile_that_fails_leaves_the_eager_step(smollm2_tokenizer, tmp_path,
                                                          monkeypatch, caplog, compile_into,
                                                          said):
    monkeypatch.setattr(compiled_decode, "_compile_into", compile_into)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 4)
    assert compiled_decode.compile_one_row(model, cache=tmp_path / "cache") is None
    assert f"compiling the one-row decode step failed {said}" in caplog.text
    assert not [p for p in (tmp_path / "cache").iterdir() if p.is_dir()]


def test_a_program_that_shares_the_weights_keeps_none_and_serves_other_weights_of_that_shape(
        smollm2_tokenizer, tmp_path, monkeypatch):
    # compiled from one model, it runs another of the same shapes from the cache (a
    # fine-tune, say) by that model's own tensors: its tokens and logits are that model's,
    # and an edit to one of them in place shows in the next step
    cache = tmp_path / "cache"
    first = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 2)
    compiled = compiled_decode.compile_one_row(first, share_weights=True, cache=cache)
    assert compiled is not None and compiled.shares_weights and not compiled.from_cache
    (entry,) = [p for p in cache.iterdir() if p.is_dir()]
    assert sorted(p.name for p in entry.iterdir()) == ["program.pt2", "shared.json"]
    with zipfile.ZipFile(entry / "program.pt2") as package:
        assert not [n for n in package.namelist() if "/data/weights/" in n]

    other = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 3)
    graphs = [compiled_decode.OneRowGraph(m) for m in (first, other)]
    assert compiled_decode.cache_key(graphs[0], True) == compiled_decode.cache_key(graphs[1], True)
    assert compiled_decode.cache_key(graphs[0]) != compiled_decode.cache_key(graphs[1])
    forward_logits = []
    hook = other.register_forward_hook(
        lambda module, args, kwargs, output: forward_logits.append(output.logits[:, -1].clone()),
        with_kwargs=True)
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)  # the forward of the edited weights
    expected, _ = decode_alone(other, smollm2_tokenizer, 12)
    with torch.no_grad():
        other.lm_head.weight.div_(1.5)
    hook.remove()

    forbid_compiling(monkeypatch)
    one_row = compiled_decode.compile_one_row(other, share_weights=True, cache=cache)
    assert one_row is not None and one_row.from_cache and one_row.shares_weights
    step = llama_decode.attach(other, smollm2_tokenizer, one_row=one_row)
    assert step.compiled
    with torch.no_grad():
        other.lm_head.weight.mul_(1.5)  # the program reads the model's tensor, not a copy
    step_logits = StepLogits(other, monkeypatch)
    assert decode_alone(other, smollm2_tokenizer, 12)[0] == expected
    assert step.compiled and len(step_logits.seen) == 11
    for theirs, ours in zip(forward_logits[1:], step_logits.seen):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4)


def test_a_program_that_shares_the_weights_refuses_weights_of_another_shape(
        smollm2_tokenizer, tmp_path):
    cache = tmp_path / "cache"
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 2)
    assert compiled_decode.compile_one_row(model, share_weights=True, cache=cache) is not None
    (entry,) = [compiled_decode.CacheEntry(p) for p in cache.iterdir() if p.is_dir()]
    weights = compiled_decode.model_weights(compiled_decode.OneRowGraph(model))
    weights["lm_head.weight"] = weights["lm_head.weight"][:-1]
    with pytest.raises(ValueError, match="other names, shapes or dtypes"):
        entry.load(from_cache=True, weights=weights)


def test_a_cached_program_that_does_not_load_is_removed_to_be_compiled_again(
        smollm2_tokenizer, one_row_cache, tmp_path, monkeypatch, caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    assert compiled_decode.compile_one_row(model) is not None  # in the session's cache
    key = compiled_decode.cache_key(compiled_decode.OneRowGraph(model))
    cache = tmp_path / "cache"
    shutil.copytree(one_row_cache / key, cache / key)
    (cache / key / "constants.pt").write_bytes(b"cut short")

    def no_compiler(*args, **kwargs):
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    assert compiled_decode.compile_one_row(model, cache=cache) is None
    assert "does not load" in caplog.text and "compiling it again" in caplog.text
    assert "Failed to find C compiler" in caplog.text  # it was compiled again
    assert not (cache / key).exists()


def test_the_cache_key_follows_the_weights(smollm2_tokenizer):
    first = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    same = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    key = compiled_decode.cache_key(compiled_decode.OneRowGraph(first))
    assert compiled_decode.cache_key(compiled_decode.OneRowGraph(same)) == key
    with torch.no_grad():
        same.model.layers[1].mlp.down_proj.weight[3, 5] += 1e-3
    assert compiled_decode.cache_key(compiled_decode.OneRowGraph(same)) != key


@pytest.mark.skipif(int8_matmul_unavailable() is not None,
                    reason=f"w8a8's int8 layers need torch._int_mm: {int8_matmul_unavailable()}")
def test_only_a_w8a8_program_s_key_follows_the_int8_layers_source(smollm2_tokenizer):
    # an edit to the int8 layers recompiles w8a8's programs, not float32's
    import inspect

    from djl_stream.generation.int8_linear import Int8Linear

    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    assert not compiled_decode._holds_int8_layers(compiled_decode.OneRowGraph(model))
    quantize_linear_layers(model)
    assert compiled_decode._holds_int8_layers(compiled_decode.OneRowGraph(model))
    source = inspect.getsource(Int8Linear)
    assert source in compiled_decode._step_sources(True)
    assert source not in compiled_decode._step_sources(False)


def test_a_program_that_fails_gives_way_to_the_eager_step(smollm2_tokenizer, monkeypatch,
                                                          one_row_cache, caplog):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    step, calls = compiled_step(model, smollm2_tokenizer, monkeypatch)

    def failing(*inputs):
        raise RuntimeError("the program failed")

    monkeypatch.setattr(step.one_row, "_program", failing)
    tokens, _ = decode_alone(model, smollm2_tokenizer, 12)
    assert tokens == expected
    assert len(calls) == 1 and not step.compiled  # tried once, then the eager step
    assert "run the eager step from now on" in caplog.text


def test_without_a_compiler_or_a_writable_cache_the_eager_step_runs(smollm2_tokenizer,
                                                                     tmp_path, monkeypatch,
                                                                     caplog):
    caplog.set_level(logging.INFO)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 1)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)

    def no_compiler(*args, **kwargs):  # what Inductor raises without a C++ compiler
        raise RuntimeError("Failed to find C compiler")

    monkeypatch.setattr(torch._inductor, "aoti_compile_and_package", no_compiler)
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temporary"))
    (tmp_path / "temporary").mkdir()
    one_row = compiled_decode.compile_one_row(model, cache=a_file / "cache")
    assert one_row is None
    assert "cache cannot be written" in caplog.text
    assert not list((tmp_path / "temporary").iterdir())  # the temporary cache is removed
    assert ("compiling the one-row decode step failed (RuntimeError: Failed to find C "
            "compiler)") in caplog.text
    pack_linear_layers(model)
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step is not None and not step.compiled
    assert decode_alone(model, smollm2_tokenizer, 12)[0] == expected


def read_only(monkeypatch, root):
    """Make every lock under ``root`` fail to open as on a read-only mount (this suite runs
    as root, whom file modes do not stop)."""
    real_lock = compiled_decode.exclusive_lock

    def lock(path, **kwargs):
        if Path(root) in Path(path).parents:
            raise OSError(30, "Read-only file system", str(path))
        return real_lock(path, **kwargs)

    monkeypatch.setattr(compiled_decode, "exclusive_lock", lock)


def test_a_read_only_cache_is_read_without_its_lock(smollm2_tokenizer, tmp_path, monkeypatch,
                                                    one_row_cache, caplog):
    # a cache baked into an image, say, and mounted read-only
    caplog.set_level(logging.INFO)
    compiled = compiled_decode.compile_one_row(
        build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED), share_weights=True)
    assert compiled is not None
    baked = tmp_path / "baked"
    shutil.copytree(compiled.path, baked / compiled.path.name)
    before = {p: p.stat().st_mtime_ns for p in baked.rglob("*")}
    read_only(monkeypatch, baked)
    forbid_compiling(monkeypatch)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 5)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    one_row = compiled_decode.compile_one_row(model, share_weights=True, cache=baked)
    assert one_row is not None and one_row.path == baked / compiled.path.name
    assert "is read-only" in caplog.text
    assert {p: p.stat().st_mtime_ns for p in baked.rglob("*")} == before  # untouched
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step.compiled and decode_alone(model, smollm2_tokenizer, 12)[0] == expected


def test_a_read_only_cache_without_the_program_compiles_into_a_temporary_directory(
        smollm2_tokenizer, tmp_path, monkeypatch, caplog):
    caplog.set_level(logging.INFO)
    baked = tmp_path / "baked"
    baked.mkdir()
    read_only(monkeypatch, baked)
    compiled_into = []

    def no_compiler(graph, entry, **kwargs):  # where it would compile, then Inductor's error
        compiled_into.append(entry.directory)
        raise RuntimeError("Failed to find C compiler")

    # (what the load calls to compile: _compile_into runs in a child process, whose
    # record would not come back)
    monkeypatch.setattr(compiled_decode, "_compile_apart", no_compiler)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temporary"))
    (tmp_path / "temporary").mkdir()
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 6)
    assert compiled_decode.compile_one_row(model, cache=baked) is None
    assert "holds no program for this model" in caplog.text
    (directory,) = compiled_into
    assert (tmp_path / "temporary") in directory.parents  # not into the read-only cache
    assert not list((tmp_path / "temporary").iterdir())  # and removed
    assert not list(baked.iterdir())


def test_option_decode_step_compiled_compiles_before_packing(tiny_model_dir, one_row_cache):
    from djl_stream.generation.loading import load_model_and_tokenizer
    from djl_stream.generation.packed_linear import PackedLinear

    props = ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled", "compiled_weights": "copy",
         "prepack_weights": "true"})
    model, _ = load_model_and_tokenizer(props)
    step = llama_decode.step_of(model)
    assert step is not None and step.compiled
    assert step.one_row.path.parent == one_row_cache  # TORCHINDUCTOR_CACHE_DIR's
    assert isinstance(model.model.layers[0].self_attn.q_proj, PackedLinear)
    assert not step.one_row.shares_weights  # packed: the program has its own copy


def test_with_the_program_s_own_copy_the_packing_trial_times_a_batch(tiny_model_dir,
                                                                     one_row_cache, monkeypatch):
    """option.compiled_weights=copy: the program runs every one-row step, so the layers'
    packing trial times a batch of packed_linear.BATCH_HINT rows; an eager load times one."""
    from djl_stream.generation.loading import load_model_and_tokenizer

    asked = []

    def slower_packed_at_one_row(pairs, repetitions=7, rows=1):  # as on the Intel Xeon
        asked.append(rows)
        return packed_linear.PackingTrial(0.020, 0.030 if rows == 1 else 0.018, rows)

    monkeypatch.setattr(packed_linear, "packing_trial", slower_packed_at_one_row)
    compiled, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled", "compiled_weights": "copy"}))
    assert llama_decode.step_of(compiled).compiled
    eager, _ = load_model_and_tokenizer(ModelProperties(model_dir=str(tiny_model_dir),
                                                        decode_step="eager"))
    assert asked == [packed_linear.BATCH_HINT, 1]
    assert isinstance(compiled.model.layers[0].mlp.up_proj, packed_linear.PackedLinear)
    assert type(eager.model.layers[0].mlp.up_proj) is torch.nn.Linear


def test_option_compiled_weights_shared_reads_the_layers_weights_and_leaves_them_plain(
        tiny_model_dir, one_row_cache, monkeypatch):
    from djl_stream.generation.loading import load_model_and_tokenizer
    from djl_stream.serving.properties import PropertyError

    packing_trial_figures(monkeypatch, *XEON)  # (packing a batch 1.1x faster: left plain)

    with pytest.raises(PropertyError, match="option.compiled_weights"):
        ModelProperties.from_init_properties({"compiled_weights": "borrowed"})
    props = ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled", "compiled_weights": "Shared"})
    model, _ = load_model_and_tokenizer(props)
    step = llama_decode.step_of(model)
    assert step is not None and step.compiled and step.one_row.shares_weights
    assert type(model.model.layers[0].self_attn.q_proj) is torch.nn.Linear
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    assert any(t.data_ptr() == q_weight.data_ptr() for t in step.one_row._constants.values())


def test_the_scheduler_s_pacer_counts_the_compiled_one_row_steps(smollm2_tokenizer,
                                                                 monkeypatch, one_row_cache):
    # They are what a stream alone waits between tokens: left out, one stream decoding alone
    # leaves the pacer without a step, and so without a bound on the passes reading a long
    # prompt beside it (replayed CUDA graphs are still left out: last_step_ran_apart).
    import math

    from djl_stream.generation.prefill_pacing import PrefillPacer
    from djl_stream.generation.scheduler import Scheduler

    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    step, calls = compiled_step(model, smollm2_tokenizer, monkeypatch)
    pacer = PrefillPacer(1.5, math.inf)
    scheduler = Scheduler(model, pad_token_id=2, device="cpu", max_batch_size=4, pacer=pacer)

    def sequence(request_id, new_tokens):
        return GenerationSequence(request_id, smollm2_tokenizer(PROMPT)["input_ids"],
                                  smollm2_tokenizer, max_new_tokens=new_tokens,
                                  eos_token_ids=set(), ignore_eos=True)

    try:
        alone = scheduler.submit([sequence(0, 100_000)])
        for _ in range(6):
            next(alone)
        assert len(calls) >= 5 and pacer.step_seconds is not None  # compiled: counted
        beside = [sequence(10, 8)]
        for _ in scheduler.submit(beside):
            pass
        assert len(beside[0].generated_ids) == 8
        assert pacer.step_seconds is not None  # two rows: the eager step, counted too
        alone.close()
    finally:
        scheduler.shutdown()


@pytest.mark.skipif(int8_matmul_unavailable() is not None,
                    reason=f"w8a8's int8 layers need torch._int_mm: {int8_matmul_unavailable()}")
@pytest.mark.parametrize("share_weights", [False, True])
def test_w8a8_int8_layers_compile_into_a_program_of_int8_weights(smollm2_tokenizer, monkeypatch,
                                                                 one_row_cache, share_weights):
    # option.quantize=w8a8 + option.decode_step=compiled: the program multiplies the int8
    # layers' integers (its constants are int8: less than half of float32's bytes), and
    # its tokens and logits are the eager int8 step's (integer sums are exact; the float
    # parts around them round alike here, though a row's activation that rounds the
    # other way to int8 would move a logit by a quantization step)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    float_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    assert quantize_linear_layers(model) == 15
    # as a w8a8 load does: the program multiplies query, key and value as one product
    assert llama_decode.fuse_int8_projections(model) == 4
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    eager = StepLogits(model, monkeypatch)
    expected, _ = decode_alone(model, smollm2_tokenizer, 40)

    step, calls = compiled_step(model, smollm2_tokenizer, monkeypatch, int8=True,
                                share_weights=share_weights)
    compiled = StepLogits(model, monkeypatch)
    tokens, _ = decode_alone(model, smollm2_tokenizer, 40)
    assert len(calls) == 39 and step.compiled
    # the constants it reads: its own copies on disk, or the int8 layers' own tensors
    stored = (step.one_row._constants if share_weights else
              torch.load(step.one_row.path / "constants.pt", mmap=True, weights_only=True))
    assert sum(t.numel() * t.element_size() for t in stored.values()) < float_bytes / 2
    assert torch.int8 in {t.dtype for t in stored.values()}
    assert tokens == expected
    assert len(compiled.seen) == len(eager.seen) == 39
    for theirs, ours in zip(eager.seen, compiled.seen):
        torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=1e-3)


def _fake_entry(cache, name: str, used_at: float):
    entry = cache / name
    entry.mkdir(parents=True)
    (entry / "program.pt2").write_bytes(b"not a program")
    os.utime(entry, (used_at, used_at))
    return entry


def test_the_cache_keeps_the_most_recently_used_programs_and_leaves_one_in_use(tmp_path):
    cache = tmp_path / "cache"
    oldest, old, newer, newest = (_fake_entry(cache, letter * 40, 1_000_000 + i)
                                  for i, letter in enumerate("abcd"))
    work = _fake_entry(cache, "e" * 40 + ".compiling", 0)  # a compile's work dir
    with exclusive_lock(cache / f"{oldest.name}.lock"):  # being loaded or compiled now
        assert compiled_decode.evict_unused(cache, keep=2) == [old]
    assert oldest.exists() and newer.exists() and newest.exists() and work.exists()
    assert compiled_decode.evict_unused(cache, keep=2) == [oldest]
    assert compiled_decode.evict_unused(cache, keep=0) == []  # 0 keeps every one
    assert sorted(p.name for p in cache.iterdir() if p.is_dir()) == sorted(
        [newer.name, newest.name, work.name])


def test_the_count_of_kept_programs_is_set_by_an_environment_variable(monkeypatch, caplog):
    monkeypatch.delenv(compiled_decode.KEPT_ENTRIES_VARIABLE, raising=False)
    assert compiled_decode.kept_entries() == compiled_decode.KEPT_ENTRIES == 8
    monkeypatch.setenv(compiled_decode.KEPT_ENTRIES_VARIABLE, "9")
    assert compiled_decode.kept_entries() == 9
    monkeypatch.setenv(compiled_decode.KEPT_ENTRIES_VARIABLE, "-1")
    assert compiled_decode.kept_entries() == 8
    assert "DJL_STREAM_COMPILED_CACHE_ENTRIES='-1' is not a count" in caplog.text


def test_a_start_marks_its_program_used_and_evicts_the_least_recently_used(
        smollm2_tokenizer, tmp_path, monkeypatch, one_row_cache):
    # the session's program, copied into a cache of its own as its least recently used
    # entry, beside two others: a start that loads it marks it used, so the oldest of the
    # others is the one evicted
    shared = compiled_decode.compile_one_row(build_tiny_llama(len(smollm2_tokenizer),
                                                              seed=COMPILED_SEED))
    assert shared is not None
    cache = tmp_path / "cache"
    ours = cache / shared.path.name
    shutil.copytree(shared.path, ours)
    os.utime(ours, (900_000, 900_000))
    older = _fake_entry(cache, "a" * 40, 1_000_000)
    newer = _fake_entry(cache, "b" * 40, 1_000_001)
    monkeypatch.setenv(compiled_decode.KEPT_ENTRIES_VARIABLE, "2")
    one_row = compiled_decode.compile_one_row(
        build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED), cache=cache)
    assert one_row is not None and one_row.from_cache and one_row.path == ours
    assert ours.exists() and newer.exists() and not older.exists()


# -- a program shipped in the model directory (djl-stream compile) ---------------------

def test_a_program_in_the_model_directory_is_loaded_before_the_cache_and_never_written(
        smollm2_tokenizer, tmp_path, monkeypatch, one_row_cache, caplog):
    caplog.set_level(logging.INFO)
    shipped = tmp_path / "model" / compiled_decode.SHIPPED_FOLDER
    compiled = compiled_decode.compile_one_row(
        build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED), share_weights=True)
    assert compiled is not None
    copy = compiled_decode.ship(compiled, shipped.parent)
    assert copy == shipped / compiled.path.name
    assert sorted(p.name for p in copy.iterdir()) == ["program.pt2", "shared.json"]

    forbid_compiling(monkeypatch)
    before = sorted(p.name for p in shipped.iterdir())
    empty_cache = tmp_path / "cache"
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 4)  # other weights
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    one_row = compiled_decode.compile_one_row(model, share_weights=True, cache=empty_cache,
                                              shipped=shipped)
    assert one_row is not None and one_row.path == copy
    assert "loaded from the model directory" in caplog.text
    assert sorted(p.name for p in shipped.iterdir()) == before  # no lock file, nothing new
    assert not empty_cache.exists() or not list(empty_cache.iterdir())
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step.compiled and decode_alone(model, smollm2_tokenizer, 12)[0] == expected


def test_programs_in_the_model_directory_for_another_machine_leave_it_to_the_cache(
        smollm2_tokenizer, tmp_path, one_row_cache, caplog):
    caplog.set_level(logging.INFO)
    shipped = tmp_path / "model" / compiled_decode.SHIPPED_FOLDER
    _fake_entry(shipped, "a" * 40, 1_000_000)  # another key: another CPU, say
    one_row = compiled_decode.compile_one_row(
        build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED), share_weights=True,
        shipped=shipped)
    assert one_row is not None and one_row.path.parent == one_row_cache
    assert "were compiled for another CPU, PyTorch, weights or djl-stream" in caplog.text


def test_djl_stream_compile_ships_the_program_a_server_then_loads(tiny_model_dir, tmp_path,
                                                                   monkeypatch, one_row_cache,
                                                                   capsys):
    from djl_stream.cli import main
    from djl_stream.generation.loading import load_model_and_tokenizer

    model_dir = tmp_path / "tiny"
    shutil.copytree(tiny_model_dir, model_dir)
    assert main(["compile", str(model_dir), "--weights", "shared"]) == 0
    # the one-row program, and the batch and few-rows programs that
    # option.compiled_weights=shared adds (the serving machine's packing trial picks one)
    entries = sorted((model_dir / compiled_decode.SHIPPED_FOLDER).iterdir())
    out = capsys.readouterr().out
    assert len(entries) == 3 and all(f"wrote {entry}" in out for entry in entries)

    # a machine with an empty cache, where packing does not pay: it loads the shipped
    # programs and compiles nothing
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-cache"))
    forbid_compiling(monkeypatch)
    packing_trial_figures(monkeypatch, *XEON)
    props = ModelProperties.from_init_properties(
        {"model_dir": str(model_dir), "decode_step": "compiled", "compiled_weights": "shared"})
    model, _ = load_model_and_tokenizer(props)
    step = llama_decode.step_of(model)
    assert step is not None and step.compiled and step.batch_program is not None
    assert step.few_rows is not None
    assert sorted([step.one_row.path, step.batch_program.path, step.few_rows.path]) == entries

    # where packing pays, the one-row and few-rows programs are loaded from the model
    # directory too (the 16-row program with a copy of its own is not shipped)
    packing_trial_figures(monkeypatch, *EPYC)
    model, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(model_dir)}))
    step = llama_decode.step_of(model)
    assert step.batch_program is None
    assert step.few_rows is not None
    assert {step.one_row.path, step.few_rows.path} <= set(entries)


# -- called with the GIL released (aoti_call) -------------------------------------------

def test_the_program_is_called_through_ctypes_and_gives_the_loader_s_logits(
        smollm2_tokenizer, one_row_cache):
    import ctypes

    from djl_stream.generation.aoti_call import ReleasedGilProgram

    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    one_row = compiled_decode.compile_one_row(model)
    assert isinstance(one_row._program, ReleasedGilProgram)
    # ctypes releases the GIL around a CDLL's functions (a PyDLL's keep it)
    assert type(one_row._program._library) is ctypes.CDLL
    loader = torch._inductor.aoti_load_package(str(one_row.path / "program.pt2"))
    loader.load_constants(one_row._constants, check_full_update=True, user_managed=True)
    step = llama_decode.LlamaDecodeStep(model)
    batch = CausalLMBatch.from_sequences(
        [GenerationSequence(0, smollm2_tokenizer("Once upon a time")["input_ids"],
                            smollm2_tokenizer, max_new_tokens=4, eos_token_ids=set(),
                            ignore_eos=True)], pad_token_id=2, device="cpu")
    _, batch = generate_token(model, batch)
    keys, values, start, column = batch.past_key_values.next_columns_buffers(1)
    with torch.inference_mode():
        inputs = step._inputs(batch.input_ids, batch.position_ids, batch.attention_mask)
        arguments = llama_decode._one_row_arguments(inputs, keys, values, column, start)
        ours = one_row._program(*arguments[:-1], torch.empty(start + compiled_decode._START_OFFSET))
        theirs = loader(*arguments[:-1], torch.empty(start + compiled_decode._START_OFFSET))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)


def test_where_the_library_cannot_be_called_directly_pytorch_s_loader_runs_it(
        smollm2_tokenizer, monkeypatch, one_row_cache, caplog):
    from djl_stream.generation import aoti_call

    def missing(library):
        raise AttributeError("undefined symbol: "
                             "AOTInductorModelContainerUpdateUserManagedConstantBufferPairs")

    monkeypatch.setattr(aoti_call, "_declare", missing)
    caplog.set_level(logging.INFO)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    expected, _ = decode_alone(model, smollm2_tokenizer, 12)
    one_row = compiled_decode.compile_one_row(model)
    assert not isinstance(one_row._program, aoti_call.ReleasedGilProgram)
    assert "runs through PyTorch's loader, which holds the GIL" in caplog.text
    step = llama_decode.attach(model, smollm2_tokenizer, one_row=one_row)
    assert step.compiled and decode_alone(model, smollm2_tokenizer, 12)[0] == expected


# -- the batch program (option.compiled_weights=shared) --------------------------------

BATCH_PROMPTS = ["Hello there", "The quick brown fox jumps over", "Once upon a time",
                 "A", "Water boils at", "Seven", "In the beginning"]


def decode_in_one_batch(model, tokenizer, prompts, new_tokens, room_for_rows,
                        ran_flag="last_step_batch_program"):
    """``prompts`` decoded greedily in one batch whose cache has ``room_for_rows`` more
    rows (a scheduler's cache reserves rows on a CPU); each row's tokens, and whether each
    decode step ran the batch program (the step's ``ran_flag``)."""
    sequences = [GenerationSequence(i, tokenizer(p)["input_ids"], tokenizer,
                                    max_new_tokens=new_tokens, eos_token_ids=set(),
                                    ignore_eos=True) for i, p in enumerate(prompts)]
    batch = CausalLMBatch.from_sequences(sequences, pad_token_id=2, device="cpu",
                                         room_for_rows=room_for_rows)
    _, batch = generate_token(model, batch)  # the prefill: the model's forward
    ran = []
    while batch is not None:
        _, batch = generate_token(model, batch)
        ran.append(getattr(llama_decode.step_of(model), ran_flag))
    return [seq.generated_ids for seq in sequences], ran


@pytest.fixture()
def batch_step(smollm2_tokenizer, one_row_cache):
    """The tiny Llama's step with a 4-row batch program reading its plain weights (from
    the session's cache after the first compile), and the tokens the eager step gives
    each batch of :data:`BATCH_PROMPTS` first."""
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    program = compiled_decode.compile_batch(model, rows=4)
    assert program is not None and program.rows == 4 and program.shares_weights
    eager = llama_decode.attach(model, smollm2_tokenizer)
    expected = {rows: greedy_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:rows], 10)
                for rows in (1, 2, 3, 4, 5)}
    step = llama_decode.attach(model, smollm2_tokenizer, batch_program=program)
    assert eager is not None and step is not None and step.batch_program is program
    return model, step, expected


# (a 4-row program runs 2 to 4 rows: llama_decode.first_rows_of, 7 to 16 of 16)
@pytest.mark.parametrize("rows,runs_program", [(1, False), (2, True), (3, True), (4, True),
                                               (5, False)])
def test_batches_from_7_16ths_of_the_program_s_rows_run_it_padded_with_the_same_tokens(
        smollm2_tokenizer, batch_step, rows, runs_program):
    model, step, expected = batch_step
    tokens, ran = decode_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:rows], 10,
                                      room_for_rows=8)
    assert tokens == expected[rows]
    assert ran == [runs_program] * 9


@pytest.mark.skipif(int8_matmul_unavailable() is not None,
                    reason=f"w8a8's int8 layers need torch._int_mm: {int8_matmul_unavailable()}")
def test_a_w8a8_batch_program_runs_batches_from_2_rows_with_the_eager_int8_step_s_tokens(
        smollm2_tokenizer, one_row_cache):
    # Over w8a8's int8 layers the program beats the eager step from 2 rows (its products
    # cost little): an 8-row program runs 2- and 3-row batches, where over float32 weights
    # it would start at 4 rows; each row's tokens are the eager int8 step's (per-row
    # activation scales: the padding rows change nothing)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    assert quantize_linear_layers(model) == 15
    assert llama_decode.fuse_int8_projections(model) == 4
    program = compiled_decode.compile_batch(model, rows=8)
    assert program is not None and program.rows == 8
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    expected = {rows: greedy_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:rows], 10)
                for rows in (2, 3)}
    step = llama_decode.attach(model, smollm2_tokenizer, batch_program=program)
    assert step is not None and step.batch_program is program and step.multiplies_int8
    assert step.batch_program_from() == 2 < llama_decode.first_rows_of(8) == 4
    for rows in (2, 3):
        tokens, ran = decode_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:rows], 10,
                                          room_for_rows=8)
        assert tokens == expected[rows]
        assert all(ran)


def _matrix_products(graph) -> list:
    """The matrix-product operators of ``graph`` exported as it is compiled."""
    exported = torch.export.export(graph, graph.example_inputs(),
                                   dynamic_shapes=graph.dynamic_shapes())
    kinds = {torch.ops.aten.linear.default, torch.ops.aten.mm.default,
             torch.ops.aten.addmm.default, torch.ops.aten.matmul.default,
             torch.ops.aten.bmm.default}
    return [node for node in exported.graph.nodes if node.target in kinds]


def test_the_one_row_program_multiplies_as_reductions_and_the_batch_program_as_products(
        smollm2_tokenizer):
    # A one-row product traced as a matrix product runs MKL's, at half the memory speed of
    # Inductor's reduction on an AMD EPYC (OneRowProduct); several rows keep the products.
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    layers = len(model.model.layers)
    assert _matrix_products(compiled_decode.OneRowGraph(model)) == []
    assert _matrix_products(compiled_decode.FewRowsGraph(model)) == []
    assert len(_matrix_products(compiled_decode.BatchGraph(model, rows=4))) == 7 * layers + 1


@pytest.fixture()
def few_rows_step(smollm2_tokenizer, one_row_cache):
    """The tiny Llama's step with the few-rows program (2 to 6 rows) reading its plain
    weights (from the session's cache after the first compile), and the tokens the eager
    step gives each batch of :data:`BATCH_PROMPTS` first."""
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    program = compiled_decode.compile_few_rows(model)
    assert program is not None and program.rows == compiled_decode.FEW_ROWS == 6
    assert program.shares_weights
    eager = llama_decode.attach(model, smollm2_tokenizer)
    expected = {rows: greedy_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:rows], 10)
                for rows in (1, 2, 3, 6, 7)}
    step = llama_decode.attach(model, smollm2_tokenizer, few_rows=program)
    assert eager is not None and step is not None and step.few_rows is program
    return model, step, expected


@pytest.mark.parametrize("rows,runs_program", [(1, False), (2, True), (3, True), (6, True),
                                               (7, False)])
def test_the_few_rows_program_runs_2_to_6_rows_at_their_own_count_with_the_same_tokens(
        smollm2_tokenizer, few_rows_step, rows, runs_program):
    model, step, expected = few_rows_step
    tokens, ran = decode_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:rows], 10,
                                      room_for_rows=8, ran_flag="last_step_few_rows")
    assert tokens == expected[rows]
    assert ran == [runs_program] * 9


def test_a_few_rows_program_that_fails_gives_way_to_the_eager_step(
        smollm2_tokenizer, few_rows_step, monkeypatch, caplog):
    model, step, expected = few_rows_step

    def failing(*inputs):
        raise RuntimeError("the program failed")

    monkeypatch.setattr(step.few_rows, "_program", failing)
    tokens, ran = decode_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:3], 10,
                                      room_for_rows=8, ran_flag="last_step_few_rows")
    assert tokens == expected[3]
    assert step.few_rows is None and not any(ran)
    assert "steps of a few rows run the eager step from now on" in caplog.text


def test_the_few_rows_product_hands_on_rows_by_outputs_in_their_plain_layout():
    linear = torch.nn.Linear(8, 5)
    rows = torch.randn(3, 8)
    product = compiled_decode.FewRowsProduct(linear)(rows)
    assert product.shape == (3, 5) and product.stride() == (5, 1)
    assert torch.allclose(product, linear(rows), atol=1e-6)


def test_a_float32_step_multiplies_no_int8(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    step = llama_decode.LlamaDecodeStep(model)
    assert not step.multiplies_int8 and step.batch_program_from() == 0


def test_a_batch_program_leaves_the_rows_past_the_batch_as_they_were(smollm2_tokenizer,
                                                                     batch_step):
    model, step, _ = batch_step
    sequences = [GenerationSequence(i, smollm2_tokenizer(p)["input_ids"], smollm2_tokenizer,
                                    max_new_tokens=4, eos_token_ids=set(), ignore_eos=True)
                 for i, p in enumerate(BATCH_PROMPTS[:3])]
    batch = CausalLMBatch.from_sequences(sequences, pad_token_id=2, device="cpu",
                                         room_for_rows=5)
    _, batch = generate_token(model, batch)
    keys, values, _, _ = batch.past_key_values.next_columns_buffers(len(batch))
    with torch.inference_mode():
        for buffer in keys + values:  # a slot lent to a prompt being read, say
            buffer[3:].fill_(7.0)
    _, batch = generate_token(model, batch)
    assert step.last_step_batch_program
    assert all(bool((buffer[3:] == 7.0).all()) for buffer in keys + values)
    assert not any(bool((buffer[:3] == 7.0).all()) for buffer in keys)


def test_a_batch_program_that_fails_gives_way_to_the_eager_step(smollm2_tokenizer, batch_step,
                                                                monkeypatch, caplog):
    model, step, expected = batch_step

    def failing(*inputs):
        raise RuntimeError("the program failed")

    monkeypatch.setattr(step.batch_program, "_program", failing)
    tokens, ran = decode_in_one_batch(model, smollm2_tokenizer, BATCH_PROMPTS[:4], 10,
                                      room_for_rows=8)
    assert tokens == expected[4]
    assert step.batch_program is None and not any(ran)
    assert "batch steps run the eager step from now on" in caplog.text


def test_option_compiled_weights_shared_adds_a_batch_program_reading_the_same_weights(
        tiny_model_dir, one_row_cache, monkeypatch):
    from djl_stream.generation.loading import load_model_and_tokenizer

    packing_trial_figures(monkeypatch, *XEON)  # (packing a batch 1.1x faster: left plain)

    props = ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled", "compiled_weights": "shared"})
    model, _ = load_model_and_tokenizer(props)
    step = llama_decode.step_of(model)
    assert step is not None and step.batch_program is not None
    assert step.batch_program.rows == compiled_decode.BATCH_ROWS
    q_weight = model.model.layers[0].self_attn.q_proj.weight
    assert any(t.data_ptr() == q_weight.data_ptr()
               for t in step.batch_program._constants.values())
    # with its own copy of the weights (packed layers), no batch program
    props = ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "compiled", "compiled_weights": "copy"})
    model, _ = load_model_and_tokenizer(props)
    assert llama_decode.step_of(model).batch_program is None


# -- option.decode_step=auto on a CPU -----------------------------------------------------


def packing_trial_figures(monkeypatch, plain_seconds, packed_seconds):
    """Have the load's packing trials report these times (the rows asked for through the
    layers, each way), as a CPU of that kind would; the rows they were asked for are
    listed."""
    asked = []

    def trial(pairs, repetitions=7, rows=1):
        asked.append(rows)
        return packed_linear.PackingTrial(plain_seconds, packed_seconds, rows)

    monkeypatch.setattr(packed_linear, "packing_trial", trial)
    return asked


# 4 rows' products in the layers of SmolLM2, plain and packed: this project's 2-core Xeon
# (packing 1.15x faster) and the 2-core AMD EPYC it was also measured on (1.78x).
XEON = (0.0371, 0.0324)
EPYC = (0.0873, 0.0490)


def test_by_default_a_cpu_load_compiles_its_programs_over_the_model_s_own_weights(
        tiny_model_dir, one_row_cache, caplog, monkeypatch):
    """On a CPU whose packed layers do not multiply 4 rows much faster (the Xeon's
    figures), the layers stay plain and all three programs read their weights: one row,
    2 to 6 rows at their own count, 7 to 16 rows padded to 16."""
    from djl_stream.generation import loading
    from djl_stream.generation.loading import load_model_and_tokenizer

    asked = packing_trial_figures(monkeypatch, *XEON)
    caplog.set_level(logging.INFO)
    props = ModelProperties.from_init_properties({"model_dir": str(tiny_model_dir)})
    assert (props.decode_step, props.compiled_weights) == ("auto", "shared")
    model, _ = load_model_and_tokenizer(props)
    step = llama_decode.step_of(model)
    assert step.compiled and step.one_row.shares_weights
    assert step.batch_program is not None and step.batch_program.rows == compiled_decode.BATCH_ROWS
    assert step.batch_program.shares_weights and step.batch_program_from() == 7
    assert step.few_rows is not None and step.few_rows.rows == compiled_decode.FEW_ROWS
    assert step.few_rows.shares_weights
    assert step.one_row.path.parent == one_row_cache
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear  # read by the programs
    assert asked == [loading.BESIDE_TRIAL_ROWS]  # a batch timed, after the program loaded
    assert "packed layers are 1.15x as fast on this CPU, under the 1.40x" in caplog.text


def test_by_default_where_packed_layers_multiply_a_batch_much_faster_they_serve_beside_the_program(
        tiny_model_dir, one_row_cache, monkeypatch, caplog):
    """On a CPU whose packed layers multiply 4 rows 1.8x faster than the plain ones (the
    AMD EPYC's figures), the one-row program keeps reading the plain weights and the
    layers are packed beside them for prompts and for batches past the programs' rows;
    the few-rows program runs 2 to 6 rows over the plain weights, a 16-row program with
    a copy of its own 7 to 16 rows, and steps of each give the forward's tokens."""
    from djl_stream.generation import loading
    from djl_stream.generation.loading import load_model_and_tokenizer

    asked = packing_trial_figures(monkeypatch, *EPYC)
    caplog.set_level(logging.INFO)
    model, tokenizer = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir)}))
    step = llama_decode.step_of(model)
    assert step.compiled and step.one_row.shares_weights
    assert step.few_rows is not None and step.few_rows.rows == compiled_decode.FEW_ROWS
    assert step.few_rows.shares_weights
    assert step.batch_program is not None and not step.batch_program.shares_weights
    assert (step.batch_program.rows, step.batch_program_from()) == (compiled_decode.BATCH_ROWS, 7)
    assert isinstance(model.model.layers[0].mlp.up_proj, packed_linear.PackedLinear)
    assert asked == [loading.BESIDE_TRIAL_ROWS]
    assert "beside the plain weights the compiled one-row step reads" in caplog.text
    assert ("one-row, 2- to 6-row and 7- to 16-row decode steps run the compiled programs"
            in caplog.text)

    reference, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "decode_step": "forward",
         "prepack_weights": "false"}))
    # one row: the one-row program; three: the few-rows program over the plain weights;
    # seven: the 16-row program over its copy (a cache with rows for it, as a
    # scheduler's); eight: the eager step over the packed layers (in a batch cache of
    # eight rows, which the program does not take)
    for rows in (1, 3):
        assert (greedy_in_one_batch(model, tokenizer, BATCH_PROMPTS[:rows], 12)
                == greedy_in_one_batch(reference, tokenizer, BATCH_PROMPTS[:rows], 12))
    tokens, ran = decode_in_one_batch(model, tokenizer, BATCH_PROMPTS, 12, room_for_rows=9)
    assert ran == [True] * 11
    assert tokens == greedy_in_one_batch(reference, tokenizer, BATCH_PROMPTS, 12)
    eight = BATCH_PROMPTS + ["Far away"]
    assert (greedy_in_one_batch(model, tokenizer, eight, 12)
            == greedy_in_one_batch(reference, tokenizer, eight, 12))


def test_an_int8_load_runs_every_step_of_up_to_16_rows_through_programs_over_its_int8_bytes(
        tiny_model_dir, one_row_cache, monkeypatch, caplog):
    """option.quantize=int8 on a CPU: the one-row program and a few-rows program for 2 to
    16 rows, both reading the int8 layers' own bytes (no float32 copy, no packing trial),
    each with the eager int8 step's tokens."""
    from djl_stream.generation.int8_weights import Int8WeightOnlyLinear
    from djl_stream.generation.loading import load_model_and_tokenizer

    asked = packing_trial_figures(monkeypatch, *EPYC)
    caplog.set_level(logging.INFO)
    model, tokenizer = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "quantize": "int8"}))
    step = llama_decode.step_of(model)
    assert step.compiled and step.one_row.shares_weights and step.batch_program is None
    assert step.few_rows is not None and step.few_rows.shares_weights
    assert step.few_rows.rows == compiled_decode.INT8_WEIGHTS_FEW_ROWS == 16
    assert asked == []
    assert "one-row and 2- to 16-row decode steps run the compiled programs" in caplog.text
    up = model.model.layers[0].mlp.up_proj
    assert type(up) is Int8WeightOnlyLinear
    for program in (step.one_row, step.few_rows):
        given = [t for t in program._constants.values() if t.data_ptr() == up.weight.data_ptr()]
        # its int8 bytes as words (int32 where Inductor vectorizes with AVX-512)
        assert [t.dtype for t in given] == [int8_weights.words_dtype()]
        assert not any(t.dtype == torch.float32 and t.shape == up.weight.shape
                       for t in program._constants.values())  # no float32 weight

    reference, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "quantize": "int8", "decode_step": "eager"}))
    assert llama_decode.step_of(reference).one_row is None
    for rows in (1, 3, 7):
        tokens, ran = decode_in_one_batch(model, tokenizer, BATCH_PROMPTS[:rows], 10,
                                          room_for_rows=8, ran_flag="last_step_few_rows")
        assert tokens == greedy_in_one_batch(reference, tokenizer, BATCH_PROMPTS[:rows], 10)
        assert ran == [rows > 1] * 9


def test_the_int8_programs_multiply_as_reductions_and_their_key_follows_the_int8_product(
        smollm2_tokenizer):
    import inspect

    from djl_stream.generation.int8_weights import Int8WeightProduct, quantize_weights_only

    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    float_key = compiled_decode.cache_key(compiled_decode.OneRowGraph(model), True)
    assert quantize_weights_only(model) == 15
    one_row, few_rows = compiled_decode.OneRowGraph(model), compiled_decode.FewRowsGraph(model)
    assert _matrix_products(one_row) == [] and _matrix_products(few_rows) == []
    assert few_rows.rows == 16
    source = inspect.getsource(Int8WeightProduct)
    assert source in compiled_decode._step_sources(False, type(one_row), True)
    assert source not in compiled_decode._step_sources(False, type(one_row), False)
    assert compiled_decode.cache_key(one_row, True) != float_key


def test_a_one_row_graph_with_matrix_products_keeps_the_layers_and_has_a_key_of_its_own(
        smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED)
    reductions, matrix = (compiled_decode.OneRowGraph(model),
                          compiled_decode.OneRowGraph(model, matrix_products=True))
    assert _matrix_products(reductions) == []
    assert len(_matrix_products(matrix)) == 15  # 7 projections a layer and the LM head
    assert matrix.lm_head is model.lm_head  # the layer itself, no copy
    assert (compiled_decode.cache_key(matrix, True)
            != compiled_decode.cache_key(reductions, True))


def one_row_trial_figures(monkeypatch, matrix_seconds, sum_seconds):
    """Have the load's one-row trial report these times, as a CPU of that kind would."""
    from djl_stream.generation import one_row_products

    monkeypatch.setattr(one_row_products, "one_row_trial", lambda model: (
        one_row_products.OneRowTrial(matrix_seconds, sum_seconds)))


# One row through SmolLM2's layers with ATen's products, and a sum over their weights: the
# 2-core Xeon of 2026-11-28 (MKL faster than the sums) and the 2-core AMD EPYC (MKL's
# products 41.7 ms, at 12.9 GB/s, against sums at about 24 GB/s).
XEON_ONE_ROW = (0.0206, 0.0231)
EPYC_ONE_ROW = (0.0417, 0.0224)


@pytest.mark.parametrize("figures,matrix_products", [(XEON_ONE_ROW, True),
                                                     (EPYC_ONE_ROW, False)])
def test_by_default_the_one_row_program_multiplies_as_the_trial_finds_faster(
        tiny_model_dir, one_row_cache, monkeypatch, caplog, figures, matrix_products):
    from djl_stream.generation.loading import load_model_and_tokenizer

    one_row_trial_figures(monkeypatch, *figures)
    packing_trial_figures(monkeypatch, *XEON)
    caplog.set_level(logging.INFO)
    model, tokenizer = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir)}))
    step = llama_decode.step_of(model)
    assert step.compiled and step.one_row.shares_weights
    graph = compiled_decode.OneRowGraph(model, matrix_products=matrix_products)
    assert step.one_row.path.name == compiled_decode.cache_key(graph, True)
    way = "ATen's matrix products" if matrix_products else "reductions"
    assert f"the one-row program's products: {way}" in caplog.text
    seq = GenerationSequence(0, tokenizer(PROMPT)["input_ids"], tokenizer, max_new_tokens=6,
                             eos_token_ids=set(), ignore_eos=True)
    batch = CausalLMBatch.from_sequences([seq], pad_token_id=2, device="cpu")
    ran = []
    while batch is not None:
        _, batch = generate_token(model, batch)
        ran.append(step.last_step_compiled)
    assert ran[1:] == [True] * 5  # every decode step ran the program


def test_the_one_row_trial_times_every_float32_layer_both_ways_where_the_weights_are_many(
        monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    from djl_stream.generation import one_row_products

    small = build_tiny_llama(64)
    assert one_row_products.one_row_trial(small) is None  # under TRIAL_MIN_BYTES
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8192, hidden_size=1024,
                                         intermediate_size=4096, num_hidden_layers=2,
                                         num_attention_heads=8, num_key_value_heads=4))
    layers = [layer for _, _, layer in packed_linear.plain_linear_layers(model)]
    assert sum(layer.weight.nbytes for layer in layers) >= one_row_products.TRIAL_MIN_BYTES
    timed_pairs = []
    real_trial = packed_linear.packing_trial

    def spying(pairs, repetitions=7, rows=1):
        # the real calls run (each way's callables must take the trial's inputs); the
        # figures handed back are fixed, so nothing here depends on the machine's speed
        timed_pairs.extend(pairs)
        real_trial(pairs, repetitions=repetitions, rows=rows)
        return packed_linear.PackingTrial(*XEON_ONE_ROW, rows)

    monkeypatch.setattr(packed_linear, "packing_trial", spying)
    trial = one_row_products.one_row_trial(model, repetitions=2)
    assert [layer for layer, _ in timed_pairs] == layers and len(layers) == 15
    assert all(float(call(None)) == float(layer.weight.sum()) for layer, call in timed_pairs)
    # ATen's products are the trial's first way, the sums its second
    assert (trial.matrix_seconds, trial.sum_seconds) == XEON_ONE_ROW
    assert one_row_products.OneRowTrial(*XEON_ONE_ROW).matrix_products_pay
    assert not one_row_products.OneRowTrial(*EPYC_ONE_ROW).matrix_products_pay


def test_by_default_packed_copies_that_would_crowd_the_memory_are_not_made(
        tiny_model_dir, one_row_cache, monkeypatch, caplog):
    from djl_stream.generation import loading

    asked = packing_trial_figures(monkeypatch, *EPYC)
    monkeypatch.setattr(loading, "_memory_available", lambda: 100_000)  # 100 kB
    caplog.set_level(logging.INFO)
    model, _ = loading.load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir)}))
    step = llama_decode.step_of(model)
    assert step.compiled and step.batch_program is not None
    assert type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear
    assert asked == []  # not even timed
    assert "over half the 0 MB available" in caplog.text


def test_by_default_a_third_copy_of_the_weights_that_would_crowd_the_memory_is_not_made(
        tiny_model_dir, one_row_cache, monkeypatch, caplog):
    """Where the packed copies fit but the 16-row program's own copy would then take more
    than half the memory left, the packed layers serve 7 rows and more as before."""
    from djl_stream.generation import loading

    packing_trial_figures(monkeypatch, *EPYC)
    available = iter([10**12, 100_000])  # before packing, then after it
    monkeypatch.setattr(loading, "_memory_available", lambda: next(available))
    caplog.set_level(logging.INFO)
    model, _ = loading.load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir)}))
    step = llama_decode.step_of(model)
    assert step.compiled and step.few_rows is not None and step.batch_program is None
    assert isinstance(model.model.layers[0].mlp.up_proj, packed_linear.PackedLinear)
    assert "no 16-row decode program: its copy of the weights would take" in caplog.text
    assert "over half the 0 MB available" in caplog.text


def test_the_memory_available_is_read_from_the_system():
    from djl_stream.generation.loading import _memory_available

    available = _memory_available()
    if not Path("/proc/meminfo").exists():
        assert available is None
    else:
        total = _total_memory()
        assert 0 < available <= total


def _total_memory() -> int:
    """``MemTotal`` in bytes, read apart from the function under test."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no MemTotal in /proc/meminfo")


def test_without_a_c_compiler_the_load_times_one_row_for_the_eager_step(
        tiny_model_dir, tmp_path, monkeypatch, caplog):
    """Where nothing could compile, the eager step serves every step, one-row ones
    included: the layers' packing trial times one row."""
    from torch._inductor import cpp_builder

    from djl_stream.generation.loading import load_model_and_tokenizer

    def no_compiler():
        raise RuntimeError("no C++ compiler on this machine")

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(cpp_builder, "get_cpp_compiler", no_compiler)
    asked = packing_trial_figures(monkeypatch, *XEON)
    caplog.set_level(logging.INFO)
    model, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir)}))
    assert not llama_decode.step_of(model).compiled
    assert "compiling the one-row decode step failed (RuntimeError: no C++ compiler" in caplog.text
    assert asked == [1]


def test_by_default_a_model_the_programs_do_not_run_gets_the_eager_step_without_a_warning(
        tiny_model_dir, one_row_cache, caplog, monkeypatch):
    from djl_stream.generation.loading import load_model_and_tokenizer

    forbid_compiling(monkeypatch)
    caplog.set_level(logging.INFO)
    model, _ = load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(tiny_model_dir), "dtype": "bf16"}))
    step = llama_decode.step_of(model)
    assert step is not None and not step.compiled and step.batch_program is None
    assert "no compiled decode steps (option.decode_step=auto): Linear layers of " \
           "torch.bfloat16" in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING
                and "compiled" in r.getMessage()]


def test_without_a_c_compiler_the_load_gives_up_before_exporting(smollm2_tokenizer, tmp_path,
                                                                 monkeypatch, caplog):
    """Inductor's own compiler search (``cpp.cxx``, here a name no machine has) runs before
    the export, which takes seconds of the load for nothing where no compiler follows."""
    caplog.set_level(logging.INFO)
    model = build_tiny_llama(len(smollm2_tokenizer), seed=COMPILED_SEED + 2)
    exports = []
    real_export = torch.export.export
    monkeypatch.setattr(torch.export, "export",
                        lambda *args, **kwargs: exports.append(1) or real_export(*args, **kwargs))
    # (config.patch, not monkeypatch: undoing a monkeypatch of a sub-config's entry
    # deletes it, and every in-process compile after this test then fails)
    with torch._inductor.config.patch({"cpp.cxx": ("djl-stream-no-such-compiler",)}):
        assert compiled_decode.compile_one_row(model, cache=tmp_path / "cache") is None
    assert exports == []
    assert "compiling the one-row decode step failed (InvalidCxxCompiler" in caplog.text
    assert not list((tmp_path / "cache").glob("*/program.pt2"))

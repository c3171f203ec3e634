"""The transformers-neuronx engine, as contract tests.

transformers-neuronx needs Inferentia/Trainium hardware and is not on PyPI, so these tests
run the engine against ``tests/neuronx_standin/transformers_neuronx``: a stand-in that
implements the library's documented interface (``from_pretrained`` keywords, compile /
save / load order, ``sample()`` with a streamer, compiled batch size, ``n_positions``,
float-only ``top_p``/``temperature``) on the tiny random Llama with the real SmolLM2
tokenizer. They check that the engine keeps its side of that contract; they say nothing
about the real library's numerics on a NeuronCore.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
import torch

from djl_stream import StreamingUtils
from djl_stream.generation.engines.accelerate import AccelerateEngine, encode_prompts
from djl_stream.generation.engines.neuronx import (
    NeuronUnavailableError,
    import_transformers_neuronx,
    load_neuron_model,
    neuronx_stream_generator,
)
from djl_stream.runtime.loading import ModelLoadError
from djl_stream.serving.properties import ModelProperties
from djl_stream.protocols.validation import RequestError
from logit_bias import LogitBias

STANDIN = Path(__file__).parent / "neuronx_standin"
PROMPTS = [
    "Hello",
    "The quick brown fox jumps over the lazy dog because",
    "Name a primary colour.",
]
SECONDS = 20  # no test here may wait longer than this for a stream


@pytest.fixture
def neuronx(monkeypatch):
    """The stand-in package, importable as ``transformers_neuronx`` for one test."""
    monkeypatch.syspath_prepend(str(STANDIN))
    monkeypatch.delitem(sys.modules, "transformers_neuronx", raising=False)
    module = importlib.import_module("transformers_neuronx")
    module.NeuronAutoModelForCausalLM.instances.clear()
    yield module
    sys.modules.pop("transformers_neuronx", None)


def compiled(neuronx, tiny_model, *, batch_size=4, n_positions=256):
    """The tiny Llama as transformers-neuronx would hold it after ``to_neuron()``."""
    model = neuronx.StandInForSampling(tiny_model, batch_size=batch_size, n_positions=n_positions,
                                       amp="f32", tp_degree=2)
    model.to_neuron()
    return model


def within(seconds, fn, *args):
    """``fn(*args)`` in another thread, failing the test instead of hanging it."""
    pool = concurrent.futures.ThreadPoolExecutor(1)
    try:
        return pool.submit(fn, *args).result(timeout=seconds)
    finally:
        pool.shutdown(wait=False)


def collect(stream):
    steps = within(SECONDS, list, stream)
    texts = ["".join(step[i] for step in steps) for i in range(len(steps[0]))] if steps else []
    return texts, steps


def neuron_texts(model, tokenizer, prompts, **parameters):
    return collect(neuronx_stream_generator(model, tokenizer, prompts, **parameters))


def accelerate_texts(model, tokenizer, prompts, **parameters):
    return collect(StreamingUtils.get_stream_generator("Accelerate")(model, tokenizer, prompts,
                                                                     **parameters))


def props(directory, **options):
    values = {"model_dir": str(directory), "tensor_parallel_degree": "2", "dtype": "fp32"}
    values.update({k: str(v) for k, v in options.items()})
    return ModelProperties.from_init_properties(values)


# -- the registry and the package ----------------------------------------------------------


def test_the_engine_is_registered_and_importing_it_needs_no_neuron_package():
    code = (
        "import sys\n"
        "from djl_stream import StreamingUtils\n"
        "gen = StreamingUtils.get_stream_generator('transformers-neuronx')\n"
        "assert gen.__name__ == 'neuronx_stream_generator', gen\n"
        "assert 'transformers_neuronx' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
    assert StreamingUtils.get_stream_generator("transformers-neuronx") is neuronx_stream_generator


def test_a_missing_package_says_pypi_has_a_placeholder_and_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers_neuronx", None)
    with pytest.raises(NeuronUnavailableError) as missing:
        load_neuron_model(props(tmp_path))
    message = str(missing.value)
    assert "placeholder" in message
    assert "pip install transformers-neuronx --extra-index-url=https://pip.repos.neuron.amazonaws.com" in message
    assert "Neuron" in message and "djl-serving" in message

    # PyPI's placeholder installs a module whose import raises ImportError.
    placeholder = tmp_path / "placeholder" / "transformers_neuronx"
    placeholder.mkdir(parents=True)
    (placeholder / "__init__.py").write_text("raise ImportError('this is a placeholder package')\n")
    monkeypatch.delitem(sys.modules, "transformers_neuronx")
    monkeypatch.syspath_prepend(str(placeholder.parent))
    with pytest.raises(NeuronUnavailableError, match="this is a placeholder package"):
        import_transformers_neuronx()
    sys.modules.pop("transformers_neuronx", None)


# -- loading and compiling -------------------------------------------------------------------


@pytest.fixture(autouse=True)
def djl_cache(monkeypatch, tmp_path_factory) -> Path:
    """A private $DJL_CACHE_DIR per test, so that no test shares compiled graphs with
    another or writes into the real /tmp/.djl.ai; and a private cwd, which the stand-in's
    compiler writes its work file into when a test compiles directly (``compiled()``)."""
    cache = tmp_path_factory.mktemp("djl-cache")
    monkeypatch.setenv("DJL_CACHE_DIR", str(cache))
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))
    return cache


def graph_cache(djl_cache: Path) -> Path:
    return djl_cache / "djl-stream" / "neuronx-graphs"


def files_in(directory: Path) -> dict:
    return {str(p.relative_to(directory)): p.stat().st_size for p in directory.rglob("*")}


def writes_are_refused(directory: Path) -> bool:
    try:
        (directory / ".probe").write_text("x")
    except OSError:
        return True
    (directory / ".probe").unlink()
    return False


@pytest.fixture
def read_only(monkeypatch):
    """Make directories read-only for the engine: ``chmod a-w`` where that stops writes.
    Where it does not (tests running as root, whom permission bits do not stop), the
    engine's own probe is told the directory is read-only instead, so the test checks the
    engine's decisions rather than the operating system's refusal. Returns the mode used:
    ``"chmod"`` or ``"simulated"``."""
    from djl_stream.generation.engines import neuronx as engine

    made = []

    def make(*directories: Path) -> str:
        for directory in directories:
            directory.mkdir(parents=True, exist_ok=True)
            made.append((directory, directory.stat().st_mode))
            directory.chmod(0o555)
        if all(writes_are_refused(d) for d in directories):
            return "chmod"
        probe = engine.writable_directory

        def writable(path: Path) -> bool:
            if any(Path(path).resolve().is_relative_to(d.resolve()) for d in directories):
                return False
            return probe(path)

        monkeypatch.setattr(engine, "writable_directory", writable)
        return "simulated"

    yield make
    for directory, mode in made:
        directory.chmod(mode)


def model_copy(tiny_model_dir: Path, tmp_path: Path) -> Path:
    """A model directory of our own (it may be made read-only) holding the tiny Llama."""
    directory = tmp_path / "model"
    shutil.copytree(tiny_model_dir, directory)
    return directory


@pytest.mark.parametrize("dtype, amp", [("fp16", "f16"), ("bf16", "bf16"), ("fp32", "f32"),
                                        ("auto", "f16")])
def test_from_pretrained_gets_the_compiled_shapes_from_the_properties(neuronx, tiny_model_dir,
                                                                     tmp_path, dtype, amp):
    model, tokenizer = load_neuron_model(props(
        tiny_model_dir, dtype=dtype, tensor_parallel_degree=8, max_rolling_batch_size=4,
        n_positions=512, context_length_estimate=128))
    path, kwargs = model.from_pretrained_call
    assert path == str(tiny_model_dir)
    assert kwargs == {"batch_size": 4, "tp_degree": 8, "amp": amp, "n_positions": 512,
                      "context_length_estimate": 128}
    assert [call[0] for call in model.calls] == ["to_neuron", "save"]
    assert tokenizer.eos_token == "<|im_end|>"


def test_without_compiled_graph_path_graphs_are_cached_under_djl_cache_dir(
        neuronx, tiny_model_dir, tmp_path, djl_cache, caplog):
    model_dir = model_copy(tiny_model_dir, tmp_path)
    before = files_in(model_dir)
    settings = props(model_dir, max_rolling_batch_size=2, n_positions=128)
    with caplog.at_level("INFO", logger="djl_stream.generation.engines.neuronx"):
        first, _ = load_neuron_model(settings)
    [directory] = [d for d in graph_cache(djl_cache).iterdir() if d.is_dir()]
    assert directory.name.startswith("model-tp2-bs2-n128-f32-cleauto-")
    assert [p.name for p in directory.iterdir()] == ["standin-graph.neff"]
    assert files_in(model_dir) == before  # nothing written into the model directory
    assert f"saved to {directory} (the graph cache)" in caplog.text

    second, _ = load_neuron_model(settings)  # a restarted worker
    assert second.calls == [("load", str(directory)), ("to_neuron",)]
    assert second.compile_cwd is None


def test_without_djl_cache_dir_the_cache_is_in_the_system_temp_directory(
        neuronx, tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("DJL_CACHE_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "temp"))
    (tmp_path / "temp").mkdir()
    load_neuron_model(props(tiny_model_dir, max_rolling_batch_size=2, n_positions=128))
    assert list((tmp_path / "temp" / "djl-stream" / "neuronx-graphs").glob("*/*.neff"))


@pytest.mark.parametrize("change", [
    {"max_rolling_batch_size": 4}, {"n_positions": 256}, {"tensor_parallel_degree": 1},
    {"dtype": "bf16"}, {"context_length_estimate": 64}, "config.json",
])
def test_the_cache_key_changes_with_everything_the_graphs_depend_on(tmp_path, change):
    from djl_stream.generation.engines.neuronx import compiled_graph_dir

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    base = dict(max_rolling_batch_size=2, n_positions=128)
    place = compiled_graph_dir(props(model_dir, **base))
    assert compiled_graph_dir(props(model_dir, **base)) == place  # same settings, same place
    if change == "config.json":
        (model_dir / "config.json").write_text('{"model_type": "llama", "hidden_size": 128}')
        other = compiled_graph_dir(props(model_dir, **base))
    else:
        other = compiled_graph_dir(props(model_dir, **{**base, **change}))
    assert other.directory != place.directory
    assert other.directory.parent == place.directory.parent
    assert not place.configured


def test_the_compiler_runs_in_a_scratch_directory_and_the_cwd_comes_back(
        neuronx, tiny_model_dir, tmp_path, djl_cache, monkeypatch):
    model_dir = model_copy(tiny_model_dir, tmp_path)
    monkeypatch.chdir(model_dir)  # as djl-serving starts the worker
    model, _ = load_neuron_model(props(model_dir, max_rolling_batch_size=2, n_positions=128))
    assert Path(model.compile_cwd).parent == graph_cache(djl_cache)
    assert Path(os.getcwd()) == model_dir
    assert not Path(model.compile_cwd).exists()  # scratch removed after a good compile
    assert not (model_dir / "standin-neuronx-cc.log").exists()


def test_a_failed_compile_restores_the_cwd_and_keeps_the_compilers_files(
        neuronx, tiny_model_dir, tmp_path, monkeypatch, caplog):
    model_dir = model_copy(tiny_model_dir, tmp_path)
    monkeypatch.chdir(model_dir)

    def failing_to_neuron(self):
        open("standin-neuronx-cc.log", "w").write("error: out of device memory")
        raise RuntimeError("neuronx-cc failed")

    monkeypatch.setattr(neuronx.StandInForSampling, "to_neuron", failing_to_neuron)
    with pytest.raises(RuntimeError, match="neuronx-cc failed"):
        load_neuron_model(props(model_dir, max_rolling_batch_size=2, n_positions=128))
    assert Path(os.getcwd()) == model_dir
    kept = caplog.text.split("work files are in ")[1].split()[0]
    assert Path(kept, "standin-neuronx-cc.log").read_text() == "error: out of device memory"


def test_a_read_only_model_directory_is_never_written(neuronx, tiny_model_dir, tmp_path,
                                                      djl_cache, monkeypatch, read_only):
    """The model directory is the worker's cwd and read-only (SageMaker's /opt/ml/model).
    With chmod (not root) a write there would fail the compile; as root chmod stops
    nothing, so the listing before and after is what shows nothing was written."""
    model_dir = model_copy(tiny_model_dir, tmp_path)
    before = files_in(model_dir)
    read_only(model_dir)
    monkeypatch.chdir(model_dir)
    model, _ = load_neuron_model(props(model_dir, max_rolling_batch_size=2, n_positions=128))
    assert model.calls[0] == ("to_neuron",)
    assert files_in(model_dir) == before
    assert list(graph_cache(djl_cache).glob("*/*.neff"))


def test_compiled_graphs_are_saved_then_reused_on_the_next_start(neuronx, tiny_model_dir, tmp_path):
    directory = tmp_path / "compiled"
    settings = props(tiny_model_dir, max_rolling_batch_size=2, n_positions=128,
                     compiled_graph_path=str(directory))
    first, _ = load_neuron_model(settings)
    assert [call[0] for call in first.calls] == ["to_neuron", "save"]
    assert [p.name for p in directory.iterdir()] == ["standin-graph.neff"]
    assert [p.name for p in tmp_path.iterdir()] == ["compiled"]  # no staging directory left

    second, _ = load_neuron_model(settings)
    assert second.calls == [("load", str(directory)), ("to_neuron",)]  # load first, no save


def test_a_relative_compiled_graph_path_is_in_the_model_directory(neuronx, tiny_model_dir, tmp_path):
    """Relative to the model directory, as in djl-serving's own Neuron loader (which joins
    it to the worker's cwd, the model directory): where graphs compiled ahead of time
    ship inside model.tar.gz."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    settings = props(model_dir, model_id=str(tiny_model_dir), max_rolling_batch_size=2,
                     n_positions=128, compiled_graph_path="compiled")
    load_neuron_model(settings)
    assert [p.name for p in (model_dir / "compiled").iterdir()] == ["standin-graph.neff"]
    model, _ = load_neuron_model(settings)
    assert model.calls == [("load", str(model_dir / "compiled")), ("to_neuron",)]


def test_graphs_shipped_in_a_read_only_model_directory_are_loaded(neuronx, tiny_model_dir,
                                                                  tmp_path, read_only):
    model_dir = model_copy(tiny_model_dir, tmp_path)
    settings = props(model_dir, max_rolling_batch_size=2, n_positions=128,
                     compiled_graph_path="compiled")
    load_neuron_model(settings)  # compiled ahead of time, where it was writable
    read_only(model_dir, model_dir / "compiled")
    model, _ = load_neuron_model(settings)
    assert model.calls == [("load", str(model_dir / "compiled")), ("to_neuron",)]


def test_a_configured_place_that_has_no_graphs_and_is_read_only_fails_before_loading(
        neuronx, tiny_model_dir, tmp_path, read_only):
    """A clear load error before the weights are read, not a compiler crash minutes later.
    As root this checks the engine's decision with its write probe told "read-only"."""
    model_dir = model_copy(tiny_model_dir, tmp_path)
    mode = read_only(model_dir)
    with pytest.raises(ModelLoadError) as refused:
        load_neuron_model(props(model_dir, max_rolling_batch_size=2, n_positions=128,
                                compiled_graph_path="compiled"))
    message = str(refused.value)
    assert f"option.compiled_graph_path: {model_dir / 'compiled'} holds no compiled graphs" \
        in message, mode
    assert "unset it to use the graph cache under $DJL_CACHE_DIR" in message
    assert neuronx.NeuronAutoModelForCausalLM.instances == []  # refused before from_pretrained


def test_no_writable_place_for_the_compiler_is_a_clear_load_error(
        neuronx, tiny_model_dir, tmp_path, djl_cache, monkeypatch, read_only):
    temp = tmp_path / "temp"
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    mode = read_only(djl_cache, temp)
    with pytest.raises(ModelLoadError, match="set DJL_CACHE_DIR to a writable directory") as e:
        load_neuron_model(props(tiny_model_dir, max_rolling_batch_size=2, n_positions=128))
    assert str(djl_cache) in str(e.value) and str(temp) in str(e.value), mode
    assert neuronx.NeuronAutoModelForCausalLM.instances == []


def test_stale_graphs_in_the_cache_are_compiled_again(neuronx, tiny_model_dir, djl_cache):
    settings = props(tiny_model_dir, max_rolling_batch_size=2, n_positions=128)
    load_neuron_model(settings)
    [graph] = graph_cache(djl_cache).glob("*/*.neff")
    graph.write_text('{"something": "else"}')
    model, _ = load_neuron_model(settings)
    assert [call[0] for call in model.calls] == ["to_neuron", "save"]
    assert json.loads(graph.read_text()) == model.compile_settings


def test_the_second_of_two_workers_keeps_the_graphs_the_first_published(neuronx, tiny_model,
                                                                        tmp_path):
    """djl-serving starts one worker per NeuronCore group; each compiles and saves."""
    from djl_stream.generation.engines.neuronx import save_compiled

    directory = tmp_path / "graphs"
    first, second = compiled(neuronx, tiny_model), compiled(neuronx, tiny_model)
    save_compiled(first, directory)
    published = (directory / "standin-graph.neff").stat().st_mtime_ns
    save_compiled(second, directory)
    assert (directory / "standin-graph.neff").stat().st_mtime_ns == published
    assert [p.name for p in tmp_path.iterdir()] == ["graphs"]  # the loser's copy is gone


def test_working_directory_is_restored_after_an_error(tmp_path):
    from djl_stream.generation.engines.neuronx import working_directory

    start = os.getcwd()
    with pytest.raises(KeyError):
        with working_directory(tmp_path):
            assert Path(os.getcwd()) == tmp_path
            raise KeyError("boom")
    assert os.getcwd() == start


def test_graphs_compiled_for_other_settings_fail_the_load_with_what_to_do(neuronx, tiny_model_dir,
                                                                          tmp_path):
    directory = tmp_path / "compiled"
    load_neuron_model(props(tiny_model_dir, max_rolling_batch_size=2, n_positions=128,
                            compiled_graph_path=str(directory)))
    with pytest.raises(ModelLoadError, match="option.compiled_graph_path"):
        load_neuron_model(props(tiny_model_dir, max_rolling_batch_size=4, n_positions=128,
                                compiled_graph_path=str(directory)))


def test_tensor_parallel_degree_max_is_refused(neuronx, tiny_model_dir):
    with pytest.raises(ModelLoadError, match="NeuronCores"):
        load_neuron_model(props(tiny_model_dir, tensor_parallel_degree="max"))


# -- what sample() is given ------------------------------------------------------------------


def test_fewer_prompts_are_left_padded_with_eos_up_to_the_compiled_batch(neuronx, tiny_model,
                                                                         smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=4)
    texts, steps = neuron_texts(model, smollm2_tokenizer, PROMPTS, max_new_tokens=6)
    assert len(texts) == 3 and all(len(step) == 3 for step in steps)  # the padding row is dropped

    call = model.sample_calls[0]
    ids = encode_prompts(smollm2_tokenizer, PROMPTS)
    width = max(len(p) for p in ids)
    eos = tiny_model.config.eos_token_id
    assert call["input_ids"].shape == (4, width)
    assert call["start_ids"].tolist() == [width - len(p) for p in ids] + [width - 1]
    for row, prompt in enumerate(ids):
        assert call["input_ids"][row].tolist() == [eos] * (width - len(prompt)) + prompt
    assert call["input_ids"][3].tolist() == [eos] * width
    assert call["sequence_length"] == width + 6


def test_greedy_output_is_the_accelerate_engines_for_the_same_model(neuronx, tiny_model,
                                                                   smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=4)
    neuron, _ = neuron_texts(model, smollm2_tokenizer, PROMPTS, max_new_tokens=24)
    accelerate, _ = accelerate_texts(tiny_model, smollm2_tokenizer, PROMPTS, max_new_tokens=24)
    assert neuron == accelerate
    assert all(neuron)


def test_each_streamed_step_is_one_new_token_never_the_prompt(neuronx, tiny_model,
                                                             smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=4)
    stream = neuronx_stream_generator(model, smollm2_tokenizer, PROMPTS, max_new_tokens=10)
    texts, steps = collect(stream)
    stream.thread.join(SECONDS)  # the last step reaches us before sample() returns
    width = model.sample_calls[0]["input_ids"].shape[1]
    generated = model.last_result[:, width:]
    assert len(steps) == model.steps_streamed == generated.shape[1] == 10
    for row, text in enumerate(texts):
        assert text == smollm2_tokenizer.decode(generated[row], skip_special_tokens=True)
        assert not text.startswith(PROMPTS[row])


def test_greedy_is_top_k_1_and_top_p_and_temperature_are_python_floats(neuronx, tiny_model,
                                                                       smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=1)
    neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=3, temperature=0.5)
    greedy = model.sample_calls[-1]
    assert (greedy["top_k"], greedy["top_p"], greedy["temperature"]) == (1, 1.0, 1.0)

    # ints and numpy-ish numbers from other callers become floats; top_k=0 means "off"
    neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=3, do_sample=True,
                 temperature=1, top_p=torch.tensor(0.9).item(), top_k=0)
    sampled = model.sample_calls[-1]
    assert type(sampled["temperature"]) is float and type(sampled["top_p"]) is float
    assert sampled["top_k"] == tiny_model.config.vocab_size


@pytest.mark.parametrize("parameters, field", [
    ({"repetition_penalty": 1.3}, "parameters.repetition_penalty"),
    ({"do_sample": True, "typical_p": 0.5}, "parameters.typical_p"),
    ({"do_sample": True, "manual_seed": 7}, "parameters.manual_seed"),
    ({"logprobs": True}, "parameters.logprobs"),
    ({"top_logprobs": 3}, "parameters.top_logprobs"),
    ({"min_new_tokens": 2}, "parameters.min_new_tokens"),
])
def test_options_the_neuron_sampler_lacks_are_refused(neuronx, tiny_model, smollm2_tokenizer,
                                                     parameters, field):
    model = compiled(neuronx, tiny_model, batch_size=1)
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], **parameters)
    assert refused.value.field == field
    assert "not supported by the transformers-neuronx engine" in refused.value.message
    assert model.sample_calls == []


def test_per_token_scores_are_refused_saying_why(neuronx, tiny_model, smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=1)
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], top_logprobs=2)
    assert refused.value.message == (
        "parameters.top_logprobs is not supported by the transformers-neuronx engine (the "
        "Neuron sampler reports no per-token scores); leave it 0")
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], min_new_tokens=4)
    assert "cannot keep the end-of-sequence token from being chosen" in refused.value.message


def test_options_that_change_nothing_in_greedy_mode_are_accepted(neuronx, tiny_model,
                                                                smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=1)
    plain, _ = neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=4)
    same, _ = neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=4, typical_p=0.5,
                           manual_seed=3, repetition_penalty=1.0, min_new_tokens=0,
                           logprobs=False, top_logprobs=0, ignore_eos=False)
    assert same == plain


# -- the details of each step, and ignore_eos -------------------------------------------------


def generations_of(steps):
    """Per prompt, the Generations the steps carry (None where a prompt did not advance)."""
    return [[step.generations[i] for step in steps if step.generations[i] is not None]
            for i in range(len(steps[0]))]


def test_each_step_carries_the_generations_behind_its_text(neuronx, tiny_model, smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=4)
    stream = neuronx_stream_generator(model, smollm2_tokenizer, PROMPTS, max_new_tokens=6)
    texts, steps = collect(stream)
    stream.thread.join(SECONDS)
    width = model.sample_calls[0]["input_ids"].shape[1]
    for row, generations in enumerate(generations_of(steps)):
        assert [g.token_id for g in generations] == model.last_result[row, width:].tolist()
        assert "".join(g.text for g in generations) == texts[row]
        assert all(g.logprob is None and not g.special for g in generations)
        assert [g.finish_reason for g in generations] == [None] * 5 + ["length"]


def test_ignore_eos_runs_every_row_to_max_new_tokens(neuronx, tiny_model, smollm2_tokenizer):
    eos = tiny_model.config.eos_token_id
    model = compiled(neuronx, tiny_model, batch_size=4)
    with LogitBias(tiny_model, token_id=eos, bias=5.0):
        _, ended = neuron_texts(model, smollm2_tokenizer, PROMPTS[:2], max_new_tokens=6)
        texts, steps = neuron_texts(model, smollm2_tokenizer, PROMPTS[:2], max_new_tokens=6,
                                    ignore_eos=True)
    assert model.sample_calls[0]["eos_token_override"] is None
    assert [(g.token_id, g.special, g.finish_reason) for g in generations_of(ended)[0]] == [
        (eos, True, "eos")]
    assert model.sample_calls[1]["eos_token_override"] == -1
    assert texts == ["", ""] and len(steps) == 6
    for generations in generations_of(steps):
        assert [g.token_id for g in generations] == [eos] * 6
        assert all(g.special and g.text == "" for g in generations)
        assert generations[-1].finish_reason == "length"


def test_ignore_eos_goes_on_after_eos_as_the_accelerate_engine_does(neuronx, tiny_model,
                                                                    smollm2_tokenizer):
    eos = tiny_model.config.eos_token_id
    model = compiled(neuronx, tiny_model, batch_size=4)
    # eos is every row's first token only; the model then goes on with its own choices
    with LogitBias(tiny_model, token_id=eos, bias=5.0, calls=1):
        neuron, neuron_steps = neuron_texts(model, smollm2_tokenizer, PROMPTS, max_new_tokens=8,
                                            ignore_eos=True)
    # (the engine is made first: its load runs the model on a probe, which would take the
    # bias meant for the prompts)
    engine = AccelerateEngine(tiny_model, smollm2_tokenizer)
    # the prompts' prefill: one pass on the fast path, one per prompt on the model's forward
    prefill_calls = 1 if engine.runner.mixes_passes else len(PROMPTS)
    try:
        with LogitBias(tiny_model, token_id=eos, bias=5.0, calls=prefill_calls):
            accelerate, accelerate_steps = collect(engine.generate(PROMPTS, max_new_tokens=8,
                                                                   ignore_eos=True))
    finally:
        engine.shutdown()
    assert all(neuron) and neuron == accelerate
    assert ([[g.token_id for g in gens] for gens in generations_of(neuron_steps)]
            == [[g.token_id for g in gens] for gens in generations_of(accelerate_steps)])
    assert all(gens[0].token_id == eos and gens[0].special
               for gens in generations_of(neuron_steps))


@pytest.mark.parametrize("ignore_eos", [False, True])
def test_a_sample_that_stops_early_ends_every_row_it_left_open(neuronx, tiny_model,
                                                               smollm2_tokenizer, ignore_eos):
    model = compiled(neuronx, tiny_model, batch_size=2)
    word = smollm2_tokenizer.encode(" sea", add_special_tokens=False)[0]

    def sample(input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
               eos_token_override=None, temperature=1.0, streamer=None):
        for _ in range(2):  # then stops, as a sampler's own stopping criteria may
            streamer.put(torch.full((input_ids.shape[0], 1), word))
        streamer.end()

    model.sample = sample
    stream = neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], max_new_tokens=8,
                                      ignore_eos=ignore_eos)
    (text,), steps = collect(stream)
    assert text == " sea sea"
    (generations,) = generations_of(steps)
    assert [g.finish_reason for g in generations] == [None, None, "eos"]
    assert generations[-1].token_id == tiny_model.config.eos_token_id and generations[-1].special


def test_ignore_eos_is_refused_by_a_sample_without_eos_token_override(neuronx, tiny_model,
                                                                      smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=1)

    def sample(input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
               temperature=1.0, streamer=None):
        raise AssertionError("not to be called")

    model.sample = sample
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], ignore_eos=True)
    assert refused.value.field == "parameters.ignore_eos"
    assert "eos_token_override" in refused.value.message


# -- requests that cannot fit -----------------------------------------------------------------


def test_more_prompts_than_the_compiled_batch_is_a_request_error(neuronx, tiny_model,
                                                                 smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=2)
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, PROMPTS, max_new_tokens=4)
    assert refused.value.field == "inputs"
    assert refused.value.message == ("inputs has 3 prompts; the model is compiled for a batch of "
                                     "2 (option.max_rolling_batch_size)")
    assert model.sample_calls == []


def test_a_prompt_and_max_new_tokens_beyond_n_positions_is_a_request_error(neuronx, tiny_model,
                                                                           smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=4, n_positions=32)
    width = max(len(p) for p in encode_prompts(smollm2_tokenizer, PROMPTS))
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, PROMPTS, max_new_tokens=32 - width + 1)
    assert refused.value.field == "parameters.max_new_tokens"
    assert refused.value.message.endswith("is 33 tokens; the limit (option.n_positions) is 32")
    # exactly at the limit is fine
    texts, _ = neuron_texts(model, smollm2_tokenizer, PROMPTS, max_new_tokens=32 - width)
    assert len(texts) == 3

    with pytest.raises(RequestError) as too_long:
        neuronx_stream_generator(model, smollm2_tokenizer, ["Hello", "word " * 40],
                                 max_new_tokens=1)
    assert too_long.value.field == "inputs[1]"
    assert "(option.n_positions)" in too_long.value.message
    assert len(model.sample_calls) == 1


# -- the stream's life -----------------------------------------------------------------------


def test_the_stream_ends_and_sampling_stops_once_every_prompt_is_done(neuronx, tiny_model,
                                                                      smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=2)
    (full,), _ = neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=40)
    stop = full[len(full) // 4: len(full) // 4 + 3]
    model.steps_streamed = 0
    stream = neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], max_new_tokens=40,
                                      stop=[stop])
    (text,), steps = collect(stream)
    assert text == full[: full.index(stop)]
    stream.thread.join(SECONDS)
    assert not stream.thread.is_alive()
    assert model.steps_streamed <= len(steps) + 1 < 40


def test_closing_the_stream_stops_the_sampling_thread_promptly(neuronx, tiny_model,
                                                               smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=1, n_positions=512)
    stream = neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], max_new_tokens=400)
    within(SECONDS, next, stream)
    within(SECONDS, next, stream)
    stream.close()
    stream.thread.join(5)
    assert not stream.thread.is_alive()
    assert model.steps_streamed < 400
    assert list(stream) == []


def failing_sample(after_steps):
    def sample(input_ids, sequence_length, start_ids=None, top_k=50, top_p=1.0,
               temperature=1.0, streamer=None):
        for _ in range(after_steps):
            streamer.put(torch.full((input_ids.shape[0], 1), 42))
        raise RuntimeError("device lost")
    return sample


@pytest.mark.parametrize("after_steps", [0, 2])
def test_an_error_inside_sample_is_raised_by_the_stream_not_a_hang(neuronx, tiny_model,
                                                                   smollm2_tokenizer, after_steps):
    model = compiled(neuronx, tiny_model, batch_size=2)
    model.sample = failing_sample(after_steps)
    stream = neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], max_new_tokens=8)
    for _ in range(after_steps):
        assert len(within(SECONDS, next, stream)) == 1
    with pytest.raises(RuntimeError, match="device lost"):
        within(SECONDS, next, stream)
    assert list(stream) == []


def test_concurrent_requests_take_turns_on_the_model(neuronx, tiny_model, smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=2)
    alone = [neuron_texts(model, smollm2_tokenizer, [p], max_new_tokens=12)[0][0] for p in PROMPTS[:2]]
    streams = [neuronx_stream_generator(model, smollm2_tokenizer, [p], max_new_tokens=12)
               for p in PROMPTS[:2]]
    results = {}
    threads = [threading.Thread(target=lambda i=i: results.update({i: collect(streams[i])[0][0]}))
               for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(SECONDS)
    assert [results[0], results[1]] == alone


# -- in the service ---------------------------------------------------------------------------


def test_the_service_serves_with_transformers_neuronx_when_asked(neuronx, tmp_path, tiny_model_dir):
    from test_service import body_json, init, load_entry_point, request, stream_lines, variant_dir

    directory = variant_dir(tmp_path, tiny_model_dir, "",
                            "option.stream_engine=transformers-neuronx\noption.tensor_parallel_degree=2\n"
                            "option.max_rolling_batch_size=2\noption.n_positions=64\n"
                            "option.compiled_graph_path=compiled\n")
    module = init(load_entry_point(directory), directory)
    service = module._service
    assert service.engine.name == "transformers-neuronx"
    assert isinstance(service.model, neuronx.StandInForSampling)
    assert [call[0] for call in service.model.calls] == ["to_neuron", "save"]
    assert [p.name for p in (directory / "compiled").iterdir()] == ["standin-graph.neff"]

    lines = stream_lines(request(module, {"inputs": ["Hello", "Name a primary colour."],
                                          "parameters": {"max_new_tokens": 5}}))
    assert 1 <= len(lines) <= 5
    assert service.model.sample_calls[-1]["input_ids"].shape[0] == 2

    too_long = request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 100}})
    assert too_long.code == 400
    assert body_json(too_long)["field"] == "parameters.max_new_tokens"
    assert "(option.n_positions) is 64" in body_json(too_long)["message"]

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
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from djl_stream import StreamingUtils
from djl_stream.engines.accelerate import encode_prompts
from djl_stream.engines.neuronx import (
    NeuronUnavailableError,
    import_transformers_neuronx,
    load_neuron_model,
    neuronx_stream_generator,
)
from djl_stream.loading import ModelLoadError
from djl_stream.properties import ModelProperties
from djl_stream.request import RequestError

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
    assert model.calls == [("to_neuron",)]  # no compiled_graph_path: compile, save nothing
    assert tokenizer.eos_token == "<|im_end|>"


def test_compiled_graphs_are_saved_then_reused_on_the_next_start(neuronx, tiny_model_dir, tmp_path):
    directory = tmp_path / "compiled"
    settings = props(tiny_model_dir, max_rolling_batch_size=2, n_positions=128,
                     compiled_graph_path=str(directory))
    first, _ = load_neuron_model(settings)
    assert first.calls == [("to_neuron",), ("save", str(directory))]
    assert any(directory.glob("*.neff"))

    second, _ = load_neuron_model(settings)
    assert second.calls == [("load", str(directory)), ("to_neuron",)]  # load first, no save


def test_a_relative_compiled_graph_path_is_in_the_model_directory(neuronx, tiny_model_dir, tmp_path):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    settings = props(model_dir, model_id=str(tiny_model_dir), max_rolling_batch_size=2,
                     n_positions=128, compiled_graph_path="compiled")
    model, _ = load_neuron_model(settings)
    assert model.calls[-1] == ("save", str(model_dir / "compiled"))


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
])
def test_options_the_neuron_sampler_lacks_are_refused(neuronx, tiny_model, smollm2_tokenizer,
                                                     parameters, field):
    model = compiled(neuronx, tiny_model, batch_size=1)
    with pytest.raises(RequestError) as refused:
        neuronx_stream_generator(model, smollm2_tokenizer, ["Hello"], **parameters)
    assert refused.value.field == field
    assert "not supported by the transformers-neuronx engine" in refused.value.message
    assert model.sample_calls == []


def test_options_that_change_nothing_in_greedy_mode_are_accepted(neuronx, tiny_model,
                                                                smollm2_tokenizer):
    model = compiled(neuronx, tiny_model, batch_size=1)
    plain, _ = neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=4)
    same, _ = neuron_texts(model, smollm2_tokenizer, ["Hello"], max_new_tokens=4, typical_p=0.5,
                           manual_seed=3, repetition_penalty=1.0)
    assert same == plain


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
    assert service.engine == "transformers-neuronx"
    assert isinstance(service.model, neuronx.StandInForSampling)
    assert service.model.calls == [("to_neuron",), ("save", str(directory / "compiled"))]

    lines = stream_lines(request(module, {"inputs": ["Hello", "Name a primary colour."],
                                          "parameters": {"max_new_tokens": 5}}))
    assert 1 <= len(lines) <= 5
    assert service.model.sample_calls[-1]["input_ids"].shape[0] == 2

    too_long = request(module, {"inputs": "Hello", "parameters": {"max_new_tokens": 100}})
    assert too_long.code == 400
    assert body_json(too_long)["field"] == "parameters.max_new_tokens"
    assert "(option.n_positions) is 64" in body_json(too_long)["message"]

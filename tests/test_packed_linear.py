"""Linear layers with weights reordered for oneDNN (:mod:`djl_stream.runtime.packed_linear`):
the product they compute, which layers a model gets, what a runner's load does with them
(and with their float weights, kept where memory allows), and what a compiled program
calls in their place."""

from __future__ import annotations

import copy

import pytest
import torch

from conftest import build_tiny_llama
from djl_stream.runtime import packed_linear
from djl_stream.runtime.packed_linear import (PackedLinear, float_weights_fit_twice, is_packed,
                                              keeps_float_weights, pack_linear_layers,
                                              pack_structure, packed_weights, packing_unavailable,
                                              weights_of)
from djl_stream.runtime.linear_layers import streaming_products
from djl_stream.runtime.runner import Feed, RunnerSettings, load_runner

needs_packing = pytest.mark.skipif(packing_unavailable() is not None,
                                   reason=f"no packed product here: {packing_unavailable()}")


@needs_packing
@pytest.mark.parametrize("leading", [(1,), (7,), (3, 5), (2, 0)])
@pytest.mark.parametrize("bias", [False, True])
def test_a_packed_layer_computes_the_linear_layer_it_replaced(bias, leading):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=bias)
    x = torch.randn(*leading, 96, generator=generator)
    with torch.inference_mode():
        expected = layer(x)
        packed = PackedLinear.from_linear(layer, index=0)
        out = packed(x)
    assert out.shape == (*leading, 40)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    assert packed.packed.is_mkldnn and packed.weight is None


@needs_packing
def test_a_model_keeps_one_copy_of_each_weight_and_its_tied_embedding():
    model = build_tiny_llama(64)
    linear = [m for m in model.modules() if type(m) is torch.nn.Linear]
    embedding = model.get_input_embeddings().weight
    assert model.lm_head.weight is embedding  # (tied)
    count = pack_linear_layers(model)
    assert count == len(linear) > 0
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert is_packed(model)
    # the packed layers hold no float weight; the embedding keeps its own
    names = [name for name, _ in model.named_parameters()]
    assert not any(name.endswith("proj.weight") for name in names)
    assert model.get_input_embeddings().weight is embedding
    # each layer has an index of its own, and packing again changes nothing
    indices = [m.index for m in model.modules() if isinstance(m, PackedLinear)]
    assert sorted(indices) == list(range(count))
    assert pack_linear_layers(model) == 0
    assert len(weights_of(model)) == count


@needs_packing
def test_packing_leaves_the_request_kv_bound_the_weights_set():
    # The bound is a share of the model's weights: packed weights, which are no
    # parameters, still count, and the tied LM head's packed copy does not count twice.
    from djl_stream.runtime.kv_memory import default_max_request_kv_tokens

    model = build_tiny_llama(64)
    before = default_max_request_kv_tokens(model, 1, 1)
    pack_linear_layers(model)
    assert model.lm_head.duplicates_a_weight
    assert not model.model.layers[0].mlp.up_proj.duplicates_a_weight
    assert default_max_request_kv_tokens(model, 1, 1) == before > 2


@needs_packing
def test_a_packed_model_computes_the_logits_of_the_float_one():
    model = build_tiny_llama(64)
    reference = copy.deepcopy(model)
    ids = torch.tensor([[3, 9, 4, 1, 7, 2]])
    pack_linear_layers(model)
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits,
                                   rtol=1e-4, atol=1e-4)


@needs_packing
def test_a_runner_on_a_cpu_packs_the_models_layers_and_decodes_what_the_float_model_does():
    model = build_tiny_llama(64)
    reference = copy.deepcopy(model)
    prompt = [5, 6, 7, 8]
    with torch.inference_mode():
        expected = reference.generate(torch.tensor([prompt]), max_new_tokens=8,
                                      do_sample=False)[0, len(prompt):].tolist()
    runner = load_runner(model, RunnerSettings(max_rows=2, max_positions=64))
    assert is_packed(model) and runner.path == "attention"
    handle = runner.reserve()
    tokens = []
    logits = runner.run([Feed(handle, prompt)])
    for _ in range(8):
        tokens.append(int(logits[0].argmax()))
        logits = runner.run([Feed(handle, tokens[-1:])])
    assert tokens == expected


@needs_packing
def test_the_programs_operator_reads_the_weights_its_caller_names_and_only_then():
    layer = torch.nn.Linear(16, 8, bias=True)
    packed = PackedLinear.from_linear(layer, index=0)
    x = torch.randn(3, 16)
    with torch.inference_mode():
        with pytest.raises(RuntimeError, match="outside packed_weights"):
            torch.ops.djl_stream.packed_linear(x, packed.bias, 0, 8)
        with packed_weights([packed.packed]):
            out = torch.ops.djl_stream.packed_linear(x, packed.bias, 0, 8)
        torch.testing.assert_close(out, layer(x), rtol=1e-5, atol=1e-5)


def test_a_structure_for_export_has_the_served_models_indices_without_weights():
    served, twin = build_tiny_llama(64), build_tiny_llama(64)
    if packing_unavailable() is None:
        pack_linear_layers(served)
        served_indices = {name: m.index for name, m in served.named_modules()
                          if isinstance(m, PackedLinear)}
    else:
        served_indices = None
    count = pack_structure(twin)
    twin_indices = {name: m.index for name, m in twin.named_modules()
                    if isinstance(m, PackedLinear)}
    assert count == len(twin_indices) > 0
    assert all(m.packed is None for m in twin.modules() if isinstance(m, PackedLinear))
    if served_indices is not None:
        assert twin_indices == served_indices


@needs_packing
def test_a_packed_model_saves_a_checkpoint_that_loads_as_the_float_model(tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_tiny_llama(64)
    ids = torch.tensor([[3, 9, 4, 1, 7, 2]])
    with torch.inference_mode():
        expected = model(ids).logits
    pack_linear_layers(model)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    assert not is_packed(loaded)
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@needs_packing
def test_prefill_pacing_counts_a_packed_models_weights_as_the_float_ones():
    from djl_stream.generation.prefill_pacing import attention_parity_context

    model = build_tiny_llama(500)
    before = attention_parity_context(model)
    pack_linear_layers(model)
    assert attention_parity_context(model) == before < float("inf")


@needs_packing
def test_packing_lets_go_of_the_checkpoints_memory_mapping(tmp_path):
    from transformers import AutoModelForCausalLM

    build_tiny_llama(64).save_pretrained(tmp_path)
    weights = str(tmp_path / "model.safetensors")

    def mapped() -> bool:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            return weights in maps.read()

    model = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    if not mapped():
        pytest.skip("this transformers reads checkpoints into memory: no mapping to let go of")
    pack_linear_layers(model)
    assert not mapped()  # (its pages would stay resident beside the packed copies)
    ids = torch.tensor([[3, 9, 4]])
    with torch.inference_mode():
        assert model(ids).logits.shape == (1, 3, 64)


@needs_packing
def test_a_layer_that_keeps_its_float_weight_holds_the_parameter_itself_and_saves_it_once(
        tmp_path):
    from transformers import AutoModelForCausalLM

    model = build_tiny_llama(64)
    embedding = model.get_input_embeddings().weight
    up = model.model.layers[0].mlp.up_proj.weight
    ids = torch.tensor([[3, 9, 4, 1, 7, 2]])
    with torch.inference_mode():
        expected = model(ids).logits
    pack_linear_layers(model, keep_float_weights=True)
    assert keeps_float_weights(model)
    assert model.model.layers[0].mlp.up_proj.weight is up   # (the same parameter, no copy)
    assert model.lm_head.weight is embedding                 # (still tied)
    assert model.model.layers[0].mlp.up_proj.packed.is_mkldnn
    with torch.inference_mode():
        torch.testing.assert_close(model(ids).logits, expected, rtol=1e-4, atol=1e-4)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    with torch.inference_mode():
        torch.testing.assert_close(loaded(ids).logits, expected, rtol=1e-5, atol=1e-5)


@needs_packing
def test_weights_kept_beside_their_packed_copies_count_once_for_the_kv_bound_and_pacing():
    from djl_stream.generation.prefill_pacing import attention_parity_context
    from djl_stream.runtime.kv_memory import default_max_request_kv_tokens

    model = build_tiny_llama(500)
    bound, parity = default_max_request_kv_tokens(model, 1, 1), attention_parity_context(model)
    pack_linear_layers(model, keep_float_weights=True)
    assert default_max_request_kv_tokens(model, 1, 1) == bound > 2
    assert attention_parity_context(model) == parity < float("inf")


@needs_packing
@pytest.mark.parametrize("available, kept", [(1 << 40, True), (1 << 10, False), (None, False)])
def test_a_runner_keeps_the_float_weights_only_where_both_copies_fit_in_half_the_memory(
        monkeypatch, available, kept):
    monkeypatch.setattr(packed_linear, "available_memory", lambda: available)
    model = build_tiny_llama(64)
    load_runner(model, RunnerSettings(max_rows=2, max_positions=64))
    assert is_packed(model) and keeps_float_weights(model) == kept


def test_the_memory_rule_counts_the_linear_weights_twice_against_half_the_memory():
    model = build_tiny_llama(64)
    weights = sum(m.weight.numel() * 4 for m in model.modules() if type(m) is torch.nn.Linear)
    # (the tied LM head's weight is counted: its packed copy is one more copy)
    assert float_weights_fit_twice(model, available=4 * weights)
    assert not float_weights_fit_twice(model, available=4 * weights - 4)


def _compiled_graph_ops(module, x):
    """``module(x)`` compiled, and the names of the operators its traced graph calls."""
    ops = []

    def recording(graph_module, example_inputs):
        ops.extend(str(node.target) for node in graph_module.graph.nodes
                   if node.op == "call_function")
        return graph_module.forward

    torch._dynamo.reset()
    try:
        return torch.compile(module, backend=recording)(x), ops
    finally:
        torch._dynamo.reset()


@needs_packing
def test_a_compiled_layer_streams_its_float_weight_only_inside_streaming_products():
    layer = torch.nn.Linear(32, 24, bias=True)
    kept = PackedLinear.from_linear(layer, index=0, keep_float_weight=True)
    x = torch.randn(3, 32)
    with torch.inference_mode():
        expected = layer(x)
        with streaming_products():
            streamed, streamed_ops = _compiled_graph_ops(kept, x)
        with packed_weights([kept.packed]):
            packed, packed_ops = _compiled_graph_ops(kept, x)
    assert not any("packed_linear" in op for op in streamed_ops)
    assert any("packed_linear" in op for op in packed_ops)
    torch.testing.assert_close(streamed, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed, expected, rtol=1e-5, atol=1e-5)

"""int8 linear layers (``option.quantize=w8a8``): the arithmetic they do, that a row's result
never depends on its batch mates, which layers a model gets, and loading, the Llama decode
step and greedy text through them, on this CPU with PyTorch's own integer product."""

from __future__ import annotations

import pytest
import torch

from conftest import build_tiny_llama, greedy_in_one_batch
from djl_stream.generation import int8_linear, llama_decode
from djl_stream.runtime.int8 import (Int8Linear, int8_matmul_unavailable,
                                               quantize_linear_layers, quantize_rows)
from djl_stream.runtime.loading import ModelLoadError, load_model_and_tokenizer
from djl_stream.serving.properties import ModelProperties

pytestmark = pytest.mark.skipif(int8_matmul_unavailable() is not None,
                                reason=f"no int8 product here: {int8_matmul_unavailable()}")

PROMPTS = ["The capital of France is", "Once upon a time, in a land far away, there lived",
           "1, 2, 3,"]


@pytest.mark.parametrize("leading", [(1,), (6,), (3, 4)])
@pytest.mark.parametrize("bias", [False, True])
def test_an_int8_layer_multiplies_the_rounded_weight_by_the_rounded_rows(bias, leading):
    generator = torch.Generator().manual_seed(0)
    layer = torch.nn.Linear(96, 40, bias=bias)
    quantized = Int8Linear.from_linear(layer)
    x = torch.randn(*leading, 96, generator=generator)
    with torch.inference_mode():
        out = quantized(x)
        assert out.shape == (*leading, 40) and out.dtype == torch.float32
        # exactly: weight and each input row rounded to int8 with a scale of their own
        weight_q, weight_scale = quantize_rows(layer.weight)
        rows_q, row_scale = quantize_rows(x.reshape(-1, 96))
        expected = ((rows_q.double() @ weight_q.double().t())
                    * row_scale.double()[:, None] * weight_scale.double())
        if bias:
            expected += layer.bias.double()
        torch.testing.assert_close(out.reshape(-1, 40).double(), expected, rtol=1e-6, atol=1e-6)
        # and that is close to the float32 layer, not equal to it
        reference = layer(x)
        error = float((out - reference).abs().max() / reference.abs().max())
        assert 0 < error < 0.03
    assert quantized.weight.dtype == torch.int8 and quantized.weight.shape == (40, 96)
    assert quantized(torch.randn(2, 0, 96)).shape == (2, 0, 40)  # no rows: no error


def test_a_row_s_result_does_not_depend_on_its_batch_mates():
    torch.manual_seed(1)
    quantized = Int8Linear.from_linear(torch.nn.Linear(256, 64, bias=False))
    rows = torch.randn(9, 256)
    rows[4] *= 50  # a batch mate with far larger values: a per-tensor scale would shift
    with torch.inference_mode():
        together = quantized(rows)
        for i in range(len(rows)):
            assert torch.equal(quantized(rows[i:i + 1])[0], together[i])


def test_every_linear_of_the_tiny_llama_becomes_int8_and_the_tied_head_is_a_copy(
        smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    embedding = model.get_input_embeddings().weight.detach().clone()
    linears = sum(type(m) is torch.nn.Linear for m in model.modules())
    assert quantize_linear_layers(model) == linears == 2 * 7 + 1
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear)
    # the input embedding keeps its float32 rows; the head's int8 weight is a copy of them
    assert torch.equal(model.get_input_embeddings().weight, embedding)
    assert model.lm_head.weight.duplicates_a_weight
    assert not model.model.layers[0].mlp.up_proj.weight.duplicates_a_weight


def test_batching_does_not_change_a_request_s_int8_text(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    quantize_linear_layers(model)
    together = greedy_in_one_batch(model, smollm2_tokenizer, PROMPTS)
    alone = [greedy_in_one_batch(model, smollm2_tokenizer, [p])[0] for p in PROMPTS]
    assert together == alone


def _parameter_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def test_fused_projections_compute_what_the_separate_ones_did_and_add_no_memory(
        smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    quantize_linear_layers(model)
    layer = model.model.layers[0]
    x = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    attention, mlp = layer.self_attn, layer.mlp
    with torch.inference_mode():
        before = {name: getattr(part, name)(x) for part, names in
                  ((attention, ("q_proj", "k_proj", "v_proj")), (mlp, ("gate_proj", "up_proj")))
                  for name in names}
    size = _parameter_bytes(model)
    assert llama_decode.fuse_int8_projections(model) == 2 * 2  # two layers, two products each
    projections = llama_decode._projections_of(layer)
    assert sorted(projections) == ["down", "gate_up", "o", "qkv"]
    with torch.inference_mode():
        # one product, the same numbers bit for bit (exact integer sums, the same scales)
        assert torch.equal(projections["qkv"](x), torch.cat(
            [before["q_proj"], before["k_proj"], before["v_proj"]], dim=-1))
        assert torch.equal(projections["gate_up"](x),
                           torch.cat([before["gate_proj"], before["up_proj"]], dim=-1))
        # the model's own layers (its forward, a prompt's prefill) compute as before...
        for name, expected in before.items():
            part = attention if name in ("q_proj", "k_proj", "v_proj") else mlp
            assert torch.equal(getattr(part, name)(x), expected), name
    # ...from their rows of the fused weights: no memory added
    fused_storage = projections["qkv"].weight.untyped_storage().data_ptr()
    assert attention.k_proj.weight.untyped_storage().data_ptr() == fused_storage
    assert _parameter_bytes(model) == size
    assert llama_decode.fuse_int8_projections(model) == 0  # once is enough


def test_layers_with_a_bias_or_of_another_width_are_not_fused():
    torch.manual_seed(0)
    plain = Int8Linear.from_linear(torch.nn.Linear(16, 8, bias=False))
    biased = Int8Linear.from_linear(torch.nn.Linear(16, 8, bias=True))
    wider = Int8Linear.from_linear(torch.nn.Linear(32, 8, bias=False))
    weight = plain.weight
    assert int8_linear.fuse([plain, biased]) is None
    assert int8_linear.fuse([plain, wider]) is None
    assert int8_linear.fuse([plain]) is None
    assert int8_linear.fuse([plain, torch.nn.Linear(16, 8, bias=False)]) is None
    assert plain.weight is weight  # left alone


def test_the_fused_step_gives_the_tokens_and_logits_of_the_separate_products(smollm2_tokenizer):
    model = build_tiny_llama(len(smollm2_tokenizer), seed=3)
    quantize_linear_layers(model)
    assert llama_decode.attach(model, smollm2_tokenizer) is not None
    separate = greedy_in_one_batch(model, smollm2_tokenizer, PROMPTS)
    assert llama_decode.fuse_int8_projections(model) == 4
    # attached again, as a load attaches after quantizing: the step reads the fused products
    step = llama_decode.attach(model, smollm2_tokenizer)
    assert step is not None and all("qkv" in layer and "q" not in layer for layer in step.layers)
    assert greedy_in_one_batch(model, smollm2_tokenizer, PROMPTS) == separate
    assert [greedy_in_one_batch(model, smollm2_tokenizer, [p])[0] for p in PROMPTS] == separate


def load(directory, **options):
    return load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(directory), **options}))


def test_option_quantize_w8a8_loads_int8_layers_and_the_llama_step_runs_them(tiny_model_dir):
    model, tokenizer = load(tiny_model_dir, quantize="w8a8")
    assert all(isinstance(m, Int8Linear) for name, m in model.named_modules()
               if name.endswith(("_proj", "lm_head")))
    step = llama_decode.step_of(model)
    assert step is not None  # checked at load against the (int8) forward on probes
    # the step multiplies query, key and value as one product, gate and up as another
    assert all(sorted(name for name in layer if name in llama_decode._PROJECTION_NAMES)
               == ["down", "gate_up", "o", "qkv"] for layer in step.layers)
    float32, _ = load(tiny_model_dir, decode_step="forward")
    with torch.inference_mode():
        ids = torch.tensor([[1, 400, 401, 402, 403]])
        ours, theirs = model(ids).logits[0, -1], float32(ids).logits[0, -1]
    assert torch.nn.functional.cosine_similarity(ours, theirs, dim=0) > 0.99
    assert not torch.equal(ours, theirs)  # it did quantize
    # through the step, batched and alone
    together = greedy_in_one_batch(model, tokenizer, PROMPTS)
    assert together == [greedy_in_one_batch(model, tokenizer, [p])[0] for p in PROMPTS]


def test_w8a8_without_an_int8_product_is_a_load_error_that_says_why(monkeypatch, tiny_model_dir):
    # This PyTorch has torch._int_mm; take it away to see what a user without it gets.
    monkeypatch.delattr(torch, "_int_mm")
    assert "no torch._int_mm" in int8_linear.int8_matmul_unavailable()
    with pytest.raises(ModelLoadError, match="option.quantize=w8a8: no linear layer could be "
                                             "quantized: this PyTorch has no torch._int_mm"):
        load(tiny_model_dir, quantize="w8a8")

"""Quantized weights (``option.quantize``), loaded as a server loads them: djl-stream's own
int8 weight-only layers on this CPU (torchao's on a GPU), and bitsandbytes' CPU kernels
(its CUDA path cannot run here: the arguments it gets there are checked against
transformers' own ``BitsAndBytesConfig``)."""

from __future__ import annotations

import sys

import pytest
import torch

from djl_stream.runtime.int8 import Int8WeightOnlyLinear, int8_matmul_unavailable
from djl_stream.runtime.loading import ModelLoadError, load_model_and_tokenizer
from djl_stream.runtime.quantization import QuantizationUnavailable, quantization_kwargs
from djl_stream.serving.properties import ModelProperties

IDS = torch.tensor([[1, 400, 401, 402, 403]])


def load(directory, **options):
    return load_model_and_tokenizer(ModelProperties.from_init_properties(
        {"model_dir": str(directory), **options}))[0]


def last_logits(model):
    with torch.inference_mode():
        return model(IDS.to(model.device)).logits[0, -1].float().cpu()


@pytest.fixture(scope="module")
def float32_logits(tiny_model_dir):
    return last_logits(load(tiny_model_dir))


def test_int8_stores_every_decoder_weight_as_int8_and_computes_nearly_the_same(
        tiny_model_dir, float32_logits):
    model = load(tiny_model_dir, quantize="int8")
    projections = [m for name, m in model.named_modules() if name.endswith(("_proj"))]
    assert len(projections) == 2 * 7
    if model.device.type == "cpu":
        # djl-stream's own weight-only layers, the tied LM head quantized as a copy (the
        # input embedding keeps its float32 rows)
        assert all(type(m) is Int8WeightOnlyLinear for m in projections + [model.lm_head])
        assert all(m.weight.dtype == torch.int8 for m in projections + [model.lm_head])
        assert model.lm_head.weight.duplicates_a_weight
        assert model.model.embed_tokens.weight.dtype == torch.float32
    else:  # (this file runs on GPUs too: torchao's there)
        assert all(m.weight.qdata.dtype == torch.int8 for m in projections)
    logits = last_logits(model)
    assert torch.nn.functional.cosine_similarity(logits, float32_logits, dim=0) > 0.999
    assert not torch.equal(logits, float32_logits)  # it did quantize


def test_bitsandbytes8_on_a_cpu_runs_bitsandbytes_own_layers(tiny_model_dir, float32_logits):
    bitsandbytes = pytest.importorskip("bitsandbytes")
    model = load(tiny_model_dir, load_in_8bit="true")  # djl-serving's deprecated spelling
    assert isinstance(model.model.layers[0].self_attn.q_proj, bitsandbytes.nn.Linear8bitLt)
    logits = last_logits(model)
    assert torch.nn.functional.cosine_similarity(logits, float32_logits, dim=0) > 0.99


def test_on_cuda_bitsandbytes_gets_the_configuration_transformers_documents():
    # Contract only: no GPU here. What from_pretrained receives for each method.
    pytest.importorskip("bitsandbytes")
    eight = quantization_kwargs("bitsandbytes8", on_gpu=True)["quantization_config"]
    assert eight.load_in_8bit and not eight.load_in_4bit
    four = quantization_kwargs("bitsandbytes4", on_gpu=True,
                               compute_dtype=torch.float16)["quantization_config"]
    assert four.load_in_4bit and four.bnb_4bit_quant_type == "nf4"
    assert four.bnb_4bit_compute_dtype == torch.float16


def test_a_missing_library_is_a_load_error_that_says_what_to_install(monkeypatch, tiny_model_dir):
    monkeypatch.setitem(sys.modules, "torchao", None)  # import torchao now raises ImportError
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)
    # on a GPU int8 is torchao's (contract only: no GPU here); on a CPU djl-stream's own
    with pytest.raises(QuantizationUnavailable,
                       match="option.quantize=int8 needs torchao: pip install torchao"):
        quantization_kwargs("int8", on_gpu=True)
    # a CPU's load, on a machine with a GPU too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = load(tiny_model_dir, quantize="int8")
    assert type(model.lm_head) is Int8WeightOnlyLinear


def test_on_cuda_w8a8_serves_torchao_s_int8_weight_only_config_and_says_so(caplog):
    # Contract only: no GPU here. On a CPU w8a8 is djl-stream's own layers (test_int8).
    # On an H100 torchao's dynamic-activation config decoded at 0.03x bfloat16 (eagerly, a
    # host sync per input feature), weight-only int8 at 0.84x: a GPU gets the latter.
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig
    from transformers import TorchAoConfig

    config = quantization_kwargs("w8a8", on_gpu=True)["quantization_config"]
    assert isinstance(config, TorchAoConfig)
    assert isinstance(config.quant_type, Int8WeightOnlyConfig)
    assert "option.quantize=w8a8 on a GPU: serving int8 weight-only weights" in caplog.text
    assert quantization_kwargs("w8a8", on_gpu=False) == {}


@pytest.mark.skipif(int8_matmul_unavailable() is not None,
                    reason=f"w8a8's int8 layers need torch._int_mm: {int8_matmul_unavailable()}")
@pytest.mark.parametrize("flags,layer", [("fpu sse2 avx2 fma", "Int8WeightOnlyLinear"),
                                         ("fpu avx2 avx512f avx512_vnni", "Int8Linear"),
                                         ("fpu avx2 avx_vnni", "Int8Linear")])
def test_w8a8_on_a_cpu_without_int8_dot_products_serves_int8_and_says_why(
        tiny_model_dir, tmp_path, monkeypatch, caplog, flags, layer):
    # (PyTorch's integer product runs at about a scalar loop's speed without them: w8a8
    # decoded slower than float32 at every batch size on a 2-core AVX2 EPYC)
    from djl_stream.runtime import quantization

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    reads = quantization.lacks_int8_dot_products
    monkeypatch.setattr(quantization, "lacks_int8_dot_products", lambda: reads(str(cpuinfo)))
    # a CPU's load, on a machine with a GPU too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = load(tiny_model_dir, quantize="w8a8")
    assert {type(m).__name__ for name, m in model.named_modules()
            if name.endswith(("_proj", "lm_head"))} == {layer}
    warned = "without int8 dot-product instructions" in caplog.text
    assert warned == (layer == "Int8WeightOnlyLinear")


@pytest.mark.parametrize("flags,warned", [("fpu sse2 avx2 fma", True),
                                          ("fpu avx2 avx512f avx512_bf16", False),
                                          ("fpu avx2 amx_bf16 amx_tile", False)])
def test_bf16_on_a_cpu_without_bfloat16_arithmetic_says_float32_serves_many_clients_faster(
        tiny_model_dir, tmp_path, monkeypatch, caplog, flags, warned):
    # (a step of sixteen rows took several times float32's on a 2-core AVX2 EPYC)
    from djl_stream.runtime import cpu_info, loading

    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    monkeypatch.setattr(loading, "lacks_x86_flags",
                        lambda wanted: cpu_info.lacks_x86_flags(wanted, str(cpuinfo)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    model = load(tiny_model_dir, dtype="bf16")
    assert next(model.parameters()).dtype == torch.bfloat16
    assert ("without bfloat16 arithmetic" in caplog.text) == warned
    caplog.clear()
    load(tiny_model_dir)  # (float32: nothing to say)
    assert "without bfloat16 arithmetic" not in caplog.text


def test_a_cpu_whose_flags_cannot_be_read_is_not_judged(tmp_path):
    from djl_stream.runtime.quantization import lacks_int8_dot_products

    assert not lacks_int8_dot_products(str(tmp_path / "absent"))
    (tmp_path / "arm").write_text("processor\t: 0\nFeatures\t: fp asimd asimddp\n")
    assert not lacks_int8_dot_products(str(tmp_path / "arm"))


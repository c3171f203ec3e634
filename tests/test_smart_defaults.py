"""The Neuron image's smart defaults: the port in djl_stream.shipping.smart_defaults against values
worked out by hand from ``NeuronSmartDefaultUtils.java`` (0.30.0-dlc).

``conformance/test_smart_defaults_java.py`` runs the real Java and compares many more cases.
"""

from __future__ import annotations

from djl_stream.shipping.smart_defaults import ModelShape, neuron_smart_defaults

SMOLLM2_135M = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                "hidden_size": 576, "intermediate_size": 1536, "max_position_embeddings": 8192,
                "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
                "vocab_size": 49152}
LLAMA_3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
              "hidden_size": 4096, "intermediate_size": 14336, "max_position_embeddings": 8192,
              "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8,
              "vocab_size": 128256}
LLAMA_2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
               "hidden_size": 8192, "intermediate_size": 28672, "max_position_embeddings": 4096,
               "num_attention_heads": 64, "num_hidden_layers": 80, "num_key_value_heads": 8,
               "vocab_size": 32000}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 768,
        "hidden_size": 768, "max_position_embeddings": 1024, "num_hidden_layers": 12,
        "vocab_size": 50257}


def test_the_embedded_model_on_an_inf2_xlarge() -> None:
    # n_positions = min(8192, 4096). Model: 150,436,800 "parameters" by LmiUtils' Llama
    # formula, 0.30 GB at 2 bytes; a 4096-token sequence 0.125 GB. Each single core (16 GB)
    # fits 32 sequences (the cap), twice over on two cores: TP 1 beats TP 2.
    assert ModelShape.from_config(SMOLLM2_135M).parameters == 150_436_800
    assert neuron_smart_defaults(SMOLLM2_135M, {}, neuron_cores=2) == {
        "n_positions": "4096", "tensor_parallel_degree": "1", "max_rolling_batch_size": "32"}


def test_options_that_are_set_are_kept() -> None:
    assert neuron_smart_defaults(SMOLLM2_135M, {"n_positions": "2048",
                                                "tensor_parallel_degree": "1",
                                                "max_rolling_batch_size": "4"}, 2) == {}
    assert neuron_smart_defaults(SMOLLM2_135M, {"tensor_parallel_degree": "max"}, 2) == {
        "n_positions": "4096", "tensor_parallel_degree": "2", "max_rolling_batch_size": "32"}


def test_a_big_model_is_sharded_over_enough_cores() -> None:
    # 70B at 2 bytes is ~139 GB: 10 cores' worth, so only the 12- and 24-core configurations
    # (those above 8 are the instance's whole count) can hold it.
    assert neuron_smart_defaults(LLAMA_2_70B, {}, neuron_cores=24)["tensor_parallel_degree"] == "24"


def test_nothing_is_added_for_other_architectures_or_without_max_positions() -> None:
    assert neuron_smart_defaults({**SMOLLM2_135M, "architectures": ["BertModel"]}, {}, 2) == {}
    no_positions = {k: v for k, v in SMOLLM2_135M.items() if k != "max_position_embeddings"}
    assert neuron_smart_defaults(no_positions, {}, 2) == {}

"""Tiny random-weight models of the architectures users bring, built from a config.

Each is the architecture's own transformers class with two or three layers, small
widths, and the settings that make it what it is (grouped key/value heads, a sliding
window shorter than the test prompts, attention biases, soft-capping, alternating
sliding layers, learned positions, experts, a window its masks apply, decoder layers
that drop the forward's keyword arguments). They are made in float64 by default: random
weights give logits whose two highest values can lie within float32's rounding of each
other, and a greedy choice between them would flip on the order of a sum, not on a bug.

Example::

    model = build("mistral", vocab_size=len(tokenizer))
"""

from __future__ import annotations

from typing import Callable, Dict

import torch

#: The sliding window of the windowed tiny models: shorter than the prompts the tests send.
WINDOW = 6


def _configs(vocab: int) -> Dict[str, Callable]:
    import transformers as t

    common = dict(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                  num_attention_heads=4, max_position_embeddings=512, bos_token_id=1,
                  eos_token_id=2, pad_token_id=0)
    return {
        "llama": lambda: t.LlamaConfig(num_key_value_heads=2, **common),
        "mistral": lambda: t.MistralConfig(num_key_value_heads=2, sliding_window=WINDOW, **common),
        "qwen2": lambda: t.Qwen2Config(num_key_value_heads=2, **common),
        "phi3": lambda: t.Phi3Config(num_key_value_heads=2, sliding_window=None, **common),
        "gemma2": lambda: t.Gemma2Config(num_key_value_heads=2, head_dim=16, sliding_window=WINDOW,
                                         attn_logit_softcapping=50.0,
                                         final_logit_softcapping=30.0, **common),
        "gpt2": lambda: t.GPT2Config(vocab_size=vocab, n_embd=64, n_layer=3, n_head=4,
                                     n_positions=512, bos_token_id=1, eos_token_id=2),
        "gpt_neox": lambda: t.GPTNeoXConfig(vocab_size=vocab, hidden_size=64, intermediate_size=96,
                                            num_hidden_layers=3, num_attention_heads=4,
                                            max_position_embeddings=512, bos_token_id=1,
                                            eos_token_id=2),
        "opt": lambda: t.OPTConfig(vocab_size=vocab, hidden_size=64, ffn_dim=96, num_hidden_layers=3,
                                   num_attention_heads=4, max_position_embeddings=512,
                                   word_embed_proj_dim=64, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0),
        "mixtral": lambda: t.MixtralConfig(num_key_value_heads=2, num_local_experts=4,
                                           num_experts_per_tok=2, sliding_window=WINDOW, **common),
        # (its own attention code before transformers 5.25, the interface since)
        "falcon": lambda: t.FalconConfig(vocab_size=vocab, hidden_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, new_decoder_architecture=True,
                                         num_kv_heads=2, bos_token_id=1, eos_token_id=2),
        # (its decoder layers call attention without the forward's keyword arguments)
        "stablelm": lambda: t.StableLmConfig(num_key_value_heads=2, **common),
        # (alternating sliding layers that its masks apply: its attention is not told)
        "qwen2_moe": lambda: t.Qwen2MoeConfig(num_key_value_heads=2, num_experts=4,
                                              num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48,
                                              use_sliding_window=True, sliding_window=WINDOW,
                                              max_window_layers=3, **common),
        # (attention sinks, alternating sliding layers, experts: run one by one, as
        # PyTorch's grouped product of its transposed expert weights takes no float64)
        "gpt_oss": lambda: t.GptOssConfig(num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                          num_experts_per_tok=2, sliding_window=WINDOW,
                                          experts_implementation="eager",
                                          layer_types=["sliding_attention", "full_attention",
                                                       "sliding_attention"], **common),
    }


#: The architectures the generality suite runs, each name a key of :func:`build`.
ARCHITECTURES = tuple(_configs(64))


def build(name: str, vocab_size: int = 256, *, dtype: torch.dtype = torch.float64,
          seed: int = 0):
    """A tiny ``name`` model (see :data:`ARCHITECTURES`) with random weights, in eval mode."""
    from transformers import AutoModelForCausalLM

    config = _configs(vocab_size)[name]()
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()

"""The model runner: one forward pass over any mix of feeds, and the probe that chooses it."""

from __future__ import annotations

import logging

import pytest
import torch
import transformers

from architectures import build
from djl_stream.runtime.runner import Feed, ForwardRunner, RunnerSettings, load_runner
from generality import concurrent_streams, solo_references

SETTINGS = RunnerSettings(max_rows=6, max_positions=128)


def logits_alone(model, tokens):
    with torch.inference_mode():
        return model(input_ids=torch.tensor([tokens])).logits[0, -1]


def test_feeds_of_any_mix_get_the_logits_each_would_get_alone():
    model = build("llama")
    runner = load_runner(model, SETTINGS)
    a, b, c = runner.reserve(), runner.reserve(), runner.reserve()
    prompts = {a: [5, 6, 7, 8], b: [9, 10], c: [11, 12, 13, 14, 15, 16]}
    # c's prompt in two parts, the second beside a's and b's first decode tokens
    runner.run([Feed(b, prompts[b]), Feed(a, prompts[a]), Feed(c, prompts[c][:3], logits=False)])
    logits = runner.run([Feed(c, prompts[c][3:]), Feed(a, [20]), Feed(b, [21])])
    expected = [logits_alone(model, prompts[c]), logits_alone(model, prompts[a] + [20]),
                logits_alone(model, prompts[b] + [21])]
    assert torch.allclose(logits, torch.stack(expected), atol=1e-9)
    assert [runner.length(h) for h in (a, b, c)] == [5, 3, 6]


def test_a_pass_that_raises_grows_no_cache_and_can_be_run_again():
    model = build("qwen2")
    runner = load_runner(model, SETTINGS)
    row = runner.reserve()
    runner.run([Feed(row, [3, 4, 5])])

    def fail(module, args):
        raise RuntimeError("simulated failure")

    hook = model.model.layers[-1].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError):
        runner.run([Feed(row, [6])])
    hook.remove()
    assert runner.length(row) == 3
    assert torch.allclose(runner.run([Feed(row, [6])])[0], logits_alone(model, [3, 4, 5, 6]),
                          atol=1e-9)


def test_rows_of_a_decode_step_are_gathered_when_one_leaves():
    model = build("mistral")
    runner = load_runner(model, SETTINGS)
    rows = [runner.reserve() for _ in range(4)]
    prompts = [[3 + i, 4 + i, 5 + i, 6 + i, 7 + i, 8 + i, 9 + i] for i in range(4)]
    runner.run([Feed(h, p) for h, p in zip(rows, prompts)])
    runner.release(rows[1])  # a hole among the rows: the last one moves into it
    kept = [rows[0], rows[2], rows[3]]
    logits = runner.run([Feed(h, [30]) for h in kept])
    expected = [logits_alone(model, prompts[i] + [30]) for i in (0, 2, 3)]
    assert torch.allclose(logits, torch.stack(expected), atol=1e-9)
    assert sorted(runner.cache.row_of(h) for h in kept) == [0, 1, 2]


def test_the_model_keeps_its_own_generate_after_the_runner_adopted_it(smollm2_tokenizer):
    model = build("gemma2", vocab_size=len(smollm2_tokenizer))
    before = solo_references(model, smollm2_tokenizer, ["Hello there, general"])
    load_runner(model, SETTINGS)
    assert model.config._attn_implementation.startswith("djl_stream:")
    assert solo_references(model, smollm2_tokenizer, ["Hello there, general"]) == before


@pytest.mark.parametrize("config", [
    # (models whose own attention code transformers has kept: Falcon's went through the
    # interface from transformers 5.25 on, and takes the fast path since)
    transformers.MptConfig(vocab_size=49152, d_model=64, n_layers=2, n_heads=4,
                           max_seq_len=256),
    transformers.BloomConfig(vocab_size=49152, hidden_size=64, n_layer=2, n_head=4),
    # (no attention at all: a recurrent state, which its forward takes as ``state``)
    transformers.RwkvConfig(vocab_size=49152, hidden_size=64, num_hidden_layers=2,
                            attention_hidden_size=64, intermediate_size=96, context_length=256),
], ids=["mpt", "bloom", "rwkv"])
def test_a_model_whose_attention_skips_the_interface_runs_its_forward_correctly(
        config, smollm2_tokenizer, caplog):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    references = solo_references(model, smollm2_tokenizer)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime.runner"):
        runner = load_runner(model, SETTINGS)
    assert isinstance(runner, ForwardRunner) and not runner.mixes_passes
    assert "attention interface" in runner.reason
    assert any(runner.reason in record.getMessage() for record in caplog.records)
    assert concurrent_streams(model, smollm2_tokenizer) == references


def test_layers_that_drop_the_forward_s_keyword_arguments_still_get_the_layout(
        smollm2_tokenizer, monkeypatch, caplog):
    # StableLM's decoder layers call their attention with arguments of their own only: the
    # layout reaches it as the thread's pass, and a pass whose layers did not read it (the
    # forward run without one) is caught by counting the layers that did
    from djl_stream.runtime import attention, runner as runner_module

    config = transformers.StableLmConfig(vocab_size=49152, hidden_size=64,
                                         intermediate_size=96, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    references = solo_references(model, smollm2_tokenizer)
    assert load_runner(model, SETTINGS).path == "attention"
    assert concurrent_streams(model, smollm2_tokenizer) == references

    attention.restore_attention(model)
    monkeypatch.setattr(runner_module, "forward_with_layout",
                        lambda model, layout, **kwargs: model(**kwargs))
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime.runner"):
        runner = load_runner(model, SETTINGS)
    assert runner.path == "forward"
    assert "2 of its 2 layers attended without the KV cache's layout" in runner.reason
    assert any(runner.reason in record.getMessage() for record in caplog.records)


def test_a_hybrid_model_runs_its_forward_and_names_the_layers_that_keep_their_own_state(
        smollm2_tokenizer, caplog):
    # LFM2 attends in some layers and convolves in the others, whose state no KV cache row
    # holds: its own forward serves it, exactly, and the load log says why
    config = transformers.Lfm2Config(vocab_size=49152, hidden_size=64, intermediate_size=96,
                                     num_hidden_layers=3, num_attention_heads=4,
                                     num_key_value_heads=2, full_attn_idxs=[1])
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float64).eval()
    references = solo_references(model, smollm2_tokenizer)
    with caplog.at_level(logging.INFO, logger="djl_stream.runtime.runner"):
        runner = load_runner(model, SETTINGS)
    assert runner.path == "forward"
    assert runner.reason.startswith("2 of its 3 layers (conv) keep a state of their own")
    assert any(runner.reason in record.getMessage() for record in caplog.records)
    assert concurrent_streams(model, smollm2_tokenizer) == references


def test_a_model_with_a_state_space_mixer_beside_attention_in_every_layer_runs_its_forward():
    # Falcon-H1's layers each attend and run a state-space mixer too: every layer calls
    # attention, and a few probe tokens of random weights may not show the state lost, so
    # the cache transformers lays out for its config says so first
    config = transformers.FalconH1Config(vocab_size=256, hidden_size=64, intermediate_size=96,
                                         num_hidden_layers=2, num_attention_heads=4,
                                         num_key_value_heads=2, head_dim=16, mamba_d_ssm=64,
                                         mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    runner = load_runner(model, SETTINGS)
    assert runner.path == "forward"
    assert runner.reason.startswith("2 of its 2 layers (hybrid) keep a state of their own")


def test_a_model_whose_logits_differ_through_the_cache_runs_its_forward(monkeypatch):
    from djl_stream.runtime import attention

    model = build("llama")
    real = attention.attend
    monkeypatch.setattr(attention, "attend",
                        lambda *args, **kwargs: real(*args, **kwargs) * 1.5)
    runner = load_runner(model, SETTINGS)
    assert runner.path == "forward"
    assert "differ" in runner.reason
    assert not model.config._attn_implementation.startswith("djl_stream:")


def test_a_runner_loaded_beside_a_running_one_leaves_its_passes_exact():
    # djl's one-call adapter loads a runner per call, so under djl-serving's async worker a
    # new call's probe (which runs the model through its own attention) can meet another
    # call's passes on the same model object
    import threading

    model = build("llama", dtype=torch.float32)
    runner = load_runner(model, RunnerSettings(max_rows=2, max_positions=256))
    stop = threading.Event()

    def load_runners():
        while not stop.is_set():
            load_runner(model, RunnerSettings(max_rows=2, max_positions=256))

    loader = threading.Thread(target=load_runners)
    loader.start()
    try:
        handle = runner.reserve()
        tokens = [3, 4, 5, 6]
        worst = 0.0
        runner.run([Feed(handle, tokens)])
        for step in range(60):
            token = 7 + step % 50
            logits = runner.run([Feed(handle, [token])])[0]
            tokens.append(token)
            worst = max(worst, float((logits - logits_alone(model, tokens)).abs().max()))
    finally:
        stop.set()
        loader.join()
    assert worst < 1e-4

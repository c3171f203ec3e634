"""Shared fixtures: the real SmolLM2 tokenizer and model directory, and a tiny random Llama
built from a config (with the real SmolLM2 tokenizer) for fast engine tests."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from djl_stream.generation.loading import read_grouped_heads_in_place

# The server reads grouped key/value heads in place on a CPU (see the function): the
# references these tests compute in this process with transformers' own generate() use the
# same attention kernels, whatever test loads a model first.
read_grouped_heads_in_place()

REPO = Path(__file__).resolve().parents[1]
# The embedded model's directory; its tokenizer serves the tiny models too. Where model/ was
# not set up (a GPU machine the weights cannot reach), benchmarks/on_a_gpu.sh points this at
# the model directory it serves, which holds the same tokenizer.
MODEL_DIR = Path(os.environ.get("DJL_STREAM_TEST_MODEL_DIR", REPO / "model"))


def _require_embedded_model() -> Path:
    from djl_stream.shipping.embedded import is_outdated

    if not (MODEL_DIR / "config.json").is_file():
        pytest.fail("the embedded model is missing from model/: run `make model` first")
    if MODEL_DIR == REPO / "model" and is_outdated(MODEL_DIR):  # (another is as it is)
        pytest.fail("model/ holds the embedded model in an outdated layout: run `make model`")
    return MODEL_DIR


@pytest.fixture(scope="session")
def embedded_model_dir() -> Path:
    """The repository's model/ directory, holding the converted SmolLM2-135M-Instruct."""
    return _require_embedded_model()


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer (ByteLevel BPE, eos ``<|im_end|>``)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(_require_embedded_model()))


def build_tiny_llama(vocab_size: int, seed: int = 0):
    """A 2-layer Llama with random weights: fast, deterministic, real transformers code."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config).eval()


class StepLogits:
    """Collects the logits the step attached to ``model`` (djl-stream's Llama decode step)
    returns; it does not call the model, so a forward hook would not see them."""

    def __init__(self, model, monkeypatch):
        from djl_stream.generation import llama_decode

        step = llama_decode.step_of(model)
        self.seen = []
        original = step.logits

        def recording(batch):
            logits = original(batch)
            self.seen.append(logits.clone())
            return logits

        monkeypatch.setattr(step, "logits", recording)


#: The seed of the tiny Llama whose one-row program the compiled-step tests share: one
#: compile per test session (about 15 s here), then loads from the session's cache.
COMPILED_SEED = 3


@pytest.fixture(scope="session")
def inductor_cache(tmp_path_factory) -> Path:
    """A TorchInductor cache directory of this test session's own (compiled programs are
    not taken from, or left in, the machine's)."""
    return tmp_path_factory.mktemp("inductor-cache")


@pytest.fixture(scope="session", autouse=True)
def _every_load_uses_the_session_s_inductor_cache(inductor_cache):
    """``TORCHINDUCTOR_CACHE_DIR`` set to the session's cache for the whole session, so that
    every load (in this process, and in the servers and workers tests start) compiles into
    and loads from it: on a CPU ``option.decode_step=auto`` compiles the Llama decode
    programs at the first load, and the machine's cache is its users' (the embedded model's
    programs are compiled once per session, about 90 s here, then loaded in seconds). It
    keeps every program: the tests' programs outnumber the count a cache keeps by default,
    and each one evicted would be compiled again by the next test that shares it."""
    from djl_stream.generation.compiled_decode import KEPT_ENTRIES_VARIABLE

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TORCHINDUCTOR_CACHE_DIR", str(inductor_cache))
        patch.setenv(KEPT_ENTRIES_VARIABLE, "0")
        yield


@pytest.fixture
def one_row_cache() -> Path:
    """The one-row programs' directory in the session's cache
    (:func:`_every_load_uses_the_session_s_inductor_cache`)."""
    from djl_stream.generation.compiled_decode import cache_root

    return cache_root()


def resident_bytes() -> int:
    """This process's resident memory, in bytes (Linux's ``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def greedy_in_one_batch(model, tokenizer, prompts, new_tokens: int = 12):
    """Each prompt's greedy tokens (end-of-sequence ignored), the prompts decoding in one
    left-padded batch through ``generate_token``."""
    from djl_stream.generation.batch import CausalLMBatch, generate_token
    from djl_stream.generation.sequence import GenerationSequence

    sequences = [GenerationSequence(i, tokenizer(p)["input_ids"], tokenizer,
                                    max_new_tokens=new_tokens, eos_token_ids=set(),
                                    ignore_eos=True) for i, p in enumerate(prompts)]
    batch = CausalLMBatch.from_sequences(sequences, pad_token_id=2, device="cpu")
    while batch is not None:
        _, batch = generate_token(model, batch)
    return [seq.generated_ids for seq in sequences]


@pytest.fixture(scope="session")
def tiny_model(smollm2_tokenizer):
    return build_tiny_llama(len(smollm2_tokenizer))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_model, smollm2_tokenizer) -> Path:
    """A complete model directory (model.py, serving.properties, weights, tokenizer) holding
    the tiny random Llama: the same model.py as model/, a model small enough for fast
    server tests."""
    directory = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(directory)
    smollm2_tokenizer.save_pretrained(directory)
    shutil.copy(MODEL_DIR / "model.py", directory / "model.py")
    (directory / "serving.properties").write_text(
        "engine=Python\n"
        "option.dtype=fp32\n"
        "option.default_max_new_tokens=16\n"
        "option.max_new_tokens_limit=256\n"
        "option.max_input_length=64\n"
        # Raw completion: the random model has no use for a chat template.
        "option.apply_chat_template=false\n"
    )
    return directory

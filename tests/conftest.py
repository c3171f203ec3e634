"""Shared fixtures: the real SmolLM2 tokenizer and model directory, and a tiny random Llama
built from a config (with the real SmolLM2 tokenizer) for fast engine tests."""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from djl_stream.runtime.cpu_info import usable_cores

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


def pytest_configure(config):
    """Each of ``make test``'s processes computes with its share of the cores, and so do the
    servers and compiling processes it starts (they inherit ``OMP_NUM_THREADS``). PyTorch
    would give each of them a thread per core: with several of them busy on the same cores,
    OpenMP's threads spin at their barriers for threads that have no core, and the spinning
    takes the cores from the work. A value set by the caller stays."""
    if hasattr(config, "workerinput"):  # a pytest-xdist worker
        workers = config.workerinput["workercount"]
    elif getattr(config.option, "numprocesses", None):
        return  # (pytest-xdist's controller: its workers, which inherit its environment, decide)
    else:
        workers = 1
    share = max(1, usable_cores() // workers)
    os.environ.setdefault("OMP_NUM_THREADS", str(share))
    if "torch" in sys.modules:  # (imported by a plugin before this ran)
        sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


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


@pytest.fixture(scope="session", autouse=True)
def _programs_compile_into_the_session_s_cache(tmp_path_factory):
    """``DJL_STREAM_CACHE_DIR`` set to a folder of this test session's own for the whole
    session, so that every load (in this process, and in the servers and workers tests
    start) compiles its decode program into it and loads it from there: the machine's
    cache is its users'."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("DJL_STREAM_CACHE_DIR", str(tmp_path_factory.mktemp("djl-stream-cache")))
        yield


@pytest.fixture(scope="module")
def programs():
    """The session's cache of compiled decode programs (``DJL_STREAM_CACHE_DIR``)."""
    from djl_stream.runtime import decode_program

    return decode_program.cache_root()


def pytest_collection_modifyitems(config, items):
    """Tests that compile decode programs (marked ``compiles``) come first: ``make test``
    hands files to its processes in this order, one file each at first, so the compiles
    start side by side instead of trailing the rest of the suite on one process.

    Tests of the runtime's fast path (marked ``fast_path``) are skipped under a
    transformers without the attention interface it plugs into (the Neuron image's 4.45):
    models run their own forward there, which the rest of the suite covers."""
    from djl_stream.runtime.attention import interface_available

    items.sort(key=lambda item: "compiles" not in item.keywords)  # (stable: file order kept)

    missing = interface_available()
    if missing:
        skip = pytest.mark.skip(reason=f"the fast path is not available: {missing}")
        for item in items:
            if "fast_path" in item.keywords:
                item.add_marker(skip)


def resident_bytes() -> int:
    """This process's resident memory, in bytes (Linux's ``/proc/self/statm``)."""
    import os

    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def greedy_in_one_batch(runner, tokenizer, prompts, new_tokens: int = 12):
    """Each prompt's greedy tokens (end-of-sequence ignored), the prompts decoding in one
    batch on ``runner`` through ``generate_token``."""
    from djl_stream.generation.batch import CausalLMBatch, generate_token
    from djl_stream.generation.sequence import GenerationSequence

    sequences = [GenerationSequence(i, tokenizer(p)["input_ids"], tokenizer,
                                    max_new_tokens=new_tokens, eos_token_ids=set(),
                                    ignore_eos=True) for i, p in enumerate(prompts)]
    batch = CausalLMBatch.from_sequences(runner, sequences)
    while batch is not None:
        _, batch = generate_token(runner, batch)
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
        # The eager step: the compiled one has tests of its own (test_decode_program.py),
        # and a compile for every server of the session would crowd the machine.
        "option.compile=false\n"
    )
    return directory


@pytest.fixture(scope="session")
def tiny_server(tiny_model_dir):
    """One running server on the tiny model, shared by the test files that only ask it
    questions (the clients' protocols, the routes): a server start is seconds of a test
    process's time, and these files change nothing a later one would see. Files that count
    what the server did (metrics), stop it, or change its options start their own."""
    from server_process import serving

    with serving(tiny_model_dir) as process:
        yield process

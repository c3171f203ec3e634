"""The model directory on a real local Ray cluster (``make ray``).

``djl-stream serve DIR --ray`` starts the cluster itself, on 127.0.0.1 with 2 CPUs, and
deploys 2 model replicas of 1 CPU each behind Ray Serve's HTTP proxy. The model is a tiny
random-weight Llama with the embedded model's tokenizer, built here. Without Ray the suite
does not pass quietly: collection stops with an error that says what to install.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))  # (the unit suite's server helpers, shared)

#: Ray's CPUs, and each replica's: two replicas fit side by side.
CLUSTER_CPUS, REPLICA_CPUS, REPLICAS = 2, 1, 2
#: Room for the long streams that a replica is killed under.
LONGEST_ANSWER = 3000


def pytest_configure(config: pytest.Config) -> None:
    if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
        raise pytest.UsageError("make ray needs Ray Serve: pip install -e '.[ray]' "
                                "(make ray installs it)")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A complete model directory holding a 2-layer random Llama (the same model.py as
    model/), long enough in positions for answers of :data:`LONGEST_ANSWER` tokens."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    embedded = REPO / "model"
    if not (embedded / "tokenizer.json").is_file():
        raise pytest.UsageError("make ray borrows the embedded model's tokenizer: run make model first")
    tokenizer = AutoTokenizer.from_pretrained(str(embedded))
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True)).eval()
    directory = tmp_path_factory.mktemp("ray-tiny-model")
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    shutil.copy(embedded / "model.py", directory / "model.py")
    (directory / "serving.properties").write_text(
        "engine=Python\n"
        "option.dtype=fp32\n"
        "option.default_max_new_tokens=16\n"
        f"option.max_new_tokens_limit={LONGEST_ANSWER}\n"
        "option.max_input_length=64\n"
        "option.apply_chat_template=false\n"
        "option.compile=false\n")
    return directory


@pytest.fixture(scope="session")
def ray_server(tiny_model_dir):
    """``djl-stream serve --ray`` with two replicas, ready (every replica answered)."""
    from server_process import ServerProcess

    server = ServerProcess(tiny_model_dir, args=[
        "--ray", "--replicas", str(REPLICAS), "--replica-cpus", str(REPLICA_CPUS),
        "--ray-cpus", str(CLUSTER_CPUS)], client_timeout=300)
    try:
        yield server.wait_ready(timeout=600)
    finally:
        server.stop(grace=120)  # SIGTERM: Serve and the local cluster shut down first

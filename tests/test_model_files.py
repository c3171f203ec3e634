"""What an image's transformers reads of a model directory (djl_stream.shipping.model_files).

The rules are facts about other releases of transformers (4.45.2, 4.51.3), read in their
sources; this machine runs only the installed release. So the last tests hold each rule's
prediction for the *installed* release to what that release really does: written without
reference to a version, they check the images' releases too when run under them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import transformers
from packaging.version import Version

from djl_stream.shipping.images import IMAGES
from djl_stream.shipping.model_files import (
    CHAT_TEMPLATE_FILE_SINCE,
    TOKENIZER_CLASSES,
    model_file_problems,
    model_file_problems_of,
)

INSTALLED = transformers.__version__
ROPE_ONLY = {"model_type": "llama", "rope_parameters": {"rope_theta": 100000.0,
                                                        "rope_type": "default"}}


def test_every_images_transformers_has_its_tokenizer_classes() -> None:
    for image in IMAGES.values():
        assert image.transformers in TOKENIZER_CLASSES
    assert "GPT2TokenizerFast" in TOKENIZER_CLASSES["4.45.2"]
    assert "TokenizersBackend" not in TOKENIZER_CLASSES["4.51.3"]


def test_nothing_is_reported_for_a_folder_written_for_both() -> None:
    config = {**ROPE_ONLY, "rope_theta": 100000.0}
    tokenizer = {"tokenizer_class": "GPT2Tokenizer", "chat_template": "{{ x }}"}
    for version in ("4.45.2", "4.51.3", "5.0.0"):
        assert model_file_problems_of(config, tokenizer, True, version) == []


def test_transformers_5_reads_what_it_writes() -> None:
    tokenizer = {"tokenizer_class": "TokenizersBackend"}
    assert model_file_problems_of(ROPE_ONLY, tokenizer, True, "5.0.0") == []


def test_a_scaled_rope_also_needs_rope_scaling() -> None:
    config = {"rope_parameters": {"rope_theta": 5e5, "rope_type": "llama3", "factor": 8.0}}
    [problem] = model_file_problems_of(config, {}, False, "4.51.3")
    assert problem.fix == ('add "rope_theta": 500000.0 to config.json, and "rope_scaling" for '
                           "rope_type 'llama3'")


def test_files_are_read_from_the_directory(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(ROPE_ONLY))
    (tmp_path / "tokenizer_config.json").write_text('{"tokenizer_class": "TokenizersBackend"}')
    (tmp_path / "chat_template.jinja").write_text("{{ x }}")
    assert [p.file for p in model_file_problems(tmp_path, "4.45.2")] == [
        "config.json", "tokenizer_config.json", "chat_template.jinja"]
    assert [p.file for p in model_file_problems(tmp_path / "missing", "4.45.2")] == []


# -- the installed release does what the rules predict --------------------------------------


def test_the_rope_rule_matches_the_installed_transformers() -> None:
    """What the model really rotates with: the Llama rotary embedding's frequencies."""
    import torch
    from transformers import AutoConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = AutoConfig.for_model(**ROPE_ONLY, hidden_size=64, num_attention_heads=4)
    inv_freq = LlamaRotaryEmbedding(config=config).inv_freq
    dim = 64 // 4
    wanted = 1.0 / (100000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    runs_wrong = not torch.allclose(inv_freq.float(), wanted)
    assert bool(model_file_problems_of(ROPE_ONLY, {}, False, INSTALLED)) == runs_wrong


def test_the_chat_template_rule_matches_the_installed_transformers(tmp_path: Path,
                                                                    smollm2_tokenizer) -> None:
    from transformers import AutoTokenizer

    smollm2_tokenizer.save_pretrained(tmp_path)
    template = smollm2_tokenizer.chat_template
    assert template
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text(template)
    loaded = AutoTokenizer.from_pretrained(str(tmp_path)).chat_template
    predicted_missing = any(p.file == "chat_template.jinja"
                            for p in model_file_problems(tmp_path, INSTALLED))
    assert predicted_missing == (loaded is None)
    assert predicted_missing == (Version(INSTALLED) < CHAT_TEMPLATE_FILE_SINCE)


@pytest.mark.skipif(INSTALLED not in TOKENIZER_CLASSES,
                    reason=f"no tokenizer class list for transformers {INSTALLED}")
def test_the_tokenizer_class_list_matches_the_installed_transformers() -> None:
    from transformers.models.auto.tokenization_auto import tokenizer_class_from_name

    def resolves(name: str) -> bool:
        try:
            return tokenizer_class_from_name(name) is not None
        except (ImportError, RuntimeError) as error:  # the class exists; an optional
            return "No module named" in str(error)    # dependency (sentencepiece) is missing

    assert [name for name in sorted(TOKENIZER_CLASSES[INSTALLED]) if not resolves(name)] == []
    assert not resolves("TokenizersBackend")

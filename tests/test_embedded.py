"""The embedded model directory: one layout every transformers from 4.45 to 5.x reads alike,
and a layout written by an older djl-stream is rewritten by the next ``djl-stream embed``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from djl_stream.shipping.embedded import (
    FORMAT,
    MARKER,
    TOKENIZER_CLASS,
    embed_default_model,
    embedded_format,
    is_outdated,
    portable_config,
    portable_tokenizer_config,
    should_embed,
)

#: config.json as the first djl-stream (transformers 5, no marker) wrote it, abridged.
FORMAT_1_CONFIG = {
    "_model_name_or_path": "Smollm2 135M 8k Lc100K Mix1 Ep2",
    "architectures": ["LlamaForCausalLM"],
    "dtype": "float32",
    "model_type": "llama",
    "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"},
}


def write(directory: Path, name: str, data) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_config_gets_the_transformers_4_spellings_beside_the_5_ones():
    config = portable_config(FORMAT_1_CONFIG)
    assert config["rope_theta"] == 100000.0
    assert config["torch_dtype"] == "float32"
    assert config["rope_parameters"] == FORMAT_1_CONFIG["rope_parameters"]
    assert config["dtype"] == "float32"


def test_a_rope_scaling_without_a_4_x_spelling_is_refused():
    with pytest.raises(ValueError, match="rope"):
        portable_config({"rope_parameters": {"rope_theta": 1e6, "rope_type": "yarn"}})


def test_tokenizer_config_names_a_class_4_x_knows_and_carries_the_chat_template():
    written = {"tokenizer_class": "TokenizersBackend", "is_local": True,
               "local_files_only": False, "eos_token": "<|im_end|>"}
    config = portable_tokenizer_config(written, "{{ messages }}")
    assert config == {"tokenizer_class": TOKENIZER_CLASS, "eos_token": "<|im_end|>",
                      "chat_template": "{{ messages }}", "clean_up_tokenization_spaces": False,
                      "add_prefix_space": False}


def test_the_layout_is_read_from_the_marker(tmp_path):
    write(tmp_path, "config.json", FORMAT_1_CONFIG)
    write(tmp_path, MARKER, {"format": FORMAT})
    assert embedded_format(tmp_path) == FORMAT
    assert not is_outdated(tmp_path)
    assert not should_embed(tmp_path)
    assert should_embed(tmp_path, force=True)


def test_a_directory_embedded_before_the_marker_is_outdated_and_rewritten(tmp_path):
    write(tmp_path, "config.json", FORMAT_1_CONFIG)
    assert embedded_format(tmp_path) == 1
    assert is_outdated(tmp_path)
    assert should_embed(tmp_path)


def test_someone_elses_model_is_never_overwritten_without_force(tmp_path):
    config = write(tmp_path, "config.json", {"model_type": "llama", "_name_or_path": "mine"})
    before = config.read_text()
    assert embedded_format(tmp_path) is None
    assert not should_embed(tmp_path)
    assert embed_default_model(tmp_path) is False
    assert config.read_text() == before and not (tmp_path / MARKER).exists()


def test_an_empty_directory_is_embedded(tmp_path):
    assert should_embed(tmp_path)
    assert should_embed(tmp_path / "missing")


# --- the real model/ directory, under whatever transformers runs the suite ------------


def test_model_dir_is_in_the_current_layout(embedded_model_dir):
    assert embedded_format(embedded_model_dir) == FORMAT


def test_model_dir_config_reads_rope_theta_100000(embedded_model_dir):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(embedded_model_dir))
    rope = getattr(config, "rope_parameters", None) or {}
    # 5.x keeps it in rope_parameters only; 4.x reads rope_theta (default 10000 without it)
    assert rope.get("rope_theta", getattr(config, "rope_theta", None)) == 100000.0
    assert getattr(config, "rope_theta", 100000.0) == 100000.0


def test_model_dir_tokenizer_has_its_chat_template_and_specials(smollm2_tokenizer):
    assert smollm2_tokenizer.chat_template and "<|im_start|>" in smollm2_tokenizer.chat_template
    assert (smollm2_tokenizer.bos_token, smollm2_tokenizer.eos_token,
            smollm2_tokenizer.pad_token) == ("<|im_start|>", "<|im_end|>", "<|im_end|>")
    assert smollm2_tokenizer.decode(smollm2_tokenizer.encode("it 's a test .")) == "it 's a test ."

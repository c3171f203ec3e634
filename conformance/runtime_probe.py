"""What a model directory looks like to djl-stream under the running interpreter's libraries.

Run by ``test_image_envs.py`` with the main venv's Python and with each image's runtime venv
(see :mod:`image_envs`); the JSON it writes is compared between them. It reads the config,
tokenizer and chat template with transformers' own ``Auto*`` classes, then loads the
directory through its ``model.py`` (djl-stream's ``StreamingService``, the Accelerate
engine) and answers a few greedy requests the way djl-serving's worker would call
``handle()``.

    python conformance/runtime_probe.py MODEL_DIR OUT.json
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import sys
import uuid
from pathlib import Path

#: Config values that decide what the model computes, compared across transformers releases.
CONFIG_KEYS = (
    "model_type", "architectures", "vocab_size", "hidden_size", "intermediate_size",
    "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
    "max_position_embeddings", "rms_norm_eps", "hidden_act", "tie_word_embeddings",
    "attention_bias", "attention_dropout", "mlp_bias", "bos_token_id", "eos_token_id",
    "pad_token_id", "use_cache",
)
TEXTS = (
    "Hello world",
    " The capital of France is Paris.\n\nIt 's a test , isn't it ?",
    "emoji 👋🏽 🇫🇷 and CJK 你好，世界 and accents café naïve",
    "<|im_start|>user\nHi<|im_end|>",
)
CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Name three colours."},
    {"role": "assistant", "content": "Red, green, blue."},
    {"role": "user", "content": "And two more?"},
]
#: Greedy requests (the defaults of serving.properties: do_sample off), one per form.
REQUESTS = (
    {"inputs": "What is the capital of France?", "parameters": {"max_new_tokens": 20},
     "stream": True},
    {"inputs": "Write one sentence about the sea.", "parameters": {"max_new_tokens": 20},
     "stream": False},
    {"inputs": ["Hello", "Tell me a fact about cats."], "parameters": {"max_new_tokens": 12},
     "stream": True},
    {"messages": CONVERSATION[:2], "parameters": {"max_new_tokens": 16, "stop": ["\n\n"]},
     "stream": True},
)


def versions() -> dict:
    found = {}
    for name in ("torch", "transformers", "tokenizers", "accelerate", "pydantic",
                 "huggingface-hub", "safetensors"):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = None
    return found


def config_facts(model_dir: Path) -> dict:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(str(model_dir))
    facts = {key: getattr(config, key, None) for key in CONFIG_KEYS}
    # What each release computes with: 4.x reads rope_theta (10000 when the file lacks it),
    # 5.x rope_parameters; the dtype is torch_dtype in 4.x, dtype in 5.x.
    rope = getattr(config, "rope_parameters", None) or {}
    theta = getattr(config, "rope_theta", None)
    facts["rope_theta"] = theta if theta is not None else rope.get("rope_theta")
    scaling = getattr(config, "rope_scaling", None) or rope
    facts["rope_type"] = scaling.get("rope_type", scaling.get("type", "default"))
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    facts["dtype"] = str(dtype).replace("torch.", "") if dtype is not None else None
    return facts


def tokenizer_facts(model_dir: Path) -> dict:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    ids = {text: tokenizer(text)["input_ids"] for text in TEXTS}
    return {
        "special_tokens": [tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token,
                           tokenizer.unk_token],
        "special_ids": [tokenizer.bos_token_id, tokenizer.eos_token_id,
                        tokenizer.pad_token_id, tokenizer.unk_token_id],
        "length": len(tokenizer),
        "ids": ids,
        "decoded": {text: tokenizer.decode(ids[text], skip_special_tokens=True)
                    for text in TEXTS},
        "chat_prompt": tokenizer.apply_chat_template(CONVERSATION, tokenize=False,
                                                     add_generation_prompt=True),
    }


def service_answers(model_dir: Path) -> dict:
    """Load ``model_dir/model.py`` and answer :data:`REQUESTS` through its ``handle()``."""
    from djl_stream.serving.inputs import Input
    from djl_stream.serving.properties import djl_init_properties

    name = f"probed_model_{uuid.uuid4().hex}"
    spec = importlib.util.spec_from_file_location(name, model_dir / "model.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    # djl's answer to the messages request: an OpenAI one carries an id and a time that
    # differ from run to run, and the probes of the images are compared byte for byte.
    init = Input(properties={**djl_init_properties(model_dir, {"OPTION_CHAT_PROTOCOL": "djl"}),
                             "handler": "handle"})
    if module.handle(init) is not None:
        raise AssertionError("the init call must answer None")

    answers = []
    for body in REQUESTS:
        request = Input(properties={"content-type": "application/json",
                                    "requestId": uuid.uuid4().hex})
        request.add("data", json.dumps(body).encode())
        output = module.handle(request)
        if output.stream_content is not None:
            payload = [output.format_stream_item(item).decode() for item in output.stream_content]
        else:
            payload = bytes(output.content.value_at(0)).decode()
        answers.append({"code": output.code, "payload": payload})

    service = next(v for v in vars(module).values() if hasattr(v, "engine"))
    model = service.model
    rotary = getattr(model.model, "rotary_emb", None) or model.model.layers[0].self_attn.rotary_emb
    return {
        "answers": answers,
        "engine": service.engine.name,
        "runtime": getattr(getattr(service.engine, "runner", None), "path", None),
        "model_dtype": str(model.dtype).replace("torch.", ""),
        "inv_freq": [float(x) for x in rotary.inv_freq],
    }


def main(model_dir: str, out: str) -> int:
    directory = Path(model_dir).resolve()
    import djl_stream

    result = {
        "python": "%d.%d" % sys.version_info[:2],
        "versions": versions(),
        "djl_stream": str(Path(djl_stream.__file__).resolve().parent),
        "config": config_facts(directory),
        "tokenizer": tokenizer_facts(directory),
        "service": service_answers(directory),
    }
    Path(out).write_text(json.dumps(result, indent=1, ensure_ascii=False))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

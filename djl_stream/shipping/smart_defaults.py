"""What djl-serving's Neuron image fills in when ``serving.properties`` leaves it unset.

On Neuron hardware djl-serving 0.30 (the Neuron image's release) runs
``NeuronSmartDefaultUtils.applySmartDefaults`` from ``LmiConfigRecommender`` for every
model whose ``config.json`` names a text-generation architecture (``...ForCausalLM``,
``...LMHeadModel``, ``...ForConditionalGeneration``), whatever the engine, rolling batch off
included. It sets ``option.n_positions``, ``option.tensor_parallel_degree`` and
``option.max_rolling_batch_size`` unless they are set; ``OPTION_*`` variables count as set
(``ModelInfo.loadServingProperties`` merges them first). For the transformers-neuronx
engine those three are compiled in: the longest sequence, the NeuronCores the model is
sharded over, and the batch every request is padded to.

This is a port of that Java (``wlm/.../NeuronSmartDefaultUtils.java`` and the parts of
``LmiUtils.HuggingFaceModelConfig`` it reads, 0.30.0-dlc in ``../shared/djl-serving``),
float32 arithmetic included, so that ``djl-stream check`` can say what a model would get
without a Neuron host. It can drift from the Java: it is used only to explain, never to
configure.

>>> smol = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576,
...         "intermediate_size": 1536, "max_position_embeddings": 8192,
...         "num_attention_heads": 9, "num_hidden_layers": 30, "num_key_value_heads": 3,
...         "vocab_size": 49152}
>>> neuron_smart_defaults(smol, {}, neuron_cores=2)
{'n_positions': '4096', 'tensor_parallel_degree': '1', 'max_rolling_batch_size': '32'}
"""

from __future__ import annotations

import dataclasses
import math
import struct
from typing import Any, Mapping

#: The options the Neuron image fills in, in the order it does.
NEURON_SMART_DEFAULTS = ("n_positions", "tensor_parallel_degree", "max_rolling_batch_size")
#: NeuronCores of the smallest Inferentia2 instances (inf2.xlarge, inf2.8xlarge).
INF2_XLARGE_CORES = 2

_TEXT_GENERATION = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")
_MAX_ROLLING_BATCH = 32
_MEMORY_PER_CORE = 16.0  # GB per NeuronCore
_BILLION = 1_000_000_000.0
_INT_MAX = 2**31 - 1


def _f32(value: float) -> float:
    """``value`` rounded to a Java ``float``."""
    if math.isinf(value) or math.isnan(value):
        return value
    return struct.unpack("f", struct.pack("f", value))[0]


def _div(a: float, b: float) -> float:
    # Java float division: x / 0.0f is +-Infinity (or NaN for 0 / 0), never an exception.
    if b == 0:
        return math.nan if a == 0 else math.copysign(math.inf, a)
    return _f32(a / b)


def _to_int(value: float) -> int:
    """Java's ``(int)`` cast of a float: NaN is 0, truncation, saturation."""
    if math.isnan(value):
        return 0
    if math.isinf(value):
        return _INT_MAX if value > 0 else -_INT_MAX - 1
    return max(-_INT_MAX - 1, min(_INT_MAX, int(value)))


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """The fields of ``config.json`` djl-serving reads (missing numbers are 0, as Gson
    leaves them)."""

    model_type: str = ""
    architectures: tuple = ()
    hidden_size: int = 0
    intermediate_size: int = 0
    max_position_embeddings: int = 0
    num_attention_heads: int = 0
    num_hidden_layers: int = 0
    num_key_value_heads: int = 0
    vocab_size: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> "ModelShape":
        def number(key: str) -> int:
            value = config.get(key)
            return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0

        auto_map = config.get("auto_map")
        architectures = tuple(config.get("architectures") or ()) + tuple(
            auto_map.keys() if isinstance(auto_map, dict) else ())
        return cls(model_type=str(config.get("model_type") or ""), architectures=architectures,
                   **{f.name: number(f.name) for f in dataclasses.fields(cls)
                      if f.type in ("int", int)})

    @property
    def is_text_generation(self) -> bool:
        return any(str(a).endswith(_TEXT_GENERATION) for a in self.architectures)

    @property
    def default_n_positions(self) -> int:
        return min(self.max_position_embeddings, 4096)

    @property
    def parameters(self) -> int:
        if self.model_type in ("llama", "mistral"):
            # As in LmiUtils, heads times kv heads stands for the head dimension.
            head_dim = self.num_attention_heads * self.num_key_value_heads
            embeddings = self.vocab_size * self.hidden_size
            qkv = head_dim * self.hidden_size * self.num_key_value_heads * 3
            o_proj = self.hidden_size * self.hidden_size
            gate = self.hidden_size * self.intermediate_size * 3
            return (embeddings + self.num_hidden_layers
                    * (qkv + o_proj + gate + self.hidden_size + self.hidden_size)
                    + self.hidden_size + embeddings)
        embedding = (self.vocab_size + self.max_position_embeddings) * self.hidden_size
        block = (4 * self.hidden_size ** 2 + 8 * self.hidden_size ** 2 + 4 * self.hidden_size)
        return embedding + block * self.num_hidden_layers + self.hidden_size * self.vocab_size

    def sequence_bytes(self, n_positions: int, weight_bytes: int) -> int:
        return n_positions * self.hidden_size * self.num_hidden_layers * weight_bytes


def neuron_smart_defaults(config: Mapping[str, Any], options: Mapping[str, str],
                          neuron_cores: int) -> dict[str, str]:
    """The options djl-serving 0.30 would add on a host with ``neuron_cores`` NeuronCores
    to ``options`` (the ``option.*`` keys already set, prefix removed, ``OPTION_*``
    variables included), for the model of ``config`` (its ``config.json``).

    Empty when djl-serving would add nothing: the architecture is not text generation, or
    ``n_positions`` is unset and ``max_position_embeddings`` unknown.
    """
    shape = ModelShape.from_config(config)
    if not shape.is_text_generation:
        return {}
    prop = {key: str(value) for key, value in options.items()}
    added: dict[str, str] = {}
    if "n_positions" not in prop:
        if shape.default_n_positions <= 0:
            return {}
        prop["n_positions"] = added["n_positions"] = str(shape.default_n_positions)
    cores = max(neuron_cores, 1)
    n_positions = int(prop.get("n_positions", "0"))
    param_bytes = 1 if "quantize" in prop else 2
    # long * float in Java: the long becomes a float first
    model_gb = _div(_f32(float(param_bytes * shape.parameters)), _BILLION)
    sequence_gb = _div(_f32(_f32(float(shape.sequence_bytes(n_positions, param_bytes)))
                            * _f32(0.95)), 1024.0 ** 3)

    def adjusted_model_gb(tp: int) -> float:
        return _f32(model_gb * _f32(1.0 + _div(float(tp * 2 - 2), 100.0)))

    def max_power_of_2(n: int) -> int:
        n = min(n, _MAX_ROLLING_BATCH)
        if n != 0 and (n & (n - 1)) == 0:
            return n
        power = 1
        while power < n:
            power *= 2
        return power // 2

    def max_concurrency(memory: float, tp: int) -> int:
        n = _to_int(_div(_f32(memory - adjusted_model_gb(tp)), sequence_gb))
        return min(max_power_of_2(n), _MAX_ROLLING_BATCH)

    def max_concurrency_with_batch(memory: float, tp: int, batch: int) -> int:
        n = min(max_power_of_2(_to_int(_div(_f32(memory - adjusted_model_gb(tp)), sequence_gb))),
                batch)
        return n if n == batch else 0

    def core_configs() -> list[int]:
        configs = [i for i in (1, 2, 4, 8) if i != 4 or cores != 32]
        if cores > 8:
            configs.append(cores)
        per_model = math.ceil(_div(_f32(_f32(1.1) * model_gb), _MEMORY_PER_CORE))
        return [c for c in configs if per_model <= c]

    tp = cores
    total_memory = tp * _MEMORY_PER_CORE
    if prop.get("tensor_parallel_degree") == "max":
        prop["tensor_parallel_degree"] = added["tensor_parallel_degree"] = str(cores)
    elif "tensor_parallel_degree" not in prop:
        batch = int(prop["max_rolling_batch_size"]) if "max_rolling_batch_size" in prop else None
        best = (max_concurrency(total_memory, tp) if batch is None
                else max_concurrency_with_batch(total_memory, tp, batch))
        for config in core_configs():
            memory = config * _MEMORY_PER_CORE
            found = (max_concurrency(memory, config) if batch is None
                     else max_concurrency_with_batch(memory, config, batch)) * (cores // config)
            if found >= best and config <= tp:
                tp, best = config, found
        prop["tensor_parallel_degree"] = added["tensor_parallel_degree"] = str(tp)
    if "max_rolling_batch_size" not in prop:
        tp = int(prop.get("tensor_parallel_degree", str(cores)))
        batch = max_concurrency(tp * _MEMORY_PER_CORE, tp)
        if batch > 0:
            added["max_rolling_batch_size"] = str(batch)
    return added

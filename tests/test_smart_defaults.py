"""The Neuron image's smart defaults: the port in djl_stream.smart_defaults against the
numbers djl-serving 0.30's Java computes.

The first tests hold the port to values worked out by hand from
``NeuronSmartDefaultUtils.java`` (0.30.0-dlc). The last one runs the real Java: it compiles
djl-serving's own ``NeuronSmartDefaultUtils.java`` and ``LmiUtils.HuggingFaceModelConfig``
(from ``../shared/djl-serving``) against small stand-ins for the logger, Gson's annotation
and ``NeuronUtils`` (the NeuronCore count), and compares every case with the port. It
needs ``javac`` and those sources, and is skipped without them.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from djl_stream.smart_defaults import ModelShape, neuron_smart_defaults

REPO = Path(__file__).resolve().parents[1]
DJL_SERVING_SRC = Path(os.environ.get("DJL_SERVING_SRC", REPO.parent / "shared" / "djl-serving"))
WLM = DJL_SERVING_SRC / "0.30.0-dlc" / "wlm" / "src" / "main" / "java" / "ai" / "djl" / "serving" / "wlm"

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


# -- against the real Java ---------------------------------------------------------------

STUBS = {
    "com/google/gson/annotations/SerializedName.java": """
        package com.google.gson.annotations;
        import java.lang.annotation.*;
        @Retention(RetentionPolicy.RUNTIME) @Target(ElementType.FIELD)
        public @interface SerializedName { String value(); }
    """,
    "org/slf4j/Logger.java": """
        package org.slf4j;
        public class Logger { public void info(String format, Object... args) {}
                              public void warn(String format, Object... args) {} }
    """,
    "org/slf4j/LoggerFactory.java": """
        package org.slf4j;
        public final class LoggerFactory {
            public static Logger getLogger(Class<?> c) { return new Logger(); } }
    """,
    "ai/djl/util/NeuronUtils.java": """
        package ai.djl.util;
        public final class NeuronUtils {
            public static int cores;
            public static boolean hasNeuron() { return cores > 0; }
            public static int getNeuronCores() { return cores; } }
    """,
    # One case per line: cores <TAB> config as field=value;... <TAB> options as k=v;...
    "ai/djl/serving/wlm/Harness.java": """
        package ai.djl.serving.wlm;
        import java.io.*; import java.lang.reflect.Field; import java.util.*;
        public final class Harness {
            public static void main(String[] a) throws Exception {
                BufferedReader in = new BufferedReader(new InputStreamReader(System.in));
                for (String line; (line = in.readLine()) != null; ) {
                    String[] parts = line.split("\\t", -1);
                    ai.djl.util.NeuronUtils.cores = Integer.parseInt(parts[0]);
                    LmiUtils.HuggingFaceModelConfig config = new LmiUtils.HuggingFaceModelConfig();
                    for (String kv : parts[1].split(";")) {
                        if (kv.isEmpty()) continue;
                        String[] p = kv.split("=", 2);
                        Field f = LmiUtils.HuggingFaceModelConfig.class.getDeclaredField(p[0]);
                        f.setAccessible(true);
                        if (f.getType() == int.class) f.setInt(config, Integer.parseInt(p[1]));
                        else if (f.getType() == List.class) f.set(config, Arrays.asList(p[1].split(",")));
                        else f.set(config, p[1]);
                    }
                    Properties prop = new Properties();
                    for (String kv : parts[2].split(";")) {
                        if (kv.isEmpty()) continue;
                        String[] p = kv.split("=", 2);
                        prop.setProperty("option." + p[0], p[1]);
                    }
                    Properties before = (Properties) prop.clone();
                    new NeuronSmartDefaultUtils().applySmartDefaults(prop, config);
                    StringBuilder out = new StringBuilder();
                    for (String key : new TreeSet<>(prop.stringPropertyNames())) {
                        if (!prop.getProperty(key).equals(before.getProperty(key))) {
                            out.append(key.substring(7)).append('=').append(prop.getProperty(key)).append(';');
                        }
                    }
                    System.out.println(out);
                }
            }
        }
    """,
}

# Java field names of HuggingFaceModelConfig for config.json's keys.
FIELDS = {"model_type": "modelType", "architectures": "configArchitectures",
          "hidden_size": "hiddenSize", "intermediate_size": "intermediateSize",
          "max_position_embeddings": "maxPositionEmbeddings",
          "num_attention_heads": "numAttentionHeads", "num_hidden_layers": "numHiddenLayers",
          "num_key_value_heads": "numKeyValueHeads", "vocab_size": "vocabSize"}

CASES = [
    (config, options, cores)
    for config in (SMOLLM2_135M, LLAMA_3_8B, LLAMA_2_70B, GPT2)
    for options in ({}, {"max_rolling_batch_size": "4"}, {"max_rolling_batch_size": "64"},
                    {"tensor_parallel_degree": "max"}, {"tensor_parallel_degree": "2"},
                    {"n_positions": "2048"}, {"n_positions": "512", "quantize": "awq"},
                    {"n_positions": "128000"})
    for cores in (1, 2, 12, 24, 32)
]


def nested_class(source: str, header: str) -> str:
    start = source.index(header)
    depth = 0
    for end in range(start, len(source)):
        depth += {"{": 1, "}": -1}.get(source[end], 0)
        if depth == 0 and source[end] == "}":
            return source[start:end + 1]
    raise ValueError(f"no end to {header}")


@pytest.fixture(scope="module")
def java_harness(tmp_path_factory) -> Path:
    if not shutil.which("javac") or not (WLM / "NeuronSmartDefaultUtils.java").is_file():
        pytest.skip("needs javac and djl-serving's 0.30.0-dlc sources (DJL_SERVING_SRC)")
    root = tmp_path_factory.mktemp("java")
    for name, text in STUBS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    wlm = root / "ai" / "djl" / "serving" / "wlm"
    shutil.copy(WLM / "NeuronSmartDefaultUtils.java", wlm)
    lmi = (WLM / "LmiUtils.java").read_text()
    config_class = nested_class(lmi, "public static final class HuggingFaceModelConfig {")
    (wlm / "LmiUtils.java").write_text(
        "package ai.djl.serving.wlm;\n"
        "import com.google.gson.annotations.SerializedName;\nimport java.util.*;\n"
        f"public final class LmiUtils {{\n{config_class}\n}}\n")
    sources = [str(p) for p in root.rglob("*.java")]
    subprocess.run(["javac", "-d", str(root / "classes"), *sources], check=True,
                   capture_output=True, timeout=300)
    return root / "classes"


def java_line(config: dict, options: dict, cores: int) -> str:
    fields = ";".join(f"{FIELDS[k]}={','.join(v) if isinstance(v, list) else v}"
                      for k, v in config.items() if k in FIELDS)
    return f"{cores}\t{fields}\t{';'.join(f'{k}={v}' for k, v in options.items())}"


def test_the_port_computes_what_djl_servings_java_computes(java_harness: Path) -> None:
    done = subprocess.run(["java", "-cp", str(java_harness), "ai.djl.serving.wlm.Harness"],
                          input="\n".join(java_line(*case) for case in CASES) + "\n",
                          capture_output=True, text=True, timeout=300, check=True)
    java = done.stdout.splitlines()
    assert len(java) == len(CASES)
    mismatches = []
    for (config, options, cores), line in zip(CASES, java):
        expected = dict(kv.split("=", 1) for kv in line.split(";") if kv)
        got = neuron_smart_defaults(config, options, cores)
        if got != expected:
            mismatches.append((config.get("model_type"), options, cores, expected, got))
    assert not mismatches
    assert len({line for line in java}) > 5  # the cases do exercise different outcomes

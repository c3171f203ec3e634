"""The port of the Neuron image's smart defaults (djl_stream.shipping.smart_defaults) computes what
djl-serving 0.30's own Java computes.

It compiles djl-serving's ``NeuronSmartDefaultUtils.java`` and
``LmiUtils.HuggingFaceModelConfig`` from ``DJL_SERVING_SRC`` against small stand-ins for the
logger, Gson's annotation and ``NeuronUtils`` (the NeuronCore count), runs every case through
it and compares with the port. It needs a JDK (``javac``, ``java``) and fails without one.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from djl_stream.shipping.smart_defaults import neuron_smart_defaults

from test_smart_defaults import GPT2, LLAMA_2_70B, LLAMA_3_8B, SMOLLM2_135M


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
def java_harness(tmp_path_factory, djl_src) -> Path:
    assert shutil.which("javac") and shutil.which("java"), "this check needs a JDK (javac, java)"
    wlm_sources = djl_src / "0.30.0-dlc" / "wlm" / "src" / "main" / "java" / "ai" / "djl" / "serving" / "wlm"
    root = tmp_path_factory.mktemp("java")
    for name, text in STUBS.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    wlm = root / "ai" / "djl" / "serving" / "wlm"
    shutil.copy(wlm_sources / "NeuronSmartDefaultUtils.java", wlm)
    lmi = (wlm_sources / "LmiUtils.java").read_text()
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

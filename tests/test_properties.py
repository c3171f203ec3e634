"""Properties: what serving.properties and OPTION_* variables configure, typed and checked."""

import dataclasses

import pytest

from djl_stream.serving.properties import (
    ModelProperties,
    PropertyError,
    djl_init_properties,
    read_serving_properties,
)


def test_defaults_are_the_documented_ones():
    props = ModelProperties.from_init_properties({"model_dir": "/opt/ml/model"})
    assert props.model_dir == "/opt/ml/model"
    assert props.model_id is None
    assert props.dtype == "auto"
    assert props.enable_streaming is True
    assert props.trust_remote_code is False
    assert props.default_max_new_tokens == 50
    assert props.output_formatter == "jsonlines"
    assert props.apply_chat_template is None


def test_values_are_typed():
    props = ModelProperties.from_init_properties(
        {
            "dtype": "FP16",
            "tensor_parallel_degree": "4",
            "enable_streaming": "False",
            "trust_remote_code": "true",
            "default_max_new_tokens": "32",
            "max_new_tokens_limit": "64",
            "max_input_length": "128",
            "device_id": "0",
            "apply_chat_template": "auto",
        }
    )
    assert props.dtype == "fp16"
    assert props.tensor_parallel_degree == 4
    assert props.enable_streaming is False
    assert props.trust_remote_code is True
    assert (props.default_max_new_tokens, props.max_new_tokens_limit) == (32, 64)
    assert props.max_input_length == 128
    assert props.device_id == 0


@pytest.mark.parametrize("key", [f.name for f in dataclasses.fields(ModelProperties)
                                 if f.type in ("bool", bool)])
def test_every_switch_reads_false_as_false(key):
    assert getattr(ModelProperties.from_init_properties({key: "false"}), key) is False
    assert getattr(ModelProperties.from_init_properties({key: "TRUE"}), key) is True
    with pytest.raises(PropertyError, match="true or false"):
        ModelProperties.from_init_properties({key: "maybe"})


def test_tensor_parallel_degree_max_means_all_gpus():
    assert ModelProperties.from_init_properties({"tensor_parallel_degree": "max"}).tensor_parallel_degree is None


@pytest.mark.parametrize(
    "key, value, words",
    [
        ("dtype", "fp8", "fp32, fp16, bf16, auto"),
        ("enable_streaming", "maybe", "true or false"),
        ("max_input_length", "0", "at least 1"),
        ("default_max_new_tokens", "ten", "integer"),
        ("tensor_parallel_degree", "-2", "at least 1"),
    ],
)
def test_bad_values_name_the_property_and_the_rule(key, value, words):
    with pytest.raises(PropertyError) as info:
        ModelProperties.from_init_properties({key: value})
    assert info.value.key == f"option.{key}"
    assert words in str(info.value)


def test_a_request_may_bring_twice_max_input_length_unless_set():
    assert ModelProperties.from_init_properties({}).max_request_input_length == 8192
    assert ModelProperties.from_init_properties(
        {"max_input_length": "100"}).max_request_input_length == 200
    assert ModelProperties.from_init_properties(
        {"max_input_length": "100", "max_request_input_length": "150"}
    ).max_request_input_length == 150


def test_a_request_s_kv_bound_is_derived_from_the_model_unless_set():
    assert ModelProperties.from_init_properties({}).max_request_kv_tokens is None
    assert ModelProperties.from_init_properties(
        {"max_request_kv_tokens": "20000"}).max_request_kv_tokens == 20000


def test_the_prefill_budget_is_the_device_s_unless_set():
    assert ModelProperties.from_init_properties({}).max_batch_prefill_tokens is None
    assert ModelProperties.from_init_properties(
        {"max_batch_prefill_tokens": "512"}).max_batch_prefill_tokens == 512


def test_the_prefill_stall_bound_is_a_number_of_decode_steps_zero_for_none():
    assert ModelProperties.from_init_properties({}).prefill_stall_steps == 1.5
    assert ModelProperties.from_init_properties(
        {"prefill_stall_steps": "2.5"}).prefill_stall_steps == 2.5
    assert ModelProperties.from_init_properties(
        {"prefill_stall_steps": "0"}).prefill_stall_steps == 0.0


@pytest.mark.parametrize("values, method", [
    ({}, None),
    ({"quantize": "int8"}, "int8"),
    ({"quantize": " BitsAndBytes4 "}, "bitsandbytes4"),
    ({"quantize": "none"}, None),
    # djl-serving's deprecated flags mean bitsandbytes, and an explicit method wins
    ({"load_in_8bit": "true"}, "bitsandbytes8"),
    ({"load_in_4bit": "true"}, "bitsandbytes4"),
    ({"load_in_8bit": "true", "quantize": "int8"}, "int8"),
    ({"load_in_8bit": "false"}, None),
])
def test_option_quantize_and_djl_s_load_in_flags(values, method):
    assert ModelProperties.from_init_properties(values).quantize == method


@pytest.mark.parametrize("key", ["decode_step", "compiled_weights", "prepack_weights"])
def test_the_removed_decode_step_options_are_unknown_properties(key):
    # ignored (kept in extra) by a server, refused by `djl-stream check`
    assert ModelProperties.from_init_properties({key: "auto"}).extra == {key: "auto"}
    with pytest.raises(PropertyError) as info:
        ModelProperties.from_init_properties({key: "auto"}, strict=True)
    assert info.value.key == f"option.{key}" and "unknown property" in str(info.value)


@pytest.mark.parametrize(
    "values, key, words",
    [
        ({"quantize": "int4"}, "quantize",
         "expected one of int8, w8a8, bitsandbytes8, bitsandbytes4, got 'int4'"),
        ({"apply_chat_template": "maybe"}, "apply_chat_template", "expected true or false"),
        ({"prefill_stall_steps": "-1"}, "prefill_stall_steps", "at least 0, got '-1'"),
        ({"prefill_stall_steps": "nan"}, "prefill_stall_steps", "finite number"),
        ({"prefill_stall_steps": "inf"}, "prefill_stall_steps", "finite number"),
        ({"prefill_stall_steps": "short"}, "prefill_stall_steps", "expected a number"),
        ({"max_request_input_length": "100"}, "max_request_input_length",
         "at least option.max_input_length (4096), got 100"),
        ({"max_input_length": "64", "max_request_input_length": "63"},
         "max_request_input_length", "at least option.max_input_length (64)"),
        ({"max_batch_prefill_tokens": "16"}, "max_batch_prefill_tokens",
         "at least option.max_rolling_batch_size (32), got 16"),
        ({"max_batch_prefill_tokens": "16", "max_rolling_batch_size": "64"},
         "max_batch_prefill_tokens", "at least option.max_rolling_batch_size (64)"),
        ({"max_batch_prefill_tokens": "lots"}, "max_batch_prefill_tokens", "integer"),
        ({"max_request_kv_tokens": "6143"}, "max_request_kv_tokens",
         "at least option.max_input_length + option.max_new_tokens_limit (6144), got 6143"),
        ({"max_request_kv_tokens": "300", "max_input_length": "64",
          "max_new_tokens_limit": "256"}, "max_request_kv_tokens", "(320), got 300"),
        ({"max_request_kv_tokens": "0"}, "max_request_kv_tokens", "at least 1"),
    ],
)
def test_limits_below_what_they_must_hold_are_refused(values, key, words):
    with pytest.raises(PropertyError) as info:
        ModelProperties.from_init_properties(values)
    assert info.value.key == f"option.{key}"
    assert words in str(info.value)


def test_default_may_not_exceed_the_limit():
    with pytest.raises(PropertyError, match="max_new_tokens_limit"):
        ModelProperties.from_init_properties({"default_max_new_tokens": "100", "max_new_tokens_limit": "10"})


def test_unknown_keys_are_kept_and_strict_mode_suggests_the_closest_name():
    props = ModelProperties.from_init_properties({"dtpye": "fp16", "handler": "handle"})
    assert props.dtype == "auto"
    assert props.extra == {"dtpye": "fp16", "handler": "handle"}
    with pytest.raises(PropertyError, match="did you mean option.dtype"):
        ModelProperties.from_init_properties({"dtpye": "fp16"}, strict=True)
    # keys djl-serving adds itself are fine even in strict mode
    ModelProperties.from_init_properties({"handler": "handle", "entryPoint": "model.py"}, strict=True)


def test_read_serving_properties_follows_java_syntax(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "# comment\n! another\nengine=Python\noption.dtype = fp16\noption.model_id: org/model\n\n"
    )
    assert read_serving_properties(tmp_path) == {
        "engine": "Python",
        "option.dtype": "fp16",
        "option.model_id": "org/model",
    }
    assert read_serving_properties(tmp_path / "missing") == {}


def test_init_properties_strip_the_prefix_and_serving_properties_win_over_environment(tmp_path):
    (tmp_path / "serving.properties").write_text(
        "engine=Python\noption.dtype=fp16\njob_queue_size=7\n")
    environ = {"OPTION_DTYPE": "bf16", "OPTION_MAX_INPUT_LENGTH": "512", "HOME": "/root",
               "OPTION_ENGINE": "MPI", "OPTION_ENTRYPOINT": "model.py"}
    props = djl_init_properties(tmp_path, environ)
    assert props["dtype"] == "fp16"
    assert props["max_input_length"] == "512"
    assert props["model_dir"] == str(tmp_path.resolve())
    # djl-serving sends the non-option keys too, as they are; OPTION_ENGINE is its own
    # engine key, which serving.properties already set
    assert props["engine"] == "Python" and props["job_queue_size"] == "7"
    assert props["entryPoint"] == "model.py"
    assert "HOME" not in props and "home" not in props


def test_djl_engine_key_is_never_a_stream_engine_choice():
    props = ModelProperties.from_init_properties(
        {"engine": "Python", "stream_engine": "transformers-neuronx"}, strict=True)
    assert props.stream_engine == "transformers-neuronx"
    assert ModelProperties.from_init_properties({"engine": "MPI"}).stream_engine is None


def test_weights_location(tmp_path):
    (tmp_path / "weights").mkdir()
    in_dir = ModelProperties(model_dir=str(tmp_path))
    assert in_dir.weights_location() == str(tmp_path)
    relative = ModelProperties(model_dir=str(tmp_path), model_id="weights")
    assert relative.weights_location() == str(tmp_path / "weights")
    hub = ModelProperties(model_dir=str(tmp_path), model_id="org/model")
    assert hub.weights_location() == "org/model"

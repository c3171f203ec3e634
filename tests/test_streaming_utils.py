"""The engine registry: djl-serving's StreamingUtils names, plus our register decorator."""

import pytest

from djl_stream import StreamingUtils, register_engine


def test_accelerate_is_built_in():
    generator = StreamingUtils.get_stream_generator("Accelerate")
    assert callable(generator)
    assert generator.__name__ == "accelerate_stream_generator"


def test_unknown_engine_lists_the_registered_ones():
    with pytest.raises(ValueError) as info:
        StreamingUtils.get_stream_generator("DeepSpeed")
    assert "DeepSpeed" in str(info.value)
    assert "Accelerate" in str(info.value)


def test_a_user_engine_is_one_decorator_away():
    @register_engine("Reverse-test")
    def reverse(model, tokenizer, inputs, **parameters):
        for step in range(parameters.get("max_new_tokens", 1)):
            yield [prompt[::-1][step : step + 1] for prompt in inputs]

    try:
        assert "Reverse-test" in StreamingUtils.engines()
        stream = StreamingUtils.get_stream_generator("Reverse-test")(None, None, ["abc", "xy"], max_new_tokens=3)
        assert list(stream) == [["c", "y"], ["b", "x"], ["a", ""]]
    finally:
        StreamingUtils._engines.pop("Reverse-test")

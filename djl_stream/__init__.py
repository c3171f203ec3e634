"""djl-stream: token streaming for Hugging Face causal LMs, shaped like djl-serving's Python
engine. Importing the package is cheap; torch loads with the first engine that is used."""

from djl_stream.generation.streaming_utils import StreamingUtils, register_engine

__all__ = ["StreamingUtils", "register_engine"]
__version__ = "0.1.0"

"""``Input`` and ``PairList``: what a handler receives, shaped like djl_python's.

Inside the djl-serving container the worker builds ``djl_python.inputs.Input`` objects;
everywhere else (the local server, tests) these classes stand in for them with the same
methods, so a ``model.py`` runs unchanged in both. :mod:`djl_stream.serving.compat` picks one.

A request, as the front end hands it over: HTTP headers become properties (lower-case
names), the body is the content entry ``data``::

    >>> inp = Input().add_property("content-type", "application/json")
    >>> inp = inp.add("data", '{"inputs": "Hello"}')
    >>> inp.get_property("Content-Type"), inp.get_as_json()
    ('application/json', {'inputs': 'Hello'})
"""

from __future__ import annotations

import json
import re
from typing import Any, Iterator

#: ``batch_007_data`` -> index 7, key ``data``: three digits, then one separator character.
_BATCH_KEY = re.compile(r"batch_(\d{3}).(.*)", re.DOTALL)


def _as_bytes(value: str | bytes | bytearray) -> bytes | bytearray:
    if isinstance(value, str):
        return value.encode("utf-8")
    if isinstance(value, (bytes, bytearray)):
        return value
    raise TypeError(f"content values are str, bytes or bytearray, got {type(value).__name__}")


class PairList:
    """An ordered list of ``(key, value)`` pairs; keys may repeat or be ``None``.

    Values are kept as bytes; a ``str`` is stored UTF-8 encoded.

    >>> pairs = PairList().add("data", "héllo").add(None, b"\\x00")
    >>> pairs.size(), pairs.get("data"), pairs.key_at(1)
    (2, b'h\\xc3\\xa9llo', None)
    """

    def __init__(self) -> None:
        self._keys: list[str | None] = []
        self._values: list[bytes | bytearray] = []

    def add(self, key: str | None = None, value: str | bytes | bytearray | None = None) -> PairList:
        """Append one pair and return ``self``."""
        self._keys.append(key)
        self._values.append(_as_bytes(value if value is not None else b""))
        return self

    def size(self) -> int:
        return len(self._keys)

    def is_empty(self) -> bool:
        return not self._keys

    def key_at(self, index: int) -> str | None:
        return self._keys[index]

    def value_at(self, index: int) -> bytes | bytearray:
        return self._values[index]

    def get(self, key: str) -> bytes | bytearray | None:
        """The value of the first pair named ``key``, or ``None``."""
        for k, v in zip(self._keys, self._values):
            if k == key:
                return v
        return None

    def get_keys(self) -> list[str | None]:
        return list(self._keys)

    def get_values(self) -> list[bytes | bytearray]:
        return list(self._values)

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[tuple[str | None, bytes | bytearray]]:
        return iter(list(zip(self._keys, self._values)))

    def __repr__(self) -> str:
        return f"PairList({list(zip(self._keys, self._values))!r})"


class Input:
    """One request (or, with dynamic batching, several) as the Python engine sees it.

    ``properties`` are strings (HTTP headers, ``requestId``; on the init call the model
    options); ``content`` holds the body under ``data`` plus any query parameters.

    >>> inp = Input({"content-type": "text/plain"}, PairList().add("data", "hi"))
    >>> inp.get_data(), inp.is_batch(), inp.is_empty()
    ('hi', False, False)
    """

    def __init__(self, properties: dict[str, str] | None = None,
                 content: PairList | None = None) -> None:
        self.properties: dict[str, str] = dict(properties or {})
        self.content: PairList = content if content is not None else PairList()

    # -- building one (the local server and tests do; djl's worker reads a socket) --

    def add_property(self, key: str, value: str) -> Input:
        """Set a property and return ``self``."""
        self.properties[key] = value
        return self

    def add(self, key: str | None, value: str | bytes | bytearray) -> Input:
        """Append a content entry and return ``self``."""
        self.content.add(key, value)
        return self

    # -- properties --

    def get_properties(self) -> dict[str, str]:
        return self.properties

    def get_property(self, key: str) -> str | None:
        """The property ``key``, matched case-insensitively as HTTP header names are."""
        wanted = key.lower()
        return next((v for k, v in self.properties.items() if k.lower() == wanted), None)

    def get_function_name(self) -> str | None:
        return self.properties.get("handler")

    # -- content --

    def get_content(self) -> PairList:
        return self.content

    def is_empty(self) -> bool:
        """True for the init call, which carries properties but no content."""
        return self.content.is_empty()

    def contains_key(self, key: str) -> bool:
        return self.content.get(key) is not None

    def get_as_bytes(self, key: str | None = None) -> bytes | bytearray | None:
        """The raw value of ``key``; without a key, ``data`` or else the first entry.

        Returns ``None`` when there is no content at all; a missing ``key`` is a ``KeyError``.
        """
        if self.content.is_empty():
            return None
        if key:
            value = self.content.get(key)
            if value is None:
                raise KeyError(f"requested data for key {key!r} is not found")
            return value
        value = self.content.get("data")
        return value if value is not None else self.content.value_at(0)

    def get_as_string(self, key: str | None = None) -> str:
        return bytes(self._require(key)).decode("utf-8")

    def get_as_json(self, key: str | None = None) -> Any:
        return json.loads(self.get_as_string(key))

    def get_data(self, key: str | None = None) -> Any:
        """The value decoded by the ``content-type`` property, as djl_python does.

        JSON types give the decoded object, ``text/*`` a string, anything else (or no
        content type) the raw bytes; ``None`` when there is no content.
        """
        content_type = (self.get_property("content-type") or "").strip().lower()
        if self.content.is_empty():
            return None
        # startswith, as djl does: also covers "application/json; charset=utf-8".
        if content_type.startswith("application/json"):
            return self.get_as_json(key)
        if content_type.startswith("text/"):
            return self.get_as_string(key)
        return self.get_as_bytes(key)

    def _require(self, key: str | None) -> bytes | bytearray:
        value = self.get_as_bytes(key)
        if value is None:
            raise ValueError("the input has no content")
        return value

    # -- dynamic batching --

    def is_batch(self) -> bool:
        return "batch_size" in self.properties

    def get_batch_size(self) -> int:
        return int(self.properties.get("batch_size", "1"))

    def get_batches(self) -> list[Input]:
        """Split a dynamically batched input into one ``Input`` per request.

        The front end prefixes each request's properties and content keys with
        ``batch_NNN_``; a plain input is its own batch of one.

        >>> merged = Input({"batch_size": "2", "batch_001_content-type": "text/plain"})
        >>> merged = merged.add("batch_000_data", "a").add("batch_001_data", "b")
        >>> [(b.get_properties(), b.get_as_string()) for b in merged.get_batches()]
        [({}, 'a'), ({'content-type': 'text/plain'}, 'b')]
        """
        if not self.is_batch():
            return [self]
        batches = [Input() for _ in range(self.get_batch_size())]
        for key, value in self.properties.items():
            # Unprefixed properties (batch_size itself) belong to the merged input only.
            if key != "batch_size" and (parsed := self._split_key(key, len(batches))):
                index, name = parsed
                batches[index].properties[name] = value
        for key, value in self.content:
            parsed = self._split_key(key, len(batches))
            if parsed is None:
                raise ValueError(f"content key {key!r} of a batched input has no batch_NNN_ prefix")
            index, name = parsed
            batches[index].content.add(name, value)
        return batches

    @staticmethod
    def _split_key(key: str | None, size: int) -> tuple[int, str] | None:
        match = _BATCH_KEY.fullmatch(key or "")
        if match is None:
            return None
        index = int(match.group(1))
        if index >= size:
            raise ValueError(f"key {key!r} is outside the batch of {size}")
        return index, match.group(2)

    def __repr__(self) -> str:
        return f"Input(properties={self.properties!r}, content={self.content.get_keys()!r})"

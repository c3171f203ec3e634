"""The djl-serving container images djl-stream ships on, and what each one carries.

A model directory runs inside someone else's Python: the image's interpreter and the
packages it was built with. These are the facts djl-stream must fit there (read off the
images' Dockerfiles and pin files; ``make conformance`` checks them against the real ones
in ``../shared/djl-serving``), used by ``djl-stream check`` and the Dockerfiles' tests.

    >>> IMAGES["lmi"].transformers, IMAGES["neuron"].python
    ('4.51.3', '3.10')
    >>> IMAGES["lmi"].async_without_entry_point
    True
"""

from __future__ import annotations

import dataclasses
from typing import Mapping


@dataclasses.dataclass(frozen=True)
class ContainerImage:
    """One djl-serving image: where it comes from and the packages djl-stream meets there.

    ``pins`` are the exact versions the image installs of the packages djl-stream imports
    (directly or through transformers); installing djl-stream must change none of them.
    ``serving_features`` is the image's ``SERVING_FEATURES``; with ``vllm`` in it, djl-serving
    0.33 starts the Python worker in async mode unless ``option.entryPoint`` is set.
    ``smart_defaults`` names the options djl-serving fills in on its own when a Hugging Face
    model directory leaves them unset.
    """

    name: str
    djl_serving: str
    tag: str
    python: str
    pins: Mapping[str, str]
    serving_features: str
    async_without_entry_point: bool
    smart_defaults: tuple[str, ...] = ()

    @property
    def transformers(self) -> str:
        return self.pins["transformers"]

    @property
    def torch(self) -> str:
        return self.pins["torch"]


IMAGES: Mapping[str, ContainerImage] = {
    "lmi": ContainerImage(
        name="lmi",
        djl_serving="0.33.0",
        tag="763104351884.dkr.ecr.us-west-2.amazonaws.com/djl-inference:0.33.0-lmi15.0.0-cu128",
        python="3.12",
        pins={"torch": "2.6.0", "transformers": "4.51.3", "accelerate": "1.0.1",
              "pydantic": "2.9.2"},
        serving_features="vllm",
        async_without_entry_point=True,
        smart_defaults=("max_rolling_batch_size", "pipeline_parallel_degree"),
    ),
    "neuron": ContainerImage(
        name="neuron",
        djl_serving="0.30.0",
        tag="763104351884.dkr.ecr.us-west-2.amazonaws.com/djl-inference:0.30.0-neuronx-sdk2.20.1",
        python="3.10",
        pins={"torch": "2.1.2", "transformers": "4.45.2", "accelerate": "0.29.2",
              "pydantic": "2.6.1", "huggingface-hub": "0.25.2"},
        serving_features="vllm,lmi-dist,tnx",
        async_without_entry_point=False,
        smart_defaults=("n_positions", "max_rolling_batch_size", "tensor_parallel_degree"),
    ),
}

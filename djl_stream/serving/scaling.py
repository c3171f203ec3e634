"""How many model replicas serve a directory on Ray Serve, and how each is sized (no Ray
needed to read or check them: ``djl-stream serve --ray``'s flags become one of these before
Ray is imported; :mod:`djl_stream.serving.ray_serve` deploys them).

    >>> ScalingOptions(min_replicas=1, max_replicas=4).deployment_options(batch_rows=32)
    {'ray_actor_options': {'num_cpus': 1}, 'max_ongoing_requests': 32, 'autoscaling_config': {'min_replicas': 1, 'max_replicas': 4, 'target_ongoing_requests': 8}}
"""

from __future__ import annotations

import dataclasses
from typing import Any, Dict, Mapping, Optional

#: Environment variables the replicas need from the process that deploys them: the model's
#: options (SageMaker-style ``OPTION_*``) and where models and caches live.
PASSED_ENVIRONMENT = ("OPTION_", "DJL_", "HF_", "TRANSFORMERS_", "TORCHINDUCTOR_")


@dataclasses.dataclass(frozen=True)
class ScalingOptions:
    """How many model replicas, and how each one is sized.

    ``replicas`` fixes the count; ``max_replicas`` (with ``min_replicas``) turns on Ray
    Serve's autoscaling instead, which adds a replica when the requests in flight per
    replica stay above ``target_ongoing_requests``. ``max_ongoing_requests`` bounds what
    Ray sends one replica at once (None: the model's ``max_rolling_batch_size``).

    >>> ScalingOptions(replicas=2).deployment_options()["num_replicas"]
    2
    >>> ScalingOptions(min_replicas=1, max_replicas=4).deployment_options()["autoscaling_config"]
    {'min_replicas': 1, 'max_replicas': 4, 'target_ongoing_requests': 8}
    """

    replicas: int = 1
    min_replicas: int = 1
    max_replicas: Optional[int] = None
    target_ongoing_requests: float = 8
    replica_cpus: float = 1
    max_ongoing_requests: Optional[int] = None

    def __post_init__(self) -> None:
        if self.replicas < 1:
            raise ValueError(f"replicas must be at least 1, got {self.replicas}")
        if self.max_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) must be between 0 and "
                             f"max_replicas ({self.max_replicas})")
        if self.target_ongoing_requests <= 0:
            raise ValueError("target_ongoing_requests must be positive, got "
                             f"{self.target_ongoing_requests}")
        if self.replica_cpus <= 0:
            raise ValueError(f"replica_cpus must be positive, got {self.replica_cpus}")

    def deployment_options(self, batch_rows: Optional[int] = None) -> Dict[str, Any]:
        """``serve.deployment`` options of the model replicas (``batch_rows``: the model's
        ``max_rolling_batch_size``, what a replica batches)."""
        options: Dict[str, Any] = {"ray_actor_options": {"num_cpus": self.replica_cpus}}
        ongoing = self.max_ongoing_requests or batch_rows
        if ongoing:
            options["max_ongoing_requests"] = ongoing
        if self.max_replicas is None:
            options["num_replicas"] = self.replicas
        else:
            options["autoscaling_config"] = {
                "min_replicas": self.min_replicas, "max_replicas": self.max_replicas,
                "target_ongoing_requests": self.target_ongoing_requests}
        return options


def passed_environment(environ: Mapping[str, str]) -> Dict[str, str]:
    """The variables of ``environ`` the replicas get (Ray starts them from its own
    processes, which on another node never saw the deploying shell's environment).

    >>> passed_environment({"OPTION_COMPILE": "false", "HOME": "/root"})
    {'OPTION_COMPILE': 'false'}
    """
    return {name: value for name, value in environ.items()
            if name.startswith(PASSED_ENVIRONMENT)}

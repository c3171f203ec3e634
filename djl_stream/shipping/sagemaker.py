"""Shipping a model directory to SageMaker: ``model.tar.gz``, S3 upload, endpoint creation,
autoscaling.

SageMaker unpacks the ``ModelDataUrl`` archive into ``/opt/ml/model``, which is where
djl-serving looks for its model, so the archive holds the *contents* of the model
directory at its root (``model.py``, ``serving.properties``...), never a ``model/``
folder. When ``option.model_id`` sends the loader elsewhere (a hub id, an S3 prefix that
djl-serving downloads itself, an absolute path) the weights in the directory would be dead
weight, and they are left out (those at the top level, where a Hugging Face folder keeps
them; subfolders always ship).

The archive also carries the ``djl_stream`` package itself beside ``model.py`` (pure Python,
the version that wrote the archive): djl-serving puts the model directory on the worker's
``PYTHONPATH``, so the stock LMI and Neuron images, which have every library djl-stream
needs but not djl-stream, import it from there. No ``requirements.txt`` is needed for
them (``make conformance`` runs the real worker from an unpacked archive in venvs of
their libraries, without djl-stream installed).

boto3 is imported only by the functions that talk to AWS (``pip install djl-stream[sagemaker]``).

Example::

    >>> from djl_stream.shipping.sagemaker import write_package, upload, deploy, autoscale  # doctest: +SKIP
    >>> write_package("model/", "model.tar.gz")                          # doctest: +SKIP
    >>> data = upload("model.tar.gz", "s3://my-bucket/djl-stream/")      # doctest: +SKIP
    >>> deploy("123456789012.dkr.ecr.us-west-2.amazonaws.com/djl-stream:lmi", data,
    ...        "arn:aws:iam::123456789012:role/SageMakerRole", "djl-stream-smollm2")  # doctest: +SKIP
    >>> autoscale("djl-stream-smollm2", min_instances=1, max_instances=4,
    ...           target_per_instance=120)                               # doctest: +SKIP
"""

from __future__ import annotations

import dataclasses
import re
import tarfile
from pathlib import Path
from typing import Any, BinaryIO, Callable, Mapping, Optional

from djl_stream.serving.properties import ModelProperties, PropertyError, djl_init_properties

#: Files that are model weights (left out of the archive when ``option.model_id`` points
#: elsewhere). Index files go with them: without their shards they only confuse a loader.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack")
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
#: Never shipped: caches and editor/OS litter.
SKIPPED_DIRS = frozenset({"__pycache__", ".ipynb_checkpoints", ".git", ".hypothesis",
                          ".pytest_cache"})
SKIPPED_FILES = frozenset({".DS_Store"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
#: The package that ships beside model.py (see the module docstring).
PACKAGE_DIR = Path(__file__).resolve().parents[1]

#: SageMaker's pattern for model, endpoint-config and endpoint names.
_NAME = re.compile(r"^[a-zA-Z0-9](-*[a-zA-Z0-9]){0,62}$")
_S3_URI = re.compile(r"^s3://(?P<bucket>[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9])(?:/(?P<key>.*))?$")


def is_weight_file(name: str) -> bool:
    """True for a weights file or a sharded checkpoint's index.

    >>> is_weight_file("model-00001-of-00002.safetensors"), is_weight_file("config.json")
    (True, False)
    """
    return name.endswith(WEIGHT_SUFFIXES) or name in WEIGHT_INDEXES


def weights_elsewhere(model_dir: str | Path, environ: Optional[Mapping[str, str]] = None) -> bool:
    """True when ``option.model_id`` names weights outside ``model_dir``.

    A ``model_id`` that is a relative path inside the directory keeps its weights in the
    archive; unset keeps everything. ``environ`` supplies ``OPTION_*`` variables as in
    djl-serving (default: none, since the archive must not depend on this shell).
    """
    model_dir = Path(model_dir).resolve()
    properties = djl_init_properties(model_dir, environ if environ is not None else {})
    model_id = (properties.get("model_id") or "").strip()
    if not model_id:
        return False
    if "://" in model_id or Path(model_id).is_absolute():
        return True
    inside = (model_dir / model_id).resolve()
    return not (inside.exists() and inside.is_relative_to(model_dir))


@dataclasses.dataclass(frozen=True)
class PackagePlan:
    """What ``model.tar.gz`` will hold: ``(path on disk, name in the archive)`` pairs, and
    the weight files left out because ``option.model_id`` points elsewhere."""

    files: tuple[tuple[Path, str], ...]
    left_out: tuple[str, ...]
    #: whether ``djl_stream/`` ships beside model.py
    vendored: bool = False

    @property
    def names(self) -> list[str]:
        return [name for _, name in self.files]


def plan_package(model_dir: str | Path, *, output: Optional[str | Path] = None,
                 environ: Optional[Mapping[str, str]] = None,
                 vendor: bool = True) -> PackagePlan:
    """The files :func:`write_package` will archive, without writing anything.

    Names are relative to ``model_dir`` (the archive root), sorted; ``__pycache__``,
    ``*.pyc``, the output file itself and other litter are skipped. With ``vendor`` the
    ``djl_stream`` package is added as ``djl_stream/...`` (unless the directory has its
    own), so that the archive runs on djl-serving's stock images.

    >>> plan_package("model/").names[:2]  # doctest: +SKIP
    ['chat_template.jinja', 'config.json']
    """
    root = Path(model_dir).resolve()
    if not root.is_dir():
        raise FileNotFoundError(f"{model_dir} is not a directory")
    drop_weights = weights_elsewhere(root, environ)
    out = Path(output).resolve() if output is not None else None
    files: list[tuple[Path, str]] = []
    left_out: list[str] = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if any(part in SKIPPED_DIRS for part in relative.parts[:-1]) or path.is_dir():
            continue
        if path.name in SKIPPED_FILES or path.name.endswith(SKIPPED_SUFFIXES):
            continue
        if out is not None and path.resolve() == out:
            continue
        name = relative.as_posix()
        # Only the top level holds the Hugging Face folder; subfolders (compiled Neuron
        # artifacts, helper code) are the model's own and always ship.
        if drop_weights and len(relative.parts) == 1 and is_weight_file(path.name):
            left_out.append(name)
            continue
        files.append((path, name))
    vendored = vendor and not (root / "djl_stream").exists()
    if vendored:
        files += _package_files()
    return PackagePlan(tuple(files), tuple(left_out), vendored)


def _package_files() -> list[tuple[Path, str]]:
    """The ``djl_stream`` package's own files as ``(path, name in the archive)``."""
    return [(path, f"djl_stream/{path.relative_to(PACKAGE_DIR).as_posix()}")
            for path in sorted(PACKAGE_DIR.rglob("*"))
            if path.is_file() and "__pycache__" not in path.parts
            and not path.name.endswith(SKIPPED_SUFFIXES)]


def _normalised(info: tarfile.TarInfo) -> tarfile.TarInfo:
    # Owner names of the build machine mean nothing in the container; readable by all, so
    # that djl-serving's user (root or djl) can read what SageMaker unpacked.
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    info.mode = 0o644 if info.isfile() else 0o755
    return info


def write_package(model_dir: str | Path, output: str | Path = "model.tar.gz", *,
                  environ: Optional[Mapping[str, str]] = None,
                  compresslevel: int = 6, vendor: bool = True,
                  progress: Optional[Callable[[int, int], None]] = None) -> PackagePlan:
    """Write ``output`` (a gzipped tar) with ``model_dir``'s files at the archive root.

    Symbolic links are followed (weights linked from a hub cache are shipped as files).
    ``progress(bytes_packed, bytes_in_all)`` is called as the files' bytes go in (weights
    take minutes to compress). Returns the :class:`PackagePlan` that was written.

    >>> plan = write_package("model/", "model.tar.gz")  # doctest: +SKIP
    >>> "model.py" in plan.names and not any(n.startswith("model/") for n in plan.names)  # doctest: +SKIP
    True
    """
    plan = plan_package(model_dir, output=output, environ=environ, vendor=vendor)
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    # compresslevel 6: weights barely compress, and level 9 costs minutes on a large model.
    total = sum(Path(path).stat().st_size for path, _ in plan.files if Path(path).is_file())
    packed = 0

    def count(size: int) -> None:
        nonlocal packed
        packed += size
        if progress is not None:
            progress(packed, total)

    with tarfile.open(partial, "w:gz", compresslevel=compresslevel, dereference=True) as tar:
        for path, name in plan.files:
            info = _normalised(tar.gettarinfo(path, arcname=name))
            if not info.isfile():
                tar.addfile(info)
                continue
            with open(path, "rb") as data:
                tar.addfile(info, _CountingReader(data, count))
    partial.replace(output)  # never leave a truncated archive under the final name
    return plan


class _CountingReader:
    """A file whose reads are counted (what :func:`write_package`'s progress reports)."""

    def __init__(self, data: BinaryIO, count: Callable[[int], None]) -> None:
        self._data, self._count = data, count

    def read(self, size: int = -1) -> bytes:
        chunk = self._data.read(size)
        self._count(len(chunk))
        return chunk


# -- AWS --

def parse_s3_uri(uri: str) -> tuple[str, str]:
    """``(bucket, key)`` of an ``s3://bucket/key`` URI; raises ``ValueError`` otherwise.

    >>> parse_s3_uri("s3://my-bucket/models/model.tar.gz")
    ('my-bucket', 'models/model.tar.gz')
    """
    match = _S3_URI.match(uri.strip())
    if not match:
        raise ValueError(f"not an S3 URI (s3://bucket/key with a valid bucket name): {uri!r}")
    return match["bucket"], match["key"] or ""


def _client(service: str, client: Any, region_name: Optional[str]) -> Any:
    if client is not None:
        return client
    try:
        import boto3
    except ImportError:
        raise ImportError("talking to SageMaker needs boto3: pip install 'djl-stream[sagemaker]'"
                          ) from None
    return boto3.client(service, region_name=region_name)


def upload(tarball: str | Path, s3_uri: str, *, s3_client: Any = None,
           region_name: Optional[str] = None) -> str:
    """Upload ``tarball`` to ``s3_uri`` and return the object's URI (``ModelDataUrl``).

    A URI ending in ``/`` (or naming only a bucket) is a prefix: the file's own name is
    appended. boto3's ``upload_file`` is used, so large archives go up in parts.

    >>> upload("model.tar.gz", "s3://my-bucket/djl-stream/")  # doctest: +SKIP
    's3://my-bucket/djl-stream/model.tar.gz'
    """
    tarball = Path(tarball)
    if not tarball.is_file():
        raise FileNotFoundError(f"{tarball} does not exist; write it with djl-stream package")
    bucket, key = parse_s3_uri(s3_uri)
    if not key or key.endswith("/"):
        key += tarball.name
    _client("s3", s3_client, region_name).upload_file(str(tarball), bucket, key)
    return f"s3://{bucket}/{key}"


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{kind} {name!r} is not a valid SageMaker name: 1 to 63 letters, "
                         "digits and hyphens, starting with a letter or digit")
    return name


def container_environment(env: Optional[Mapping[str, Any]]) -> dict[str, str]:
    """``env`` as SageMaker's ``Environment`` map: string keys and values.

    ``OPTION_<KEY>`` variables configure the model exactly as ``option.<key>`` in
    ``serving.properties`` would (which wins over them). A value that is no valid property
    is refused here, before an endpoint spends minutes starting to fail.

    >>> container_environment({"OPTION_MAX_NEW_TOKENS_LIMIT": 512, "HF_HUB_OFFLINE": "1"})
    {'OPTION_MAX_NEW_TOKENS_LIMIT': '512', 'HF_HUB_OFFLINE': '1'}
    """
    environment = {str(key): str(value) for key, value in (env or {}).items()}
    options = {key[len("OPTION_"):].lower(): value for key, value in environment.items()
               if key.startswith("OPTION_")}
    known = set(ModelProperties.known_keys())
    typed = {key: value for key, value in options.items() if key in known}
    try:
        ModelProperties.from_init_properties(typed)
    except PropertyError as error:
        raise ValueError(f"env: {error}") from error
    return environment


#: Seconds SageMaker waits for ``/ping`` after the container starts, by default. djl-serving
#: opens its port only once the model is loaded: a first start on a CPU instance may wait
#: for djl-serving's whole ``model_loading_timeout`` (240 s), a large model's download of
#: its weights from the hub takes longer, and a GPU image pulls gigabytes first.
DEFAULT_STARTUP_HEALTH_CHECK_TIMEOUT_S = 900
#: Seconds SageMaker gives the download of ``model.tar.gz`` into ``/opt/ml/model``.
DEFAULT_MODEL_DATA_DOWNLOAD_TIMEOUT_S = 900


def deploy(
    image_uri: str,
    model_data_s3_uri: Optional[str],
    role_arn: str,
    endpoint_name: str,
    instance_type: str = "ml.g5.xlarge",
    env: Optional[Mapping[str, Any]] = None,
    *,
    initial_instance_count: int = 1,
    model_name: Optional[str] = None,
    endpoint_config_name: Optional[str] = None,
    startup_health_check_timeout_s: Optional[int] = DEFAULT_STARTUP_HEALTH_CHECK_TIMEOUT_S,
    model_data_download_timeout_s: Optional[int] = DEFAULT_MODEL_DATA_DOWNLOAD_TIMEOUT_S,
    sagemaker_client: Any = None,
    region_name: Optional[str] = None,
    wait: bool = False,
) -> dict[str, str]:
    """Create the SageMaker model, endpoint configuration and endpoint for an image.

    ``image_uri`` is the djl-stream image in your ECR (``docker/``); ``model_data_s3_uri``
    the ``model.tar.gz`` from :func:`upload`, or ``None`` to serve the ``/opt/ml/model``
    baked into the image; ``env`` the container's environment (``OPTION_*`` variables).
    The model and endpoint configuration are named after the endpoint unless named here;
    SageMaker refuses to reuse a name, so give new ones to deploy again. With ``wait`` the
    call returns once the endpoint is ``InService`` (boto3's waiter; raises if it fails).

    ``startup_health_check_timeout_s`` (default
    :data:`DEFAULT_STARTUP_HEALTH_CHECK_TIMEOUT_S`) and ``model_data_download_timeout_s``
    (default :data:`DEFAULT_MODEL_DATA_DOWNLOAD_TIMEOUT_S`) become the production variant's
    ``ContainerStartupHealthCheckTimeoutInSeconds`` and
    ``ModelDataDownloadTimeoutInSeconds`` (SageMaker allows 60 to 3600); ``None`` leaves
    one to SageMaker's default.

    Returns the names and ARNs created::

        >>> deploy("123456789012.dkr.ecr.us-west-2.amazonaws.com/djl-stream:lmi",
        ...        "s3://my-bucket/djl-stream/model.tar.gz",
        ...        "arn:aws:iam::123456789012:role/SageMakerRole", "djl-stream-smollm2",
        ...        env={"OPTION_DTYPE": "fp16"})  # doctest: +SKIP
        {'model_name': 'djl-stream-smollm2', ..., 'endpoint_arn': 'arn:aws:sagemaker:...'}
    """
    endpoint_name = _check_name("endpoint name", endpoint_name)
    model_name = _check_name("model name", model_name or endpoint_name)
    endpoint_config_name = _check_name("endpoint config name",
                                       endpoint_config_name or endpoint_name)
    if model_data_s3_uri is not None:
        parse_s3_uri(model_data_s3_uri)
    if initial_instance_count < 1:
        raise ValueError(f"initial_instance_count must be at least 1, got {initial_instance_count}")
    client = _client("sagemaker", sagemaker_client, region_name)

    container: dict[str, Any] = {"Image": image_uri,
                                 "Environment": container_environment(env)}
    if model_data_s3_uri is not None:
        container["ModelDataUrl"] = model_data_s3_uri
    model = client.create_model(ModelName=model_name, ExecutionRoleArn=role_arn,
                                PrimaryContainer=container)

    variant: dict[str, Any] = {"VariantName": "AllTraffic", "ModelName": model_name,
                               "InstanceType": instance_type,
                               "InitialInstanceCount": initial_instance_count}
    # djl-serving answers /ping only once the model is loaded (see the defaults above).
    if startup_health_check_timeout_s is not None:
        variant["ContainerStartupHealthCheckTimeoutInSeconds"] = int(startup_health_check_timeout_s)
    if model_data_download_timeout_s is not None:
        variant["ModelDataDownloadTimeoutInSeconds"] = int(model_data_download_timeout_s)
    config = client.create_endpoint_config(EndpointConfigName=endpoint_config_name,
                                           ProductionVariants=[variant])
    endpoint = client.create_endpoint(EndpointName=endpoint_name,
                                      EndpointConfigName=endpoint_config_name)
    if wait:
        client.get_waiter("endpoint_in_service").wait(EndpointName=endpoint_name)
    return {"model_name": model_name, "model_arn": model.get("ModelArn", ""),
            "endpoint_config_name": endpoint_config_name,
            "endpoint_config_arn": config.get("EndpointConfigArn", ""),
            "endpoint_name": endpoint_name, "endpoint_arn": endpoint.get("EndpointArn", "")}


#: Target-tracking metrics an endpoint can scale on: invocations per instance per minute
#: (SageMaker's classic one), or requests in flight per model copy, sampled every 10 s
#: (closer to what a streaming LLM's instance can hold, since a stream lasts seconds).
SCALING_METRICS = ("SageMakerVariantInvocationsPerInstance",
                   "SageMakerVariantConcurrentRequestsPerModelHighResolution")


def autoscale(endpoint_name: str, min_instances: int, max_instances: int,
              target_per_instance: float, *, variant_name: str = "AllTraffic",
              metric: str = SCALING_METRICS[0], scale_in_cooldown_s: int = 300,
              scale_out_cooldown_s: int = 60, autoscaling_client: Any = None,
              region_name: Optional[str] = None) -> dict[str, str]:
    """Let Application Auto Scaling change an endpoint's instance count between
    ``min_instances`` and ``max_instances``, keeping ``metric`` near ``target_per_instance``.

    Each instance runs the same model directory with its own continuous batching, so an
    endpoint scales out as a Ray Serve deployment does: more copies of one ``handle()``.
    This registers the variant as a scalable target and puts a target-tracking policy on
    it (named ``<endpoint>-<metric>``); scaling in waits ``scale_in_cooldown_s`` after the
    last change, scaling out ``scale_out_cooldown_s``. Returns the policy's ARN and name::

        >>> autoscale("djl-stream-smollm2", 1, 4, target_per_instance=120)  # doctest: +SKIP
        {'policy_name': 'djl-stream-smollm2-SageMakerVariantInvocationsPerInstance', ...}
    """
    endpoint_name = _check_name("endpoint name", endpoint_name)
    if not 1 <= min_instances <= max_instances:
        raise ValueError(f"min_instances must be at least 1 and at most max_instances "
                         f"({max_instances}), got {min_instances}")
    if target_per_instance <= 0:
        raise ValueError(f"target_per_instance must be positive, got {target_per_instance}")
    if metric not in SCALING_METRICS:
        raise ValueError(f"metric must be one of {', '.join(SCALING_METRICS)}, got {metric!r}")
    client = _client("application-autoscaling", autoscaling_client, region_name)
    resource = f"endpoint/{endpoint_name}/variant/{variant_name}"
    dimension = "sagemaker:variant:DesiredInstanceCount"
    client.register_scalable_target(
        ServiceNamespace="sagemaker", ResourceId=resource, ScalableDimension=dimension,
        MinCapacity=min_instances, MaxCapacity=max_instances)
    policy_name = f"{endpoint_name}-{metric}"
    policy = client.put_scaling_policy(
        PolicyName=policy_name, ServiceNamespace="sagemaker", ResourceId=resource,
        ScalableDimension=dimension, PolicyType="TargetTrackingScaling",
        TargetTrackingScalingPolicyConfiguration={
            "TargetValue": float(target_per_instance),
            "PredefinedMetricSpecification": {"PredefinedMetricType": metric},
            "ScaleInCooldown": int(scale_in_cooldown_s),
            "ScaleOutCooldown": int(scale_out_cooldown_s)})
    return {"policy_name": policy_name, "policy_arn": policy.get("PolicyARN", ""),
            "resource_id": resource}

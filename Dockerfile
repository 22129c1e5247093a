# syntax=docker/dockerfile:1
# One image for every omni-serve service; the container command picks which:
#   omni-thinker | omni-talker | omni-code2wav | omni-router | omni-tiny-checkpoint
#
#   docker build -t omni-serve:cpu .
#   docker build -t omni-serve:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
#   docker run --rm -p 50063:50063 -v "$PWD/models:/models:ro" omni-serve:cpu \
#       omni-code2wav --checkpoint /models/tiny-qwen3-omni
#
# Runs as uid/gid 10001 (non-root) and writes only under /tmp, so a read-only root filesystem
# with an emptyDir on /tmp works (k8s/base).

ARG PYTHON_VERSION=3.11

# ---- build: a virtual environment with the pinned dependencies and the package ----
FROM python:${PYTHON_VERSION}-slim-bookworm AS build

# torch comes from PyTorch's own index, one wheel per accelerator, pinned as in requirements.txt:
# - CPU (default): https://download.pytorch.org/whl/cpu (no CUDA libraries: a small image).
# - NVIDIA GPU: https://download.pytorch.org/whl/cu128 (or the cuXYZ that the nodes' driver
#   supports); the CUDA runtime comes inside the wheel's nvidia-* packages, the driver from the
#   node (NVIDIA container toolkit), so the base image stays the same.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /src

RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

# Runtime dependencies only (pyproject.toml's list), at the exact versions requirements.txt pins
# (a constraints file: its test-only pins are not installed). grpcio-tools generates the protobuf
# code below and is removed again.
COPY requirements.txt pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/runtime-requirements.txt \
    && pip install -c requirements.txt -r /tmp/runtime-requirements.txt grpcio-tools

COPY README.md ./
COPY protos ./protos
COPY services ./services
COPY router ./router
COPY sessions ./sessions
COPY bench ./bench
COPY gateway ./gateway
# The protobuf code (omni/v1, not in git): the Makefile's `proto` target, run here.
RUN python -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. protos/omni/v1/*.proto \
    && touch omni/__init__.py omni/v1/__init__.py
# pip byte-compiles what it installs, so the read-only image never compiles at start-up. The
# invariant GEMM of --exact-batching gemm (services/runtime/lm/invariant_gemm.c) is compiled here, next
# to its source in the installed package, with the build stage's own compiler (not in the runtime).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev && rm -rf /var/lib/apt/lists/* \
    && pip install --no-deps . \
    && pip uninstall -y grpcio-tools \
    && cd /tmp && python -m services.runtime.lm.invariant_gemm

# ---- runtime ----
FROM python:${PYTHON_VERSION}-slim-bookworm

RUN groupadd --gid 10001 omni \
    && useradd --uid 10001 --gid 10001 --home-dir /tmp --no-create-home --shell /usr/sbin/nologin omni
COPY --from=build /opt/venv /opt/venv

ENV PATH=/opt/venv/bin:$PATH
ENV PYTHONUNBUFFERED=1
ENV PYTHONDONTWRITEBYTECODE=1
# Everything a service may write goes under /tmp (an emptyDir in Kubernetes): caches of
# Hugging Face, torch, Triton and CUDA's JIT all follow HOME / XDG_CACHE_HOME.
ENV HOME=/tmp
ENV XDG_CACHE_HOME=/tmp/.cache
ENV HF_HOME=/tmp/.cache/huggingface
# Checkpoints are local folders: never reach for the Hub.
ENV HF_HUB_OFFLINE=1
ENV TRANSFORMERS_OFFLINE=1

USER 10001:10001
WORKDIR /tmp
# gRPC: router 50051, thinker 50061, talker 50062, code2wav 50063; Prometheus metrics 9090.
EXPOSE 50051 50061 50062 50063 9090
CMD ["omni-router"]

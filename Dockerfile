# gspo-megatron images. Two targets:
#   gpu (default): NVIDIA's PyTorch container (CUDA, NCCL, Transformer Engine, apex) + pinned
#       megatron-core + this package; SGLang in its own virtualenv at /opt/sglang, because its
#       wheel pins an exact torch that would replace the container's. The rollout servers run
#       /opt/sglang/bin/python (GSPO_SGLANG_PYTHON in slurm/gspo_30b.sh), the learners `python`.
#   cpu: Python + CPU torch for development and the tiny config (no GPU stack).
#
#   docker build --target gpu -t gspo-megatron:gpu .
#   docker build --target cpu -t gspo-megatron:cpu .
#   enroot import dockerd://gspo-megatron:gpu   # -> .sqsh for GSPO_CONTAINER_IMAGE (pyxis)
# Linted in CI with hadolint (tests/test_slurm_scripts.py).

ARG GPU_BASE=nvcr.io/nvidia/pytorch:25.06-py3
ARG CPU_BASE=python:3.11-slim-bookworm

FROM ${GPU_BASE} AS gpu
ARG MEGATRON_CORE_VERSION=0.16.1
ARG SGLANG_VERSION=0.5.23
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
RUN pip install --no-cache-dir "megatron-core==${MEGATRON_CORE_VERSION}"
RUN python -m venv /opt/sglang \
    && /opt/sglang/bin/pip install --no-cache-dir "sglang[all]==${SGLANG_VERSION}"
WORKDIR /workspace/gspo-megatron
COPY pyproject.toml README.md ./
COPY gspo_megatron ./gspo_megatron
# The container's torch satisfies the package's torch>=2.6, so pip keeps NVIDIA's build.
# hadolint ignore=DL3013
RUN pip install --no-cache-dir .
COPY configs ./configs
COPY slurm ./slurm
COPY pipelines ./pipelines
COPY tools ./tools

FROM ${CPU_BASE} AS cpu
ARG TORCH_VERSION=2.13.0
ARG MEGATRON_CORE_VERSION=0.16.1
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl git \
    && rm -rf /var/lib/apt/lists/*
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir "megatron-core==${MEGATRON_CORE_VERSION}"
WORKDIR /workspace/gspo-megatron
COPY pyproject.toml README.md ./
COPY gspo_megatron ./gspo_megatron
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[dev]"
COPY . .

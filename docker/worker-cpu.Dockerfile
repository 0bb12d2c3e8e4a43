# The worker and router image for CPU-only nodes: `disagg worker|router|make-model` with torch's CPU
# build (examples/cpu-tiny.yaml runs it). No CUDA, so a fraction of worker.Dockerfile's size.
# Build from the repository root:
#   docker build -f docker/worker-cpu.Dockerfile -t ghcr.io/disagg/disagg-worker:0.1.0-cpu .
# TORCH_INDEX names another index holding torch's CPU wheels (a local mirror, for example).
FROM debian:bookworm-slim

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/disagg

# gcc builds the CPU path's native kernels on first use.
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv $VIRTUAL_ENV

WORKDIR /src
# Dependencies first, so code changes do not re-download torch.
COPY pyproject.toml setup.py README.md ./
RUN pip install --upgrade pip \
 && pip install "torch==2.13.0" --index-url $TORCH_INDEX
COPY src ./src
# The gRPC modules are generated while the wheel is built; tests/test_packaging.py runs this
# install line in a clean virtual environment.
RUN pip install ".[worker]" \
 && rm -rf /src

RUN useradd --uid 1000 --create-home --home-dir /home/disagg disagg
USER 1000:1000
WORKDIR /home/disagg
EXPOSE 50051 9100 8000
ENTRYPOINT ["disagg"]

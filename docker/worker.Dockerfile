# The worker and router image: `disagg worker|router|make-model` on a CUDA runtime.
# Build from the repository root: docker build -f docker/worker.Dockerfile -t ghcr.io/disagg/disagg-worker:0.1.0 .
FROM nvidia/cuda:12.8.1-cudnn-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HOME=/home/disagg

# UCX/NIXL need the RDMA user-space libraries (libibverbs, librdmacm) to use InfiniBand/RoCE.
# gcc builds the CPU path's native kernels on first use (CPU-only workers; GPUs use Triton).
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3.12 python3.12-venv ca-certificates \
      libibverbs1 librdmacm1 ibverbs-providers gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python3.12 -m venv $VIRTUAL_ENV

WORKDIR /src
# Dependencies first, so code changes do not re-download torch.
COPY pyproject.toml setup.py README.md ./
RUN pip install --upgrade pip \
 && pip install "torch==2.13.0" --index-url https://download.pytorch.org/whl/cu128 \
 && pip install triton "huggingface_hub[cli]"
COPY src ./src
# The gRPC modules are generated while the wheel is built; tests/test_packaging.py runs this
# install line in a clean virtual environment.
RUN pip install ".[worker]"

RUN useradd --uid 1000 --create-home --home-dir /home/disagg disagg
USER 1000:1000
WORKDIR /home/disagg
EXPOSE 50051 9100 8000
ENTRYPOINT ["disagg"]

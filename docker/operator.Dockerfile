# The operator image: only what `disagg operator` imports (kopf, aiohttp, redis, pyyaml,
# prometheus-client for the autoscaler's own metrics), no torch.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t ghcr.io/disagg/disagg-operator:0.1.0 .
FROM python:3.12-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY worker ./worker
COPY kernels ./kernels
COPY proto ./proto
COPY operator ./operator
# --no-deps: the operator needs none of the engine's dependencies (torch, nixl, ...).
RUN pip install "kopf>=1.37" "aiohttp>=3.9" "redis>=5.0" "pyyaml>=6.0" "prometheus-client>=0.20" \
 && pip install --no-deps . \
 && rm -rf /src

# Matches the chart's runAsUser; the root filesystem is mounted read-only.
USER 65532:65532
WORKDIR /tmp
# 8080: liveness (--liveness); 9090: the autoscaler's own Prometheus metrics (DISAGG_AUTOSCALER_METRICS_PORT).
EXPOSE 8080 9090
ENTRYPOINT ["disagg"]
CMD ["operator", "--all-namespaces", "--standalone"]

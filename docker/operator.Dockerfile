# The operator image: the `operator` extra only (kopf and the Kubernetes client), no torch or NIXL.
# Build from the repository root: docker build -f docker/operator.Dockerfile -t ghcr.io/disagg/disagg-operator:0.1.0 .
FROM debian:bookworm-slim

ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH

RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ca-certificates \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv $VIRTUAL_ENV

WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY src ./src
# tests/test_packaging.py runs this install line in a clean virtual environment.
RUN pip install ".[operator]" \
 && rm -rf /src

# Matches the chart's runAsUser; the root filesystem is mounted read-only. The operator does not
# need a passwd entry (it names itself to kopf), but tools in the container expect one.
RUN useradd --uid 65532 --user-group --no-create-home --home-dir /tmp --shell /usr/sbin/nologin disagg-operator
USER 65532:65532
WORKDIR /tmp
# 8080: liveness (--liveness); 9090: the autoscaler's own Prometheus metrics (DISAGG_AUTOSCALER_METRICS_PORT).
EXPOSE 8080 9090
ENTRYPOINT ["disagg"]
CMD ["operator", "--all-namespaces", "--standalone"]

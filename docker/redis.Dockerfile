# Debian's redis-server under the uid the operator's managed Redis runs as (999, the official
# image's `redis` user), with /data as its working directory. The operator runs `redis-server
# <config> --save "" --appendonly no --protected-mode yes` from `sh -c`, which this image serves
# as well as `redis:7.4-alpine`; hack/node builds it for its node, which pulls from no registry.
FROM debian:bookworm-slim

ARG DEBIAN_FRONTEND=noninteractive
# The user first, so the package's postinst keeps it instead of making its own.
RUN groupadd --system --gid 999 redis \
 && useradd --system --uid 999 --gid 999 --no-create-home --home-dir /data --shell /usr/sbin/nologin redis \
 && apt-get update \
 && apt-get install -y --no-install-recommends redis-server \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir /data && chown redis:redis /data

WORKDIR /data
USER 999:999
EXPOSE 6379
CMD ["redis-server"]

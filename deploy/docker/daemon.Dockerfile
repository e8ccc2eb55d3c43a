# syntax=docker/dockerfile:1
#
# ckptd daemon image: `ckptd serve` on a small Python base, running as a non-root user.
#
#   docker build -f deploy/docker/daemon.Dockerfile -t ckptd:0.1.0 .
#   docker run --rm -e CKPTD_STORAGE=s3://bucket/prefix -e AWS_ENDPOINT_URL=... \
#       -e AWS_ACCESS_KEY_ID=... -e AWS_SECRET_ACCESS_KEY=... \
#       -v /run/ckptd:/run/ckptd -v /dev/shm/ckptd:/dev/shm/ckptd ckptd:0.1.0 --shm-dir /dev/shm/ckptd
#
# Every `ckptd serve` flag can be given as an argument after the image name or as a CKPTD_* variable
# (CKPTD_STORAGE, CKPTD_STAGING_BYTES, ...). See docs/OPERATIONS.md.

# ---- build stage: a self-contained virtual environment in /opt/ckptd -------------------------------
FROM python:3.11-slim-trixie AS build

# The daemon never imports torch, but the ckptd package depends on it (for the client). The default
# torch wheel pulls several GB of CUDA libraries, so torch comes from PyTorch's CPU-only index,
# pinned; everything else comes from the default index.
ARG TORCH_VERSION=2.13.0
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/ckptd/bin:$PATH

RUN python -m venv /opt/ckptd \
 && pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY ckptd/ ckptd/
COPY client/ client/
# torch is already satisfied, so pip keeps the CPU build; the constraint makes sure of it.
RUN echo "torch==${TORCH_VERSION}" > /tmp/torch-constraint.txt \
 && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt . \
 && ckptd --help > /dev/null

# ---- runtime stage ---------------------------------------------------------------------------------
FROM python:3.11-slim-trixie

# uid/gid of the daemon; the gid is also the socket group: training processes that talk to the daemon
# must be members of it (k8s: supplementalGroups, docker: --group-add, bare metal: usermod -aG).
ARG CKPTD_UID=10001
ARG CKPTD_GID=10001

LABEL org.opencontainers.image.title="ckptd" \
      org.opencontainers.image.description="Per-node daemon for async sharded checkpointing of FSDP training (zarr v3 on S3 or local disk)" \
      org.opencontainers.image.licenses="Apache-2.0"

RUN groupadd --system --gid "${CKPTD_GID}" ckptd \
 && useradd --system --uid "${CKPTD_UID}" --gid ckptd --no-create-home \
            --home-dir /nonexistent --shell /usr/sbin/nologin ckptd \
 && install -d -o ckptd -g ckptd -m 0750 /run/ckptd

COPY --from=build /opt/ckptd /opt/ckptd

ENV PATH=/opt/ckptd/bin:$PATH \
    PYTHONUNBUFFERED=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    CKPTD_SOCKET=/run/ckptd/ckptd.sock \
    CKPTD_LOG_FORMAT=json

# numeric, so that Kubernetes' runAsNonRoot can verify it without reading /etc/passwd
USER 10001

# Prometheus /metrics (--metrics-port)
EXPOSE 9400

# SIGTERM drains in-flight saves for up to --drain-timeout seconds (default 600): give the container
# that long to stop (docker stop -t 630, compose stop_grace_period, k8s terminationGracePeriodSeconds).
STOPSIGNAL SIGTERM

# gRPC health service (grpc.health.v1) on the daemon's socket; exits 0 when SERVING.
HEALTHCHECK --interval=30s --timeout=10s --start-period=60s --retries=3 \
    CMD ["sh", "-c", "exec ckptd health --socket \"${CKPTD_SOCKET}\""]

ENTRYPOINT ["ckptd", "serve"]

# syntax=docker/dockerfile:1
#
# Example training image: the official PyTorch CUDA runtime image with the ckptd client installed.
# Use it as a template for your own training image (add your code and dependencies).
#
#   docker build -f deploy/docker/train.Dockerfile -t ckptd-train:0.1.0 .
#   docker run --rm --gpus all --group-add 10001 \
#       -v /run/ckptd:/run/ckptd -v /dev/shm/ckptd:/dev/shm/ckptd ckptd-train:0.1.0 \
#       --standalone --nproc_per_node=gpu /opt/ckptd/examples/fsdp2_train.py --job demo
#
# Bump the tag together with the torch version you train with; the client works with torch >= 2.6.
FROM pytorch/pytorch:2.11.0-cuda12.8-cudnn9-runtime

# gid of the daemon's socket group (see daemon.Dockerfile): the training user is a member, so it can
# enter /run/ckptd and open staging segments. Kubernetes pods add it with supplementalGroups instead.
ARG CKPTD_GID=10001
ARG TRAIN_UID=10002

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONUNBUFFERED=1 \
    CKPTD_DAEMON=unix:///run/ckptd/ckptd.sock

WORKDIR /opt/ckptd/src
COPY pyproject.toml README.md ./
COPY proto/ proto/
COPY ckptd/ ckptd/
COPY client/ client/
# Keep the image's CUDA build of torch: pin the installed version so pip never replaces it.
RUN python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > /tmp/torch-constraint.txt \
 && pip install --no-cache-dir --constraint /tmp/torch-constraint.txt ".[examples]" \
 && python -c "import ckptd_client" \
 && rm -rf /opt/ckptd/src /tmp/torch-constraint.txt

COPY examples/ /opt/ckptd/examples/

RUN groupadd --gid "${CKPTD_GID}" ckptd \
 && useradd --create-home --uid "${TRAIN_UID}" --groups ckptd --shell /bin/bash trainer

WORKDIR /workspace
# uid only (no group): docker then also applies the supplementary groups of the user (ckptd)
USER 10002

ENTRYPOINT ["torchrun"]
CMD ["--standalone", "--nproc_per_node=gpu", "/opt/ckptd/examples/fsdp2_train.py", "--job", "example"]

# GPU image of the Anytime service (x86-64, a cloud or desktop NVIDIA GPU): TensorRT plans, built on the first
# start on the GPU the container runs on (docs/tensorrt.md). Run with the NVIDIA Container Toolkit
# (`docker run --gpus all`, or `docker compose --profile gpu up anytime-gpu`). Nobody has built or run this image
# yet: our machines have no GPU and cannot pull NVIDIA's base images.
FROM nvcr.io/nvidia/cuda:12.8.1-runtime-ubuntu24.04

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PATH=/opt/venv/bin:$PATH \
    ANYTIME_LADDER=/data/ladder \
    ANYTIME_HOST=0.0.0.0 \
    ANYTIME_PORT=8000 \
    ANYTIME_BUILD_BACKEND=tensorrt

# Ubuntu 24.04's own Python 3.12, in a venv (the system one is externally managed). The data is Debian's
# package, synced into Ubuntu (calibration, thresholds and profiles on first start; the load generator).
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv curl \
        dataset-fashion-mnist=0.0~git20200523.55506a9-* \
    && rm -rf /var/lib/apt/lists/* \
    && python3 -m venv /opt/venv

RUN useradd --create-home --uid 10001 anytime \
    && mkdir -p /data \
    && chown anytime:anytime /data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY constraints constraints
COPY service service
COPY models models
COPY engines engines
COPY calibration calibration
COPY loadtest loadtest
COPY bench bench
COPY cli cli
COPY docker/entrypoint.sh /usr/local/bin/anytime-entrypoint

# torch: the pinned version (constraints/cpu.txt), as the CUDA 12 build from PyTorch's index (its CUDA libraries
# come as wheels; TensorRT's plans and torch's buffers then share one CUDA 12 runtime). TensorRT 10 through the
# `gpu` extra; everything else at the versions of the CPU install.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cu128
RUN grep -E '^torch(vision)?==' constraints/cpu.txt > /tmp/torch.txt \
    && pip install --no-cache-dir --index-url "$TORCH_INDEX" -r /tmp/torch.txt \
    && pip install --no-cache-dir -c constraints/cpu.txt '.[gpu]' \
    && rm /tmp/torch.txt

USER 10001
# The ladder lives in this volume: built once on this GPU, it survives restarts and upgrades of the image.
VOLUME /data
EXPOSE 8000
# Readiness gates traffic: the container turns healthy the first time /readyz answers 200, however long the
# first start's build takes. The start period is only a grace window in which failed probes do not count.
HEALTHCHECK --interval=10s --timeout=3s --start-period=60m --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/readyz"]
ENTRYPOINT ["anytime-entrypoint"]

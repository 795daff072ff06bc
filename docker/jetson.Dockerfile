# Jetson image of the Anytime service (AGX Orin / Orin NX, JetPack 6): the JetPack's own TensorRT and a torch
# wheel built for the JetPack, never the pinned CPU wheels; TensorRT plans built on the first start on the
# device (docs/tensorrt.md). Build it on the Jetson (arm64) and run it with the NVIDIA runtime
# (`docker compose --profile jetson up anytime-jetson`). Nobody has built or run this image yet: our machines
# have no Jetson and cannot pull NVIDIA's base images.
#
# L4T r36.4 is JetPack 6.1/6.2: TensorRT 10.3 (INT8 plans from the QDQ file), CUDA 12.6, Python 3.10. L4T r36.3
# (JetPack 6.0) has TensorRT 8.6 (INT8 through the entropy calibrator), but its torch wheels are older than the
# 2.6 our ONNX export needs (pyproject.toml, the cpu extra).
ARG L4T_TAG=r36.4.0
FROM nvcr.io/nvidia/l4t-jetpack:${L4T_TAG}

ENV DEBIAN_FRONTEND=noninteractive \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    ANYTIME_LADDER=/data/ladder \
    ANYTIME_HOST=0.0.0.0 \
    ANYTIME_PORT=8000 \
    ANYTIME_BUILD_BACKEND=tensorrt

# The JetPack's Python 3.10 and its TensorRT bindings (python3-libnvinfer, at the base image's version; no
# venv, so the system package stays importable). The data is Debian's package, synced into Ubuntu.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-pip python3-libnvinfer curl \
        dataset-fashion-mnist=0.0~git20200523.55506a9-* \
    && rm -rf /var/lib/apt/lists/*

# The device nodes of the Jetson's GPU belong to the video group.
RUN useradd --create-home --uid 10001 --groups video anytime \
    && mkdir -p /data \
    && chown anytime:anytime /data
WORKDIR /app
COPY pyproject.toml README.md ./
COPY service service
COPY models models
COPY engines engines
COPY calibration calibration
COPY loadtest loadtest
COPY bench bench
COPY cli cli
COPY docker/entrypoint.sh /usr/local/bin/anytime-entrypoint

# torch and torchvision built for this JetPack (CUDA 12.6), from the Jetson AI Lab index; then the package with
# its version ranges (pyproject.toml), neither the `cpu` nor the `gpu` extra: pip keeps the torch, numpy and
# TensorRT already here. Check the index for the versions built for your JetPack.
ARG TORCH_INDEX=https://pypi.jetson-ai-lab.io/jp6/cu126
ARG TORCH_VERSION=2.8.0
ARG TORCHVISION_VERSION=0.23.0
RUN pip install --no-cache-dir --index-url "$TORCH_INDEX" "torch==${TORCH_VERSION}" "torchvision==${TORCHVISION_VERSION}" \
    && pip install --no-cache-dir .

USER 10001
# The ladder lives in this volume: built once on this device, it survives restarts and upgrades of the image.
VOLUME /data
EXPOSE 8000
# Readiness gates traffic: the container turns healthy the first time /readyz answers 200, however long the
# first start's build takes (longer on a Jetson than on a cloud GPU). The start period is only a grace window in
# which failed probes do not count.
HEALTHCHECK --interval=10s --timeout=3s --start-period=120m --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/readyz"]
ENTRYPOINT ["anytime-entrypoint"]

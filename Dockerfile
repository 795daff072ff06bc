# CPU image of the Anytime service. Builds the default ladder at image build time, so it starts warm.
FROM python:3.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    ANYTIME_LADDER=/app/ladders/default \
    ANYTIME_HOST=0.0.0.0 \
    ANYTIME_PORT=8000

# The data is Debian's package (used at build time for calibration, thresholds and profiles).
RUN apt-get update \
    && apt-get install -y --no-install-recommends dataset-fashion-mnist=0.0~git20200523.55506a9-1 curl=7.88.* \
    && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 10001 anytime
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
# The exact versions of the CPU install (constraints/cpu.txt); the cpu extra brings torch.
RUN pip install --no-cache-dir -c constraints/cpu.txt '.[cpu]' \
    && anytime build models/checkpoints/resnet_exits_fmnist.pt --out /app/ladders/default \
    && chown -R anytime:anytime /app

USER 10001
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
    CMD ["curl", "-fsS", "http://127.0.0.1:8000/readyz"]
CMD ["anytime", "serve"]

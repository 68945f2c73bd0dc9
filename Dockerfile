# One image for the trainer and every daemon.
# CPU build by default; for NVIDIA GPUs: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
FROM python:3.11-slim
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
WORKDIR /app
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch
COPY pyproject.toml README.md ./
COPY eventbus eventbus
COPY workers workers
RUN pip install --no-cache-dir ".[tensorboard]"
ENV PYTHONUNBUFFERED=1
# The run folders (metrics, journal, checkpoints) and the CURVE keys live on named volumes.
VOLUME ["/runs", "/keys"]

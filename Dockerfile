# One image for the trainer and every daemon.
# CPU build by default; for NVIDIA GPUs: --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu124
#
# Without an image registry or a package index (scripts/compose-check.sh builds it this way):
#   --build-arg BASE_IMAGE=eventbus-base:bookworm --build-arg WHEELHOUSE=build/wheelhouse
# BASE_IMAGE: any image with python3 (3.11 or later) and its venv module, e.g. a debootstrapped
# Debian imported with `docker import`. WHEELHOUSE: a folder inside the build context holding every
# wheel the install needs (`pip download`); nothing is downloaded then (--no-index).
ARG BASE_IMAGE=python:3.11-slim
FROM ${BASE_IMAGE}
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG WHEELHOUSE=""
WORKDIR /app
# A virtual environment: Debian's own python3 refuses installs into the system (PEP 668).
# Its bin/ comes first on PATH, so `eventbus`, `python` and `torchrun` are the installed ones.
RUN python3 -m venv /opt/venv
ENV VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH PYTHONUNBUFFERED=1
# Without a WHEELHOUSE this copies .dockerignore alone (an empty ${WHEELHOUSE} would copy the whole context).
COPY .dockerignore ${WHEELHOUSE:-.dockerignore} /wheels/
# torch first, in its own layer: it is the big one, and it does not change with the code.
RUN if [ -n "${WHEELHOUSE}" ]; then pip install --no-cache-dir --no-index --find-links /wheels torch; \
    else pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" torch; fi
COPY pyproject.toml README.md LICENSE ./
COPY eventbus eventbus
COPY workers workers
RUN if [ -n "${WHEELHOUSE}" ]; then pip install --no-cache-dir --no-index --find-links /wheels ".[tensorboard]"; \
    else pip install --no-cache-dir ".[tensorboard]"; fi \
 && eventbus --help >/dev/null && cd / && python -m eventbus.workers.logger --help >/dev/null
# The run folders (metrics, journal, checkpoints) and the CURVE keys live on named volumes.
VOLUME ["/runs", "/keys"]

#!/usr/bin/env sh
# Create .venv and install eventbus into it (add "test" to install what the tests and CI use too: the
# test extra, with Lightning and transformers; the dev extra (ruff, mypy, the docs tools); Composer 0.32.1
# (scripts/install-composer.sh); and tmux, which the terminal tests drive, when it is missing and
# apt-get can install it).
# An already-installed torch is kept: the venv sees system site-packages, and torch is installed only
# when none imports, as torch==$TORCH_VERSION (default 2.13.0) from the configured package index (on
# Linux, PyPI's is the CUDA build; install the CPU build into .venv first to avoid that download).
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv --system-site-packages .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: no torch found; installing torch==${TORCH_VERSION:-2.13.0}"
  .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
extras=""
[ "${1:-}" = "test" ] && extras="[test,dev]"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".${extras}"
if [ "${1:-}" = "test" ]; then
  sh scripts/install-composer.sh
  if ! command -v tmux >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    echo "bootstrap: installing tmux (the terminal tests drive it)"
    (apt-get update -qq && apt-get install -y -qq tmux) >/dev/null 2>&1 || echo "bootstrap: could not install tmux"
  fi
fi
echo "bootstrap: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"

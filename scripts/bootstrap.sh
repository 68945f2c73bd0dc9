#!/usr/bin/env sh
# Create .venv and install eventbus into it (add "test" to install the test tools too).
# An already-installed torch is kept: the venv sees system site-packages, and torch
# is installed only when none imports, pinned to the local CPU build so that no
# multi-GB CUDA download happens by accident.
set -eu
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$PYTHON" -m venv --system-site-packages .venv
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  echo "bootstrap: installing torch==${TORCH_VERSION:-2.13.0} (CPU build)"
  .venv/bin/pip install --quiet "torch==${TORCH_VERSION:-2.13.0}"
fi
extras=""
[ "${1:-}" = "test" ] && extras="[test]"
.venv/bin/pip install --quiet --disable-pip-version-check -e ".${extras}"
echo "bootstrap: ready ($(.venv/bin/python -c 'import torch; print("torch", torch.__version__)'))"

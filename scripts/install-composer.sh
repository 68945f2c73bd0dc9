#!/usr/bin/env sh
# Install MosaicML Composer 0.32.1 into .venv beside the installed torch: the reference the tests
# compare against, and the trainer of eventbus.integrations.composer. Composer pins torch<2.7.1, so
# it is installed without its dependencies (never a second torch), then the light packages it
# imports. Where no torchvision matches the local torch, a stand-in (scripts/standins) takes its place.
set -eu
cd "$(dirname "$0")/.."
PY=.venv/bin/python
if $PY -c "import composer, sys; sys.exit(composer.__version__ != '0.32.1')" >/dev/null 2>&1; then
  exit 0
fi
echo "bootstrap: installing Composer 0.32.1 (without its torch pin)"
wheels=$(mktemp -d)
$PY -m pip download --quiet --disable-pip-version-check --no-deps -d "$wheels" \
  mosaicml==0.32.1 "mosaicml-cli<0.8" "torch_optimizer<0.4"
$PY -m pip install --quiet --disable-pip-version-check --no-deps "$wheels"/*.whl
$PY -m pip install --quiet --disable-pip-version-check "pyyaml>=6" tqdm "torchmetrics<1.7.5" requests "numpy<2.3" \
  psutil "coolname<3" "tabulate==0.9.0" py-cpuinfo "packaging<25.1" importlib-metadata "pillow<12" argcomplete \
  arrow backoff "gql[websockets]<4" prompt_toolkit protobuf "questionary<2.1" "rich<14" ruamel.yaml validators termcolor
rm -rf "$wheels"
if ! $PY -c "import torchvision" >/dev/null 2>&1; then
  site=$($PY -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  mkdir -p "$site/torchvision"
  cp scripts/standins/torchvision.py "$site/torchvision/__init__.py"
fi
$PY -c "import composer, torch; print('bootstrap: composer', composer.__version__, 'on torch', torch.__version__)"

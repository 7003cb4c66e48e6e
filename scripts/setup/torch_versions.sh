#!/usr/bin/env bash
# The suite's smoke subset on another torch from the registry, beside the pinned one (make test): the engines
# without Horovod (simulate, torchrun with the torch engine, its timeout and bucket order), checkpoints and
# their resume at the same and at another world size, the run's length across world sizes. Horovod is not
# built against that torch: its tests skip with one reason, as on any torch-only install.
#
#   bash scripts/setup/torch_versions.sh 2.6.0         # a venv in $HVD_PARTIALFC_CACHE/venv-torch-2.6.0, then
#                                                      # the subset
#   bash scripts/setup/torch_versions.sh 2.13.0 --all  # a new user's torch-only install: pip sees only the
#                                                      # public index (this machine's wheel folder and pip config
#                                                      # ignored), pip install .[test], no Horovod; the whole suite
#
# The venv is kept (a second run only re-runs the tests). PyPI's Linux torch wheel is a CUDA build (about
# 3 GB with its NVIDIA libraries); it runs on the CPU. docs/usage.md has the measured times.
set -euo pipefail
VERSION="${1:?usage: scripts/setup/torch_versions.sh TORCH_VERSION [--all]}"
ALL="${2:-}"
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
CACHE="${HVD_PARTIALFC_CACHE:-$HOME/.cache/hvd_partialfc}"
VENV="$CACHE/venv-torch-$VERSION"
PIPENV=()
if [ "$ALL" = --all ]; then
  VENV="$VENV-public"
  PIPENV=(env -u PIP_FIND_LINKS -u PIP_EXTRA_INDEX_URL -u PIP_CONSTRAINT PIP_CONFIG_FILE=/dev/null)
fi
PYTHON="${PYTHON:-python3}"
t0=$(date +%s)
if [ ! -x "$VENV/bin/python" ]; then "$PYTHON" -m venv "$VENV"; fi
if ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '$VERSION')" 2>/dev/null; then
  "${PIPENV[@]}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check "torch==$VERSION"
fi
# the package without replacing that torch (install_requires says torch>=, which it meets), and the test extra
"${PIPENV[@]}" "$VENV/bin/python" -m pip install -q --disable-pip-version-check -e "$ROOT[test]"
"$VENV/bin/python" -c "import torch; assert torch.__version__.split('+')[0] == '$VERSION', torch.__version__; print('torch', torch.__version__)"
t1=$(date +%s)
cd "$ROOT"
if [ "$ALL" = --all ]; then
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs tests
else
  "$VENV/bin/python" -m pytest -q -p no:cacheprovider -rs tests/test_torch_engine.py tests/test_simulate.py \
    tests/test_checkpoints.py tests/test_run_length.py tests/test_restart_policy.py tests/test_round_store.py \
    tests/test_architecture.py
fi
t2=$(date +%s)
echo "torch_versions: torch $VERSION: set-up $((t1 - t0)) s, tests $((t2 - t1)) s"

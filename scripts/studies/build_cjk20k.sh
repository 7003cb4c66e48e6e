#!/usr/bin/env bash
# The `cjk-20k` data set (docs/evidence/data.md §4.1): CJK Unified Ideographs + Extension A rendered from the Debian
# font packages of `scripts/setup/install.sh --fonts`; every character with distinct renderings from >= 5 font
# family keys, 10% of the characters held out, >= 20 samples per class; then 6,000 verification pairs
# from the held-out characters. Deterministic (same fonts, same options: same shard sha256).
#
#   bash scripts/studies/build_cjk20k.sh [OUT]          # default OUT: data/cjk-20k; extra build options via $BUILD_ARGS
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
OUT="${1:-$ROOT/data/cjk-20k}"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# shellcheck disable=SC2086
"$PY" -m data_tools.shards_cli build fonts --charset cjk --size 32 --faces-per-family 1 --near-duplicate 8 \
    --min-families 5 --min-samples 20 --holdout 0.1 --seed 0 --num-shards 256 \
    --out "$OUT/train" --holdout-out "$OUT/heldout" --overwrite ${BUILD_ARGS:-}
"$PY" -m data_tools.shards_cli pairs "$OUT/heldout" --out "$OUT/pairs.h5" --num-pairs 6000 --seed 0

#!/usr/bin/env bash
# `make demo`: the main job on the embedded default data, from a fresh machine.
#
#   1. set-up (idempotent): Debian MPI + CJK font packages, .venv, torch, Horovod;
#   2. the `fonts` data set: level-1 Hanzi (GB2312, 3,755 characters) rendered from the faces that
#      configs/demo_fonts.txt names (those of step 1's packages; a missing one stops the build, other
#      installed fonts are not used), where the face's cmap has the glyph; 10% of the characters are held
#      out (never trained on);
#   3. verification pairs, and an IJB-C-shaped set (loose crops, landmarks, templates), from the held-out
#      characters;
#   4. training with `horovodrun -np 2` (Gloo), configs/demo.yaml, evaluation during training;
#   5. evaluation of the final backbone: pairs against two baselines (raw pixels, random init), all pairs,
#      IJB-style templates (flip off: a mirrored glyph is another glyph), 1:N identification; the report.
# A second run reuses the venv, the shards and the pairs; training resumes (`--resume auto`), so a
# finished run is only re-evaluated. `rm -rf runs/demo` trains again from scratch.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
BIN="$ROOT/.venv/bin"
DATA="${DEMO_DATA:-data/demo-fonts}"
RUN="${DEMO_RUN:-runs/demo}"
NP="${DEMO_NP:-2}"
SIZE="${DEMO_SIZE:-32}"
t0=$(date +%s)

bash scripts/setup/install.sh --fonts
t_setup=$(date +%s)

if [ ! -f "$DATA/train/manifest.json" ]; then
  "$BIN/hvd-partialfc-shards" build fonts --charset gb2312-1 --font-list configs/demo_fonts.txt \
      --size "$SIZE" --holdout 0.1 --seed 0 --out "$DATA/train" --holdout-out "$DATA/heldout" \
      --num-shards 8 --overwrite
fi
if [ ! -f "$DATA/pairs.h5" ]; then
  "$BIN/hvd-partialfc-shards" pairs "$DATA/heldout" --out "$DATA/pairs.h5" --num-pairs 6000 --seed 0
fi
if [ ! -f "$DATA/ijb/glyph_ijb.json" ]; then   # an IJB-C-shaped set of the held-out characters (docs/evaluation.md)
  "$BIN/hvd-partialfc-shards" ijb "$DATA/heldout" --out "$DATA/ijb" --seed 0 --overwrite
fi
t_data=$(date +%s)

"$BIN/horovodrun" -np "$NP" --gloo "$BIN/hvd-partialfc" train --config configs/demo.yaml \
    --shards "$DATA/train" --out "$RUN" --resume auto --set "eval.pairs=[$DATA/pairs.h5]" "$@"
t_train=$(date +%s)

"$BIN/hvd-partialfc" eval --backbone "$RUN" --pairs "$DATA/pairs.h5" --baselines --all-pairs "$DATA/heldout" \
    --ijb "$DATA/ijb" --ijb-name IJBC --ijb-no-flip --identification "$DATA/heldout" --out "$RUN/eval"
"$BIN/python" -m hvd_partialfc.tools.report "$RUN" --pairs "$DATA/pairs.h5" \
    --note "wall time=set-up $((t_setup - t0)) s, data $((t_data - t_setup)) s, training $((t_train - t_data)) s, evaluation $(( $(date +%s) - t_train )) s" \
    --note "machine=$(nproc) cores, $NP ranks (horovodrun --gloo)" >/dev/null
echo "report: $RUN/report.md"

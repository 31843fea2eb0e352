#!/usr/bin/env bash
# DeFT's convergence on real data: ddp, deft at its defaults (the Preserver on, no stale update: the
# best exact schedule deft finds, DeAR over both links included) and deft without the Preserver
# on an aggressive plan (capacity 0.25 x the stage times), SEEDS seeds each, inside an emulated
# cluster of 2 nodes x 1 worker (root). Prints final val_acc per run and the mean per variant.
# VARIANTS adds deft-stale1 (one iteration of staleness allowed: accepted under SGD with momentum 0.9,
# compensated as deft.compensation=auto does) and deft-uncompensated (the same without compensation,
# judged by nothing but the walk: a curvature margin too small to reject anything).
#   recipes/deft_convergence.sh                                  # digits (scikit-learn), ResNet-18 w8, 4 epochs
#   RATE=200mbit recipes/deft_convergence.sh +recipe=resnet model.cifar=true data=synthetic_images ...
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/../.venv/bin"
RATE="${RATE:-50mbit}"
SECONDARY="${SECONDARY:-30mbit}"
SEEDS="${SEEDS:-0 1 2}"
OUT="${OUT:-outputs/deft_convergence/$RATE}"
RECIPE=("${@:-+recipe=digits}")
VARIANTS="${VARIANTS:-ddp deft deft-unguarded}"
for seed in $SEEDS; do
  for variant in $VARIANTS; do
    case "$variant" in
      ddp) extra=(schedule=ddp) ;;
      deft) extra=(schedule=deft links=gloo+gloo) ;;
      deft-unguarded) extra=(schedule=deft links=gloo+gloo preserver.enabled=false deft.capacity=0.25) ;;
      deft-stale1) extra=(schedule=deft links=gloo+gloo preserver.max_staleness=1) ;;
      deft-uncompensated) extra=(schedule=deft links=gloo+gloo deft.compensation=none preserver.max_staleness=1 preserver.curvature_margin=1e-9) ;;
      *) echo "VARIANTS: ddp, deft, deft-unguarded, deft-stale1 or deft-uncompensated, not $variant" >&2; exit 2 ;;
    esac
    "$bin/commsched-cluster" --nodes 2 --rate "$RATE" --secondary-rate "$SECONDARY" -- \
      "$bin/commsched-train" "${RECIPE[@]}" "${extra[@]}" seed="$seed" trainer.num_nodes=2 trainer.devices=1 \
      checkpoint.enabled=false hydra.run.dir="$OUT/$variant/seed$seed"
  done
done
"$bin/python" "$here/deft_table.py" "$OUT"

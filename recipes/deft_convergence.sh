#!/usr/bin/env bash
# DeFT's convergence on real data: ddp, deft with the Preserver, and deft without it on an
# aggressive plan (capacity 0.25 x the stage times), SEEDS seeds each, inside an emulated cluster of
# 2 nodes x 1 worker (root). Prints final val_acc per run and the mean per variant. VARIANTS adds
# deft-stale (one iteration of staleness allowed, judged by nothing but the walk) and
# deft-compensated (the same with spike compensation and weight prediction).
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
      deft) extra=(schedule=deft link=gloo+gloo) ;;
      deft-unguarded) extra=(schedule=deft link=gloo+gloo preserver.enabled=false deft.capacity=0.25) ;;
      deft-stale) extra=(schedule=deft link=gloo+gloo preserver.max_staleness=1 preserver.curvature_margin=0) ;;
      deft-compensated) extra=(schedule=deft link=gloo+gloo preserver.max_staleness=1 preserver.curvature_margin=0 deft.compensation=spike+predict) ;;
      *) echo "VARIANTS: ddp, deft, deft-unguarded, deft-stale or deft-compensated, not $variant" >&2; exit 2 ;;
    esac
    "$bin/commsched-cluster" --nodes 2 --rate "$RATE" --secondary-rate "$SECONDARY" -- \
      "$bin/commsched-train" "${RECIPE[@]}" "${extra[@]}" seed="$seed" trainer.num_nodes=2 trainer.devices=1 \
      checkpoint.enabled=false hydra.run.dir="$OUT/$variant/seed$seed"
  done
done
"$bin/python" "$here/deft_table.py" "$OUT"

#!/usr/bin/env bash
# Sparse exchanges on real data: dense wfbp, MSTopK at DENSITY with error feedback, and without it,
# SEEDS seeds each, 2 local CPU processes (accuracy does not depend on the network). Prints final
# val_acc and train_loss per run and the mean per variant (recipes/deft_table.py, "ddp" = dense).
#   recipes/compression_convergence.sh                           # digits (scikit-learn), ResNet-18 w8, 4 epochs
#   DENSITY=0.001 recipes/compression_convergence.sh +recipe=digits model=vgg model.width=8
#   WARMUP=22 VARIANTS="mstopk mstopk-no-feedback" OUT=... recipes/compression_convergence.sh ...   # only the sparse runs
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/../.venv/bin"
DENSITY="${DENSITY:-0.01}"
WARMUP="${WARMUP:-0}"  # compression.dense_warmup_steps of the sparse variants (e.g. one epoch)
FINAL="${FINAL:-0}"    # compression.dense_final_steps of the sparse variants (the paper kept its last epochs dense)
SEEDS="${SEEDS:-0 1 2}"
VARIANTS="${VARIANTS:-ddp mstopk mstopk-no-feedback}"
OUT="${OUT:-outputs/compression_convergence/$DENSITY-w$WARMUP-f$FINAL}"
RECIPE=("${@:-+recipe=digits}")
for seed in $SEEDS; do
  for variant in $VARIANTS; do
    case "$variant" in
      ddp) extra=(schedule=wfbp) ;;
      mstopk) extra=(schedule=wfbp compression=mstopk compression.density="$DENSITY" compression.dense_warmup_steps="$WARMUP" compression.dense_final_steps="$FINAL") ;;
      mstopk-no-feedback) extra=(schedule=wfbp compression=mstopk compression.density="$DENSITY" compression.error_feedback=false
                                 compression.dense_warmup_steps="$WARMUP" compression.dense_final_steps="$FINAL") ;;
      *) echo "VARIANTS: ddp, mstopk or mstopk-no-feedback, not $variant" >&2; exit 2 ;;
    esac
    "$bin/commsched-train" "${RECIPE[@]}" "${extra[@]}" seed="$seed" trainer.devices=2 \
      checkpoint.enabled=false hydra.run.dir="$OUT/$variant/seed$seed"
  done
done
"$bin/python" "$here/deft_table.py" "$OUT"

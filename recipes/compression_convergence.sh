#!/usr/bin/env bash
# Sparse exchanges on real data at DENSITY: dense wfbp, DGC's corrections with the density's warm-up
# (the default under SGD), each correction removed in turn, and error feedback alone (the default
# before the corrections); SEEDS seeds each, DEVICES local CPU processes (accuracy does not depend on
# the network). torch.topk selection is named, not "auto": auto may keep the dense exchange on a
# fast link, which would compare nothing. Prints final val_acc and train_loss per run and the mean
# per variant (recipes/deft_table.py, "ddp" = dense).
#   recipes/compression_convergence.sh +recipe=digits model=small_cnn model.weight_decay=1e-4 trainer.max_epochs=3
#   DENSITY=0.001 recipes/compression_convergence.sh +recipe=digits model=vgg model.width=8
#   VARIANTS="ef dgc" OUT=... recipes/compression_convergence.sh ...   # some variants only
#   WARMUP=22 VARIANTS=ef ...   # error feedback alone with a dense warm-up of 22 steps
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/../.venv/bin"
DENSITY="${DENSITY:-0.01}"
WARMUP="${WARMUP:-0}"  # compression.dense_warmup_steps of the sparse variants (e.g. one epoch)
FINAL="${FINAL:-0}"    # compression.dense_final_steps of the sparse variants (the paper kept its last epochs dense)
SEEDS="${SEEDS:-0 1 2}"
DEVICES="${DEVICES:-4}"
VARIANTS="${VARIANTS:-ddp ef dgc dgc-masking dgc-no-correction dgc-no-decay-first dgc-no-warmup}"
OUT="${OUT:-outputs/compression_convergence/$DENSITY-w$WARMUP-f$FINAL}"
RECIPE=("${@:-+recipe=digits}")
sparse=(schedule=wfbp compression=topk compression.density="$DENSITY" compression.dense_warmup_steps="$WARMUP" compression.dense_final_steps="$FINAL")
for seed in $SEEDS; do
  for variant in $VARIANTS; do
    case "$variant" in
      ddp) extra=(schedule=wfbp) ;;
      ef) extra=("${sparse[@]}" compression.momentum_correction=false compression.decay_before_accumulation=false compression.sparsity_warmup_steps=0) ;;
      ef-no-feedback) extra=("${sparse[@]}" compression.error_feedback=false compression.decay_before_accumulation=false compression.sparsity_warmup_steps=0) ;;
      dgc) extra=("${sparse[@]}") ;;
      dgc-no-correction) extra=("${sparse[@]}" compression.momentum_correction=false) ;;
      dgc-masking) extra=("${sparse[@]}" compression.momentum_masking=true) ;;
      dgc-no-decay-first) extra=("${sparse[@]}" compression.decay_before_accumulation=false) ;;
      dgc-no-warmup) extra=("${sparse[@]}" compression.sparsity_warmup_steps=0) ;;
      *) echo "VARIANTS: ddp, ef, ef-no-feedback, dgc, dgc-masking, dgc-no-correction, dgc-no-decay-first or dgc-no-warmup, not $variant" >&2; exit 2 ;;
    esac
    "$bin/commsched-train" "${RECIPE[@]}" "${extra[@]}" seed="$seed" trainer.devices="$DEVICES" \
      checkpoint.enabled=false hydra.run.dir="$OUT/$variant/seed$seed"
  done
done
"$bin/python" "$here/deft_table.py" "$OUT"

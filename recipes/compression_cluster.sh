#!/usr/bin/env bash
# The accuracy column of the compression figures: short real-data runs on the emulated cluster,
# 2 nodes x 2 workers (real num_nodes=2, RATE between nodes; needs root): ddp, the dense two-level
# all-reduce (hier), MSTopK at 0.01 and 0.001 (two-level, error feedback, WARMUP dense steps first).
# VGG-16-BN and ResNet-50 at CIFAR size (width 64) train on scikit-learn's digits at 32x32, GPT-2 tiny
# on Python's documentation text. Prints val_acc (val_loss for GPT-2), MB sent per step and the
# median step after the warm-up per run (recipes/compression_table.py). Accuracy does not depend on RATE.
#   recipes/compression_cluster.sh                                   # every model, 1 Gbit, 4 epochs
#   MODELS="vgg16" RATE=200mbit EPOCHS=3 recipes/compression_cluster.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/../.venv/bin"
RATE="${RATE:-1gbit}"
EPOCHS="${EPOCHS:-4}"
MODELS="${MODELS:-vgg16 resnet50 gpt2_tiny}"
VARIANTS="${VARIANTS:-ddp hier topk topk@0.001}"
OUT="${OUT:-outputs/compression_cluster/$RATE}"
for model in $MODELS; do
  case "$model" in
    vgg16) run=(+recipe=digits model=vgg model.width=64 trainer.max_epochs="$EPOCHS"); warmup="${WARMUP:-11}" ;;  # 11 steps: one epoch of 4 x 32
    resnet50) run=(+recipe=digits model=resnet model.arch=resnet50 model.width=64 trainer.max_epochs="$EPOCHS"); warmup="${WARMUP:-11}" ;;
    gpt2_tiny) run=(+recipe=gpt2); warmup="${WARMUP:-10}" ;;  # 10 of its 100 steps
    *) echo "MODELS: vgg16, resnet50 or gpt2_tiny, not $model" >&2; exit 2 ;;
  esac
  for variant in $VARIANTS; do
    case "$variant" in
      ddp) extra=(schedule=ddp) ;;
      hier) extra=(schedule=wfbp compression=none compression.hierarchical=true) ;;
      topk) extra=(schedule=wfbp compression=mstopk compression.dense_warmup_steps="$warmup") ;;
      topk@*) extra=(schedule=wfbp compression=mstopk compression.density="${variant#topk@}" compression.dense_warmup_steps="$warmup") ;;
      *) echo "VARIANTS: ddp, hier, topk or topk@DENSITY, not $variant" >&2; exit 2 ;;
    esac
    "$bin/commsched-cluster" --nodes 2 --workers-per-node 2 --rate "$RATE" -- \
      "$bin/commsched-train" "${run[@]}" "${extra[@]}" trainer.num_nodes=2 trainer.devices=2 \
      checkpoint.enabled=false hydra.run.dir="$OUT/$model/$variant"
  done
done
"$bin/python" "$here/compression_table.py" "$OUT"

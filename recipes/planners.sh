#!/usr/bin/env bash
# Fusion planners against a grid of fixed bucket sizes, over an emulated link (needs root + iproute2).
#   recipes/planners.sh RATE NAME RECIPE-OVERRIDES...
#   recipes/planners.sh 1gbit gpt2 +recipe=gpt2
#   recipes/planners.sh 1gbit resnet50 +recipe=resnet model=resnet50 model.cifar=true model.num_classes=10 data.batch_size=16
# Writes multirun/planners/RATE/NAME/{wfbp-grid,dear-grid,mgwfbp,dear-model,bayes}; then
#   .venv/bin/python recipes/planners_table.py multirun/planners/RATE/NAME
set -euo pipefail
rate=$1; name=$2; shift 2
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$root/.venv/bin/python"
out="multirun/planners/$rate/$name"
STEPS=${STEPS:-16}; WARMUP=${WARMUP:-9}  # model policies profile 5 steps, then plan and rebuild
TRIALS=${TRIALS:-10}; TRIAL_STEPS=${TRIAL_STEPS:-3}
STAGES=${STAGES:-"grid mgwfbp dear-model bayes"}  # e.g. STAGES=grid to run only the fixed sizes
want() { [[ " $STAGES " == *" $1 "* ]]; }
bayes_tuning=$((TRIALS * (TRIAL_STEPS + 2) + 2))
run() { "$py" -m commsched.cluster.netns "$rate" "$py" -m commsched.cli.train -m "$@" trainer.enable_progress_bar=false; }
want grid && run "$@" schedule=wfbp,dear fusion=fixed fusion.bucket_cap_mb=1,5,10,25,50,100 \
    trainer.max_steps=$STEPS warmup_steps=$WARMUP hydra.sweep.dir="$out/grid"
want mgwfbp && run "$@" schedule=wfbp fusion=mgwfbp,mgwfbp-greedy trainer.max_steps=$STEPS warmup_steps=$WARMUP hydra.sweep.dir="$out/mgwfbp"
want dear-model && run "$@" schedule=dear fusion=dear-model trainer.max_steps=$STEPS warmup_steps=$WARMUP hydra.sweep.dir="$out/dear-model"
want bayes && run "$@" schedule=dear fusion=bayes tuning.trials=$TRIALS tuning.trial_steps=$TRIAL_STEPS \
    tuning.warmup_steps=1 trainer.max_steps=$((bayes_tuning + STEPS - WARMUP)) warmup_steps=$bayes_tuning \
    hydra.sweep.dir="$out/bayes"
exit 0

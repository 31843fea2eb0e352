#!/usr/bin/env bash
# Compare ddp, wfbp and dear at two bucket sizes on the ResNet recipe; collects sweep.csv, a table
# and sweep.png in the multirun directory. Extra overrides follow, e.g. +recipe=vgg is replaced by:
#   recipes/sweep_schedules.sh trainer.max_steps=30
exec "$(dirname "$0")/../.venv/bin/commsched-train" -m +recipe=resnet schedule=ddp,wfbp,dear fusion.bucket_cap_mb=1,25 "$@"

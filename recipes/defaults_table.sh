#!/usr/bin/env bash
# The README's first table: every schedule at its defaults (nothing set but its name) against
# Lightning's ddp at its defaults, on the emulated cluster (needs root): 2 nodes x 1 worker at 1 Gbit
# and 600 Mbit, 2 workers on the unlimited loopback, 2 x 2 at 1 Gbit and at 200 Mbit (about 45
# minutes on 2 cores). Each run decides its own
# settings on its first steps (those are left out of the timing, and counted); then 20 steady steps
# are timed, the schedules interleaved over 2 rounds, the best round counted.
#   recipes/defaults_table.sh                      # the small CNN (3 M parameters) in every setting
#   MODELS="[small_cnn,resnet18]" SETTINGS="2x1@1gbit" recipes/defaults_table.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
bin="$here/../.venv/bin"
MODELS="${MODELS:-[small_cnn]}"
SCHEDULES="${SCHEDULES:-[ddp,wfbp,dear,deft,topk,wfbp:auto]}"
SETTINGS="${SETTINGS:-2x1@1gbit 2x1@600mbit loopback 2x2@1gbit 2x2@200mbit}"
OUT="${OUT:-outputs/defaults_table}"
for setting in $SETTINGS; do
  if [ "$setting" = loopback ]; then
    where=(link.rate=none)
  else
    shape="${setting%@*}"
    where=(cluster.nodes="${shape%x*}" cluster.workers_per_node="${shape#*x}" cluster.rate="${setting#*@}")
  fi
  "$bin/commsched-bench" "${where[@]}" "models=$MODELS" "schedules=$SCHEDULES" steps=20 rounds=2 \
    hydra.run.dir="$OUT/$setting"
done

#!/usr/bin/env bash
# hydra_sweep.sh: one Hydra multirun trains the digits recipe under Lightning's ddp and under two
# commsched schedules, each at its defaults, and collects sweep.csv, a table and sweep.png in the
# sweep's folder. Overrides given to this script are added (a later one wins):
#   examples/hydra_sweep.sh                               # 2 CPU processes, 4 epochs each
#   examples/hydra_sweep.sh trainer.max_steps=10 hydra.sweep.dir=outputs/quick_sweep
set -euo pipefail
exec commsched-train -m +recipe=digits schedule=ddp,wfbp,dear hydra.sweep.dir=outputs/hydra_sweep "$@"

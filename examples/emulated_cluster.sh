#!/usr/bin/env bash
# emulated_cluster.sh: the Lightning script of train_with_dear.py as two nodes of one worker each,
# joined by an emulated 1 Gbit network (network namespaces on this machine; needs root). The
# script runs unchanged: commsched-cluster gives each node Lightning's multi-node environment.
# Arguments given to this script go to train_with_dear.py:
#   sudo examples/emulated_cluster.sh                     # dear, 2 epochs
#   sudo examples/emulated_cluster.sh --strategy ddp --max-steps 20
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
exec commsched-cluster --nodes 2 --workers-per-node 1 --rate 1gbit -- \
    python "$here/train_with_dear.py" --num-nodes 2 --devices 1 "$@"

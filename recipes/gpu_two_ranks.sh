#!/usr/bin/env bash
# Two ranks on one GPU: the GPU suite (one rank, then two ranks sharing cuda:0 over gloo), then the
# first figures on GPU compute. For a machine that already has torch and Lightning (a GPU image with
# no network): the project runs from src/, and the few dependencies such an image lacks (hydra-core,
# omegaconf, antlr4, bayesian-optimization) are installed from wheels in .whl/ when that folder exists.
#   recipes/gpu_two_ranks.sh tests             # `make test-gpu`'s suite, about 5 minutes on an H200
#   recipes/gpu_two_ranks.sh bench             # ResNet-18 at width 64, 2 ranks (sharing the GPU on a one-GPU machine)
#   MODELS="[vgg16]" WHERE="cluster.nodes=2 cluster.rate=1gbit" recipes/gpu_two_ranks.sh bench
# Each rank computes on the GPU; the ranks share it, so every entry (ddp too) talks over gloo through
# host memory: `commsched-bench accelerator=gpu` does this by itself where the ranks outnumber the GPUs.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-outputs/gpu}"
mkdir -p "$OUT"
python="${PYTHON:-python3}"
if [ -d .whl ]; then
  "$python" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/commsched-site .whl/*.whl
  export PYTHONPATH="/tmp/commsched-site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
"$python" -c "import torch, lightning; print('torch', torch.__version__, 'lightning', lightning.__version__, torch.cuda.get_device_name(0))"
case "${1:-tests}" in
  tests)
    # the two-rank tier first: a run cut short still has its verdicts, one line per test (-v)
    "$python" -m pytest -v -p no:cacheprovider -m gpu tests/gpu/test_two_ranks.py tests/gpu/test_gpu.py \
      --timeout 900 -ra --durations=8 2>&1 | tee "$OUT/gpu_tests.log"
    ;;
  bench)
    # shellcheck disable=SC2086  # WHERE holds several overrides
    "$python" -m commsched.bench.cli accelerator=gpu devices=2 "models=${MODELS:-[resnet18]}" "width=${WIDTH:-64}" \
      "schedules=${SCHEDULES:-[ddp,wfbp,dear,deft,topk]}" "steps=${STEPS:-20}" "rounds=${ROUNDS:-2}" \
      ${WHERE:-link.rate=none} "hydra.run.dir=$OUT/bench" 2>&1 | tee "$OUT/bench.log"
    ;;
  *)
    echo "usage: recipes/gpu_two_ranks.sh [tests|bench]" >&2
    exit 2
    ;;
esac

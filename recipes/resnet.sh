#!/usr/bin/env bash
# ResNet on 2 CPU workers with DeAR; any override can follow, e.g. schedule=ddp model.arch=resnet50 model.width=64
exec "$(dirname "$0")/../.venv/bin/commsched-train" +recipe=resnet "$@"

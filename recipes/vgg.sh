#!/usr/bin/env bash
# VGG-16-BN on 2 CPU workers with DeAR; e.g. schedule=wfbp model.width=64
exec "$(dirname "$0")/../.venv/bin/commsched-train" +recipe=vgg "$@"

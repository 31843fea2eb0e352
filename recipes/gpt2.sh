#!/usr/bin/env bash
# tiny GPT-2 on Python's documentation text with DeAR; e.g. model.size=small data.block_size=1024
exec "$(dirname "$0")/../.venv/bin/commsched-train" +recipe=gpt2 "$@"

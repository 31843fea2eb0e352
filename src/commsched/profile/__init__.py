"""Measurement: per-layer and per-bucket times (`run_profiler`, `layer_times`, `collectives`), the link
probe (`probe`, and its command line `cli`). Import the modules themselves: the command line must start
without torch."""

DEFAULT_SIZES = tuple(4**k * 1024 for k in range(8))  # the probe's message sizes: 1 KiB .. 16 MiB

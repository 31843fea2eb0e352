"""Measurement: per-layer and per-bucket times (`run_profiler`, `layers`, `collectives`), the link
probe (`probe`, `probe_cli`). Import the modules themselves: the command line must start without torch."""

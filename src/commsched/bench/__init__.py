"""`commsched-bench`: the emulated-cluster benchmark; and `make demo` (`demo`), a three-minute one
that runs ddp, wfbp and dear side by side with the benchmark's own configuration and report."""

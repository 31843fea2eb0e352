"""`commsched-bench`: the emulated-cluster benchmark."""

"""An emulated cluster on one machine: nodes as network namespaces, one or two links per node with
their own rates (each direction limited separately), an optional per-flow cap, and a launcher that
gives each node Lightning's multi-node environment (`commsched-cluster`); and the one rate-limited
namespace of a single command (`netns`: `python -m commsched.cluster.netns RATE COMMAND...`), which
the probe, the benchmark and the demo run in."""

"""The training command line, `commsched-train`: Hydra's typed configuration and its validation
(`config`, with `overrides` refusing keys Hydra would ignore), the launch of every rank of a node
(`train`, `ranks`), one rank's run (`run`, which builds model, data and strategy with `builders`),
Lightning's console made quiet (`quiet`) and the collection of a multi-run (`sweep`). The other
commands keep their own `cli.py` in their folders (bench, sim, planning, profile, cluster) and take
the shared pieces from here. Torch-free on import: `--help` and refused input answer at once."""

"""`commsched-bench`: ddp, wfbp and dear side by side on N local workers (on the CPU, or on GPUs with
`accelerator=gpu`), over the unlimited loopback or an emulated slow link, with each schedule's best
possible step and the simulator's prediction for the same measured components, and how far each
one's final weights are from ddp's.

    commsched-bench                                   # the README's defaults table: SmallCNN width 64, 2 MB buckets
    commsched-bench link.rate=1gbit models=[small_cnn,resnet18] steps=20

The emulated link is a network namespace made for the run and always removed (root + iproute2;
without them the benchmark says so and runs unlimited). Writes results.json, bench.csv and
bench.png to the run directory and prints the table.
"""

from __future__ import annotations

import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf
from rich.console import Console

from commsched.bench import report
from commsched.bench.config import BenchConfig, register_bench_config, validate_bench
from commsched.cli import overrides
from commsched.errors import CommSchedConfigError, use_syntax
from commsched.lab import require_lab

register_bench_config()


def main() -> None:
    use_syntax("hydra")  # refusals name settings as this command line spells them
    try:
        overrides.check(sys.argv[1:], BenchConfig, {})
    except CommSchedConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    require_lab("commsched-bench")
    run_bench()


@hydra.main(version_base=None, config_path="conf", config_name="bench")
def run_bench(cfg: DictConfig) -> None:
    try:
        validate_bench(cfg)
    except CommSchedConfigError as error:
        print(error, file=sys.stderr)
        sys.exit(2)
    out = Path(HydraConfig.get().runtime.output_dir)
    console = Console(width=200)
    spec = OmegaConf.to_container(cfg, resolve=True)
    results, rate = report.run_benchmark(spec, out, console)
    report.print_results(results, spec, rate, console)
    report.write_bench_csv(results, rate, out / "bench.csv")
    report.plot_bench(results, rate, out / "bench.png")
    console.print(f"wrote {out}/results.json, bench.csv, bench.png")


if __name__ == "__main__":
    main()

"""`make demo`: what commsched is for, in about three minutes: Lightning's `ddp` against `wfbp` and
`dear`, each at its defaults, training the same CNN on 2 CPU processes over an emulated slow network
link (a network namespace whose loopback is rate-limited; needs root, which CI and these machines
have; without it the demo says so and runs on the unlimited loopback, where there is nothing to
hide). Each commsched run decides its own settings on its first steps; those are not timed.

It prints each schedule's step time, its speed-up over ddp, the best step its schedule allows for
the measured compute and communication ([DeAR] Eq. 7-8), and how far its final weights are from
ddp's: the schedules change when bytes move, not what is computed.

    python -m commsched.bench.demo [--rate 600mbit] [--steps 10] [--rounds 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from rich.console import Console

from commsched.bench import report
from commsched.bench.config import BenchConfig
from commsched.lab import require_lab
from commsched.rates import parse_rate

# The README's benchmark model; at 600 Mbit its 11.7 MB of gradients take about as long to move as
# backward takes to compute, where overlapping communication pays most.
DEMO_RATE = "600mbit"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rate", default=DEMO_RATE, help="emulated link rate, e.g. 1gbit, 600mbit; none: unlimited")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="interleaved rounds; the best median counts")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="where results.json, bench.csv, bench.png and the profile go (default: outputs/demo/<time>)",
    )
    args = parser.parse_args()
    require_lab("the demo (a benchmark)")
    if args.rate != "none":
        parse_rate(args.rate)
    console = Console()
    spec = {
        **dataclasses.asdict(BenchConfig()),
        "link": {"rate": args.rate},
        "steps": args.steps,
        "rounds": args.rounds,
    }
    out = args.out or Path("outputs", "demo", time.strftime("%Y-%m-%d_%H-%M-%S"))  # every file it names stays
    results, rate = report.run_benchmark(spec, out, console)
    report.print_results(
        results,
        spec,
        rate,
        console,
        compact=True,
        more_steps='raise --steps or --rounds (make demo DEMO_ARGS="--steps 20")',
    )
    report.write_bench_csv(results, rate, out / "bench.csv")
    report.plot_bench(results, rate, out / "bench.png")
    rows = {row["schedule"]: row for row in results[0]["rows"]}
    dear, wfbp = rows["dear"], rows["wfbp"]
    link = f"an emulated {rate} link" if rate != "none" else "the unlimited loopback (nothing to hide there)"
    console.print(
        f"\n[bold]dear trained {dear['speedup_vs_ddp']:.2f}x as fast as Lightning's ddp[/bold] over {link} "
        f"(wfbp {wfbp['speedup_vs_ddp']:.2f}x), {dear['step_ms']:.0f} ms a step against the "
        f"{dear['theoretical_ms']:.0f} ms its schedule allows at best; its final weights differ from ddp's by at most "
        f"{dear['weights_vs_ddp']:.1e}."
    )
    console.print(f"results, the table as CSV, a plot and the profile are in {out}")


if __name__ == "__main__":
    main()

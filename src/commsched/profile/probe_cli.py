"""`commsched-probe`: fit t(m) = a + b m for all-reduce, reduce-scatter and all-gather between local
workers, optionally over an emulated slow link, and print the table.

    commsched-probe                          # 2 workers, unlimited loopback
    commsched-probe --rate 1gbit --out probe.json   # needs root + iproute2; the simulator reads --link probe.json
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched import netns
from commsched.errors import CommSchedConfigError, bad_value
from commsched.sim.network import parse_rate

DEFAULT_SIZES = tuple(4**k * 1024 for k in range(8))  # 1 KiB .. 16 MiB

UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}


def parse_sizes(text: str) -> tuple[int, ...]:
    sizes = []
    for item in text.split(","):
        item = item.strip().lower().removesuffix("b")
        scale = UNITS.get(item[-1:], 1)
        try:
            sizes.append(int(float(item[:-1] if scale > 1 else item) * scale))
        except ValueError:
            raise bad_value("--sizes", text, "comma-separated byte sizes such as 4k,64k,1m,16m") from None
    if len(sizes) < 2 or min(sizes) < 4:
        raise bad_value("--sizes", text, "at least two sizes of >= 4 bytes")
    return tuple(sizes)


def _probe_worker(rank: int, sizes: tuple[int, ...], repeats: int, out: str) -> None:
    from commsched.links import Link
    from commsched.profile.probe import probe_link

    fitted, medians = probe_link(Link("control", None), sizes, repeats)
    if rank == 0:
        Path(out).write_text(json.dumps({"link": fitted.to_dict(), "probe": medians}, indent=1))


def print_table(result: dict, console: Console) -> None:
    link = result["link"]
    table = Table(title=f"link fit t(m) = a + b*m on {link['workers']} workers")
    for column in ("collective", "a (latency, us)", "1/b (Gbit/s)", "rel. RMS residual", "1 MiB (ms)", "16 MiB (ms)"):
        table.add_column(column, justify="right")
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        line = link[name]
        rate = f"{8 / line['b'] / 1e9:.3f}" if line["b"] > 0 else "inf"  # Gbit/s, as the simulator and --rate
        table.add_row(name, f"{line['a'] * 1e6:.1f}", rate, f"{line['residual']:.1%}",
                      f"{(line['a'] + line['b'] * 2**20) * 1e3:.2f}", f"{(line['a'] + line['b'] * 2**24) * 1e3:.2f}")
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--rate", default="none", help="emulated link rate, e.g. 1gbit or 200mbit; none: unlimited")
    parser.add_argument("--sizes", default=",".join(f"{s // 1024}k" for s in DEFAULT_SIZES))
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the fit as JSON (simulate --link reads it)")
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    console = Console(width=120)
    try:
        sizes = parse_sizes(args.sizes)
        if args.workers < 2:
            raise bad_value("--workers", args.workers, "an integer >= 2")
        if args.repeats < 1:
            raise bad_value("--repeats", args.repeats, "an integer >= 1")
        if args.rate != "none":
            parse_rate(args.rate)
    except CommSchedConfigError as error:
        parser.error(str(error))

    if args.rate != "none" and not args.inside:
        reason = netns.unavailable_reason()
        if reason is None:
            return netns.run_in_namespace(args.rate, [sys.executable, "-m", "commsched.profile.probe_cli", *argv, "--inside"])
        console.print(f"[yellow]{reason}: probing the unlimited loopback instead of {args.rate}[/yellow]")
    from commsched.workers import run_workers  # torch: only once there is something to run

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "probe.json"
        run_workers(args.workers, _probe_worker, sizes, args.repeats, str(out))
        result = json.loads(Path(out).read_text())
    print_table(result, console)
    if args.out is not None:
        console.print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""`commsched-probe`: fit t(m) = a + b m for all-reduce, reduce-scatter and all-gather between
workers, over the unlimited loopback, an emulated slow link, or an emulated cluster, and print
the fit with each collective's bus bandwidth (bytes a rank moves over its link per second, as
nccl-tests reports it: comparable with the link's rate).

    commsched-probe                                   # 2 workers, unlimited loopback
    commsched-probe --rate 1gbit --out probe.json     # one namespace (needs root); simulate --link reads probe.json
    commsched-probe --nodes 2 --rate 1gbit --secondary-rate 600mbit --link secondary   # a cluster's second link
    commsched-probe --nodes 2 --rate 1gbit --flow-rate 250mbit --groups 4              # 4 concurrent groups
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table

from commsched.cluster import netns
from commsched.errors import CommSchedConfigError, bad_value
from commsched.profile import DEFAULT_SIZES
from commsched.rates import parse_rate

UNITS = {"k": 2**10, "m": 2**20, "g": 2**30}
BUS_FACTOR = {
    "all_reduce": lambda p: 2 * (p - 1) / p,
    "reduce_scatter": lambda p: (p - 1) / p,
    "all_gather": lambda p: (p - 1) / p,
}


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


def _probe_worker(rank: int, sizes: tuple[int, ...], repeats: int, link_name: str, groups: int, out: str) -> None:
    from datetime import timedelta

    from commsched.comm.link_groups import Links, LinkSpec
    from commsched.options.links import LinkOptions
    from commsched.profile.probe import probe_concurrent, probe_link

    ifname = LinkOptions().secondary_interface() if link_name == "secondary" else None
    specs = [LinkSpec(f"{link_name}{g}", "gloo", ifname) for g in range(groups)]
    links = Links(specs, timedelta(minutes=5), trace=None)
    if groups == 1:
        fitted, medians = probe_link(links[f"{link_name}0"], sizes, repeats)
        result = {"link": fitted.to_dict(), "probe": medians}
    else:
        result = {"concurrent": probe_concurrent([links[s.name] for s in specs], max(sizes), repeats)}
    links.destroy()
    if rank == 0:
        Path(out).write_text(json.dumps(result, indent=1))


def print_probe_table(result: dict, console: Console, title: str) -> None:
    if "concurrent" in result:
        c = result["concurrent"]
        console.print(
            f"{title}: {c['groups']} process groups all-gathering {c['bytes'] / 2**20:.1f} MiB each at once: "
            f"{c['seconds'] * 1e3:.1f} ms, bus bandwidth {c['bus_gbit_s']:.3f} Gbit/s in all"
        )
        return
    link, probe = result["link"], result["probe"]
    workers = link["workers"]
    table = Table(title=f"{title}: t(m) = a + b*m on {workers} workers")
    for column in (
        "collective",
        "a (latency, us)",
        "1 MiB (ms)",
        "16 MiB (ms)",
        "rel. RMS residual",
        f"bus bandwidth at {probe['bytes'][-1] / 2**20:.0f} MiB (Gbit/s)",
    ):
        table.add_column(column, justify="right")
    for name in ("all_reduce", "reduce_scatter", "all_gather"):
        line = link[name]
        bus = BUS_FACTOR[name](workers) * probe["bytes"][-1] * 8 / probe[name][-1] / 1e9
        table.add_row(
            name,
            f"{line['a'] * 1e6:.1f}",
            f"{(line['a'] + line['b'] * 2**20) * 1e3:.2f}",
            f"{(line['a'] + line['b'] * 2**24) * 1e3:.2f}",
            f"{line['residual']:.1%}",
            f"{bus:.3f}",
        )
    console.print(table)


def probe_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="commsched-probe", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--workers", type=int, default=2, help="workers on this machine (without --nodes)")
    p.add_argument(
        "--rate",
        default="none",
        help="emulated link rate, e.g. 1gbit; none: unlimited (with --nodes: the primary link)",
    )
    p.add_argument("--nodes", type=int, default=None, help="run inside an emulated cluster of this many nodes")
    p.add_argument("--workers-per-node", type=int, default=1)
    p.add_argument("--secondary-rate", default=None, help="cluster: a second link per node")
    p.add_argument("--flow-rate", default=None, help="cluster: a per-flow cap on the primary link")
    p.add_argument("--link", choices=("primary", "secondary"), default="primary", help="which link to probe")
    p.add_argument("--groups", type=int, default=1, help="concurrent process groups (each its own TCP flows)")
    p.add_argument("--sizes", default=",".join(f"{s // 1024}k" for s in DEFAULT_SIZES))
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, default=None, help="write the result as JSON (simulate --link reads a fit)")
    p.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    return p


def _check(args: argparse.Namespace) -> tuple[int, ...]:
    sizes = parse_sizes(args.sizes)
    if args.workers < 2 and args.nodes is None:
        raise bad_value("--workers", args.workers, "an integer >= 2")
    if args.repeats < 1:
        raise bad_value("--repeats", args.repeats, "an integer >= 1")
    if args.groups < 1:
        raise bad_value("--groups", args.groups, "an integer >= 1")
    if args.rate != "none":
        parse_rate(args.rate)
    if args.nodes is None and (args.secondary_rate or args.flow_rate or args.link == "secondary"):
        raise bad_value(
            "--link/--secondary-rate/--flow-rate", "given", "only together with --nodes (an emulated cluster)"
        )
    if args.link == "secondary" and args.secondary_rate is None:
        raise bad_value("--link", "secondary", "primary, unless --secondary-rate gives the cluster a second link")
    return sizes


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = probe_parser()
    args = p.parse_args(argv)
    console = Console(width=140)
    try:
        sizes = _check(args)
        if args.nodes is not None and not args.inside:
            return _in_cluster(args, argv)
    except CommSchedConfigError as error:
        p.error(str(error))
    if args.rate != "none" and not args.inside:
        reason = netns.unavailable_reason()
        if reason is None:
            return netns.run_in_namespace(args.rate, [sys.executable, "-m", "commsched.profile.cli", *argv, "--inside"])
        console.print(f"[yellow]{reason}: probing the unlimited loopback instead of {args.rate}[/yellow]")
    from commsched.comm.local_workers import run_node_workers, run_workers  # torch: only once there is something to run

    with tempfile.TemporaryDirectory() as tmp:
        out = args.out or Path(tmp) / "probe.json"
        work = (_probe_worker, sizes, args.repeats, args.link, args.groups, str(out))
        if args.nodes is not None:
            run_node_workers(args.workers_per_node, *work)
            if os.environ.get("NODE_RANK", "0") != "0":
                return 0
        else:
            run_workers(args.workers, *work)
        result = json.loads(Path(out).read_text())
    where = f"{args.link} link" + (f", {args.nodes} nodes x {args.workers_per_node}" if args.nodes else "")
    print_probe_table(result, console, where)
    if args.out is not None:
        console.print(f"wrote {args.out}")
    return 0


def _in_cluster(args: argparse.Namespace, argv: list[str]) -> int:
    from commsched.cluster.launch import run_on_nodes
    from commsched.cluster.spec import ClusterSpec

    spec = ClusterSpec(
        args.nodes,
        args.workers_per_node,
        args.rate if args.rate != "none" else "100gbit",
        args.secondary_rate,
        args.flow_rate,
    ).check()
    reason = netns.unavailable_reason()
    if reason is not None:
        raise CommSchedConfigError(f"commsched: {reason}; an emulated cluster cannot be made here")
    return run_on_nodes(spec, [sys.executable, "-m", "commsched.profile.cli", *argv, "--inside"])


if __name__ == "__main__":
    sys.exit(main())

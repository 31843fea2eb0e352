"""`commsched-cluster`: run a command as an N-node cluster on this machine.

    commsched-cluster --nodes 2 --workers-per-node 1 --rate 1gbit [--secondary-rate 600mbit]
                      [--flow-rate 250mbit] -- python train.py ARGS...

Everything after `--` is what each node runs, with Lightning's multi-node environment
(`MASTER_ADDR`, `MASTER_PORT`, `NODE_RANK`): a script with ``Trainer(num_nodes=2, devices=1)`` runs
unchanged. Needs root and iproute2; creates only namespaces, veth pairs, bridges and qdiscs of its
own, and removes them on success, error, Ctrl-C and SIGTERM.
"""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from commsched.cluster import netns
from commsched.cluster.spec import ClusterSpec
from commsched.errors import CommSchedConfigError


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="commsched-cluster", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--nodes", type=int, required=True, help="nodes (network namespaces)")
    p.add_argument("--workers-per-node", type=int, default=1, help="processes per node (Trainer(devices=...))")
    p.add_argument("--rate", default="1gbit", help="primary link of each node, each direction, e.g. 1gbit")
    p.add_argument("--secondary-rate", default=None, help="a second link per node on a second switch, e.g. 600mbit")
    p.add_argument("--flow-rate", default=None, help="cap per TCP flow on the primary link, at most --rate")
    p.add_argument("--port", type=int, default=29500, help="MASTER_PORT")
    p.add_argument("--grace", type=float, default=60.0, help="seconds the other nodes get after one fails")
    return p


def spec_from(args: argparse.Namespace) -> ClusterSpec:
    return ClusterSpec(
        args.nodes, args.workers_per_node, args.rate, args.secondary_rate, args.flow_rate, args.port
    ).check()


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    own, command = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    p = parser()
    args = p.parse_args(own)
    try:
        spec = spec_from(args)
        if not command:
            raise CommSchedConfigError("commsched-cluster: no command: put the command each node runs after `--`")
        reason = netns.unavailable_reason()
        if reason is not None:
            raise CommSchedConfigError(f"commsched-cluster: {reason}; an emulated cluster cannot be made here")
    except CommSchedConfigError as error:
        print(error, file=sys.stderr)
        return 2
    from commsched.cluster.launch import run_on_nodes

    try:
        return run_on_nodes(spec, command, grace_s=args.grace)
    except CommSchedConfigError as error:  # found while building: a missing qdisc or filter
        print(error, file=sys.stderr)
        return 3


if __name__ == "__main__":
    sys.exit(main())

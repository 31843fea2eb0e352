"""The emulated cluster's network: one namespace per node, joined through a switch namespace.

Each node namespace has `eth0` (and with a secondary rate `eth1`), one end of a veth pair whose other
end is a port of a bridge in the switch namespace (`br0` for the primary link, `br1` for the
secondary). Rates are limited on both ends of each pair, so each direction has its own limit, as
on a full-duplex NIC: node-to-switch on the node's interface, switch-to-node on the switch port.
A per-flow cap is an htb tree on the primary interfaces: a parent class at the link rate, one
child class per hash bucket of the TCP source port (a u32 hash filter) capped at the flow rate;
each process group's connections hash to their own bucket (collisions share one). Traffic
between processes of the same node stays on its loopback: unlimited.

Only namespaces, veth pairs, bridges and the `tbf`/`htb` qdiscs with the `u32` filter are used,
and only addresses inside these namespaces. `Network.remove()` deletes everything it made.
"""

from __future__ import annotations

import logging
import subprocess
from typing import Optional, Sequence

from commsched.cluster import netns
from commsched.cluster.spec import MTU, PRIMARY_IFNAME, SECONDARY_IFNAME, ClusterSpec
from commsched.errors import CommSchedConfigError
from commsched.rates import parse_rate

log = logging.getLogger(__name__)


class ToolError(RuntimeError):
    """An `ip` or `tc` command failed."""


def _run(*argv: str) -> None:
    proc = subprocess.run(list(argv), capture_output=True, text=True)
    if proc.returncode != 0:
        raise ToolError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")


def _burst(rate_bits: float) -> str:
    """Enough to carry 10 ms at the rate, and never less than a few jumbo frames (below the MTU it stalls)."""
    return f"{max(256 * 1024, int(rate_bits / 8 / 100))}b"


class Network:
    def __init__(self, spec: ClusterSpec) -> None:
        self.spec = spec
        tag = netns.new_name()
        self.switch = f"{tag}-sw"
        self.nodes = [f"{tag}-n{i}" for i in range(spec.nodes)]
        self._made: list[str] = []

    # ----------------------------------------------------------------- build
    def create(self) -> None:
        """Build the whole network; on any failure what was made is removed and the error raised."""
        netns.remove_orphans()
        try:
            self._namespace(self.switch)
            links = [("br0", PRIMARY_IFNAME, "p", False)]
            if self.spec.secondary_rate is not None:
                links.append(("br1", SECONDARY_IFNAME, "s", True))
            for bridge, *_ in links:
                self._in(self.switch, "ip", "link", "add", bridge, "type", "bridge")
                self._in(self.switch, "ip", "link", "set", bridge, "mtu", str(MTU), "up")
            self._check_qdiscs()
            for i, node in enumerate(self.nodes):
                self._namespace(node)
                for bridge, ifname, suffix, secondary in links:
                    self._cable(i, node, bridge, ifname, f"n{i}{suffix}", secondary)
        except BaseException:
            self.remove()
            raise

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self._made.append(name)
        self._in(name, "ip", "link", "set", "lo", "mtu", str(MTU), "up")

    def _in(self, namespace: str, *argv: str) -> None:
        _run("ip", "netns", "exec", namespace, *argv)

    def _cable(self, i: int, node: str, bridge: str, ifname: str, port: str, secondary: bool) -> None:
        _run(
            "ip",
            "link",
            "add",
            "name",
            ifname,
            "netns",
            node,
            "type",
            "veth",
            "peer",
            "name",
            port,
            "netns",
            self.switch,
        )
        self._in(node, "ip", "link", "set", ifname, "mtu", str(MTU))
        self._in(node, "ip", "addr", "add", f"{self.spec.address(i, secondary)}/24", "dev", ifname)
        self._in(node, "ip", "link", "set", ifname, "up")
        self._in(self.switch, "ip", "link", "set", port, "mtu", str(MTU), "master", bridge, "up")
        rate = self.spec.secondary_rate if secondary else self.spec.rate
        flow = None if secondary else self.spec.flow_rate
        self._shape(node, ifname, rate, flow)  # node -> switch
        self._shape(self.switch, port, rate, flow)  # switch -> node

    def _shape(self, namespace: str, device: str, rate: str, flow_rate: Optional[str]) -> None:
        bits = parse_rate(rate)
        burst = _burst(bits)
        tc = ("tc", "qdisc", "add", "dev", device, "root")
        if flow_rate is None:
            self._in(namespace, *tc, "tbf", "rate", rate, "burst", burst, "latency", "50ms")
            return
        buckets, flow_bits = self.spec.flow_buckets, parse_rate(flow_rate)
        self._in(namespace, *tc, "handle", "1:", "htb", "default", "2")
        htb = ("tc", "class", "add", "dev", device, "parent")
        self._in(
            namespace, *htb, "1:", "classid", "1:1", "htb", "rate", rate, "ceil", rate, "burst", burst, "cburst", burst
        )
        guaranteed = f"{max(1.0, min(flow_bits, bits / (buckets + 1)) / 1e3):.0f}kbit"
        for k in range(buckets + 1):  # 1:2 for what is not TCP, 1:100.. for the hash buckets
            classid = "1:2" if k == buckets else f"1:{0x100 + k:x}"
            self._in(
                namespace,
                *htb,
                "1:1",
                "classid",
                classid,
                "htb",
                "rate",
                guaranteed,
                "ceil",
                flow_rate,
                "burst",
                _burst(flow_bits),
                "cburst",
                _burst(flow_bits),
            )
        tcf = ("tc", "filter", "add", "dev", device, "parent", "1:", "prio", "1", "protocol", "ip")
        self._in(namespace, *tcf, "handle", "2:", "u32", "divisor", str(buckets))
        # the TCP source port's low bits (IP header of 20 bytes, then the ports) pick the bucket
        mask = f"0x{(buckets - 1) << 16:08x}"
        self._in(
            namespace,
            *tcf,
            "u32",
            "ht",
            "800::",
            "match",
            "ip",
            "protocol",
            "6",
            "0xff",
            "hashkey",
            "mask",
            mask,
            "at",
            "20",
            "link",
            "2:",
        )
        for k in range(buckets):
            self._in(namespace, *tcf, "u32", "ht", f"2:{k:x}:", "match", "u32", "0", "0", "flowid", f"1:{0x100 + k:x}")

    def _check_qdiscs(self) -> None:
        """tbf, htb and u32 are all this needs; refuse clearly where the kernel lacks one."""
        needed = [("tbf", ("tbf", "rate", "1mbit", "burst", "256kb", "latency", "50ms"))]
        if self.spec.flow_rate is not None:
            needed.append(("htb", ("handle", "1:", "htb")))
        for name, arguments in needed:
            try:
                self._in(self.switch, "tc", "qdisc", "add", "dev", "lo", "root", *arguments)
                if name == "htb":
                    self._in(
                        self.switch,
                        "tc",
                        "filter",
                        "add",
                        "dev",
                        "lo",
                        "parent",
                        "1:",
                        "prio",
                        "1",
                        "protocol",
                        "ip",
                        "handle",
                        "2:",
                        "u32",
                        "divisor",
                        "2",
                    )
                self._in(self.switch, "tc", "qdisc", "del", "dev", "lo", "root")
            except ToolError as error:
                what = "the u32 filter" if "filter" in str(error) else f"the {name} qdisc"
                raise CommSchedConfigError(
                    f"commsched: this kernel lacks {what}, which the emulated network needs ({error})"
                ) from None

    # --------------------------------------------------------------- teardown
    def remove(self) -> None:
        """Delete every namespace this made; their interfaces, bridges and qdiscs go with them."""
        for name in reversed(self._made):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        self._made.clear()

    def command_in(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.nodes[node], *argv]


def leftovers() -> list[str]:
    """Namespaces commsched made that still exist (none after any run: tests check this)."""
    return netns.namespaces()

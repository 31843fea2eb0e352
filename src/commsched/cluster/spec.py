"""What an emulated cluster is: its nodes, links and rates, checked before anything is created."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from commsched.errors import CommSchedConfigError, bad_value
from commsched.rates import parse_rate

PRIMARY_IFNAME = "eth0"
SECONDARY_IFNAME = "eth1"
LOOPBACK = "lo"
"""The interface of nodes run on this machine itself (`run_on_nodes(on_host=True)`)."""
PRIMARY_SUBNET = "10.123.0"  # inside the cluster's own namespaces only; nothing outside is ever addressed
SECONDARY_SUBNET = "10.124.0"
MTU = 9000
MAX_NODES = 200


@dataclass(frozen=True)
class ClusterSpec:
    nodes: int
    workers_per_node: int = 1
    rate: str = "1gbit"
    """The primary link of every node, limited in each direction separately (full duplex)."""
    secondary_rate: Optional[str] = None
    """A second interface per node on a second switch (absent unless given)."""
    flow_rate: Optional[str] = None
    """A cap per TCP flow on the primary link, below `rate` (htb classes chosen by a u32 hash of ports)."""
    master_port: int = 29500
    flow_buckets: int = 64

    def check(self, name: Callable[[str], str] = lambda field: "--" + field.replace("_", "-")) -> "ClusterSpec":
        """Refuse what cannot be built, naming each field as `name` spells it (a flag, a config key)."""
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or not 1 <= self.nodes <= MAX_NODES:
            raise bad_value(name("nodes"), self.nodes, f"an integer from 1 to {MAX_NODES}")
        if (
            isinstance(self.workers_per_node, bool)
            or not isinstance(self.workers_per_node, int)
            or self.workers_per_node < 1
        ):
            raise bad_value(name("workers_per_node"), self.workers_per_node, "an integer >= 1")
        rate = _rate(name("rate"), self.rate)
        if self.secondary_rate is not None:
            _rate(name("secondary_rate"), self.secondary_rate)
        if self.flow_rate is not None and _rate(name("flow_rate"), self.flow_rate) > rate:
            raise bad_value(
                name("flow_rate"),
                self.flow_rate,
                f"a rate at most {name('rate')} ({self.rate}): a flow cannot exceed its link",
            )
        if not 1024 <= self.master_port <= 65535:
            raise bad_value(name("port"), self.master_port, "a port number from 1024 to 65535")
        return self

    @property
    def world_size(self) -> int:
        return self.nodes * self.workers_per_node

    def address(self, node: int, secondary: bool = False) -> str:
        return f"{SECONDARY_SUBNET if secondary else PRIMARY_SUBNET}.{node + 1}"


def _rate(flag: str, text: str) -> float:
    try:
        return parse_rate(text)
    except CommSchedConfigError:
        raise bad_value(flag, text, "a rate with a unit kbit/mbit/gbit, e.g. 1gbit or 600mbit") from None

"""Options of the links: the backend and network interface each process group uses."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

from commsched.options.catalogue import BACKENDS
from commsched.options.validators import network_interface, one_of, option, optional

SECONDARY_IFNAME_ENV = "COMMSCHED_SECONDARY_IFNAME"
"""Set by ``commsched-cluster`` on each node: the interface of its second network."""


@dataclass
class LinkOptions:
    """The process groups a schedule communicates over, each created on every rank in the same order.

    A schedule names the links it needs (`primary`; DeFT adds `secondary`). An interface name binds
    that link's sockets to one network interface (gloo: GLOO_SOCKET_IFNAME, NCCL: NCCL_SOCKET_IFNAME
    while the group is created), e.g. the second NIC of each node of ``commsched-cluster``.
    """

    primary_backend: Optional[str] = option(None, optional(one_of(*BACKENDS)))
    """Backend of the primary link (default: the Trainer's process group backend, NCCL on GPU, gloo on CPU)."""
    primary_ifname: Optional[str] = option(None, optional(network_interface))
    """Network interface of the primary link (default: the backend's own choice)."""
    secondary_backend: str = option("gloo", one_of(*BACKENDS))
    """Backend of the secondary link, for schedules that use two (DeFT: gloo beside NCCL)."""
    secondary_ifname: Optional[str] = option(None, optional(network_interface))
    """Network interface of the secondary link (default: $COMMSCHED_SECONDARY_IFNAME, set by commsched-cluster;
    without one, a second group on the primary network)."""

    def secondary_interface(self) -> Optional[str]:
        """The secondary link's interface: `secondary_ifname`, else the node's second network
        (`SECONDARY_IFNAME_ENV`), else None (a second group on the primary's network)."""
        return self.secondary_ifname or os.environ.get(SECONDARY_IFNAME_ENV) or None

"""Concurrent collectives on several streams ([AIACC] §IV-VI): buckets sliced into
units (`units`), unit i on stream i mod S, and the search that picks S, the unit size and the
algorithm while training (`tuner`, `bandit`, `techniques`, `control`)."""

from commsched.streams.units import Striping, Unit, plan_units

__all__ = ["Striping", "Unit", "plan_units"]

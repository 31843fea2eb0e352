"""Concurrent collectives on several streams ([AIACC] §IV-VI): buckets sliced into units
(`commsched.reducers.units`, where the reducers that send them live), unit i on stream i mod S, and
the search that picks S, the unit size and the algorithm while training (`search`, `bandit`,
`techniques`, `control`)."""

from commsched.reducers.units import Striping, Unit, plan_units

__all__ = ["Striping", "Unit", "plan_units"]

"""Gradient compression: the top-k selections (MSTopK [cloud-topk], a sampled threshold after DGC)
and DGC's corrections; the exchanges are reducers (`commsched.reducers.topk`)."""

from commsched.compression.mstopk import mstopk
from commsched.compression.sampled import sampled_topk

__all__ = ["mstopk", "sampled_topk"]

"""Gradient compression ([cloud-topk]): MSTopK selection; the exchanges are reducers (`commsched.reducers.topk`)."""

from commsched.compression.mstopk import mstopk

__all__ = ["mstopk"]

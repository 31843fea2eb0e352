"""The selections of the largest entries, by name: torch.topk, the sampled threshold and MSTopK.
Below the reducers that call them and the choice that times them (`commsched.compression.sparse_or_dense`)."""

from __future__ import annotations

import torch

from commsched.compression.mstopk import mstopk
from commsched.compression.sampled import sampled_topk
from commsched.compression.whole_vectors import Selector


def exact_topk(x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.topk by magnitude: the reference MSTopK approximates."""
    indices = torch.topk(x.abs(), k, sorted=False).indices
    return x[indices], indices


SELECTIONS = {"topk": "torch.topk", "sampled": "the sampled threshold", "mstopk": "MSTopK"}
"""The selections by name, and how a message calls them: torch.topk, the sampled threshold (the same
elements, faster on CPUs), MSTopK (the paper's, approximate)."""


def selector(method: str, samplings: int) -> Selector:
    if method == "topk":
        return exact_topk
    if method == "sampled":
        return sampled_topk
    return lambda x, k: mstopk(x, k, samplings)

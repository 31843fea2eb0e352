"""Data modules (issue 3 adds CIFAR-10, digits and text)."""

from commsched.data.synthetic import SyntheticImages

__all__ = ["SyntheticImages"]

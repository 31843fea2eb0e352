"""Data modules: synthetic (throughput), CIFAR-10 from disk, scikit-learn digits, byte-level text."""

from commsched.data.cifar10 import Cifar10Data, check_cifar10_dir, read_batches
from commsched.data.digits import DigitsData
from commsched.data.synthetic import SyntheticImageData, SyntheticImages, SyntheticTokenData, SyntheticTokens
from commsched.data.text import ByteTextData, read_bytes

__all__ = [
    "ByteTextData", "Cifar10Data", "DigitsData", "SyntheticImageData", "SyntheticImages",
    "SyntheticTokenData", "SyntheticTokens", "check_cifar10_dir", "read_batches", "read_bytes",
]

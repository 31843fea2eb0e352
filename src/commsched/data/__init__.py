"""Data modules: synthetic (throughput), CIFAR-10 from disk, scikit-learn digits, byte-level text; data caching;
a DataLoader that resumes in the middle of an epoch."""

from commsched.data.cache import CachedDataset, local_copy
from commsched.data.cifar10 import Cifar10Data, check_cifar10_dir, read_batches
from commsched.data.digits import DigitsData
from commsched.data.resumable import ResumableDataLoader
from commsched.data.synthetic import SyntheticImageData, SyntheticImages, SyntheticTokenData, SyntheticTokens
from commsched.data.text import ByteTextData, read_bytes

__all__ = [
    "ByteTextData",
    "CachedDataset",
    "Cifar10Data",
    "DigitsData",
    "ResumableDataLoader",
    "SyntheticImageData",
    "SyntheticImages",
    "SyntheticTokenData",
    "SyntheticTokens",
    "check_cifar10_dir",
    "local_copy",
    "read_batches",
    "read_bytes",
]

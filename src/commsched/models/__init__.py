"""Models used by the demo and benchmarks (issue 3 adds ResNet, VGG and GPT-2)."""

from commsched.models.small_cnn import SmallCNN

__all__ = ["SmallCNN"]

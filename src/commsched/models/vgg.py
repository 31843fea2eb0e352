"""VGG 11/16/19 with and without BatchNorm (Simonyan & Zisserman 2015), laid out as torchvision's.

The ImageNet classifier reads a 7x7x512 map into 4096-wide layers. `cifar_head=True` pools to
1x1 instead and uses `hidden`-wide layers (512 by default), the usual choice for 32x32 images.
`width` scales the convolutions (64 is the standard network).
"""

from __future__ import annotations

import torch
from torch import nn

# "M" is a 2x2 max-pool; numbers are output channels at width 64.
LAYOUTS: dict[int, list[int | str]] = {
    11: [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"],
    16: [64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M"],
    19: [64, 64, "M", 128, 128, "M", 256, 256, 256, 256, "M", 512, 512, 512, 512, "M", 512, 512, 512, 512, "M"],
}


class VGG(nn.Module):
    def __init__(
        self,
        depth: int = 16,
        num_classes: int = 1000,
        batch_norm: bool = False,
        cifar_head: bool = False,
        width: int = 64,
        hidden: int | None = None,
        dropout: float = 0.5,
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        channels = 3
        for item in LAYOUTS[depth]:
            if item == "M":
                layers.append(nn.MaxPool2d(2, 2))
                continue
            out = int(item) * width // 64
            layers.append(nn.Conv2d(channels, out, 3, padding=1))
            if batch_norm:
                layers.append(nn.BatchNorm2d(out))
            layers.append(nn.ReLU(inplace=True))
            channels = out
        self.features = nn.Sequential(*layers)
        pool = 1 if cifar_head else 7
        hidden = hidden or (512 if cifar_head else 4096)
        self.avgpool = nn.AdaptiveAvgPool2d(pool)
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Dropout(dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.avgpool(self.features(x)), 1))

"""The models `commsched-bench` can run: small enough for CPU workers, shaped like the real ones."""

from __future__ import annotations

from typing import Callable

import lightning.pytorch as pl
from torch.utils.data import Dataset

from commsched.data import SyntheticImages, SyntheticTokens
from commsched.models import ImageClassifier, LanguageModel, SmallCNN

Factory = Callable[[int], tuple[pl.LightningModule, Callable[[int], Dataset]]]


def _image(arch: str) -> Factory:
    def build(width: int):
        if arch == "small_cnn":
            return SmallCNN(width=width), lambda n: SyntheticImages(n)
        return ImageClassifier(arch, num_classes=10, cifar=True, width=width), lambda n: SyntheticImages(n)

    return build


def _gpt2(width: int):
    """`width` is the embedding size (a multiple of the tiny config's head count)."""
    model = LanguageModel("tiny", n_embd=width)
    return model, lambda n: SyntheticTokens(n, block_size=model.config.block_size, vocab_size=model.config.vocab_size)


BENCH_MODELS: dict[str, Factory] = {
    "small_cnn": _image("small_cnn"),
    "resnet18": _image("resnet18"),
    "vgg11": _image("vgg11"),
    "resnet50": _image("resnet50"),
    "vgg16": _image("vgg16"),
    "gpt2_tiny": _gpt2,
}

"""The model zoo: parameter counts equal the standard definitions; tiny variants run forward."""

from __future__ import annotations

import pytest
import torch

from commsched import CommSchedConfigError
from commsched.models import GPT2, IMAGE_ARCHS, GPT2Config, ImageClassifier, LanguageModel, build_backbone


def count(module: torch.nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


@pytest.mark.parametrize(
    "arch, expected",
    [
        ("resnet18", 11_689_512),
        ("resnet34", 21_797_672),
        ("resnet50", 25_557_032),
        ("resnet101", 44_549_160),
        ("resnet152", 60_192_808),
        ("vgg11", 132_863_336),
        ("vgg11_bn", 132_868_840),
        ("vgg16", 138_357_544),
        ("vgg16_bn", 138_365_992),
        ("vgg19", 143_667_240),
        ("vgg19_bn", 143_678_248),
    ],
)
def test_imagenet_parameter_counts_match_standard_definitions(arch, expected):
    with torch.device("meta"):  # count without allocating 0.5 GB for VGG
        assert count(build_backbone(arch, num_classes=1000, cifar=False, width=64)) == expected


def test_gpt2_small_has_124m_parameters_with_tied_embeddings():
    with torch.device("meta"):
        model = GPT2(GPT2Config.small())
    assert count(model) == 124_439_808
    assert model.lm_head.weight is model.wte.weight


@pytest.mark.parametrize("arch", IMAGE_ARCHS)
def test_every_image_arch_runs_at_cifar_size(arch):
    model = ImageClassifier(arch=arch, num_classes=7, cifar=True, width=8)
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_cifar_stem_changes_only_the_stem():
    with torch.device("meta"):
        imagenet = build_backbone("resnet50", 1000, cifar=False, width=64)
        cifar = build_backbone("resnet50", 1000, cifar=True, width=64)
    assert count(imagenet) - count(cifar) == 3 * 64 * (49 - 9)


def test_language_model_shapes_and_overrides():
    model = LanguageModel(size="tiny", n_layer=1, block_size=16)
    assert model.config.n_layer == 1 and model.config.block_size == 16
    assert model(torch.randint(0, 256, (3, 16))).shape == (3, 16, 256)


def test_unknown_arch_lists_valid_choices():
    with pytest.raises(CommSchedConfigError, match="model.arch='resnet51'.*'resnet50'"):
        build_backbone("resnet51", 10, cifar=True, width=64)
    with pytest.raises(CommSchedConfigError, match="model.size='medium'.*'tiny', 'small'"):
        LanguageModel(size="medium")


def test_the_light_name_lists_match_the_zoo():
    """The command lines validate against `model_names` without importing torch; it must name what the zoo builds."""
    from commsched import model_names
    from commsched.models.resnet import DEPTHS
    from commsched.models.vgg import LAYOUTS

    assert model_names.RESNET_DEPTHS == tuple(DEPTHS) and model_names.VGG_DEPTHS == tuple(LAYOUTS)

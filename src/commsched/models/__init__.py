"""The model zoo: readable single-file definitions, wrapped as LightningModules."""

from commsched.model_names import GPT2_SIZES, IMAGE_ARCHS
from commsched.models.gpt2 import GPT2, GPT2Config
from commsched.models.image_classifier import ImageClassifier, build_backbone
from commsched.models.language_model import LanguageModel
from commsched.models.resnet import ResNet
from commsched.models.small_cnn import SmallCNN, SmallCNNBackbone
from commsched.models.vgg import VGG

__all__ = [
    "GPT2",
    "GPT2Config",
    "GPT2_SIZES",
    "IMAGE_ARCHS",
    "ImageClassifier",
    "LanguageModel",
    "ResNet",
    "SmallCNN",
    "SmallCNNBackbone",
    "VGG",
    "build_backbone",
]

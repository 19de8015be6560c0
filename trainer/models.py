"""The image classifiers --model names: built for the dataset's channels, image size and classes.

Built-ins (convnet, lenet, and ResNets with a stem for small images) and any torchvision
classification model as ``torchvision/<name>`` (``torchvision/efficientnet_b0``), optionally with
torchvision's pretrained weights.
"""

from __future__ import annotations

import urllib.error
from collections.abc import Callable
from functools import partial

import torch
import torchvision
from torch import nn

from trainer.errors import ConfigError
from trainer.registry import Registry

__all__ = ["MODELS", "ConvNet", "LeNet", "ThreeChannels", "build_model"]

# in_channels, (height, width), num_classes, pretrained -> model
ModelFactory = Callable[[int, tuple[int, int], int, bool], nn.Module]
TORCHVISION_PREFIX = "torchvision/"


class ConvNet(nn.Module):
    """The classic distributed-tutorial ConvNet: two conv+BatchNorm+ReLU+pool blocks and a linear layer."""

    def __init__(self, in_channels: int, image_size: tuple[int, int], num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
            nn.Conv2d(16, 32, kernel_size=5, stride=1, padding=2),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.MaxPool2d(kernel_size=2, stride=2),
        )
        height, width = (size // 4 for size in image_size)
        self.classifier = nn.Linear(32 * height * width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


class LeNet(nn.Module):
    """LeNet-5 (ReLU and max-pooling), with no BatchNorm: the model where DDP equals one big batch exactly."""

    def __init__(self, in_channels: int, image_size: tuple[int, int], num_classes: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, kernel_size=5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, kernel_size=5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        height, width = ((size // 2 - 4) // 2 for size in image_size)
        if height < 1 or width < 1:
            raise ValueError(f"LeNet needs images of at least 12x12, got {image_size}")
        self.classifier = nn.Sequential(
            nn.Linear(16 * height * width, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.flatten(self.features(x), 1))


def _small_image_resnet(builder: Callable[..., nn.Module]) -> Callable[[int, tuple[int, int], int], nn.Module]:
    """torchvision's ResNet with a 3x3 stride-1 stem and no max-pool: a 7x7/2 stem plus pooling
    shrinks 28x28 or 32x32 images to almost nothing before the first block."""

    def build(in_channels: int, image_size: tuple[int, int], num_classes: int) -> nn.Module:
        model = builder(weights=None, num_classes=num_classes)
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model

    return build


def _without_weights(name: str, build: Callable[[int, tuple[int, int], int], nn.Module]) -> ModelFactory:
    def factory(in_channels: int, image_size: tuple[int, int], num_classes: int, pretrained: bool) -> nn.Module:
        if pretrained:
            raise ConfigError(f"--pretrained: the built-in {name} has no pretrained weights; use a "
                              f"{TORCHVISION_PREFIX}<name> model, or drop --pretrained")
        return build(in_channels, image_size, num_classes)
    return factory


class ThreeChannels(nn.Module):
    """Repeats a one-channel image into three, for torchvision's models, which expect RGB."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x.expand(-1, 3, -1, -1))


def torchvision_model(name: str, in_channels: int, image_size: tuple[int, int], num_classes: int,
                      pretrained: bool) -> nn.Module:
    """torchvision's classification model ``name`` with ``num_classes`` outputs.

    With pretrained weights, every tensor whose shape fits is taken from them; the classifier head,
    sized for ImageNet's 1000 classes, starts fresh.
    """
    model = torchvision.models.get_model(name, weights=None, num_classes=num_classes)
    if pretrained:
        try:
            weights = torchvision.models.get_model(name, weights="DEFAULT").state_dict()
        except (urllib.error.URLError, OSError) as error:
            raise ConfigError(
                f"--pretrained: could not get torchvision's weights for {name} ({error}); without internet "
                f"access, copy the weights file into $TORCH_HOME/hub/checkpoints (~/.cache/torch by default), "
                f"or drop --pretrained"
            ) from None
        own = model.state_dict()
        model.load_state_dict({key: value for key, value in weights.items()
                               if key in own and own[key].shape == value.shape}, strict=False)
    if in_channels == 1:
        return ThreeChannels(model)
    if in_channels != 3:
        raise ConfigError(f"--model {TORCHVISION_PREFIX}{name} takes RGB images, but the dataset has {in_channels} "
                          f"channels")
    return model


def _resolve_torchvision(name: str) -> ModelFactory | None:
    if not name.startswith(TORCHVISION_PREFIX):
        return None
    model_name = name.removeprefix(TORCHVISION_PREFIX)
    if model_name not in torchvision.models.list_models(module=torchvision.models):
        return None
    return partial(torchvision_model, model_name)


MODELS: Registry[ModelFactory] = Registry("model", "--model")
MODELS.add("convnet", _without_weights("convnet", ConvNet), "two conv+BatchNorm blocks and a linear layer")
MODELS.add("lenet", _without_weights("lenet", LeNet), "LeNet-5, no BatchNorm")
MODELS.add("resnet18", _without_weights("resnet18", _small_image_resnet(torchvision.models.resnet18)),
           "ResNet-18 with a 3x3 stem for small images")
MODELS.add("resnet50", _without_weights("resnet50", _small_image_resnet(torchvision.models.resnet50)),
           "ResNet-50 with a 3x3 stem for small images")
MODELS.add_pattern(f"{TORCHVISION_PREFIX}<name> (any torchvision classification model)", _resolve_torchvision)


def build_model(name: str, in_channels: int, image_size: tuple[int, int], num_classes: int,
                pretrained: bool = False) -> nn.Module:
    return MODELS.get(name)(in_channels, image_size, num_classes, pretrained)

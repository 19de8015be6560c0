"""Model registry: each model built for the dataset's channels, image size and classes."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torchvision
from torch import nn

ModelFactory = Callable[[int, tuple[int, int], int], nn.Module]


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


def _small_image_resnet(builder: Callable[..., nn.Module]) -> ModelFactory:
    """torchvision's ResNet with a 3x3 stride-1 stem and no max-pool: a 7x7/2 stem plus pooling
    shrinks 28x28 or 32x32 images to almost nothing before the first block."""

    def build(in_channels: int, image_size: tuple[int, int], num_classes: int) -> nn.Module:
        model = builder(weights=None, num_classes=num_classes)
        model.conv1 = nn.Conv2d(in_channels, 64, kernel_size=3, stride=1, padding=1, bias=False)
        model.maxpool = nn.Identity()
        return model

    return build


MODEL_REGISTRY: dict[str, ModelFactory] = {
    "convnet": ConvNet,
    "lenet": LeNet,
    "resnet18": _small_image_resnet(torchvision.models.resnet18),
    "resnet50": _small_image_resnet(torchvision.models.resnet50),
}


def build_model(name: str, in_channels: int, image_size: tuple[int, int], num_classes: int) -> nn.Module:
    try:
        factory = MODEL_REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODEL_REGISTRY)}") from None
    return factory(in_channels, image_size, num_classes)

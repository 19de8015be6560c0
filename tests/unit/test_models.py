"""--model: the built-ins, any torchvision classification model by name, and its pretrained weights, offline."""

from __future__ import annotations

import pytest
import torch
import torchvision

from trainer.errors import ConfigError
from trainer.models import MODELS, ThreeChannels, build_model


@pytest.mark.parametrize("name", ["convnet", "lenet", "resnet18", "torchvision/squeezenet1_1",
                                  "torchvision/mobilenet_v3_small"])
def test_each_model_takes_the_datasets_images_and_gives_one_score_per_class(name):
    model = build_model(name, 3, (32, 32), 7).eval()
    assert model(torch.randn(2, 3, 32, 32)).shape == (2, 7)


def test_a_torchvision_model_takes_one_channel_images_as_grey_rgb():
    model = build_model("torchvision/squeezenet1_1", 1, (28, 28), 10)
    assert isinstance(model, ThreeChannels) and model.eval()(torch.randn(2, 1, 28, 28)).shape == (2, 10)


def test_torchvisions_names_are_accepted_and_others_refused_with_the_choices():
    assert "torchvision/efficientnet_b0" in MODELS and "torchvision/resnet1000" not in MODELS
    with pytest.raises(ConfigError, match=r"no such model; choose one of convnet, lenet, resnet18, resnet50, "
                                          r"torchvision/<name>"):
        MODELS.get("torchvision/resnet1000")


def test_pretrained_weights_are_read_from_torch_home_and_the_head_starts_fresh(tmp_path, monkeypatch):
    """Nothing is downloaded: the weights file is where torch.hub keeps what it downloaded."""
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    torch.manual_seed(1)
    weights = torchvision.models.squeezenet1_1(num_classes=1000).state_dict()
    url = torchvision.models.get_model_weights("squeezenet1_1").DEFAULT.url
    (tmp_path / "hub" / "checkpoints").mkdir(parents=True)
    torch.save(weights, tmp_path / "hub" / "checkpoints" / url.rsplit("/", 1)[1])
    model = build_model("torchvision/squeezenet1_1", 3, (32, 32), 5, pretrained=True)
    own = model.state_dict()
    assert torch.equal(own["features.0.weight"], weights["features.0.weight"])
    assert own["classifier.1.weight"].shape[0] == 5  # sized for this dataset's classes, not ImageNet's


def test_pretrained_weights_that_cannot_be_fetched_are_one_line_saying_where_to_put_them(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))
    monkeypatch.setenv("https_proxy", "http://127.0.0.1:9")  # refused at once: no waiting on a firewall
    with pytest.raises(ConfigError, match=r"--pretrained: could not get torchvision's weights for squeezenet1_1 "
                                          r"\(.*\); without internet access, copy the weights file into "
                                          r"\$TORCH_HOME/hub/checkpoints"):
        build_model("torchvision/squeezenet1_1", 3, (32, 32), 5, pretrained=True)
    with pytest.raises(ConfigError, match="the built-in convnet has no pretrained weights"):
        build_model("convnet", 3, (32, 32), 5, pretrained=True)

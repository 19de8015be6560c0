"""TorchX components of this project: ``torchx run torchx_components/train.py:ddp`` (see train.py)."""

"""Where data comes from: real datasets from folders, URLs or downloads, and a synthetic one, as tensors."""

from trainer.data.dataset import DatasetInfo, ImageTensorDataset, collate_batch
from trainer.data.loading import load_datasets
from trainer.data.locate import default_data_dir

__all__ = ["DatasetInfo", "ImageTensorDataset", "collate_batch", "default_data_dir", "load_datasets"]

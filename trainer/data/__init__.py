"""Where the built-in classification task's data comes from: real datasets from folders, URLs or
downloads, image folders, and a synthetic dataset; the registry --dataset reads its names from."""

from trainer.data.dataset import DatasetInfo, ImageTensorDataset, Normalise, collate_batch
from trainer.data.idx import read_idx, write_idx
from trainer.data.imagefolder import MEAN as IMAGENET_MEAN
from trainer.data.imagefolder import STD as IMAGENET_STD
from trainer.data.imagefolder import ImageFolderDataset, decode_image, load_imagefolder
from trainer.data.loading import DATASETS, load_datasets
from trainer.data.locate import SHIPPED_FASHION_MNIST, SYSTEM_FASHION_MNIST, default_data_dir
from trainer.data.synthetic import cached_synthetic, make_synthetic

__all__ = ["DATASETS", "IMAGENET_MEAN", "IMAGENET_STD", "SHIPPED_FASHION_MNIST", "SYSTEM_FASHION_MNIST", "DatasetInfo",
           "ImageFolderDataset", "ImageTensorDataset", "Normalise", "cached_synthetic", "collate_batch", "decode_image",
           "default_data_dir", "load_datasets", "load_imagefolder", "make_synthetic", "read_idx", "write_idx"]

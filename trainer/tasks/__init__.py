"""The built-in tasks, by the names --task accepts besides ``package.module:Class``."""

from trainer.registry import Registry
from trainer.tasks.classification import ClassificationOptions, ImageClassification

TASKS: Registry[type] = Registry("task", "--task")
TASKS.add(ImageClassification.name, ImageClassification,
          "image classification: --dataset, --model, cross-entropy, accuracy")

__all__ = ["TASKS", "ClassificationOptions", "ImageClassification"]

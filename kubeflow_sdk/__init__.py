"""Submitting the trainer through Kubeflow Trainer's Python SDK (PyPI ``kubeflow``): see trainjob.py."""

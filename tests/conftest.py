"""Test-session setup: GPU-only tests are skipped with a reason on machines without CUDA."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("OMP_NUM_THREADS", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine); run on a GPU box to exercise it")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)

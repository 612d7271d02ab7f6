"""Marks every test of the GPU module (this directory) ``gpu``: ``-m "not gpu"`` leaves them out,
``-m gpu`` runs only them (with KVFUSE_TEST_GPU=1 on a CUDA machine)."""
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).parents:
            item.add_marker(pytest.mark.gpu)

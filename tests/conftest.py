"""Shared test configuration: GPU tests carry the `gpu` marker and skip without CUDA."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def gen():
    """A fresh, seeded generator per test (different data for every parametrization)."""
    g = torch.Generator()
    g.manual_seed(torch.randint(0, 2**31, (1,)).item())
    return g

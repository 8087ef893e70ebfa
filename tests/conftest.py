"""Shared pytest setup: the `slow` marker (deselected by `make test`, run by `make test-slow`) and
the one-thread fixture for modules of tiny models."""
import pytest
import torch


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests, run by `make test-slow`")


@pytest.fixture(scope="module")
def one_thread():
    "Tiny models: one thread beats two, by far on a busy machine (no OpenMP barriers)."
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

"""Shared pytest setup: the `slow` marker (deselected by `make test`, run by `make test-slow`)."""
import pytest

def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long tests, run by `make test-slow`")

"""Fixtures shared by all test packages."""

from __future__ import annotations

from pathlib import Path

import pytest

from pdserve.model.fetch import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model, fetched into the user's cache on the first run and reused after."""
    return resolve_model(DEFAULT_MODEL, progress=False)

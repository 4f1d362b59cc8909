"""Fixtures shared by all test packages."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pdserve.model.fetch import DEFAULT_MODEL, resolve_model


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The converted default model, fetched into the user's cache on the first run and reused after."""
    return resolve_model(DEFAULT_MODEL, progress=False)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    """With ``PDSERVE_FAILURES_AT_ONCE=1`` (scripts/gpu-check sets it), each failure's report is
    written to stderr when it happens, not only in the summary at the end: a run cut short (a
    lent GPU's time running out) still leaves every failure seen so far in its log."""
    if report.failed and os.environ.get("PDSERVE_FAILURES_AT_ONCE") == "1":
        sys.stderr.write(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}\n")
        sys.stderr.flush()

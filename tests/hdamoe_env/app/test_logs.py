"""Tests of hdamoe_env.app.logs: the logging levels of the package loggers set by
``configure_logging`` (and the progress bars it silences)."""

from __future__ import annotations

import logging

import pytest

from hdamoe_env.app import progress
from hdamoe_env.app.logs import PACKAGES, configure_logging


@pytest.fixture
def restore_logging():
    yield
    configure_logging(0, False)


def test_configure_logging_levels(restore_logging):
    assert configure_logging(0, False) == logging.WARNING
    assert configure_logging(1, False) == logging.INFO
    assert configure_logging(2, False) == logging.DEBUG
    assert all(logging.getLogger(p).level == logging.DEBUG for p in PACKAGES)
    assert logging.getLogger("numba").getEffectiveLevel() >= logging.WARNING
    handlers = [h for h in logging.getLogger().handlers if h.get_name() == "hdamoe-cli"]
    assert len(handlers) == 1                          # idempotent
    assert configure_logging(3, True) == logging.ERROR
    assert progress.bar(1, "x").__class__.__name__ == "_Silent"

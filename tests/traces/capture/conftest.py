"""Fixtures of the capture tests: the tiny random model and the byte tokenizer (module scope)."""

from __future__ import annotations

import pytest

from tests.traces.capture.random_model import random_model


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("transformers", reason="the [record] extra (transformers) is not installed")
    return random_model()


@pytest.fixture(scope="module")
def tok():
    from traces.capture.tiny_model import ByteTokenizer

    return ByteTokenizer()

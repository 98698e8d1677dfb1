"""Tests of traces.capture.tiny_model: training the tiny model on the standard library (smoke) and
its held-out split.
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the [record] extra (torch) is not installed")
transformers = pytest.importorskip(
    "transformers", reason="the [record] extra (transformers) is not installed")

from traces.capture import record
from traces.capture.tiny_model import ByteTokenizer, TinyModelSpec  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tok():
    return ByteTokenizer()


def test_train_tiny_smoke_and_heldout_split(tmp_path):
    from traces.capture.tiny_model import is_heldout, stdlib_corpus, train_tiny

    corpus = stdlib_corpus(max_train_bytes=200_000)
    assert corpus.heldout_files and all(is_heldout(f) for f in corpus.heldout_files)
    assert corpus.heldout_files == stdlib_corpus(max_train_bytes=0).heldout_files
    spec = TinyModelSpec(hidden_size=16, intermediate_size=16, num_layers=2, num_heads=2,
                         num_kv_heads=1, max_positions=64)
    res = train_tiny(tmp_path / "m", minutes=1.0, seed=3, spec=spec, seq_len=32, batch_size=2,
                     max_steps=2, log=lambda line: None)
    assert res.steps == 2 and np.isfinite(res.heldout_loss)
    loaded, tok = record.load_model(tmp_path / "m")
    assert loaded.config.num_local_experts == 8 and tok.vocab_size == 259
    assert (tmp_path / "m" / "hdamoe_training.json").is_file()

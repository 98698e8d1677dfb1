"""The output safety of the offline pipeline (baselines.pipeline, ``hdamoe place``): it never
deletes or overwrites files it did not create, extends a finished run without touching its
layers, writes files with the usual permissions, and recomputes or refuses damaged cache entries."""

from __future__ import annotations

import os
import stat

import numpy as np
import pytest

pytest.importorskip("pulp")

from baselines.pipeline import run_pipeline
from baselines.pipeline_config import PlaceConfig
from hdamoe_env.config.errors import HdMoeError, OutputPathError
from hdamoe_env.sim.placement import Placement


@pytest.fixture
def cfg(nb_model):
    return PlaceConfig.create(model=nb_model, mesh=(2, 2), setting="1/1", trace="given",
                       lb_method="local", bo_calls=4, nb_mode="heuristic", seed=5)


@pytest.fixture
def trace(make_trace):
    return make_trace(2, 4, 2, 200, seed=1)


def test_extending_a_finished_run_keeps_its_layers(cfg, trace, tmp_path):
    """A finished run + another --layers selection extends, never deletes."""
    run_pipeline(cfg, tmp_path, trace=trace, layers="0")
    before = (tmp_path / "layer_000.npz").read_bytes()
    res = run_pipeline(cfg, tmp_path, trace=trace, layers="1")
    assert res.computed == [1]
    assert (tmp_path / "layer_000.npz").read_bytes() == before
    assert Placement.load(tmp_path / "placement.npz").meta["layers_missing"] == []


def test_unrelated_directory_is_refused_and_force_deletes_nothing(cfg, trace, tmp_path):
    """A non-empty unrelated directory is refused; --force only moves files aside."""
    (tmp_path / "layer_007.json").write_text("my notes")
    (tmp_path / "run.json").write_text('{"mine": true}')
    (tmp_path / "placement.npz").write_bytes(b"precious")
    (tmp_path / "other.txt").write_text("keep")
    with pytest.raises(OutputPathError, match="not empty.*--force"):
        run_pipeline(cfg, tmp_path, trace=trace, layers="0")
    assert (tmp_path / "layer_007.json").read_text() == "my notes"
    assert (tmp_path / "run.json").read_text() == '{"mine": true}'
    run_pipeline(cfg, tmp_path, trace=trace, layers="0", force=True)
    (aside,) = tmp_path.glob("superseded-foreign-*")
    assert (aside / "layer_007.json").read_text() == "my notes"
    assert (aside / "run.json").read_text() == '{"mine": true}'
    assert (aside / "placement.npz").read_bytes() == b"precious"
    assert (tmp_path / "other.txt").read_text() == "keep"


def test_out_is_a_file(cfg, trace, tmp_path):
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(OutputPathError, match="is a file"):
        run_pipeline(cfg, target, trace=trace, layers="0")
    assert target.read_text() == "x"


def test_files_follow_the_umask(cfg, trace, tmp_path):
    old = os.umask(0o022)
    try:
        run_pipeline(cfg, tmp_path, trace=trace, layers="0")
    finally:
        os.umask(old)
    for name in ("placement.npz", "run.json", "layer_000.npz"):
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o644, name


@pytest.mark.parametrize("damage", ["truncate", "empty", "flip", "meta"])
def test_damaged_layer_or_placement_is_recomputed_or_refused(cfg, trace, tmp_path, damage):
    """Damaged files give typed errors; a resumed run recomputes damaged layers."""
    run_pipeline(cfg, tmp_path, trace=trace)
    path = tmp_path / "placement.npz"
    data = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(data[: len(data) // 2])
    elif damage == "empty":
        path.write_bytes(b"")
    elif damage == "flip":
        buf = bytearray(data)
        for i in range(40, len(buf), 97):
            buf[i] ^= 0xFF
        path.write_bytes(bytes(buf))
    else:
        np.savez(path, P=np.full((2, 4, 4), 0.25), pi=np.tile(np.arange(4), (2, 1)),
                 meta=np.frombuffer(b"[1, 2]", np.uint8))
    with pytest.raises(HdMoeError, match="placement.npz"):
        Placement.load(path)
    (tmp_path / "layer_001.npz").write_bytes(b"PK\x03\x04 broken")
    res = run_pipeline(cfg, tmp_path, trace=trace, resume=True)
    assert res.computed == [1] and res.skipped == [0]
    assert Placement.load(path).meta["layers_missing"] == []



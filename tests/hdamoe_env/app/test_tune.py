"""``hdamoe tune`` (hdamoe_env/app/tune.py) and the bench method ``tuned:PATH``.

One small end-to-end run (DeepSeek-V2-Lite preset at B = 8, EP placement, one decode step per
episode, a 2-point grid) covers the command, its files, ``--resume`` and the refusals.
"""

from __future__ import annotations

import json

import pytest

from hdamoe_env.app import cli, methods
from hdamoe_env.app.tune import _prepare_out, parse_grid
from hdamoe_env.config.errors import ConfigError, OutputPathError

ARGS = ["-q", "tune", "--placement", "ep", "--batch", "8", "--requests", "4", "--steps", "1",
        "--eval-steps", "1", "--gating-levels", "0,1", "--gating-protect-top", "0",
        "--dispatch-rules", "least_loaded", "--train-seeds", "0", "--eval-seeds", "10000",
        "--oracle", "--no-progress"]


def test_parse_grid():
    grid = parse_grid("0,0.5,8", "0,1", "least_loaded,home", "budget,0,2", "none",
                      "none,1.25")
    assert grid.gating_levels == (0.0, 0.5, 8.0) and grid.min_imbalance == (None, 1.25)
    assert grid.k_b == (None, 0, 2) and grid.replica_rules == (None,)
    with pytest.raises(ConfigError, match="--gating-levels"):
        parse_grid("a", "0", "first", "budget", "none")
    with pytest.raises(ConfigError, match="--k-b"):
        parse_grid("0", "0", "first", "many", "none")


def test_prepare_out_refuses_foreign_and_moves_with_force(tmp_path):
    (tmp_path / "notes.txt").write_text("user file")
    with pytest.raises(OutputPathError, match="not an `hdamoe tune` output"):
        _prepare_out(tmp_path, resume=False, force=False)
    (tmp_path / "tuned.json").write_text("{}")
    with pytest.raises(OutputPathError, match="holds a tune run"):
        _prepare_out(tmp_path, resume=False, force=False)
    _prepare_out(tmp_path, resume=True, force=False)              # ours: resume is fine
    _prepare_out(tmp_path, resume=False, force=True)
    assert (tmp_path / "notes.txt").read_text() == "user file"    # never touched
    moved = list(tmp_path.glob("superseded-*/tuned.json"))
    assert len(moved) == 1 and not (tmp_path / "tuned.json").exists()


def test_tune_command_end_to_end(tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main([*ARGS, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "Held-out streams" in text and "hindsight oracle" in text
    data = json.loads((out / "tuned.json").read_text())
    assert data["format"] == "hdamoe-tuned/1" and len(data["points"]) == 2
    assert set(data["summary"]["compared"]) == {"hd-moe", "hda-moe", "tuned"}
    oracle = json.loads((out / "oracle.json").read_text())
    assert oracle["unconstrained_tbt_us"] <= oracle["constrained_tbt_us"] + 1e-9
    assert len((out / "points.jsonl").read_text().splitlines()) == 2
    # a second run refuses without --resume (one line, exit 2) and skips every point with it
    assert cli.main([*ARGS, "--out", str(out)]) == 2
    assert "--resume" in capsys.readouterr().err
    assert cli.main([*ARGS, "--out", str(out), "--resume"]) == 0
    again = json.loads((out / "tuned.json").read_text())
    assert again["summary"]["resumed_points"] == 2
    assert again["knobs"] == data["knobs"]
    # the bench method
    spec = methods.parse_method(f"tuned:{out / 'tuned.json'}@ep")
    assert spec.placement == "ep" and dict(spec.env_kwargs)["gating_protect_top"] == 0
    with pytest.raises(ConfigError, match="does not exist"):
        methods.parse_method(f"tuned:{tmp_path / 'nope.json'}")

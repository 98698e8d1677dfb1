"""``benchmarks/learned_matrix.py``: every command it would run parses with the real CLI.

The driver builds ``hdamoe tune`` / ``hdamoe train`` argument lists as text; a renamed or removed
flag would only show up hours into a matrix run. Parsing them with ``hdamoe_env.app.cli``'s
parser (no work is done) catches that here, for all 12 cells and both placements.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from hdamoe_env.app import cli


def test_every_command_parses(tmp_path, load_benchmark):
    drv = load_benchmark("learned_matrix")
    parser = cli.build_parser()
    cells = drv.cells()
    assert len(cells) == 12 and len({c[0] for c in cells}) == 12
    for name, m, setting, batch in cells:
        for eplb in (False, True):
            cmd = drv.tune_cmd(tmp_path / name, m, setting, batch, eplb=eplb)
            args = parser.parse_args(cmd[1:])
            assert args.placement == ("eplb" if eplb else "node_link")
            assert args.oracle == eplb and args.batch == batch
        for placement in ("node_link", "eplb"):
            cmd = drv.train_cmd(tmp_path / name, tmp_path / "tuned.json", m, setting, batch,
                                20480, ["--replica-shares", "4"], placement)
            args = parser.parse_args(cmd[1:])
            assert args.placement == placement and args.replica_shares == 4
            assert args.seeds == "0,1,2" and args.eval_baselines.endswith("tuned.json")
            if m == "mix":
                assert args.eval_trace.endswith("experts_stem_mixtral.json")


def test_summary_of_an_empty_run_has_only_headers(tmp_path, load_benchmark):
    text = load_benchmark("learned_matrix").summary(tmp_path)
    assert text.count("\n|---") == 2 and "DeepSeek" not in text


def test_unknown_cell_is_refused(tmp_path, monkeypatch, capsys, load_benchmark):
    drv = load_benchmark("learned_matrix")
    monkeypatch.setattr("sys.argv", ["learned_matrix.py", "--out", str(tmp_path), "--cells",
                                     "ds_1-1_B7"])
    assert drv.main() == 2
    assert "unknown cell" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        monkeypatch.setattr("sys.argv", ["learned_matrix.py", "--phase", "bogus"])
        drv.main()


def test_process_backend_runs_cells_at_once_and_collects_failures(tmp_path, monkeypatch,
                                                                  load_benchmark):
    """``--workers 2``: every cell's commands run (tune, then train), failures in cell order."""
    drv = load_benchmark("learned_matrix")
    ran = []

    def fake_run(cmd):
        out = Path(cmd[cmd.index("--out") + 1])
        ran.append((cmd[1], out.parent.name))
        if cmd[1] == "tune":
            if out.parent.name == "qwen_10-25_B32":
                return 1                                         # this cell's tune fails
            out.mkdir(parents=True)
            (out / "tuned.json").write_text("{}")
        return 0

    monkeypatch.setattr(drv, "_run", fake_run)
    todo = [c for c in drv.cells() if c[0] in ("ds_2.5-75_B32", "qwen_10-25_B32", "mix_10-25_B128")]
    failed = drv.run_cells(todo, tmp_path, workers=2, backend="process")
    assert failed == ["qwen_10-25_B32:tune"]
    assert sorted(ran) == sorted([("tune", "ds_2.5-75_B32"), ("train", "ds_2.5-75_B32"),
                                  ("tune", "qwen_10-25_B32"), ("tune", "mix_10-25_B128"),
                                  ("train", "mix_10-25_B128")])
    ran.clear()                                                  # finished phases are skipped
    assert drv.run_cells(todo[:1], tmp_path, phase="tune", workers=2) == [] and ran == []


def test_ray_backend_without_ray_is_a_typed_error(tmp_path, monkeypatch, capsys, load_benchmark):
    from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

    drv = load_benchmark("learned_matrix")
    monkeypatch.setitem(__import__("sys").modules, "ray", None)  # import ray fails
    with pytest.raises(DependencyNotInstalled, match="needs Ray"):
        drv.run_cells(drv.cells()[:1], tmp_path, backend="ray")
    monkeypatch.setattr("sys.argv", ["learned_matrix.py", "--out", str(tmp_path), "--backend",
                                     "ray", "--cells", "ds_2.5-75_B32"])
    assert drv.main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs Ray" in err
    with pytest.raises(ConfigError, match="workers"):
        drv.run_cells(drv.cells()[:1], tmp_path, workers=0)
    with pytest.raises(ConfigError, match="backend"):
        drv.run_cells(drv.cells()[:1], tmp_path, backend="dask")


@pytest.mark.slow
def test_ray_backend_runs_one_task_per_cell(tmp_path, load_benchmark):
    """A real local Ray instance: the train phase of cells without a tuned heuristic fails at
    once in every task (no command runs), reported in cell order."""
    pytest.importorskip("ray", reason="ray is not installed (extra `ray`)")
    drv = load_benchmark("learned_matrix")
    todo = drv.cells()[:2]
    failed = drv.run_cells(todo, tmp_path, phase="train", workers=1, backend="ray")
    assert [f.split(":")[0] for f in failed] == [c[0] for c in todo]
    assert all("no " in f and "tuned.json" in f for f in failed)

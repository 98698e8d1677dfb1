"""The CLI's errors: values validated at parse time, output paths checked before any work,
one-line errors with exit code 2, a memory pre-flight, unexpected exceptions as one line."""

from __future__ import annotations

import json

import pytest

from hdamoe_env.app.cli import main


def _run(argv, capsys):
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    return code, err


@pytest.mark.parametrize("argv", [
    ["simulate", "--steps", "0"],
    ["simulate", "--requests", "0"],
    ["simulate", "--requests", "-3"],
    ["traces", "gen", "--requests", "0", "--out", "x.npz"],
    ["sweep-mem", "--model", "mixtral", "--out", "d", "--rho-values", "1,abc"],
    ["place", "--model", "mixtral", "--out", "d", "--time-limit", "-1"],
    ["train", "--out", "d", "--timesteps", "0"],
    ["train", "--out", "d", "--hp", "n_steps"],
    ["train", "--out", "d", "--gating-protect-top", "x"],
    ["bench", "--seeds", "0,x"],
    ["simulate", "--batch", "0"],
    ["bench-env", "--num-envs", "2", "--des-threads", "0"],
])
def test_bad_values_fail_at_parse_time(argv, capsys):
    """argparse prints one usage error and exits 2 before any work."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_memory_estimate_refuses_a_huge_batch(capsys):
    """--batch 10000000 is refused up front with the estimate."""
    code, err = _run(["simulate", "--batch", "10000000", "--steps", "1", "--requests", "8"],
                     capsys)
    assert code == 2 and len(err) == 1 and "GiB" in err[0] and "--batch" in err[0]


def test_memory_estimate_refuses_a_huge_trace(tmp_path, capsys):
    code, err = _run(["traces", "gen", "--requests", "100000000", "--out",
                      str(tmp_path / "t.npz")], capsys)
    assert code == 2 and "GiB" in err[0] and not (tmp_path / "t.npz").exists()


@pytest.mark.parametrize("make", ["dir_as_file", "missing_parent", "file_as_dir"])
def test_output_paths_checked_before_work(tmp_path, capsys, make):
    """Directories as files, missing/file parents → one line, exit 2."""
    blocker = tmp_path / "file"
    blocker.write_text("x")
    argv = {"dir_as_file": ["simulate", "--json", str(tmp_path)],
            "missing_parent": ["traces", "gen", "--out", str(tmp_path / "nodir" / "x.npz")],
            "file_as_dir": ["place", "--model", "mixtral", "--out", str(blocker)]}[make]
    code, err = _run(argv, capsys)
    assert code == 2 and len(err) == 1 and err[0].startswith("hdamoe: error:")
    assert blocker.read_text() == "x"


def test_json_is_never_truncated(tmp_path, capsys):
    """An existing --json file is not replaced without --resume."""
    path = tmp_path / "records.json"
    path.write_text(json.dumps([{"method": "tp", "seed": s} for s in range(16)]))
    code, err = _run(["bench", "--json", str(path), "--methods", "tp", "--seeds", "0"], capsys)
    assert code == 2 and "--resume" in err[0]
    assert len(json.loads(path.read_text())) == 16
    from hdamoe_env.app.bench import BenchConfig, run_bench
    from hdamoe_env.config.errors import OutputPathError

    with pytest.raises(OutputPathError):
        run_bench(BenchConfig(), ["tp"], [0], json_path=path)


def test_fresh_train_into_an_old_directory_is_refused(tmp_path, capsys):
    """A fresh train into a directory with an older run's checkpoints is refused (they would
    mix)."""
    (tmp_path / "checkpoints").mkdir()
    (tmp_path / "checkpoints" / "ckpt_5000.zip").write_bytes(b"old")
    code, err = _run(["train", "--out", str(tmp_path), "--timesteps", "8"], capsys)
    assert code == 2 and "--resume" in err[0]


def test_unexpected_exceptions_become_one_line(monkeypatch, capsys):
    from hdamoe_env.app import simbench

    def boom(args):
        raise IndexError("list index out of range")

    monkeypatch.setattr(simbench, "cmd_bench_sim", boom)
    code, err = _run(["bench-sim"], capsys)
    assert code == 2 and len(err) == 1 and "IndexError" in err[0] and "-v" in err[0]
    code = main(["-v", "bench-sim"])
    assert code == 2 and "Traceback" in capsys.readouterr().err

    def interrupt(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(simbench, "cmd_bench_sim", interrupt)
    assert main(["bench-sim"]) == 130


def test_usage_errors_are_one_line(capsys):
    from hdamoe_env.app.cli import main as cli_main

    with pytest.raises(SystemExit) as exc:
        cli_main(["simulate", "--steps", "0"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hdamoe simulate: error: argument --steps")


def test_cli_rejects_a_bad_quality_target_in_one_line(capsys):
    from hdamoe_env.app.cli import main

    assert main(["bench", "--methods", "tp,hda-moe@qx", "--steps", "1", "--seeds", "0",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "'hda-moe@qx'" in err and "hda-moe@qNN" in err


def test_errors_name_the_subcommands_help(capsys):
    """A typed error of a subcommand points to that subcommand's help, not `hdamoe --help`."""
    code = main(["simulate", "--model", "no-such-model"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("hdamoe: error:") and err[0].endswith("(see `hdamoe simulate --help`)")


def test_same_flags_across_subcommands_and_deprecated_spellings(capsys):
    """--progress/--no-progress, --json and --out mean the same everywhere; old spellings are
    accepted with a one-line note."""
    from hdamoe_env.app.cli import build_parser

    parser = build_parser()
    for argv in (["bench"], ["tune", "--out", "x"], ["train", "--out", "x"],
                 ["compare", "--methods", "tp,ep"], ["evaluate", "--agent", "noop"]):
        on = parser.parse_args([*argv, "--progress"])
        off = parser.parse_args([*argv, "--no-progress"])
        assert on.progress is True and off.progress is False, argv
    for argv in (["bench"], ["compare", "--methods", "tp,ep"], ["evaluate", "--agent", "noop"],
                 ["simulate"]):
        assert parser.parse_args([*argv, "--json", "r.json"]).json == "r.json", argv
    capsys.readouterr()
    args = parser.parse_args(["tune", "--out", "x", "--levels", "0,1", "--protect-top", "0"])
    assert args.levels == "0,1" and args.protect_top == "0"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hdamoe tune: note: --levels is deprecated, use --gating-levels (removed "
                   "after 0.2)", "hdamoe tune: note: --protect-top is deprecated, use "
                   "--gating-protect-top (removed after 0.2)"]
    new = parser.parse_args(["tune", "--out", "x", "--gating-levels", "0,2"])
    assert new.levels == "0,2" and capsys.readouterr().err == ""


def test_bench_env_des_threads_above_numbas_pool_is_one_line(capsys):
    """More DES threads than numba's pool: the typed error, one line, exit 2, before any
    env is built."""
    code, err = _run(["bench-env", "--num-envs", "2", "--fidelity", "des", "--mesh", "2x2",
                      "--batch", "8", "--des-threads", "1", "10000"], capsys)
    assert code == 2 and len(err) == 1
    assert "des_threads=10000 exceeds numba's thread pool" in err[0]

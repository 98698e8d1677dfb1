"""Try bad inputs as a careful user would and count the outcomes (typed error, one line, exit 2).

Every input runs in-process under a time limit, inside a fresh temporary directory (nothing
outside it is touched). Outcomes:

* ``typed``: a one-line ``hdamoe: error:`` / argparse ``error: argument`` (exit 2), or an
  ``HdMoeError`` from the Python API;
* ``traceback``: any other exception (or a multi-line error);
* ``silent``: the call succeeded although the input is invalid;
* ``hang``: the time limit (default 60 s) expired;
* ``data_loss``: a file that existed before the call was changed or deleted.

Run: ``OMP_NUM_THREADS=1 python benchmarks/bad_inputs.py [--timeout 60] [--list]``.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import signal
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


class _Timeout(Exception):
    pass


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file()}


def _cli(*argv: str) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from hdamoe_env.app.cli import main

        return ("cli", main([a.replace("TMP", str(tmp)) for a in argv]))
    return run


def _api(fn: Callable[[Path], Any]) -> Callable[[Path], Any]:
    return lambda tmp: ("api", fn(tmp))


def _setup_files(tmp: Path) -> None:
    """User files that must survive every input."""
    (tmp / "notes").mkdir()
    (tmp / "notes" / "layer_007.json").write_text("mine")
    (tmp / "notes" / "run.json").write_text('{"mine": 1}')
    (tmp / "notes" / "placement.npz").write_bytes(b"precious")
    (tmp / "records.json").write_text(json.dumps([{"method": "tp", "seed": s}
                                                  for s in range(16)]))
    (tmp / "afile").write_text("x")
    (tmp / "old_run" / "checkpoints").mkdir(parents=True)
    (tmp / "old_run" / "checkpoints" / "ckpt_5000.zip").write_bytes(b"stale")
    (tmp / "trace.json").write_text(json.dumps({"0": [[0, 1]], "\u0661": [[1, 2]]}))
    (tmp / "bool.json").write_text(json.dumps({"0": [[True, 1]], "1": [[0, 1]]}))
    (tmp / "four.json").write_text(json.dumps({str(i): [[0, 1]] for i in range(4)}))
    (tmp / "empty.npz").write_bytes(b"")
    (tmp / "trunc.npz").write_bytes(b"PK\x03\x04" + b"\0" * 20)
    meta = np.frombuffer(b"[1]", np.uint8)
    np.savez(tmp / "badmeta.npz", P=np.full((1, 2, 2), 0.5), pi=np.array([[0, 1]]), meta=meta)
    good = json.dumps({"format": "hdamoe-placement", "format_version": 1}).encode()
    np.savez(tmp / "floatpi.npz", P=np.full((1, 2, 2), 0.5), pi=np.array([[0.0, 1.7]]),
             meta=np.frombuffer(good, np.uint8))
    (tmp / "garbage.zip").write_bytes(b"garbage")


def _env(**kw: Any) -> Callable[[Path], Any]:
    def make(tmp: Path) -> Any:
        from hdamoe_env.env.environment import HdMoeEnv

        return HdMoeEnv(model="mixtral-8x7b", mesh="2x2", steps_per_episode=1, **kw)
    return _api(make)


def _hw(mesh: Any) -> Callable[[Path], Any]:
    def make(tmp: Path) -> Any:
        from hdamoe_env.config.specs import hardware_from_setting

        return hardware_from_setting("5/50", mesh)
    return _api(make)


def _load(kind: str, name: str) -> Callable[[Path], Any]:
    def load(tmp: Path) -> Any:
        if kind == "placement":
            from hdamoe_env.sim.placement import Placement

            return Placement.load(tmp / name)
        if kind == "trace":
            import traces

            return traces.load(tmp / name)
        if kind == "json":
            import traces

            return traces.read_reference_json(tmp / name, E=8, k=2)
        from agents.learned.policy import load_agent

        return load_agent(tmp / name)
    return _api(load)


CASES: dict[str, Callable[[Path], Any]] = {
    # reproducers 1-3: data loss
    "place into an unrelated non-empty dir": _cli("place", "--model", "mixtral", "--mesh", "2x2",
                                                  "--layers", "0", "--requests", "1",
                                                  "--nb-mode", "heuristic", "--lb-method",
                                                  "local", "--bo-calls", "2", "--out",
                                                  "TMP/notes"),
    "bench --json over 16 records": _cli("bench", "--json", "TMP/records.json", "--methods", "tp",
                                         "--seeds", "0"),
    "train fresh into an old run": _cli("train", "--out", "TMP/old_run", "--timesteps", "8"),
    "simulate --json over a file": _cli("simulate", "--json", "TMP/records.json", "--steps", "1"),
    "traces gen --out over a file": _cli("traces", "gen", "--out", "TMP/afile"),
    # reproducers 6, 7, 10, 15: loaders
    "Placement.load empty": _load("placement", "empty.npz"),
    "Placement.load truncated": _load("placement", "trunc.npz"),
    "Placement.load non-object meta": _load("placement", "badmeta.npz"),
    "Placement.load float pi": _load("placement", "floatpi.npz"),
    "Placement.load directory": _load("placement", "notes"),
    "traces.load empty": _load("trace", "empty.npz"),
    "traces.load truncated": _load("trace", "trunc.npz"),
    "reference JSON non-ASCII layer key": _load("json", "trace.json"),
    "reference JSON true as expert id": _load("json", "bool.json"),
    "convert 4-layer file as mixtral": _cli("traces", "convert", "TMP/four.json", "--model",
                                            "mixtral-8x7b", "--out", "TMP/four.npz"),
    "load_agent garbage zip": _load("agent", "garbage.zip"),
    "load_agent missing": _load("agent", "nothing.npz"),
    # reproducer 8, 14: values
    "simulate --steps 0": _cli("simulate", "--steps", "0"),
    "simulate --requests 0": _cli("simulate", "--requests", "0"),
    "simulate --requests -3": _cli("simulate", "--requests", "-3"),
    "traces gen --requests 0": _cli("traces", "gen", "--requests", "0", "--out", "TMP/g.npz"),
    "sweep-mem --rho-values 1,abc": _cli("sweep-mem", "--model", "mixtral", "--out", "TMP/s",
                                         "--rho-values", "1,abc"),
    "train --hp n_steps=abc": _cli("train", "--out", "TMP/t", "--hp", "n_steps=abc",
                                   "--timesteps", "8"),
    "place --time-limit -1": _cli("place", "--model", "mixtral", "--out", "TMP/p",
                                  "--time-limit", "-1"),
    "train --timesteps 0": _cli("train", "--out", "TMP/t0", "--timesteps", "0"),
    "simulate --mesh 0x8": _cli("simulate", "--mesh", "0x8"),
    "simulate --setting 5": _cli("simulate", "--setting", "5"),
    "simulate --model nope": _cli("simulate", "--model", "nope"),
    "simulate --placement nope.npz": _cli("simulate", "--placement", "nope.npz", "--steps", "1"),
    "simulate --trace missing.npz": _cli("simulate", "--trace", "TMP/missing.npz"),
    "bench --seeds 0,x": _cli("bench", "--seeds", "0,x"),
    "simulate --seed -1": _cli("simulate", "--seed", "-1"),
    "simulate --hop-latency-ns nan": _cli("simulate", "--hop-latency-ns", "nan"),
    # reproducer 9: paths
    "simulate --json DIR": _cli("simulate", "--json", "TMP", "--steps", "1"),
    "place --out FILE": _cli("place", "--model", "mixtral", "--out", "TMP/afile"),
    "train --out FILE": _cli("train", "--out", "TMP/afile", "--timesteps", "8"),
    "traces gen --out /nodir/x.npz": _cli("traces", "gen", "--out", "TMP/nodir/x.npz"),
    "bench --json DIR": _cli("bench", "--json", "TMP", "--methods", "tp", "--seeds", "0"),
    # reproducer 11: sizes
    "simulate --batch 10000000": _cli("simulate", "--batch", "10000000", "--steps", "1",
                                      "--requests", "8"),
    "traces gen --requests 100000000": _cli("traces", "gen", "--requests", "100000000",
                                            "--out", "TMP/big.npz"),
    # reproducers 12, 14: Python API
    "hardware_from_setting mesh 32": _hw(32),
    "hardware_from_setting mesh (4, 8, 2)": _hw((4, 8, 2)),
    "hardware_from_setting mesh (4.5, 8)": _hw((4.5, 8)),
    "HdMoeEnv view=foo": _env(view="foo"),
    "HdMoeEnv trace_seed=-1": _env(trace_seed=-1),
    "HdMoeEnv placement_seed='x'": _env(placement_seed="x"),
    "HdMoeEnv k_b=100": _env(k_b=100),
    "HdMoeEnv trace_requests=0": _env(trace_requests=0),
    "HdMoeEnv trace_tokens=0": _env(trace_tokens=0),
    "HdMoeEnv batch=True": _env(batch=True),
}


# ------------------------------------------------------------------ issue 29: every class again
def _setup_issue29(tmp: Path) -> None:
    """Files of the issue-29 inputs: a FIFO, a deep JSON, an unsigned model, a forged resume."""
    os.mkfifo(tmp / "fifo.json")
    os.mkfifo(tmp / "fifo.npz")
    (tmp / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    (tmp / "deep_obj.json").write_text('{"a":' * 5_000 + "1" + "}" * 5_000)
    (tmp / "list_run").mkdir()
    (tmp / "list_run" / "learned.json").write_text("[1, 2]")
    (tmp / "list_run" / "model.zip").write_bytes(b"PK\x05\x06" + b"\0" * 18)
    import zipfile

    with zipfile.ZipFile(tmp / "evil.zip", "w") as zf:   # any unsigned zip stands for a payload
        zf.writestr("data", "{}")
        zf.writestr("policy.pth", b"\0")
    ckpt_dir = tmp / "forged" / "checkpoints"
    ckpt_dir.mkdir(parents=True)
    (ckpt_dir / "ckpt_8.zip").write_bytes((tmp / "evil.zip").read_bytes())
    sha = hashlib.sha256((ckpt_dir / "ckpt_8.zip").read_bytes()).hexdigest()
    (ckpt_dir / "ckpt_8.json").write_text(json.dumps({"sha256": sha, "run_digest": "x",
                                                     "steps": 8}))
    (tmp / "p").mkdir()
    (tmp / "p" / "layer_000.json").write_text('{"mine": 1}')
    # resume states (train --resume): unsigned, signed but not one, signed with a list as meta
    from hdamoe_env.config.trust import write_signature

    np.savez(tmp / "state_unsigned.npz", meta=np.frombuffer(b'{"format": 1}', np.uint8))
    np.savez(tmp / "state_junk.npz", x=np.zeros(3))
    np.savez(tmp / "state_list.npz", meta=np.frombuffer(b"[1, 2]", np.uint8))
    for name in ("state_junk.npz", "state_list.npz"):
        write_signature(tmp / name, (tmp / name).read_bytes())
    (tmp / "nan_stats").mkdir()
    np.savez(tmp / "nan_stats" / "vecnormalize.npz", mean_0=np.full(3, np.nan),
             var_0=np.full(3, np.nan), count=np.array(np.nan),
             meta=np.frombuffer(json.dumps({"keys": ["x"]}).encode(), np.uint8))


_ENV_SMALL = {"model": "mixtral-8x7b", "mesh": "2x2", "steps_per_episode": 1, "batch": 8,
              "trace_requests": 2, "trace_tokens": 256}


def _env29(**kw: Any) -> Callable[[Path], Any]:
    def make(tmp: Path) -> Any:
        from hdamoe_env.env.environment import HdMoeEnv

        return HdMoeEnv(**{**_ENV_SMALL, **kw})
    return _api(make)


def _reset(seed: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from hdamoe_env.env.environment import HdMoeEnv

        return HdMoeEnv(**_ENV_SMALL).reset(seed=seed)
    return _api(run)


def _run29(**kw: Any) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        from hdamoe_env.config.run import RunSpec

        return RunSpec.resolve(**kw)
    return _api(run)


def _call(fn_path: str, *args: Any, **kw: Any) -> Callable[[Path], Any]:
    """Call ``module:function`` with ``TMP`` in string arguments replaced by the folder."""
    def run(tmp: Path) -> Any:
        import importlib

        module, _, name = fn_path.partition(":")
        fn: Any = importlib.import_module(module)
        for part in name.split("."):
            fn = getattr(fn, part)
        fix = (lambda v: v.replace("TMP", str(tmp)) if isinstance(v, str) else v)
        return fn(*map(fix, args), **{k: fix(v) for k, v in kw.items()})
    return _api(run)


def _with_env(var: str, value: str, inner: Callable[[Path], Any]) -> Callable[[Path], Any]:
    def run(tmp: Path) -> Any:
        old = os.environ.get(var)
        os.environ[var] = value
        try:
            return inner(tmp)
        finally:
            if old is None:
                os.environ.pop(var, None)
            else:
                os.environ[var] = old
    return run


_TRAIN = ("train", "--timesteps", "8", "--no-eval", "--no-tensorboard", "--model", "mixtral",
          "--mesh", "2x2", "--batch", "8", "--requests", "2")


def _train(*extra: str) -> Callable[[Path], Any]:
    return _cli(*_TRAIN, "--out", "TMP/t29", *extra)


def _issue29_cases() -> dict[str, Callable[[Path], Any]]:
    """At least 150 new inputs: every class of issue 29 (untyped, silent, hang, code, faults)."""
    c: dict[str, Callable[[Path], Any]] = {}
    # untyped errors: seeds
    for seeds in ("-1", "0,0", "1.5", "4294967296", "0,,1", "-3,2"):
        c[f"bench --seeds {seeds}"] = _cli("bench", "--seeds", seeds, "--methods", "tp")
        c[f"train --seeds {seeds}"] = _train("--seeds", seeds)
    for opt in ("--eval-seeds", "--train-seeds"):
        c[f"tune {opt} 0,0"] = _cli("tune", "--out", "TMP/tu", opt, "0,0")
    c["evaluate --seeds -1"] = _cli("evaluate", "--agent", "greedy", "--seeds", "-1")
    c["reproduce --seeds 0,0"] = _cli("reproduce", "--out", "TMP/r", "--seeds", "0,0", "--list")
    c["crossover --seeds 0,0"] = _cli("crossover", "--out", "TMP/x", "--seeds", "0,0", "--list")
    for seed in (-1, 1.5, "0", True, 2**33, [1], np.float64(2.0)):
        c[f"env.reset(seed={seed!r})"] = _reset(seed)
    for name in ("trace_seed", "placement_seed", "gamma_seed"):
        for bad in (-1, 1.5, "0", True):
            c[f"HdMoeEnv {name}={bad!r}"] = _env29(**{name: bad})
    # untyped errors: train options
    c["train --max-broadcast 0"] = _train("--max-broadcast", "0")
    c["train --candidates 100 (E=8)"] = _train("--candidates", "100")
    for hp in ("learning_rate=-1", "learning_rate=0", "gamma=2", "gamma=-0.5", "clip_range=-1",
               "clip_range=0", "n_steps=0", "n_steps=1.5", "batch_size=-4", "ent_coef=-1",
               "gae_lambda=2", "n_epochs=0", "vf_coef=nan", "max_grad_norm=0"):
        c[f"train --hp {hp}"] = _train("--hp", hp)
    for value in ("nan", "1e308", "inf", "-1e308"):
        c[f"train --keep-logit {value}"] = _train("--keep-logit", value)
    for opt, value in (("--quality-weight", "nan"), ("--quality-weight", "-1"),
                       ("--quality-target", "2"), ("--quality-target", "nan"),
                       ("--dual-step", "nan")):
        c[f"train {opt} {value}"] = _train(opt, value)
    c["tune --penalty -1"] = _cli("tune", "--out", "TMP/tu", "--penalty", "-1")
    c["tune --quality-target 1.5"] = _cli("tune", "--out", "TMP/tu", "--quality-target", "1.5")
    # untyped errors: Python API
    for kw in ({"gating_levels": "0,1"}, {"gating_levels": ["x"]}, {"gating_levels": [1, 1]},
               {"gating_levels": [-1]}, {"gating_levels": [float("nan")]}, {"gating_levels": []},
               {"gating_levels": 5}, {"gating_levels": [True]},
               {"batch_options": "x"}, {"batch_options": {"nosuch": 1}},
               {"batch_options": {"cycle": "no"}}, {"batch_options": {"cycle": 1}},
               {"batch_options": [1]}, {"batch_options": {"n_steps": 3}},
               {"foo": 1}, {"batch_mod": "streams"}, {"hardware": "x"}, {"hardware": 3},
               {"predictor_accuracy": float("nan")}, {"predictor_accuracy": float("inf")},
               {"predictor_accuracy": -0.1}, {"predictor_accuracy": 1.5},
               {"predictor_accuracy": "high"}, {"predictor_accuracy": [0.5] * 3},
               {"reward_scale": "x"}, {"reward_scale": float("nan")}, {"reward_scale": -1},
               {"dispatch_rules": "first"}, {"dispatch_rules": ["first", "first"]},
               {"dispatch_rules": []}, {"dispatch_rules": ["nosuch"]},
               {"replica_rules": "nearest"}, {"measure_twin_error": "yes"},
               {"flatten_replicas": 1}, {"gating_include_future": "no"},
               {"gammas": [float("nan")] * 32}, {"gammas": "x"}, {"gammas": [0.0] * 32},
               {"gating_coefficients": (1.0,)}, {"gating_coefficients": ("a", "b")},
               {"gating_coefficients": (float("nan"), 1.0)},
               {"gating_protect_top": -1}, {"gating_protect_top": "x"},
               {"gating_protect_top": 1.5}, {"steps_per_episode": 0},
               {"steps_per_episode": 1.5}, {"steps_per_episode": True}, {"max_broadcast": -1},
               {"max_broadcast": "x"}, {"bc_max_messages": 0}, {"gating_candidate_window": -1},
               {"trace": ""}, {"trace": 3}, {"topology": "nosuch"},
               {"conventions": "faithful+b_psum=1+b_psum=2"}, {"trace_skew": 1e308},
               {"batch": 2**40}, {"mesh": (2**31, 2**31)}, {"mesh": "4096x4096"}):
        c[f"HdMoeEnv {kw!r}"[:90]] = _env29(**kw)
    c["Placement.load(3)"] = _call("hdamoe_env.sim.placement:Placement.load", 3)
    # silently wrong: values and cross-field checks
    for value in ("1e308", "1e7", "inf", "nan", "-1"):
        c[f"simulate --hop-latency-ns {value}"] = _cli("simulate", "--hop-latency-ns", value,
                                                        "--steps", "1")
    c["place --hop-latency-ns 1e308"] = _cli("place", "--model", "mixtral", "--out", "TMP/pl",
                                             "--hop-latency-ns", "1e308")
    for setting in ("1e9/50", "5/1e9", "0/50", "5/0", "1e-9/50"):
        c[f"simulate --setting {setting}"] = _cli("simulate", "--setting", setting, "--steps",
                                                  "1")
    for value in ("1e308", "1e3", "1e-5", "nan", "inf"):
        c[f"bench --trace-skew {value}"] = _cli("bench", "--trace-skew", value, "--methods", "tp")
    c["place --trace-skew 1e308"] = _cli("place", "--model", "mixtral", "--out", "TMP/pl",
                                         "--trace-skew", "1e308")
    for over in ({"hop_latency_ns": 1e308}, {"mem_bw_gbps": 0}, {"mem_bw_gbps": 1e12},
                 {"node_dram_gib": 1e308}, {"nosuch": 1}, {"compute_tflops": 5}):
        c[f"RunSpec hardware_overrides={over}"] = _run29(hardware_overrides=over)
    for mesh in ((2**31, 2**31), "100000x100000", (1025, 1)):
        c[f"RunSpec mesh={mesh}"] = _run29(mesh=mesh)
    c["RunSpec batch=2**40"] = _run29(batch=2**40)
    for placement in (",", "", "tp,,ep", "tp,tp"):
        c[f"simulate --placement {placement!r}"] = _cli("simulate", "--placement", placement,
                                                        "--steps", "1")
    for methods in (",", "", "tp,tp"):
        c[f"bench --methods {methods!r}"] = _cli("bench", "--methods", methods)
    c["--conventions faithful+b_psum=1+b_psum=2"] = _cli(
        "simulate", "--conventions", "faithful+b_psum=1+b_psum=2", "--steps", "1")
    c["simulate --json ''"] = _cli("simulate", "--json", "", "--steps", "1")
    c["bench --json ''"] = _cli("bench", "--json", "", "--methods", "tp")
    c["bench --csv ''"] = _cli("bench", "--csv", "", "--methods", "tp")
    c["train --out ''"] = _cli(*_TRAIN, "--out", "")
    c["bench --csv o.json --json o.json"] = _cli("bench", "--csv", "TMP/o.json", "--json",
                                                 "TMP/o.json", "--methods", "tp")
    c["bench --csv x --json ./x"] = _cli("bench", "--csv", "TMP/x.out", "--json", "TMP/./x.out",
                                         "--methods", "tp")
    for inside in ("p/layer_000.json", "p/layer_001.json", "p/run.json", "p/sub/rows.json"):
        c[f"place --json {inside} --out p"] = _cli(
            "place", "--model", "mixtral", "--mesh", "2x2", "--layers", "0", "--nb-mode",
            "heuristic", "--lb-method", "local", "--bo-calls", "2", "--requests", "1",
            "--out", "TMP/p", "--json", f"TMP/{inside}", "--resume")
    c["evaluate --agent ''"] = _cli("evaluate", "--agent", "")
    c["evaluate --agent ','"] = _cli("evaluate", "--agent", ",")
    for opt, value in (("--models", "nosuch"), ("--models", "../../x"), ("--models", ""),
                       ("--settings", "5/0"), ("--settings", "1e9/1"), ("--settings", "x"),
                       ("--batches", "0"), ("--batches", "-1"), ("--batches", "x"),
                       ("--steps", "0"), ("--workers", "0")):
        c[f"crossover {opt} {value}"] = _cli("crossover", "--out", "TMP/x", opt, value, "--list")
    c["crossover --batches 0 --out x (no --list)"] = _cli("crossover", "--out", "TMP/x",
                                                          "--batches", "0")
    # hangs and memory: files
    c["simulate --trace FIFO"] = _cli("simulate", "--trace", "TMP/fifo.json", "--steps", "1")
    c["simulate --trace /dev/zero"] = _cli("simulate", "--trace", "/dev/zero", "--steps", "1")
    c["simulate --trace DIR"] = _cli("simulate", "--trace", "TMP/notes", "--steps", "1")
    c["traces stats FIFO"] = _cli("traces", "stats", "TMP/fifo.json")
    c["traces convert FIFO"] = _cli("traces", "convert", "TMP/fifo.json", "--out", "TMP/c.npz")
    c["traces convert /dev/zero"] = _cli("traces", "convert", "/dev/zero", "--out", "TMP/c.npz")
    c["traces convert deep JSON"] = _cli("traces", "convert", "TMP/deep.json", "--out",
                                         "TMP/c.npz")
    c["read_reference_json deep list"] = _load("json", "deep.json")
    c["read_reference_json deep object"] = _load("json", "deep_obj.json")
    c["traces.load FIFO"] = _load("trace", "fifo.npz")
    c["Placement.load FIFO"] = _load("placement", "fifo.npz")
    c["Placement.load /dev/zero"] = _call("hdamoe_env.sim.placement:Placement.load", "/dev/zero")
    c["simulate --placement FIFO"] = _cli("simulate", "--placement", "TMP/fifo.npz", "--steps",
                                          "1")
    c["bench --resume --json FIFO"] = _cli("bench", "--json", "TMP/fifo.json", "--resume",
                                           "--methods", "tp")
    c["trace over the size cap"] = _with_env("HDAMOE_MAX_INPUT_BYTES", "16",
                                             _load("json", "trace.json"))
    c["learned.json that is a list"] = _load("agent", "list_run")
    # code from files
    c["load_agent unsigned zip"] = _load("agent", "evil.zip")
    c["bench --methods agent:evil.zip"] = _cli("bench", "--methods", "agent:TMP/evil.zip",
                                               "--seeds", "0", "--model", "mixtral", "--mesh",
                                               "2x2", "--steps", "1")
    c["evaluate --agent evil.zip"] = _cli("evaluate", "--agent", "TMP/evil.zip")
    c["train --resume with a recomputed sidecar"] = _cli(*_TRAIN, "--out", "TMP/forged",
                                                         "--resume")
    c.update(_resume_state_cases())
    return c


def _set_state(change: Callable[[dict[str, Any], dict[str, Any]], Any],
               **other: Any) -> Callable[[Path], Any]:
    """``HdMoeEnv.set_state`` of a changed state (of ``_ENV_SMALL``) on an env with ``other``."""
    def run(tmp: Path) -> Any:
        from hdamoe_env.env.environment import HdMoeEnv

        env = HdMoeEnv(**_ENV_SMALL)
        env.reset(seed=0)
        meta, arrays = env.get_state()
        changed = change(meta, arrays)
        target = HdMoeEnv(**{**_ENV_SMALL, **other}) if other else env
        return target.set_state(*(changed if changed is not None else (meta, arrays)))
    return _api(run)


def _resume_state_cases() -> dict[str, Callable[[Path], Any]]:
    """Resume states of ``train --resume`` and env states: damaged, unsigned, mismatched."""
    load = "agents.learned.resume:load_resume_state"
    return {
        "resume state FIFO": _call(load, "TMP/fifo.npz"),
        "resume state directory": _call(load, "TMP/p"),
        "resume state missing": _call(load, "TMP/nosuch_state.npz"),
        "resume state unsigned": _call(load, "TMP/state_unsigned.npz"),
        "resume state signed, no meta": _call(load, "TMP/state_junk.npz"),
        "resume state signed, meta a list": _call(load, "TMP/state_list.npz"),
        "env set_state of another batch": _set_state(lambda m, a: None, batch=16),
        "env set_state meta {}": _set_state(lambda m, a: ({}, a)),
        "env set_state meta a list": _set_state(lambda m, a: ([1], a)),
        "env set_state no arrays": _set_state(lambda m, a: (m, {})),
        "env set_state rows 1-D": _set_state(lambda m, a: (m, {**a, "rows": a["rows"][0]})),
        "env set_state layer 99": _set_state(lambda m, a: ({**m, "layer": 99}, a)),
        "env set_state unknown bit generator": _set_state(lambda m, a: (
            {**m, "np_random": {**m["np_random"], "bit_generator": "os.system"}}, a)),
        "env set_state RNG state None": _set_state(lambda m, a: ({**m, "twin_rng": None}, a)),
        "env set_state tbts_us a string": _set_state(lambda m, a: ({**m, "tbts_us": "x"}, a)),
    }


CASES_BEFORE_29 = len(CASES)
CASES.update(_issue29_cases())


def _run_case(fn: Callable[[Path], Any], timeout: float) -> tuple[str, str]:
    import traces.errors
    from hdamoe_env.config.errors import HdMoeError

    # the package's typed errors (every trace error is an HdMoeError too)
    typed = (HdMoeError, traces.errors.TraceFormatError, traces.errors.UnknownNameError)

    with tempfile.TemporaryDirectory(prefix="hdamoe-bad-") as name:
        tmp = Path(name)
        _setup_files(tmp)
        _setup_issue29(tmp)
        before = _snapshot(tmp)
        err = io.StringIO()
        old_cwd = os.getcwd()
        os.chdir(tmp)
        signal.signal(signal.SIGALRM, lambda *_: (_ for _ in ()).throw(_Timeout()))
        signal.alarm(int(timeout))
        try:
            with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
                try:
                    kind, result = fn(tmp)
                except SystemExit as exc:
                    kind, result = "cli", exc.code
            outcome = "silent"
            if kind == "cli" and result not in (0, None):
                lines = [l for l in err.getvalue().strip().splitlines() if l.strip()]
                last = lines[-1] if lines else ""
                clear = ("Traceback" not in err.getvalue()
                         and (last.startswith("hdamoe: ") and "error:" in last
                              or "error: argument" in last))
                outcome = "typed" if clear else "traceback"
        except _Timeout:
            outcome = "hang"
        except typed:
            outcome = "typed"
        except BaseException:  # noqa: BLE001 - that is what we count
            outcome = "traceback"
        finally:
            signal.alarm(0)
            os.chdir(old_cwd)
        after = _snapshot(tmp)
        lost = [p for p, h in before.items() if after.get(p) != h]
        if lost:
            outcome = "data_loss"
        return outcome, err.getvalue().strip().splitlines()[-1][:160] if err.getvalue() else ""


def main() -> int:
    """Run every case and print the count table."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--list", action="store_true", help="print every case and its outcome")
    args = p.parse_args()
    counts: Counter[str] = Counter()
    for name, fn in CASES.items():
        outcome, line = _run_case(fn, args.timeout)
        counts[outcome] += 1
        if args.list or outcome != "typed":
            print(f"{outcome:>10}  {name}  {line}")
    print(f"\n(inputs of issue 29: {len(CASES) - CASES_BEFORE_29} of {len(CASES)})")
    print(f"bad inputs tried {len(CASES)} | typed clear errors {counts['typed']} | raw "
          f"tracebacks {counts['traceback']} | silently wrong {counts['silent']} | hangs "
          f"{counts['hang']} | data-loss {counts['data_loss']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

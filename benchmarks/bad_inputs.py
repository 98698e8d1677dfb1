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


def _run_case(fn: Callable[[Path], Any], timeout: float) -> tuple[str, str]:
    import traces.errors
    from hdamoe_env.config.errors import HdMoeError

    # the package's typed errors (every trace error is an HdMoeError too)
    typed = (HdMoeError, traces.errors.TraceFormatError, traces.errors.UnknownNameError)

    with tempfile.TemporaryDirectory(prefix="hdamoe-bad-") as name:
        tmp = Path(name)
        _setup_files(tmp)
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
    print(f"\nbad inputs tried {len(CASES)} | typed clear errors {counts['typed']} | raw "
          f"tracebacks {counts['traceback']} | silently wrong {counts['silent']} | hangs "
          f"{counts['hang']} | data-loss {counts['data_loss']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Bit-identity snapshot of hdamoe-env behaviour, to prove that a refactoring changes nothing.

``snapshot --out DIR`` runs a fixed set of small, seeded workloads and writes one canonical JSON
file per part into ``DIR``; ``compare DIR_A DIR_B`` diffs two snapshots field by field. Take a
snapshot before a restructuring, another after it, and compare them.

The workloads use only entry points that survive a restructuring of the package's modules:

* ``simulate`` -- ``hdamoe simulate ... --json FILE`` (CLI subprocess) over models, settings,
  meshes, topologies, convention profiles, evaluators, placements, batch sizes and batching;
* ``env`` -- ``gymnasium.make`` of the registered ids (``hdamoe_env/HdMoE-v1`` and its
  variants) with varied kwargs, ``reset(seed=...)`` and seeded ``action_space.sample()``
  actions; per step the action, ``repr`` of the reward, every info entry (floats as ``repr``,
  arrays as dtype/shape/SHA-256) and a SHA-256 of the observation (each Dict entry's key,
  dtype, shape and bytes, in sorted key order), plus per-entry hashes;
* ``train`` -- a tiny ``hdamoe train`` run; the SHA-256 of every tensor of the saved SB3
  policy (``policy.pth``), optimizer state and ``pytorch_variables.pth``, the VecNormalize
  statistics, the plain fields of SB3's ``data``, ``learned.json`` and the held-out
  ``eval.json``;
* ``reproduce`` -- ``hdamoe reproduce --suite quick`` (by default); every cell payload, the
  records of ``results.jsonl``, ``suite.json``, ``run.json``, the lines of ``report.md``
  (timing text masked by :data:`REPORT_MASKS`), the SHA-256 of each figure and the placement
  artifacts (``.npz`` arrays, ``.json`` records) the suite left in its cache directory.

Every subprocess and this process run with one thread per math library
(:data:`THREAD_ENV`) and ``HDAMOE_CACHE_DIR=DIR/cache/<part>`` so placement caches start empty
and are not shared between snapshots or parts. Subprocesses inherit ``PYTHONPATH``: to snapshot
a worktree other than the installed one, run with ``PYTHONPATH=<worktree>`` and check that
``manifest.json`` (``resolved_modules``) names the intended files.

Canonical form: floats are stored as ``repr`` strings (exact, and ``-0.0``/``nan`` survive),
arrays and tensors as ``{"dtype", "shape", "sha256"}``, absolute paths under the snapshot
directory or the working directory are rewritten to ``<OUT>``/``<CWD>``, and the keys of
:data:`EXCLUDED_KEYS` (wall-clock times, timestamps, environment versions, hashes of files that
embed timestamps, text tables holding timings) are dropped at any depth -- both when writing and
again when comparing. Two values are masked rather than dropped: timing text of ``report.md``
(:data:`REPORT_MASKS`) and the ``run_key`` of bench records whose configuration hashes an
absolute placement path (:data:`PATH_KEYED_MASK`). ``manifest.json`` (options, part run
times, interpreter) is never compared.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
import warnings
import zipfile
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

PARTS: tuple[str, ...] = ("simulate", "env", "train", "reproduce")

#: Single-threaded math libraries: thread counts change floating-point reduction orders.
THREAD_ENV: dict[str, str] = {
    "OMP_NUM_THREADS": "1",
    "OPENBLAS_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMBA_NUM_THREADS": "1",
}

#: The CLI as a subprocess (the module path ``hdamoe_env.app.cli`` is stable by contract).
CLI_CODE = "from hdamoe_env.app.cli import main; main()"

#: Keys dropped from every record at any depth (timing- or environment-dependent), with why.
EXCLUDED_KEYS: dict[str, str] = {
    "wall_s": "wall-clock seconds (reproduce cell payloads and placement records, run.json, "
              "learned.json, placement-pipeline records)",
    "finished": "timestamp of a finished reproduce cell",
    "episode_wall_s": "wall-clock seconds of one bench episode (bench records)",
    "decision_ms_per_step": "wall-clock agent decision time (bench records)",
    "decision_ms_p95": "wall-clock agent decision time, 95th percentile (bench records)",
    "steps_per_s": "training throughput (learned.json)",
    "pipeline_cpu_s": "sum of the placement pipeline's per-layer wall times (placement records)",
    "timings_s": "per-stage wall times of the placement pipeline (layer_*.json in the cache)",
    "nb_wall_s": "wall-clock seconds of Node Balance (placement-pipeline layer records)",
    "search_wall_s": "wall-clock seconds of the gating-scale search (bench records)",
    "solver_version": "environment: installed MILP/LP solver version (placement records)",
    "start_time": "SB3 training start timestamp (model.zip 'data')",
    "torch_version": "environment: installed torch version (learned.json)",
    "model_sha256": "SHA-256 of model.zip, whose members carry timestamps; the policy tensors "
                    "are hashed one by one instead (learned.json)",
    "tables": "rendered text tables that include the wall-clock 'decide ms' column (eval.json); "
              "the same numbers are compared in 'records' and 'summary'",
}

#: Replaces ``run_key`` in the records of reproduce cells with ``placement_from`` (paper
#: Fig. 21): there the bench configuration holds the placement directory, and ``run_key``
#: hashes its resolved absolute path (inside this snapshot's cache), not just the behaviour.
PATH_KEYED_MASK = "<masked: hashes the absolute placement cache path>"

#: Timing text of ``hdamoe reproduce``'s report.md, masked line by line: (regex, replacement).
REPORT_MASKS: tuple[tuple[str, str], ...] = (
    (r"wall time [0-9.]+ min", "wall time <MASKED> min"),
    (r"written \d{4}-\d{2}-\d{2}", "written <DATE>"),
    (r"with \d+ worker\(s\)", "with <N> worker(s)"),
)

#: Files of a snapshot directory that ``compare`` diffs, one per part.
PART_FILES: dict[str, str] = {part: f"{part}.json" for part in PARTS}

# --------------------------------------------------------------------------------- workloads
#: ``hdamoe simulate`` configurations: (label, CLI arguments). Small batches, 2-3 decode steps
#: and 16 synthetic requests keep each run at seconds.
SIMULATE_CONFIGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("ds-5/50-4x8-mesh-faithful-sampled-B16",
     ("--model", "deepseek-v2-lite", "--setting", "5/50", "--mesh", "4x8", "--topology", "mesh",
      "--conventions", "faithful", "--evaluator", "sampled", "--steps", "2",
      "--placement", "tp,ep", "--batch", "16")),
    ("ds-2.5/75-4x4-torus-paper-sampled-B32-ep",
     ("--model", "deepseek-v2-lite", "--setting", "2.5/75", "--mesh", "4x4", "--topology",
      "torus", "--conventions", "paper", "--evaluator", "sampled", "--steps", "2",
      "--placement", "ep", "--batch", "32")),
    ("ds-10/25-4x8-fattree-paperhd-static-B64",
     ("--model", "deepseek-v2-lite", "--setting", "10/25", "--mesh", "4x8", "--topology",
      "fattree", "--conventions", "paper-hd", "--evaluator", "static", "--placement", "tp,ep",
      "--batch", "64")),
    ("mixtral-5/50-4x8-mesh-faithful-static-B16",
     ("--model", "mixtral-8x7b", "--setting", "5/50", "--mesh", "4x8", "--topology", "mesh",
      "--conventions", "faithful", "--evaluator", "static", "--placement", "tp,ep",
      "--batch", "16")),
    ("mixtral-2.5/75-4x4-torus-paper-sampled-B8-tp",
     ("--model", "mixtral-8x7b", "--setting", "2.5/75", "--mesh", "4x4", "--topology", "torus",
      "--conventions", "paper", "--evaluator", "sampled", "--steps", "2", "--placement", "tp",
      "--batch", "8")),
    ("qwen2-5/50-4x8-fattree-faithful-sampled-B16",
     ("--model", "qwen2-57b-a14b", "--setting", "5/50", "--mesh", "4x8", "--topology",
      "fattree", "--conventions", "faithful", "--evaluator", "sampled", "--steps", "2",
      "--placement", "tp,ep", "--batch", "16")),
    ("qwen3.5-10/25-8x8-mesh-paperhd-static-B32",
     ("--model", "qwen3.5-35b-a3b", "--setting", "10/25", "--mesh", "8x8", "--topology", "mesh",
      "--conventions", "paper-hd", "--evaluator", "static", "--placement", "tp,ep",
      "--batch", "32")),
    ("ds-5/50-4x8-torus-derived-randomrows-unique-nearest-seed3-B16",
     ("--model", "deepseek-v2-lite", "--setting", "5/50", "--mesh", "4x8", "--topology",
      "torus", "--conventions", "faithful+b_psum=2", "--evaluator", "sampled", "--steps", "2",
      "--batching", "random_rows", "--view", "unique", "--replica-rule", "nearest",
      "--placement", "tp,ep", "--batch", "16", "--seed", "3")),
    ("qwen2-2.5/75-4x8-mesh-paper-hop5ns-static-B128",
     ("--model", "qwen2-57b-a14b", "--setting", "2.5/75", "--mesh", "4x8", "--topology", "mesh",
      "--conventions", "paper", "--hop-latency-ns", "5", "--evaluator", "static",
      "--placement", "tp,ep", "--batch", "128", "--seed", "1")),
    ("ds-2.5/75-8x4-mesh-faithful-sampled-raw-B8-seed7",
     ("--model", "deepseek-v2-lite", "--setting", "2.5/75", "--mesh", "8x4", "--topology",
      "mesh", "--conventions", "faithful", "--evaluator", "sampled", "--steps", "3",
      "--view", "raw", "--placement", "ep", "--batch", "8", "--seed", "7")),
)
#: Arguments shared by every simulate run (a small synthetic trace).
SIMULATE_COMMON: tuple[str, ...] = ("--trace", "synthetic", "--requests", "16")

#: Env configurations: (label, gymnasium id, kwargs, reset seed, action-space seed).
ENV_CONFIGS: tuple[tuple[str, str, dict[str, Any], int, int], ...] = (
    ("ds-des-default-B16", "hdamoe_env/HdMoE-v1",
     {"batch": 16, "trace_requests": 16}, 0, 100),
    ("ds-analytic-paper-B32", "hdamoe_env/HdMoE-v1",
     {"fidelity": "analytic", "conventions": "paper", "batch": 32, "trace_requests": 16}, 1, 101),
    ("ds-torus-paperhd-tp-2.5/75", "hdamoe_env/HdMoE-v1",
     {"topology": "torus", "conventions": "paper-hd", "placement": "tp", "setting": "2.5/75",
      "batch": 16, "trace_requests": 16}, 2, 102),
    ("ds-fattree-oracle-10/25", "hdamoe_env/HdMoE-v1",
     {"topology": "fattree", "predictor": "oracle", "setting": "10/25", "batch": 16,
      "trace_requests": 16}, 3, 103),
    ("mixtral-registered-id-B16", "hdamoe_env/HdMoE-Mixtral-v1",
     {"batch": 16, "trace_requests": 16}, 4, 104),
    ("qwen2-analytic-frequency-1step", "hdamoe_env/HdMoE-v1",
     {"model": "qwen2-57b-a14b", "fidelity": "analytic", "predictor": "frequency", "batch": 16,
      "steps_per_episode": 1, "trace_requests": 16}, 5, 105),
    ("qwen3.5-trace-predictor-4x4", "hdamoe_env/HdMoE-v1",
     {"model": "qwen3.5-35b-a3b", "predictor": "trace", "mesh": "4x4", "batch": 16,
      "trace_requests": 16}, 6, 106),
    ("ds-invalid-raise-duplicates-raise", "hdamoe_env/HdMoE-v1",
     {"invalid_action": "raise", "duplicates": "raise", "placement": "ep", "batch": 16,
      "trace_requests": 16}, 7, 107),
    ("ds-gating-options", "hdamoe_env/HdMoE-v1",
     {"gating_levels": (0.0, 1.0, 4.0), "gating_protect_top": 1,
      "gating_comp_penalty": "host_finish", "gating_comm_penalty": "new_nodes",
      "gating_candidate_window": 2, "gating_include_future": True,
      "gating_coefficients": (-20000.0, -0.02), "batch": 32, "trace_requests": 16}, 8, 108),
    ("analytic-id-twin-kb2-rewardscale", "hdamoe_env/HdMoE-analytic-v1",
     {"measure_twin_error": True, "k_b": 2, "reward_scale": 1e-3, "batch": 16,
      "trace_requests": 16}, 9, 109),
    ("ds-8x8-2.5/75-B8-1step-rules-accuracy", "hdamoe_env/HdMoE-v1",
     {"mesh": "8x8", "setting": "2.5/75", "batch": 8, "steps_per_episode": 1,
      "dispatch_rules": ("home", "least_loaded"), "predictor_accuracy": 0.7,
      "max_broadcast": 4, "trace_requests": 16}, 10, 110),
    ("ds-skew-randomrows-seeds", "hdamoe_env/HdMoE-v1",
     {"trace_skew": 1.5, "batch_mode": "random_rows", "trace_seed": 3, "placement_seed": 2,
      "gamma_seed": 1, "fidelity": "analytic", "batch": 16, "trace_requests": 16}, 11, 111),
)

#: ``hdamoe train`` arguments (the run directory is appended as ``--out``).
TRAIN_ARGS: tuple[str, ...] = (
    "--algo", "maskable-ppo", "--seed", "0", "--batch", "16", "--requests", "16",
    "--hp", "n_steps=32", "--hp", "batch_size=32", "--hp", "n_epochs=1",
    "--checkpoint-every", "0", "--no-tensorboard",
    "--eval-steps", "1", "--eval-seeds", "10000", "--eval-baselines", "noop,hda-moe",
)


# ----------------------------------------------------------------------------- canonical form
class Canon:
    """Canonicalises values: exact floats, hashed arrays, placeholder paths, dropped keys."""

    def __init__(self, replacements: Sequence[tuple[str, str]] = ()) -> None:
        # longest prefix first, so that nested roots win
        self.replacements = sorted(((a, b) for a, b in replacements if a),
                                   key=lambda ab: -len(ab[0]))

    def string(self, text: str) -> str:
        """Rewrite machine-specific absolute paths inside ``text``."""
        for old, new in self.replacements:
            text = text.replace(old, new)
        return text

    def __call__(self, value: Any) -> Any:  # noqa: C901 - one branch per type
        """Return the canonical, JSON-serialisable form of ``value``."""
        import numpy as np

        if value is None or isinstance(value, bool | np.bool_):
            return None if value is None else bool(value)
        if isinstance(value, int | np.integer):
            return int(value)
        if isinstance(value, float | np.floating):
            return repr(float(value))
        if isinstance(value, str):
            return self.string(value)
        if isinstance(value, Path):
            return self.string(str(value))
        if isinstance(value, Mapping):
            return {str(k): self(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))
                    if str(k) not in EXCLUDED_KEYS}
        if isinstance(value, list | tuple):
            return [self(v) for v in value]
        if isinstance(value, np.ndarray):
            return array_digest(value)
        if hasattr(value, "detach") and hasattr(value, "dtype"):  # a torch tensor
            return tensor_digest(value)
        return {"repr": self.string(repr(value)), "type": type(value).__name__}


def array_digest(array: Any) -> dict[str, Any]:
    """``{"dtype", "shape", "sha256"}`` of a numpy array (C-order bytes)."""
    import numpy as np

    arr = np.ascontiguousarray(array)
    if arr.dtype == object:
        return {"dtype": "object", "shape": list(arr.shape),
                "sha256": hashlib.sha256(repr(arr.tolist()).encode()).hexdigest()}
    return {"dtype": arr.dtype.str, "shape": list(arr.shape),
            "sha256": hashlib.sha256(arr.tobytes()).hexdigest()}


def tensor_digest(tensor: Any) -> dict[str, Any]:
    """``{"dtype", "shape", "sha256"}`` of a torch tensor (contiguous CPU bytes)."""
    import torch

    t = tensor.detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
    return {"dtype": str(t.dtype), "shape": list(t.shape),
            "sha256": hashlib.sha256(raw).hexdigest()}


def obs_digest(obs: Any) -> tuple[str, dict[str, str]]:
    """SHA-256 of an observation (Dict entries in sorted key order) and one per entry."""
    import numpy as np

    whole = hashlib.sha256()
    parts: dict[str, str] = {}
    items = sorted(obs.items()) if isinstance(obs, Mapping) else [("", obs)]
    for key, value in items:
        arr = np.ascontiguousarray(value)
        header = f"{key}\0{arr.dtype.str}\0{arr.shape}\0".encode()
        whole.update(header)
        whole.update(arr.tobytes())
        parts[str(key)] = hashlib.sha256(header + arr.tobytes()).hexdigest()
    return whole.hexdigest(), parts


def write_canonical(path: Path, data: Any) -> None:
    """Write already canonical data as sorted, indented JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1, sort_keys=True, allow_nan=False) + "\n")


# ------------------------------------------------------------------------------- environment
def part_environment(out: Path, part: str) -> dict[str, str]:
    """Environment of a part: single-threaded, fresh ``HDAMOE_CACHE_DIR`` inside ``out``."""
    cache = out / "cache" / part
    shutil.rmtree(cache, ignore_errors=True)       # fresh: nothing cached by an earlier run
    cache.mkdir(parents=True)
    env = dict(os.environ)
    env.update(THREAD_ENV)
    env["HDAMOE_CACHE_DIR"] = str(cache)
    return env


def run_cli(args: Sequence[str], env: Mapping[str, str], log: Path) -> None:
    """Run ``hdamoe ARGS`` in a subprocess; its stdout/stderr go to ``log``.

    Raises:
        RuntimeError: Non-zero exit (the log's tail is in the message).
    """
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.run([sys.executable, "-c", CLI_CODE, *args], env=dict(env),
                              stdout=fh, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        tail = "\n".join(log.read_text(errors="replace").splitlines()[-20:])
        raise RuntimeError(f"hdamoe {' '.join(args[:1])} exited {proc.returncode}:\n{tail}")


def read_json_file(path: Path) -> Any:
    """Read a JSON file (NaN/Infinity allowed, as Python writes them)."""
    return json.loads(path.read_text())


def npz_digest(path: Path, canon: Canon) -> dict[str, Any]:
    """Per-array digests of an ``.npz``; a uint8 ``meta`` array holding JSON is decoded."""
    import numpy as np

    out: dict[str, Any] = {}
    with np.load(path, allow_pickle=False) as data:
        for name in sorted(data.files):
            arr = data[name]
            if name == "meta" and arr.dtype == np.uint8 and arr.ndim == 1:
                try:
                    out[name] = {"json": canon(json.loads(arr.tobytes().decode()))}
                    continue
                except ValueError:
                    pass
            out[name] = array_digest(arr)
    return out


def cache_digest(cache: Path, canon: Canon) -> dict[str, Any]:
    """Canonical contents of a placement cache directory (.npz and .json files)."""
    files: dict[str, Any] = {}
    for path in sorted(cache.rglob("*")):
        if not path.is_file():
            continue
        rel = path.relative_to(cache).as_posix()
        if path.suffix == ".npz":
            files[rel] = npz_digest(path, canon)
        elif path.suffix == ".json":
            files[rel] = canon(read_json_file(path))
        elif path.suffix == ".jsonl":
            files[rel] = canon([json.loads(line) for line in path.read_text().splitlines()
                                if line.strip()])
    return files


# ------------------------------------------------------------------------------------- parts
def part_simulate(out: Path, canon: Canon, env: Mapping[str, str]) -> dict[str, Any]:
    """Run every :data:`SIMULATE_CONFIGS` entry through ``hdamoe simulate --json``."""
    work = out / "work" / "simulate"
    results: dict[str, Any] = {}
    for i, (label, args) in enumerate(SIMULATE_CONFIGS):
        target = work / f"{i:02d}.json"
        cli = ["simulate", *SIMULATE_COMMON, *args, "--json", str(target)]
        run_cli(cli, env, work / f"{i:02d}.log")
        results[f"{i:02d} {label}"] = {"args": list(args), "records":
                                       canon(read_json_file(target))}
    return {"common_args": list(SIMULATE_COMMON), "configs": results}


def _run_env_config(env_id: str, kwargs: Mapping[str, Any], reset_seed: int, action_seed: int,
                    steps: int, canon: Canon) -> dict[str, Any]:
    """Run one env configuration for ``steps`` action attempts; return its record."""
    import gymnasium
    import hdamoe_env

    env = gymnasium.make(env_id, **dict(kwargs))
    try:
        env.action_space.seed(action_seed)
        episode = 0
        obs, info = env.reset(seed=reset_seed)
        digest, parts = obs_digest(obs)
        record: dict[str, Any] = {
            "id": env_id, "kwargs": canon(dict(kwargs)), "reset_seed": reset_seed,
            "action_seed": action_seed,
            "observation_space": str(env.observation_space),
            "action_space": str(env.action_space),
            "reset": {"obs_sha256": digest, "obs_entries": parts,
                      "info": canon(dict(info))},
        }
        events: list[dict[str, Any]] = []
        for _ in range(steps):
            action = env.action_space.sample()
            event: dict[str, Any] = {"action": canon(list(action))}
            try:
                obs, reward, terminated, truncated, info = env.step(action)
            except hdamoe_env.InvalidAction as exc:
                # strict mode: record the refusal, then take a mask-respecting sample
                event["error"] = {"type": type(exc).__name__, "message": canon(str(exc))}
                masked = env.action_space.sample(mask=env.unwrapped.action_mask_tuple())
                event["masked_action"] = canon(list(masked))
                try:
                    obs, reward, terminated, truncated, info = env.step(masked)
                except hdamoe_env.InvalidAction as exc2:
                    event["masked_error"] = {"type": type(exc2).__name__,
                                             "message": canon(str(exc2))}
                    events.append(event)
                    continue
            digest, parts = obs_digest(obs)
            event.update({"reward": repr(float(reward)), "terminated": bool(terminated),
                          "truncated": bool(truncated), "obs_sha256": digest,
                          "obs_entries": parts, "info": canon(dict(info))})
            if terminated or truncated:
                episode += 1
                obs, info = env.reset(seed=reset_seed + 1000 * episode)
                event["reset_obs_sha256"] = obs_digest(obs)[0]
                event["reset_info"] = canon(dict(info))
            events.append(event)
        record["steps"] = events
        return record
    finally:
        env.close()


def part_env(canon: Canon, env: Mapping[str, str], steps: int) -> dict[str, Any]:
    """Run every :data:`ENV_CONFIGS` entry in this process (environment already set)."""
    os.environ.update({k: v for k, v in env.items()
                       if k in THREAD_ENV or k == "HDAMOE_CACHE_DIR"})
    configs: dict[str, Any] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")          # gymnasium's env checker on sampled actions
        for i, (label, env_id, kwargs, reset_seed, action_seed) in enumerate(ENV_CONFIGS):
            configs[f"{i:02d} {label}"] = _run_env_config(env_id, kwargs, reset_seed,
                                                          action_seed, steps, canon)
    return {"steps_per_config": steps, "configs": configs}


def _zip_torch(z: zipfile.ZipFile, member: str, canon: Canon) -> Any:
    import torch

    if member not in z.namelist():
        return None
    state = torch.load(io.BytesIO(z.read(member)), weights_only=True, map_location="cpu")
    return canon(state)


def _sb3_data(z: zipfile.ZipFile, canon: Canon) -> dict[str, Any]:
    """Plain JSON fields of SB3's ``data`` member (cloudpickled objects are skipped)."""
    data = json.loads(z.read("data"))
    plain = {k: v for k, v in data.items()
             if not (isinstance(v, dict) and ":serialized:" in v)}
    return canon(plain)


def part_train(out: Path, canon: Canon, env: Mapping[str, str], timesteps: int) -> dict[str, Any]:
    """Tiny ``hdamoe train`` run; hash the saved policy and keep the deterministic files."""
    run = out / "work" / "train"
    args = ["train", *TRAIN_ARGS, "--timesteps", str(timesteps), "--out", str(run)]
    run_cli(args, env, out / "work" / "train.log")
    result: dict[str, Any] = {"args": list(TRAIN_ARGS), "timesteps": timesteps}
    with zipfile.ZipFile(run / "model.zip") as z:
        result["model_zip_members"] = sorted(z.namelist())
        result["policy"] = _zip_torch(z, "policy.pth", canon)
        result["optimizer"] = _zip_torch(z, "policy.optimizer.pth", canon)
        result["pytorch_variables"] = _zip_torch(z, "pytorch_variables.pth", canon)
        result["sb3_data"] = _sb3_data(z, canon)
    files: dict[str, Any] = {}
    for path in sorted(run.rglob("*")):
        rel = path.relative_to(run).as_posix()
        if path.suffix == ".json":
            files[rel] = canon(read_json_file(path))
        elif path.suffix == ".npz":
            files[rel] = npz_digest(path, canon)
    result["files"] = files
    result["cache"] = cache_digest(Path(env["HDAMOE_CACHE_DIR"]), canon)
    return result


def part_reproduce(out: Path, canon: Canon, env: Mapping[str, str], suite: str, workers: int,
                   mixtral_dir: str | None) -> dict[str, Any]:
    """``hdamoe reproduce --suite SUITE``; keep its cells, records and placement cache."""
    run = out / "work" / "reproduce"
    args = ["reproduce", "--suite", suite, "--out", str(run), "--workers", str(workers),
            "--fresh"]
    if mixtral_dir is not None:
        args += ["--mixtral-dir", mixtral_dir]
    run_cli(args, env, out / "work" / "reproduce.log")
    cells = {p.stem: read_json_file(p) for p in sorted((run / "cells").glob("*.json"))}
    records = [json.loads(line) for line in (run / "results.jsonl").read_text().splitlines()
               if line.strip()]
    # cells whose bench config gets an absolute placement_dir: their run_key hashes that path
    path_keyed = {key for key, payload in cells.items()
                  if "placement_from" in payload.get("cell", {}).get("params", {})}
    for rec in [r for payload in cells.values() for r in payload.get("records", [])] + records:
        if rec.get("cell") in path_keyed and "run_key" in rec:
            rec["run_key"] = PATH_KEYED_MASK
    cells = {key: canon(payload) for key, payload in cells.items()}
    result: dict[str, Any] = {
        "suite": suite, "mixtral_dir": mixtral_dir,
        "suite_json": canon(read_json_file(run / "suite.json")),
        "run_json": canon({k: v for k, v in read_json_file(run / "run.json").items()
                           if k != "workers"}),
        "cells": cells, "results_jsonl": canon(records),
        "cache": cache_digest(Path(env["HDAMOE_CACHE_DIR"]), canon),
    }
    report = run / "report.md"
    if report.exists():
        lines = []
        for line in report.read_text().splitlines():
            for pattern, replacement in REPORT_MASKS:
                line = re.sub(pattern, replacement, line)
            lines.append(canon.string(line))
        result["report_md_lines"] = lines
    result["figures_sha256"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest()
                                for p in sorted((run / "figures").glob("*"))}
    for path in sorted(run.glob("*.csv")):
        result[f"csv:{path.name}"] = hashlib.sha256(canon.string(path.read_text())
                                                    .encode()).hexdigest()
    return result


# ----------------------------------------------------------------------------------- snapshot
def resolved_modules(env: Mapping[str, str]) -> dict[str, str]:
    """Files the top-level packages resolve to in a subprocess with ``env`` (a sanity check)."""
    code = ("import json, hdamoe_env, agents, baselines, traces; print(json.dumps({m.__name__: "
            "m.__file__ for m in (hdamoe_env, agents, baselines, traces)}))")
    proc = subprocess.run([sys.executable, "-c", code], env=dict(env), capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def cmd_snapshot(args: argparse.Namespace) -> int:
    """Run the requested parts into ``args.out``; write one JSON per part and a manifest."""
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    unknown = sorted(set(parts) - set(PARTS))
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; expected a comma list of {list(PARTS)}")
    canon = Canon([(str(out), "<OUT>"), (str(Path.cwd().resolve()), "<CWD>")])
    os.environ.update(THREAD_ENV)                   # before numpy/torch are imported here
    base_env = part_environment(out, "probe")
    manifest: dict[str, Any] = {
        "options": {"parts": parts, "env_steps": args.env_steps,
                    "train_timesteps": args.train_timesteps, "suite": args.suite,
                    "mixtral_dir": args.mixtral_dir},
        "reproduce_workers": args.reproduce_workers,
        "python": sys.version, "executable": sys.executable, "platform": platform.platform(),
        "cwd": str(Path.cwd()), "pythonpath": os.environ.get("PYTHONPATH"),
        "resolved_modules": resolved_modules(base_env),
        "excluded_keys": EXCLUDED_KEYS, "seconds": {},
    }
    print(f"modules: {manifest['resolved_modules']}", flush=True)
    for part in parts:
        env = part_environment(out, part)
        shutil.rmtree(out / "work" / part, ignore_errors=True)
        t0 = time.perf_counter()
        if part == "simulate":
            data = part_simulate(out, canon, env)
        elif part == "env":
            data = part_env(canon, env, args.env_steps)
        elif part == "train":
            data = part_train(out, canon, env, args.train_timesteps)
        else:
            data = part_reproduce(out, canon, env, args.suite, args.reproduce_workers,
                                  args.mixtral_dir)
        seconds = time.perf_counter() - t0
        write_canonical(out / PART_FILES[part], data)
        manifest["seconds"][part] = round(seconds, 1)
        print(f"{part}: {seconds:.1f} s -> {out / PART_FILES[part]}", flush=True)
        write_canonical(out / "manifest.json", manifest)
    if "hdamoe_env" in sys.modules:                 # the env part imported it in-process
        manifest["in_process_module"] = sys.modules["hdamoe_env"].__file__
        write_canonical(out / "manifest.json", manifest)
    return 0


# ------------------------------------------------------------------------------------ compare
def _short(value: Any, width: int = 100) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= width else text[:width - 3] + "..."


def _drop_excluded(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_excluded(v) for k, v in value.items() if k not in EXCLUDED_KEYS}
    if isinstance(value, list):
        return [_drop_excluded(v) for v in value]
    return value


def diff(a: Any, b: Any, path: str = "$") -> Iterator[tuple[str, str]]:
    """Yield ``(path, description)`` for every differing leaf of two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            sub = f"{path}.{key}" if key.isidentifier() else f"{path}[{json.dumps(key)}]"
            if key not in b:
                yield sub, "only in A"
            elif key not in a:
                yield sub, "only in B"
            else:
                yield from diff(a[key], b[key], sub)
    elif isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            yield path, f"length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            yield from diff(x, y, f"{path}[{i}]")
    elif type(a) is not type(b) or a != b:
        yield path, f"A={_short(a)} B={_short(b)}"


def count_leaves(value: Any) -> int:
    """Number of leaf values of a JSON value."""
    if isinstance(value, dict):
        return sum(count_leaves(v) for v in value.values())
    if isinstance(value, list):
        return sum(count_leaves(v) for v in value)
    return 1


def cmd_compare(args: argparse.Namespace) -> int:
    """Diff two snapshot directories; exit 1 on any difference."""
    a_dir, b_dir = Path(args.a), Path(args.b)
    differences = 0
    files = leaves = 0
    for name in PART_FILES.values():
        pa, pb = a_dir / name, b_dir / name
        if not pa.exists() and not pb.exists():
            continue
        if not pa.exists() or not pb.exists():
            print(f"{name}: missing in {'A' if not pa.exists() else 'B'}")
            differences += 1
            continue
        a, b = _drop_excluded(read_json_file(pa)), _drop_excluded(read_json_file(pb))
        files += 1
        leaves += count_leaves(a)
        shown = 0
        for where, what in diff(a, b):
            differences += 1
            if args.max_lines and shown >= args.max_lines:
                continue
            print(f"{name}: {where}: {what}")
            shown += 1
        if args.max_lines and shown >= args.max_lines:
            print(f"{name}: (output capped at {args.max_lines} lines per file)")
    ma, mb = a_dir / "manifest.json", b_dir / "manifest.json"
    if ma.exists() and mb.exists():
        oa, ob = read_json_file(ma).get("options"), read_json_file(mb).get("options")
        if oa != ob:
            print(f"note: snapshot options differ (not counted): A={_short(oa, 300)} "
                  f"B={_short(ob, 300)}")
    if differences:
        print(f"DIFFERENT: {differences} difference(s) in {files} compared file(s)")
        return 1
    if files == 0:
        print("nothing to compare: no part file in either directory")
        return 1
    print(f"IDENTICAL: {files} file(s), {leaves} field(s) compared, 0 differences")
    return 0


# ---------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    """The argument parser of this script."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    snap = sub.add_parser("snapshot", help="run the workloads and write a snapshot directory")
    snap.add_argument("--out", required=True, help="snapshot directory (created)")
    snap.add_argument("--parts", default=",".join(PARTS),
                      help=f"comma list of parts (default: {','.join(PARTS)})")
    snap.add_argument("--env-steps", type=int, default=40,
                      help="action attempts per env configuration (default: 40: every model "
                      "with <= 40 MoE layers finishes a decode step, so tbt_us is recorded)")
    snap.add_argument("--train-timesteps", type=int, default=64,
                      help="total env steps of the tiny training run (default: 64)")
    snap.add_argument("--suite", default="quick", choices=("tiny", "quick", "full"),
                      help="reproduce suite (default: quick)")
    snap.add_argument("--reproduce-workers", type=int, default=1,
                      help="worker processes of hdamoe reproduce (default: 1; kept in "
                      "manifest.json, not compared)")
    snap.add_argument("--mixtral-dir", default=None,
                      help="hdamoe reproduce --mixtral-dir (default: the CLI's default, "
                      "resolved against the working directory)")
    snap.set_defaults(func=cmd_snapshot)
    comp = sub.add_parser("compare", help="diff two snapshot directories (exit 1 if different)")
    comp.add_argument("a", help="snapshot directory A")
    comp.add_argument("b", help="snapshot directory B")
    comp.add_argument("--max-lines", type=int, default=0,
                      help="print at most this many differences per file (0: all)")
    comp.set_defaults(func=cmd_compare)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point."""
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())

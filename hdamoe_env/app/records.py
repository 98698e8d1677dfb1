"""Records of the application layer: JSON, JSONL and CSV files, summaries and tables.

One place for every file a command writes and every table it prints (style.md R16: only the
application layer writes). JSON goes through the one atomic writer of the core
(:func:`hdamoe_env.config.fileio.write_json`); tables through the one renderer,
:func:`hdamoe_env.app.tables.render_table` (re-exported here with ``fmt``).

Bench records (``hdamoe bench``) are one dict per (method, seed); :func:`summarise` aggregates them
per method over seeds and :func:`format_bench_table` prints the summary.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env.app import intervals
from hdamoe_env.app.tables import fmt, render_table
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.fileio import (atomic_write, json_default, loads_json, read_input_bytes,
                                     write_json)

__all__ = [
    "CSV_FIELDS",
    "format_seed_summary",
    "seed_interval_summary",
    "t_interval",
    "SPEEDUP_BASELINES",
    "fmt",
    "format_bench_table",
    "read_jsonl",
    "read_records",
    "render_table",
    "summarise",
    "write_csv",
    "write_json",
    "write_jsonl",
    "write_records",
]

#: Methods that get a "speed-up over" column when present in a summary.
SPEEDUP_BASELINES: tuple[str, ...] = ("tp", "ep", "hybrid", "hd-moe")

CSV_FIELDS = ("method", "seed", "tbt_us", "tbt_std_us", "compute_us", "communication_us",
              "memory_us", "extra_us", "j_per_token", "edp_js", "dram_j", "noc_j", "compute_j",
              "static_j", "changed_fraction", "top1_retention", "score_mass_kept",
              "gating_scale", "quality_target",
              "decision_ms_per_step", "env_steps", "decode_steps", "k_b_mean", "broadcast_mean",
              "balancedness_mean", "model", "setting", "mesh", "topology", "batch", "fidelity",
              "predictor", "profile", "knobs_sha256", "placement", "placement_artifact",
              "agent", "trace", "trace_id", "run_key", "version")


# ------------------------------------------------------------------------------------ tables
# ------------------------------------------------------------------------------------ files
def read_records(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Read the records of a bench JSON file (an empty list if it does not exist).

    Raises:
        ConfigError: The file is not a JSON list of records.
    """
    path = Path(path)
    if not path.exists():
        return []
    try:
        data = loads_json(read_input_bytes(path, "records file"), f"records file {str(path)!r}")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{str(path)!r} is not valid JSON ({exc}); move it away or rerun "
                          "without --resume") from None
    if isinstance(data, dict) and "records" in data:
        data = data["records"]
    if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
        raise ConfigError(f"{str(path)!r} is not a list of bench records")
    return data


def write_records(path: str | os.PathLike[str], records: Sequence[dict[str, Any]]) -> Path:
    """Write records as a JSON list, atomically (temporary file + rename)."""
    return write_json(path, list(records))


def write_csv(path: str | os.PathLike[str], records: Sequence[dict[str, Any]]) -> Path:
    """Write one CSV row per bench record (scalars only, :data:`CSV_FIELDS`), atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, extrasaction="ignore")
    w.writeheader()
    for rec in records:
        row = {**rec, **rec.get("breakdown_us", {}), **(rec.get("gating") or {}),
               **{f"{k}_j": v for k, v in (rec.get("energy_j") or {}).items()}}
        w.writerow({k: ("" if row.get(k) is None else row.get(k)) for k in CSV_FIELDS})
    text = buf.getvalue()
    return atomic_write(path, lambda fh: fh.write(text))


def write_jsonl(path: str | os.PathLike[str], records: Iterable[dict[str, Any]]) -> Path:
    """Write one JSON line per record (keys sorted), atomically."""
    def write(fh: Any) -> None:
        for rec in records:
            fh.write(json.dumps(rec, default=json_default, sort_keys=True) + "\n")

    return atomic_write(path, write, mode="w")


def read_jsonl(path: str | os.PathLike[str], *, default_name: str = "results.jsonl",
               hint: str = "run `hdamoe reproduce --out DIR` first") -> list[dict[str, Any]]:
    """Read a JSON-lines file (or the ``default_name`` file inside a directory).

    Raises:
        ConfigError: The file does not exist or a line is not JSON (the message names it).
    """
    p = Path(path)
    if p.is_dir():
        p = p / default_name
    if not p.exists():
        raise ConfigError(f"{str(p)!r} does not exist; {hint}")
    records = []
    for n, line in enumerate(p.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except ValueError as exc:
            raise ConfigError(f"{p}:{n}: not a JSON line ({exc})") from None
    return records


# ------------------------------------------------------------------------------------ summaries
def _stat(values: Sequence[float | None]) -> tuple[float, float]:
    """Mean and sample standard deviation (ddof=1; 0 for one value) of the finite values."""
    vals = np.asarray([v for v in values if v is not None and math.isfinite(v)], dtype=float)
    if vals.size == 0:
        return float("nan"), float("nan")
    return float(vals.mean()), float(vals.std(ddof=1)) if vals.size > 1 else 0.0


def summarise(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Aggregate bench records per method over seeds (mean and std over seeds).

    Speed-ups ``speedup_over_<m>`` = TBT(m) / TBT(method), per seed, then averaged; present when
    method m is among the records. ``tbt_over_tp`` = TBT / TBT(tp).

    Returns:
        One dict per method, in record order.
    """
    by_method: dict[str, dict[int, dict[str, Any]]] = {}
    for rec in records:
        by_method.setdefault(rec["method"], {})[int(rec["seed"])] = rec
    rows = []
    for method, per_seed in by_method.items():
        recs = list(per_seed.values())
        row: dict[str, Any] = {"method": method, "seeds": sorted(per_seed)}
        row["tbt_us"], row["tbt_seed_std_us"] = _stat([r["tbt_us"] for r in recs])
        row["tbt_step_std_us"] = _stat([r["tbt_std_us"] for r in recs])[0]
        for base in ("tp", *SPEEDUP_BASELINES[1:]):
            if base not in by_method:
                continue
            ratios = [by_method[base][s]["tbt_us"] / per_seed[s]["tbt_us"]
                      for s in per_seed if s in by_method[base] and per_seed[s]["tbt_us"] > 0]
            row[f"speedup_over_{base}"], row[f"speedup_over_{base}_std"] = _stat(ratios)
        if "tp" in by_method:
            norm = [per_seed[s]["tbt_us"] / by_method["tp"][s]["tbt_us"] for s in per_seed
                    if s in by_method["tp"]]
            row["tbt_over_tp"], row["tbt_over_tp_std"] = _stat(norm)
        for key in ("compute_us", "communication_us", "memory_us", "extra_us"):
            row[key] = _stat([r["breakdown_us"].get(key, 0.0) for r in recs])[0]
        for key in ("changed_fraction", "top1_retention", "score_mass_kept"):
            row[key] = _stat([(r.get("gating") or {}).get(key) for r in recs])[0]
        row["gating_scale"] = _stat([r.get("gating_scale") for r in recs])[0]
        row["quality_target"] = recs[0].get("quality_target")
        row["decision_ms"], row["decision_ms_std"] = _stat(
            [r["decision_ms_per_step"] for r in recs])
        row["k_b_mean"] = _stat([r.get("k_b_mean", 0.0) for r in recs])[0]
        row["broadcast_mean"] = _stat([r.get("broadcast_mean", 0.0) for r in recs])[0]
        # energy (docs/PHYSICS.md §18): J per token, EDP, breakdown; None for old records
        row["j_per_token"] = _stat([r.get("j_per_token") for r in recs])[0]
        row["edp_js"] = _stat([r.get("edp_js") for r in recs])[0]
        for part in ("dram", "noc", "compute", "static"):
            row[f"{part}_j"] = _stat([(r.get("energy_j") or {}).get(part) for r in recs])[0]
        if "tp" in by_method:
            e_norm = [per_seed[s]["j_per_token"] / by_method["tp"][s]["j_per_token"]
                      for s in per_seed if s in by_method["tp"]
                      and per_seed[s].get("j_per_token") and by_method["tp"][s].get("j_per_token")]
            row["energy_over_tp"] = _stat(e_norm)[0]
        rows.append(row)
    return rows


def format_bench_table(records: Sequence[dict[str, Any]]) -> str:
    """Return the benchmark table (µs per decode step; mean over seeds, ± sample std over seeds).

    The ``±seeds`` column is the spread (ddof=1), not an interval: ``hdamoe compare`` reports
    95 % intervals and paired differences.
    """
    rows = summarise(records)
    present = {r["method"] for r in rows}
    bases = [b for b in SPEEDUP_BASELINES if b in present]
    head = ["method", "TBT µs", "±seeds", "TBT/TP"] + [f"×{b}" for b in bases] + [
        "compute", "comm", "memory", "other", "mJ/token", "E/TP", "k_b", "bcast", "scale",
        "changed", "top1 kept", "decide ms"]
    cells = []
    for r in rows:
        line = [r["method"], fmt(r["tbt_us"]), fmt(r["tbt_seed_std_us"]),
                fmt(r.get("tbt_over_tp"), "{:.3f}")]
        line += [fmt(r.get(f"speedup_over_{b}"), "{:.3f}") for b in bases]
        line += [fmt(r["compute_us"]), fmt(r["communication_us"]), fmt(r["memory_us"]),
                 fmt(r["extra_us"]),
                 fmt(1e3 * r["j_per_token"], "{:.3f}"),
                 fmt(r.get("energy_over_tp"), "{:.3f}"), fmt(r["k_b_mean"], "{:.1f}"),
                 fmt(r["broadcast_mean"], "{:.1f}"), fmt(r["gating_scale"], "{:.3g}"),
                 fmt(r["changed_fraction"], "{:.1%}"), fmt(r["top1_retention"], "{:.1%}"),
                 fmt(r["decision_ms"], "{:.3f}") + (
                     f"±{r['decision_ms_std']:.3f}" if r["decision_ms_std"] else "")]
        cells.append(line)
    return render_table(head, cells)


def t_interval(values: Sequence[float]) -> tuple[float, float | None]:
    """Return the mean and the half-width of its two-sided 95 % Student-t interval.

    The interval is mean ± t(0.975, n − 1) · s / √n with the sample standard deviation s
    (``ddof=1``) and the quantile from scipy (:func:`hdamoe_env.app.intervals.t_interval`): the
    spread over independent training seeds, not over episodes.

    Args:
        values: One value per seed.

    Returns:
        ``(mean, half_width)``; half_width is None for a single value.

    Raises:
        ConfigError: No values.
    """
    iv = intervals.t_interval(values)
    return iv.estimate, iv.half_width


def seed_interval_summary(result: dict[str, Any], labels: dict[str, int]) -> dict[str, Any]:
    """Summarise an :func:`evaluate` result of several training seeds per fidelity.

    Args:
        result: The evaluation (its ``records``; learned methods named as in ``labels``).
        labels: Method label of each seed's learned agent -> training seed.

    Returns:
        ``{fidelity: {"per_seed": [{seed, tbt_us, top1_retention}], "learned": {tbt_us,
        tbt_ci95_us, top1_retention, top1_ci95}, "baselines": {method: {tbt_us,
        top1_retention}}, "learned_vs": {method: mean learned TBT / method TBT − 1}}}``; TBT and
        retention of a seed are means over the evaluation episodes.
    """
    out: dict[str, Any] = {}
    by_fid: dict[str, list[dict[str, Any]]] = {}
    for rec in result["records"]:
        by_fid.setdefault(str(rec.get("fidelity", "des")), []).append(rec)
    for fid, recs in by_fid.items():
        rows = {r["method"]: r for r in summarise(recs)}
        per_seed = [{"seed": seed, "tbt_us": rows[m]["tbt_us"],
                     "top1_retention": rows[m].get("top1_retention")}
                    for m, seed in labels.items() if m in rows]
        if not per_seed:
            continue
        tbt, tbt_hw = t_interval([p["tbt_us"] for p in per_seed])
        rets = [p["top1_retention"] for p in per_seed if p["top1_retention"] is not None]
        ret, ret_hw = t_interval(rets) if rets else (None, None)
        base = {m: {"tbt_us": r["tbt_us"], "top1_retention": r.get("top1_retention")}
                for m, r in rows.items() if m not in labels}
        out[fid] = {"per_seed": per_seed,
                    "learned": {"tbt_us": tbt, "tbt_ci95_us": tbt_hw, "top1_retention": ret,
                                "top1_ci95": ret_hw, "n_seeds": len(per_seed)},
                    "baselines": base,
                    "learned_vs": {m: tbt / b["tbt_us"] - 1 for m, b in base.items()
                                   if b["tbt_us"] > 0}}
    return out


def format_seed_summary(summary: dict[str, Any]) -> str:
    """Return :func:`seed_interval_summary` as Markdown tables (one per fidelity)."""
    def pct(v: Any) -> str:
        return "–" if v is None else f"{v:.4f}"

    lines: list[str] = []
    for fid, s in summary.items():
        ln = s["learned"]
        ci = "" if ln["tbt_ci95_us"] is None else f" ± {ln['tbt_ci95_us']:.1f}"
        rci = "" if ln["top1_ci95"] is None else f" ± {ln['top1_ci95']:.4f}"
        lines += [f"## fidelity {fid}", "",
                  f"95 % interval: Student t, n − 1 = {ln['n_seeds'] - 1} degrees of freedom, "
                  "over training seeds (each seed: mean over the evaluation episodes).", "",
                  "| method | TBT µs | top-1 retention |", "|---|---|---|"]
        for p in s["per_seed"]:
            lines.append(f"| learned, seed {p['seed']} | {p['tbt_us']:.1f} | "
                         f"{pct(p['top1_retention'])} |")
        lines.append(f"| **learned, mean ± 95 % CI** | **{ln['tbt_us']:.1f}{ci}** | "
                     f"{pct(ln['top1_retention'])}{rci} |")
        for m, b in s["baselines"].items():
            lines.append(f"| {m} | {b['tbt_us']:.1f} | {pct(b['top1_retention'])} |")
        lines += ["", "learned mean vs: " + ", ".join(f"{m} {v:+.2%}" for m, v in
                                                       s["learned_vs"].items()), ""]
    return "\n".join(lines) + "\n"

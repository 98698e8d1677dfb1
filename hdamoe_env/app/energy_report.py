"""Energy table with robust marks: which method wins energy and EDP, and over which pJ values?

``hdamoe energy-report RECORDS.json... [--samples 64 --seed 0]`` reads `hdamoe bench --json`
records (each carries the per-decode-step energy breakdown ``energy_j`` = DRAM, NoC, compute,
static; docs/PHYSICS.md §18) and prints one row per cell (model, setting, B): every method's
mJ/token, energy and TBT relative to TP, the latency winner, the energy winner and the EDP
winner, and for the last two a robust or conditional mark.

Re-pricing, not re-simulation. Every part of the breakdown is linear in exactly one energy value
of :data:`hdamoe_env.config.uncertainty.ENERGY_UNCERTAINTIES` (DRAM bits × ``dram_pj_per_bit``,
NoC bit-hops × ``noc_pj_per_bit_hop``, MACs × ``mac_pj``, seconds × nodes ×
``static_w_per_node``), and none of them changes the schedule (time does not depend on the pJ
values). So under a sample s the energy of a decode step is exactly
``E(s) = Σ_part E_part · value_part(s) / value_part(base)``: each of the joint Latin-hypercube
samples re-prices the recorded breakdown, with the same samples (one seed) in every cell.

Means: per method, the breakdown and TBT are averaged over the records' episode seeds (each
record already averages its decode steps), as ``hdamoe bench`` does. EDP here is
``E_step · TBT`` of those means (J·s per decode step); the records' ``edp_js`` averages the
per-step products instead, which differs by the step-to-step covariance only.

Verdicts reuse :mod:`hdamoe_env.app.robust`: the winner of a sample is the lowest value
(methods within ``TIE_RTOL`` tie; a tie goes to the method listed first, so Node+Link falling
back to TP counts as TP), a winner is *robust* when it wins ≥ 90 % of the samples, else the
deciding knob is the best decision-stump split (``depends on X``).
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from hdamoe_env.app.records import read_records
from hdamoe_env.app.robust import MIN_PUBLISHED_SAMPLES, cell_verdict, lowest_winner, mark
from hdamoe_env.app.tables import render_table
from hdamoe_env.config.errors import ConfigError, InputFileError
from hdamoe_env.config.uncertainty import ENERGY_UNCERTAINTIES, Uncertainty, latin_hypercube
from hdamoe_env.cost.energy import energy_spec_for

__all__ = ["PART_KNOB", "analyse_energy", "cmd_energy_report", "energy_samples", "load_records",
           "render_energy_section", "reprice"]

#: Breakdown part → the energy knob it is linear in (docs/PHYSICS.md §18).
PART_KNOB: dict[str, str] = {"dram": "dram_pj_per_bit", "noc": "noc_pj_per_bit_hop",
                             "compute": "mac_pj", "static": "static_w_per_node"}
_PARTS = tuple(PART_KNOB)


def energy_samples(n: int, seed: int,
                   knobs: Mapping[str, Uncertainty] | None = None) -> dict[str, np.ndarray]:
    """Return ``n`` joint Latin-hypercube samples of the energy knobs (knob → float [n]).

    Args:
        n: Number of samples (≥ 1).
        seed: Seed of the sampling generator.
        knobs: Uncertainties to sample (default :data:`ENERGY_UNCERTAINTIES`).
    """
    table = dict(ENERGY_UNCERTAINTIES if knobs is None else knobs)
    names = sorted(table)
    u = latin_hypercube(n, len(names), np.random.default_rng(seed))
    return {k: np.array([float(table[k].value_at(float(u[i, j]))) for i in range(n)])
            for j, k in enumerate(names)}


def reprice(parts: Mapping[str, float], base: Mapping[str, float],
            values: Mapping[str, np.ndarray]) -> np.ndarray:
    """Return the step energy (J) of a breakdown under sampled knob values (float [n]).

    Args:
        parts: Breakdown J per part (``dram``, ``noc``, ``compute``, ``static``).
        base: knob → the value the breakdown was priced with.
        values: knob → float [n] sampled values (a knob not sampled keeps its base value).
    """
    n = len(next(iter(values.values()))) if values else 1
    total = np.zeros(n)
    for part, knob in PART_KNOB.items():
        factor = values[knob] / base[knob] if knob in values else np.ones(n)
        total += float(parts.get(part, 0.0)) * factor
    return total


def load_records(paths: Sequence[str]) -> list[dict[str, Any]]:
    """Read bench records with an energy breakdown from JSON files.

    Raises:
        InputFileError: A file does not exist.
        ConfigError: A file is not a records list, holds no bench record, or a record has no
            energy breakdown (bench records written before the energy model).
    """
    out: list[dict[str, Any]] = []
    for path in paths:
        if not Path(path).is_file():
            raise InputFileError(f"records file {path!r} does not exist; write it with "
                                 "`hdamoe bench --json FILE`")
        recs = [r for r in read_records(path) if isinstance(r, dict) and "method" in r]
        if not recs:
            raise ConfigError(f"records file {path!r} holds no bench record; write it with "
                              "`hdamoe bench --json FILE`")
        for rec in recs:
            parts = rec.get("energy_j")
            if not isinstance(parts, dict) or not all(p in parts for p in _PARTS):
                raise ConfigError(f"record of method {rec.get('method')!r} in {path!r} has no "
                                  "energy breakdown (energy_j with dram/noc/compute/static); "
                                  "rerun `hdamoe bench --json` with this version")
        out += recs
    return out


def _cell_means(recs: Sequence[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Return method → mean breakdown, TBT (µs) over the records' seeds, in record order."""
    by_method: dict[str, dict[int, Mapping[str, Any]]] = {}
    for rec in recs:
        by_method.setdefault(rec["method"], {})[int(rec.get("seed", 0))] = rec
    out = {}
    for method, per_seed in by_method.items():
        rs = list(per_seed.values())
        out[method] = {"parts": {p: float(np.mean([r["energy_j"][p] for r in rs]))
                                 for p in _PARTS},
                       "tbt_us": float(np.mean([r["tbt_us"] for r in rs])),
                       "profile": rs[0].get("profile", "faithful")}
    return out


def analyse_energy(records: Sequence[Mapping[str, Any]], *, samples: int = MIN_PUBLISHED_SAMPLES,
                   seed: int = 0,
                   knobs: Mapping[str, Uncertainty] | None = None) -> list[dict[str, Any]]:
    """Return one row per cell (model, setting, B, mesh, topology, profile) with the verdicts.

    Args:
        records: Bench records with ``energy_j`` (:func:`load_records`).
        samples: Latin-hypercube samples of :data:`ENERGY_UNCERTAINTIES`.
        seed: Seed of the samples (the same samples in every cell).
        knobs: Uncertainties to sample (default :data:`ENERGY_UNCERTAINTIES`; a knob left out
            keeps its base value).

    Returns:
        Rows (per model in first-seen order, then by TFLOPS and B) with ``methods`` (method → ``mj_per_token``, ``e_over_tp``, ``tbt_over_tp``,
        ``tbt_us``), ``latency_winner``, and per objective ``energy`` / ``edp`` the
        :func:`hdamoe_env.app.robust.cell_verdict` fields plus ``winner`` (base values) and
        ``mark``.
    """
    if samples < 1:
        raise ConfigError(f"--samples must be >= 1, got {samples}")
    values = energy_samples(samples, seed, knobs)
    groups: dict[tuple[Any, ...], list[Mapping[str, Any]]] = {}
    for rec in records:
        key = (rec.get("model"), rec.get("setting"), int(rec.get("batch", 0)),
               rec.get("mesh", "4x8"), rec.get("topology", "mesh"),
               rec.get("profile", "faithful"))
        groups.setdefault(key, []).append(rec)
    rows = []
    for (model, setting, batch, mesh, topology, profile), recs in groups.items():
        means = _cell_means(recs)
        order = list(means)
        spec = energy_spec_for(profile)
        base = {k: float(getattr(spec, k)) for k in PART_KNOB.values()}
        tbt = {m: v["tbt_us"] for m, v in means.items()}
        e_base = {m: sum(v["parts"].values()) for m, v in means.items()}
        e_samp = {m: reprice(v["parts"], base, values) for m, v in means.items()}
        row: dict[str, Any] = {"model": model, "setting": setting, "batch": batch, "mesh": mesh,
                               "topology": topology, "profile": profile,
                               "latency_winner": lowest_winner(tbt, order)[0], "methods": {}}
        for m in order:
            row["methods"][m] = {
                "tbt_us": tbt[m], "mj_per_token": 1e3 * e_base[m] / max(batch, 1),
                "e_over_tp": e_base[m] / e_base["tp"] if "tp" in e_base else None,
                "tbt_over_tp": tbt[m] / tbt["tp"] if "tp" in tbt else None}
        for name, base_val, samp in (
                ("energy", e_base, e_samp),
                ("edp", {m: e_base[m] * tbt[m] * 1e-6 for m in order},
                 {m: e_samp[m] * tbt[m] * 1e-6 for m in order})):
            winners = [lowest_winner({m: float(samp[m][i]) for m in order}, order)[0]
                       for i in range(samples)]
            base_winner = lowest_winner(base_val, order)[0]
            verdict = cell_verdict(values, winners, base_winner=base_winner)
            verdict.update(winner=base_winner, mark=mark(verdict))
            row[name] = verdict
        rows.append(row)
    models = list(dict.fromkeys(r["model"] for r in rows))
    rows.sort(key=lambda r: (models.index(r["model"]), _tflops(r["setting"]), r["batch"]))
    return rows


def _tflops(setting: Any) -> float:
    """Return the TFLOPS of a ``TFLOPS/GBps`` setting (inf if unparsable: sorted last)."""
    try:
        return float(str(setting).split("/")[0])
    except ValueError:
        return float("inf")


def _split(verdict: Mapping[str, Any]) -> str:
    knob = verdict.get("deciding")
    if knob is None:
        return ""
    s = verdict["splits"][knob]
    return f": {s['below']} if {knob} ≤ {s['threshold']:.3g}, {s['above']} above"


def render_energy_section(rows: Sequence[Mapping[str, Any]], *, samples: int, seed: int,
                          command: str | None = None) -> str:
    """Render the Markdown energy table (one row per cell) with its reading notes."""
    methods: list[str] = []
    for r in rows:
        methods += [m for m in r["methods"] if m not in methods]
    head = ["model", "setting", "B", *methods, "latency winner", "energy winner",
            "EDP winner"]
    body = []
    for r in rows:
        cells = []
        for m in methods:
            v = r["methods"].get(m)
            if v is None:
                cells.append("-")
                continue
            rel = ("" if v["e_over_tp"] is None
                   else f" ({v['e_over_tp']:.2f} / {v['tbt_over_tp']:.2f})")
            cells.append(f"{v['mj_per_token']:.3f}{rel}")
        body.append([str(r["model"]), str(r["setting"]), str(r["batch"]), *cells,
                     r["latency_winner"],
                     f"{r['energy']['winner']} — {r['energy']['mark']}{_split(r['energy'])}",
                     f"{r['edp']['winner']} — {r['edp']['mark']}{_split(r['edp'])}"])
    profiles = sorted({str(r["profile"]) for r in rows})
    lines = []
    if command:
        lines += [f"Regenerate: `{command}`.", ""]
    lines += [f"Profile {', '.join(f'`{p}`' for p in profiles)}. Per method: mJ per token "
              "(energy / TP, TBT / TP), means over the records' seeds. Marks over "
              f"{samples} joint Latin-hypercube samples (seed {seed}) of "
              f"{', '.join(f'`{k}`' for k in sorted(ENERGY_UNCERTAINTIES))} across their "
              "credible ranges; each sample re-prices the recorded DRAM/NoC/compute/static "
              "breakdown exactly (energy is linear in each value; no re-simulation). Robust = "
              "the same winner in ≥ 90 % of the samples (percentage = samples won by the "
              "base-value winner); else the deciding knob's best split. EDP = step energy × "
              "TBT.", "", render_table(head, body, style="markdown"), ""]
    diff = []
    for r in rows:
        for name, label in (("energy", "energy"), ("edp", "EDP")):
            v = r[name]
            if v["winner"] != r["latency_winner"]:
                kind = "robust" if v["mark"].startswith("robust") else "conditional"
                diff.append(f"* {r['model']} {r['setting']} B={r['batch']}: {label} winner "
                            f"{v['winner']}, latency winner {r['latency_winner']} ({kind}: "
                            f"{v['mark']})")
    lines += (["Cells where a winner differs from the latency winner:", "", *diff, ""] if diff
              else ["In every cell the energy and EDP winners (at the base values) are the "
                    "latency winner.", ""])
    return "\n".join(lines)


def cmd_energy_report(args: argparse.Namespace) -> int:
    """Run ``hdamoe energy-report``: print the energy table of bench records."""
    records = load_records(args.records)
    if args.methods:
        keep = {m.strip() for m in str(args.methods).split(",")}
        missing = keep - {r["method"] for r in records}
        if missing:
            raise ConfigError(f"--methods names {sorted(missing)}, which no record has; the "
                              f"records hold {sorted({r['method'] for r in records})}")
        records = [r for r in records if r["method"] in keep]
    rows = analyse_energy(records, samples=args.samples, seed=args.seed)
    text = render_energy_section(rows, samples=args.samples, seed=args.seed)
    if args.samples < MIN_PUBLISHED_SAMPLES:
        text += (f"\nNote: {args.samples} samples (< {MIN_PUBLISHED_SAMPLES}); too few for a "
                 "published table.\n")
    print(text)
    return 0

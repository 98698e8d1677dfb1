"""The paper's claims (paper-model.md §15) checked against ``hdamoe reproduce`` records.

Each :class:`Claim` carries a rule that computes its verdict (``holds``, ``partly``, ``does not
hold``, ``not measured``) and the evidence from the records; :func:`claims_section` renders the
table of the report. The per-cell summaries (:func:`cell_tables`) and the small number formatters
used by every section of the report live here too, so that :mod:`hdamoe_env.app.report` imports
this module and not the other way round.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from hdamoe_env.app.tables import render_table

__all__ = ["CLAIMS", "MATCHED", "OTHERS", "SHORT", "Claim", "best_other", "cell_records",
           "cell_tables", "claims_section", "lb_method", "md_table", "model_label",
           "quality_range", "speedup", "tcomp"]

SHORT = {"deepseek-v2-lite": "DeepSeek-V2-Lite", "mixtral-8x7b": "Mixtral-8x7B",
         "qwen2-57b-a14b": "Qwen2-57B-A14B", "qwen3.5-35b-a3b": "Qwen3.5-35B-A3B"}
OTHERS = ("tp", "ep", "hybrid", "hd-moe")
#: HDA-MoE at matched routing quality (bench methods) and their top-1 retention targets.
MATCHED = (("hda-moe@q99", "top-1 ≥ 99 %"), ("hda-moe@q95", "top-1 ≥ 95 %"))


def cell_tables(records: Iterable[dict[str, Any]], figure: str | None = None
                ) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    """Group bench records by cell and summarise every cell per method.

    Returns:
        ``[(meta, {method: summary row})]`` in record order; ``meta`` is the first record of the
        cell (configuration fields and tags), the rows come from
        :func:`hdamoe_env.app.records.summarise`.
    """
    from hdamoe_env.app.records import summarise

    groups: dict[str, list[dict[str, Any]]] = {}
    for rec in records:
        if rec.get("kind") != "bench" or (figure is not None and rec.get("figure") != figure):
            continue
        groups.setdefault(rec["cell"], []).append(rec)
    return [(recs[0], {row["method"]: row for row in summarise(recs)})
            for recs in groups.values()]


def md_table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    return render_table(head, rows, style="markdown")


def best_other(rows: dict[str, dict[str, Any]], method: str = "hda-moe",
                others: Sequence[str] = OTHERS) -> tuple[str | None, float]:
    """Speed-up of ``method`` over the fastest of ``others`` present (TBT_best / TBT_method)."""
    cands = [(rows[m]["tbt_us"], m) for m in others if m in rows and m != method]
    if method not in rows or not cands:
        return None, float("nan")
    tbt, name = min(cands)
    return name, tbt / rows[method]["tbt_us"]


def speedup(rows: dict[str, dict[str, Any]], method: str, base: str) -> float:
    if method not in rows or base not in rows or rows[method]["tbt_us"] <= 0:
        return float("nan")
    return rows[base]["tbt_us"] / rows[method]["tbt_us"]


def model_label(meta: dict[str, Any]) -> str:
    return SHORT.get(meta.get("model", ""), str(meta.get("model")))


def cell_records(records: list[dict[str, Any]], cell: str, method: str) -> list[dict[str, Any]]:
    return [r for r in records if r.get("cell") == cell and r.get("method") == method]


def tcomp(records: list[dict[str, Any]], cell: str, method: str) -> float:
    vals = [r["breakdown_us"].get("t_comp_us", float("nan"))
            for r in cell_records(records, cell, method)]
    return float(np.mean(vals)) if vals else float("nan")


def lb_method(r: dict[str, Any]) -> str:
    """The Link-Balance column of the ablation: the unguarded placement when it was measured."""
    return "node-link-raw" if "node-link-raw" in r else "node-link"


class Claim:
    """A qualitative claim of the paper (§15) and the rule that checks it on the records.

    Attributes:
        text: The claim.
        source: Where the paper makes it.
        check: ``records -> (verdict, evidence)``; verdict is ``holds``, ``partly``,
            ``does not hold`` or ``not measured``.
    """

    def __init__(self, text: str, source: str,
                 check: Callable[[list[dict[str, Any]]], tuple[str, str]]) -> None:
        self.text = text
        self.source = source
        self.check = check


def _e2e(records: list[dict[str, Any]], profile: str = "faithful", **match: Any
         ) -> list[tuple[dict[str, Any], dict[str, dict[str, Any]]]]:
    return [(m, r) for m, r in cell_tables(records, "fig10_end_to_end")
            if m.get("profile") == profile and all(m.get(k) == v for k, v in match.items())]


def _verdict(fraction: float) -> str:
    if not math.isfinite(fraction):
        return "not measured"
    return "holds" if fraction >= 0.999 else ("partly" if fraction > 0 else "does not hold")


def _claim_ep_tp(records: list[dict[str, Any]]) -> tuple[str, str]:
    ev, hits, n = [], 0, 0
    for profile in ("faithful", "paper"):
        for meta, r in _e2e(records, profile, setting="2.5/75", batch=128):
            if "ep" in r:
                n += 1
                hits += r["ep"]["tbt_over_tp"] > 1.0
                ev.append(f"{model_label(meta)} {profile}: EP/TP {r['ep']['tbt_over_tp']:.2f} at 2.5/75")
        for meta, r in _e2e(records, profile, setting="10/25", batch=128):
            if "tp" in r and "ep" in r:
                n += 1
                ok = r["tp"]["tbt_us"] > r["ep"]["tbt_us"]
                hits += ok
                ev.append(f"{model_label(meta)} {profile}: TP/EP {1 / r['ep']['tbt_over_tp']:.2f} at "
                          "10/25")
    return _verdict(hits / n if n else float("nan")), "; ".join(ev) + (
        " (rule: EP slower than TP at 2.5/75 and TP slower than EP at 10/25, B = 128)")


def _range(values: Iterable[Any], spec: str) -> str:
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return "–"
    lo, hi = min(vals), max(vals)
    return spec.format(lo) if spec.format(lo) == spec.format(hi) else (
        f"{spec.format(lo)}–{spec.format(hi)}")


def quality_range(rows: Iterable[dict[str, dict[str, Any]]], method: str) -> str:
    """Routing quality of ``method`` over cells: top-1 retention, changed fraction, gating scale.

    Args:
        rows: ``{method: summary row}`` per cell.
        method: The method.

    Returns:
        e.g. ``"top-1 kept 56.1–99.0 %, changed 12.0–78.4 %, scale 0.0104–1"``.
    """
    sub = [r[method] for r in rows if method in r]
    return (f"top-1 kept {_range((x.get('top1_retention') for x in sub), '{:.1%}')}, "
            f"changed {_range((x.get('changed_fraction') for x in sub), '{:.1%}')}, "
            f"scale {_range((x.get('gating_scale') for x in sub), '{:.3g}')}")


def _claim_speedups(profile: str, method: str = "hda-moe"
                    ) -> Callable[[list[dict[str, Any]]], tuple[str, str]]:
    def check(records: list[dict[str, Any]]) -> tuple[str, str]:
        cells = [(m, r) for m, r in _e2e(records, profile) if method in r]
        if not cells:
            return "not measured", f"no `{profile}` cells with {method}"
        parts, wins = [], []
        for base, lo in (("tp", 1.1), ("ep", 1.1), ("hybrid", 1.1), ("hd-moe", 1.1)):
            sp = [speedup(r, method, base) for _, r in cells]
            sp = [s for s in sp if math.isfinite(s)]
            if sp:
                parts.append(f"×{base} {min(sp):.2f}–{max(sp):.2f}")
                wins.append(sum(s >= lo * 0.995 for s in sp) / len(sp))
        if not wins:
            return "not measured", f"`{profile}`: no cells with {method} and a baseline"
        frac = float(np.mean(wins))
        verdict = _verdict(frac)
        label = "HDA-MoE" if method == "hda-moe" else method
        text = (f"`{profile}`, {len(cells)} cells: {label} " + ", ".join(parts)
                + f" ({quality_range([r for _, r in cells], method)})"
                + f"; share of (cell, baseline) pairs with ≥ 1.1×: {frac:.0%}")
        if method == "hda-moe":
            for matched, label_q in MATCHED:
                sub = [r for _, r in cells if matched in r]
                sp = [speedup(r, matched, "tp") for r in sub]
                sp_hd = [speedup(r, matched, "hd-moe") for r in sub]
                if sub:
                    text += (f". At matched quality ({label_q}): ×tp {_range(sp, '{:.2f}')}, "
                             f"×hd-moe {_range(sp_hd, '{:.2f}')} "
                             f"({quality_range(sub, matched)})")
        return verdict, text
    return check


def _claim_scaling(figure: str, what: str) -> Callable[[list[dict[str, Any]]], tuple[str, str]]:
    def check(records: list[dict[str, Any]]) -> tuple[str, str]:
        cells = cell_tables(records, figure)
        if not cells:
            return "not measured", f"no {figure} cells"
        ok = []
        ev = []
        for meta, r in cells:
            name, sp = best_other(r)
            ok.append(sp >= 1.0)
            ev.append(f"{model_label(meta)} {meta.get(what)}: {sp:.3f}× over {name}")
        return _verdict(sum(ok) / len(ok)), "; ".join(ev) + " (rule: HDA-MoE fastest)"
    return check


def _claim_memory(records: list[dict[str, Any]]) -> tuple[str, str]:
    shares = []
    for meta, r in _e2e(records, setting="5/50", batch=128):
        for m, x in r.items():
            total = x["compute_us"] + x["communication_us"] + x["memory_us"] + x["extra_us"]
            if total > 0:
                shares.append((x["memory_us"] / total, f"{model_label(meta)} {m}"))
    if not shares:
        return "not measured", "no 5/50 B = 128 cells"
    worst = max(shares)
    frac = sum(s < 0.15 for s, _ in shares) / len(shares)
    return _verdict(frac), (f"`faithful` memory share {min(shares)[0]:.1%}–{worst[0]:.1%} "
                            f"(largest: {worst[1]}); rule: < 15 % of TBT for every method")


def _claim_node_balance(records: list[dict[str, Any]]) -> tuple[str, str]:
    ev, ok = [], []
    for meta, r in _e2e(records, batch=128, model="deepseek-v2-lite"):
        if "ep" in r and "node-balance" in r:
            t_ep = tcomp(records, meta["cell"], "ep")
            t_nb = tcomp(records, meta["cell"], "node-balance")
            ok.append(t_nb < t_ep)
            ev.append(f"{meta['setting']}: expert-phase tail EP {t_ep:.0f} → NB {t_nb:.0f} µs")
    if not ok:
        return "not measured", "no DeepSeek B = 128 cells"
    return _verdict(sum(ok) / len(ok)), "; ".join(ev) + " (`faithful`)"


def _claim_link_balance(records: list[dict[str, Any]]) -> tuple[str, str]:
    ev, ok = [], []
    for profile in ("faithful", "paper"):
        for meta, r in _e2e(records, profile, batch=128):
            if "node-link" in r and "node-balance" in r:
                lb = lb_method(r)
                a, b = r["node-balance"]["communication_us"], r[lb]["communication_us"]
                ok.append(b < a)
                ev.append(f"{model_label(meta)} {meta['setting']} {profile}: {a:.0f} → {b:.0f} µs")
    if not ok:
        return "not measured", "no cells"
    return _verdict(sum(ok) / len(ok)), "communication NB → NB+LB: " + "; ".join(ev)


def _claim_memory_cap(records: list[dict[str, Any]]) -> tuple[str, str]:
    rows = [r for r in records if r.get("figure") == "fig20_memory_cap"]
    if len(rows) < 2:
        return "not measured", "no memory-cap sweep"
    ratio = [r["dram_max_over_mean"] for r in rows]
    tbt = [r["normalised_tbt"] for r in rows]
    mono = all(b <= a + 1e-9 for a, b in zip(ratio, ratio[1:], strict=False))
    close = max(tbt) - min(tbt) <= 0.05 * tbt[0]
    verdict = "holds" if mono and close else ("partly" if mono or close else "does not hold")
    return verdict, (f"max/mean {' → '.join(f'{v:.3f}' for v in ratio)} (monotone: {mono}); "
                     f"TBT ÷ TP {min(tbt):.3f}–{max(tbt):.3f} (within 5 %: {close})")


def _claim_dynamic(records: list[dict[str, Any]]) -> tuple[str, str]:
    cells = cell_tables(records, "fig21_dynamic")
    if not cells:
        return "not measured", "no dynamic-placement cells"
    by_kb: dict[Any, list[float]] = {}
    for meta, r in cells:
        by_kb.setdefault(meta.get("k_b"), []).append(speedup(r, "hd-moe", "node-link"))
    means = {k: float(np.mean(v)) for k, v in by_kb.items()}
    helps = sum(s > 1.0 for v in by_kb.values() for s in v) / sum(len(v) for v in by_kb.values())
    more = len(means) >= 2 and means[max(means)] > means[min(means)]
    ev = ", ".join(f"k_b={k}: mean speed-up {v:.3f}" for k, v in sorted(means.items()))
    verdict = _verdict(helps)
    if verdict == "holds" and not more:
        verdict = "partly"
    return verdict, f"{ev}; dynamic faster in {helps:.0%} of the runtime traces; more k_b helps " \
                    f"more: {more} (different settings, as in the paper)"


def _claim_gating_batch(records: list[dict[str, Any]]) -> tuple[str, str]:
    cells = sorted(cell_tables(records, "fig22_gating_batch"), key=lambda c: c[0]["batch"])
    if len(cells) < 2:
        return "not measured", "no batch sweep"
    small, large = cells[0], cells[-1]
    pb_s, pb_l = (speedup(c[1], "hd-moe", "node-link") for c in (small, large))
    g = [speedup(r, "agent:hardware-aware-gating", "node-link") for _, r in cells]
    both = [speedup(r, "hda-moe", "node-link") for _, r in cells]
    best = [max(b, x, speedup(r, "hd-moe", "node-link")) <= b + 1e-9
            for (_, r), b, x in zip(cells, both, g, strict=True)]
    checks = [pb_s <= pb_l, min(g) > 1.0, all(best)]
    return _verdict(sum(checks) / 3), (
        f"pre-broadcast speed-up B={small[0]['batch']}: {pb_s:.3f}, B={large[0]['batch']}: "
        f"{pb_l:.3f}; gating-only {min(g):.3f}–{max(g):.3f}; both best at "
        f"{sum(best)}/{len(best)} batch sizes (rules: pre-broadcast weaker at small B, gating "
        "> 1 everywhere, both ≥ either)")


def _claim_r_comm(records: list[dict[str, Any]]) -> tuple[str, str]:
    cells = sorted([(m, r) for m, r in cell_tables(records, "fig24_sensitivity")
                    if m.get("axis") == "r_comm"], key=lambda c: abs(c[0]["r_comm"]))
    if len(cells) < 3:
        return "not measured", "no r_comm sweep"
    sp = [speedup(r, "hda-moe", "node-link") for _, r in cells]
    d = np.diff(sp)
    nonmono = bool((d > 1e-4).any() and (d < -1e-4).any())
    return ("holds" if nonmono else "does not hold"), (
        "speed-up at |r_comm| = " + ", ".join(f"{abs(m['r_comm']):g}: {s:.3f}"
                                              for (m, _), s in zip(cells, sp, strict=True)))


def _not_measured(reason: str) -> Callable[[list[dict[str, Any]]], tuple[str, str]]:
    return lambda records: ("not measured", reason)


CLAIMS: tuple[Claim, ...] = (
    Claim("EP suffers from load imbalance at 2.5/75; TP from all-reduce overhead at 10/25",
          "§VI-B", _claim_ep_tp),
    Claim("HDA-MoE reaches 1.1–3.4× over TP, 1.1–1.5× over EP, 1.1–3.7× over the hybrid, "
          "1.1–1.3× over HD-MoE (`faithful`)", "§VI-B, §VII", _claim_speedups("faithful")),
    Claim("the same under the paper-compatible profile (`paper`)", "§VI-B, §VII",
          _claim_speedups("paper")),
    *(Claim(f"the same at matched routing quality, {label} (`{profile}`; gating scale "
            "searched per cell on training steps)", "§VI-B, §VI-E",
            _claim_speedups(profile, method))
      for method, label in MATCHED for profile in ("faithful", "paper")),
    Claim("HDA-MoE keeps low TBT across mesh sizes", "§VI-B",
          _claim_scaling("fig11_mesh", "mesh")),
    Claim("HDA-MoE beats all baselines on torus and fat-tree", "§VI-B",
          _claim_scaling("fig12_topology", "topology")),
    Claim("memory access is a small latency component", "§VI-C", _claim_memory),
    Claim("Node Balance lowers EP's compute tail", "§VI-F1", _claim_node_balance),
    Claim("Link Balance lowers communication latency relative to Node Balance alone",
          "§VI-F2", _claim_link_balance),
    Claim("a tighter ρ_mem lowers max/mean DRAM load while normalised TBT stays close",
          "§VI-F3", _claim_memory_cap),
    Claim("dynamic placement helps on traces unlike the placement's; more pre-broadcast "
          "experts help more", "§VI-F4", _claim_dynamic),
    Claim("pre-broadcast weakens at small batches, gating stays effective, combining is best",
          "§VI-F5", _claim_gating_batch),
    Claim("speed-up is non-monotonic in r_comm", "§VI-H", _claim_r_comm),
    Claim("boundary replacements keep output similarity ≈ 0.95; GSM8K accuracy ≈ 70 % with "
          "gating", "§VI-E, §VI-F5",
          _not_measured("needs the real model's weights (the tiny-model fidelity run, "
                        "`hdamoe traces fidelity`)")),
    Claim("the LP finishes within minutes; BO is stable after ≈ 45 of 70 calls", "§VI-A6",
          _not_measured("the quick suite uses the heuristic Node Balance and local search; "
                        "see `hdamoe place` timings in docs/RESULTS.md")),
)


def claims_section(records: list[dict[str, Any]]) -> list[str]:
    rows = []
    for claim in CLAIMS:
        try:
            verdict, evidence = claim.check(records)
        except (KeyError, ValueError, ZeroDivisionError) as exc:
            verdict, evidence = "not measured", f"records incomplete ({exc!r})"
        rows.append([claim.text, claim.source, f"**{verdict}**", evidence])
    return ["## The paper's claims vs this package", "",
            "Each verdict is computed from the records above by the rule in its evidence "
            "column (profile `faithful` unless stated). Every speed-up of a gating method is "
            "given with its routing quality (top-1 retention, changed fraction, gating scale ×"
            " the default coefficients); `hda-moe@q99` / `@q95` gate at the strongest scale ≤ 1 "
            "keeping top-1 retention ≥ 99 % / 95 % on training decode steps. Routing quality "
            "is not model quality: KL and perplexity ratios exist only for the recorded "
            "tiny-model traces (`hdamoe traces fidelity`, docs/results/fidelity.md).", "",
            md_table(["claim (paper-model.md §15)", "paper", "verdict", "measured"], rows)]



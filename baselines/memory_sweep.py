"""The memory-cap sweep of the offline placement pipeline (paper-model.md §7.3 (10), Fig. 20).

:func:`sweep_rho_mem` runs ``baselines.pipeline.run_pipeline`` once per relative memory cap
ρ_mem and reports the per-node DRAM of the placed experts and the normalised TBT.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from baselines.pipeline import run_pipeline
from baselines.pipeline_config import PlaceConfig, load_trace
from hdamoe_env.cost import perf

__all__ = ["sweep_rho_mem"]


def sweep_rho_mem(config: PlaceConfig, rho_values: Sequence[float | None],
                  out_dir: str | os.PathLike[str], *, layers: str | Sequence[int] | None = None,
                  workers: int = 1, backend: str = "process", resume: bool = False,
                  trace: Any = None, force: bool = False) -> list[dict[str, Any]]:
    """Sweep the memory cap ρ_mem (§7.3 (10), paper Fig. 20).

    For every ρ_mem the pipeline runs into ``out_dir/rho_<value>``; reported per value: the
    routed-expert DRAM bytes of every physical node summed over the placed layers (max and mean,
    and their ratio), and the TBT of the placed layers (Σ t_nm + MoE latency, static evaluator)
    for Node+Link Balance and TP, with the normalised TBT = TBT / TBT_TP.

    Returns:
        One dict per ρ_mem value.
    """
    if trace is None:
        trace = load_trace(config)
    model = config.model_spec
    conv = config.conv
    out = Path(out_dir)
    rows = []
    for rho in rho_values:
        cfg = dataclasses.replace(config, rho_mem=None if rho is None else float(rho))
        sub = out / ("rho_none" if rho is None else f"rho_{float(rho):g}")
        res = run_pipeline(cfg, sub, layers=layers, workers=workers, backend=backend,
                           resume=resume, trace=trace, force=force)
        placed = sorted(res.layers)
        P, pi = res.placement.P, res.placement.pi
        w_e = perf.expert_bytes(model, conv)
        dram = np.zeros(P.shape[2])
        for layer in placed:
            np.add.at(dram, pi[layer], P[layer].sum(axis=0) * w_e)
        tbt = sum(res.layers[l].record["latency_us"]["node_link"]["total_us"]
                  + res.layers[l].record["latency_us"]["node_link"]["nm_us"] for l in placed)
        tbt_tp = sum(res.layers[l].record["latency_us"]["tp"]["total_us"]
                     + res.layers[l].record["latency_us"]["tp"]["nm_us"] for l in placed)
        rows.append({"rho_mem": rho, "layers": placed,
                     "dram_max_gib": float(dram.max()) / 2**30,
                     "dram_mean_gib": float(dram.mean()) / 2**30,
                     "dram_max_over_mean": float(dram.max() / dram.mean()) if dram.mean() else 1.0,
                     "tbt_us": tbt, "tbt_tp_us": tbt_tp,
                     "normalised_tbt": tbt / tbt_tp if tbt_tp else float("nan"),
                     "out_dir": str(sub)})
    return rows

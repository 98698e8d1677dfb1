"""Offline placement methods: TP, EP, hybrid, Node Balance, Link Balance (paper-model.md §7–9).

Modules:

* :mod:`baselines.static` — TP and EP (re-exported data constructors of the core) and the
  compute-balanced hybrid TP-EP baseline (§9.3);
* :mod:`baselines.node_balance` — the Node-Balance MILP in PuLP (one solver factory, group
  compression, warm starts, symmetry breaking) and its heuristic mode (§7);
* :mod:`baselines.link_balance` — Link Balance: BO with scikit-optimize, swap local search,
  simulated annealing, random search and the MST proxy (§8);
* :mod:`baselines.pipeline` — the per-layer offline pipeline (§8.5) with parallel workers,
  atomic per-layer artifacts and resume; the memory-cap sweep;
* :mod:`hdamoe_env.app.place` — ``hdamoe place`` and ``hdamoe sweep-mem``.

``METHODS`` names every placement method of §9 and where its placement comes from: built on
the fly (``tp``, ``ep``) or read from a pipeline output directory (``artifact``). ``hd_moe`` and
``hda_moe`` are the Node+Link placement plus the names of their online agents, which the
application layer (``hdamoe_env.app.bench``) resolves; this package never imports ``agents``.
PuLP, highspy, scikit-optimize and scipy are imported lazily inside the functions that need them.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from hdamoe_env.errors import ConfigError, unknown_name
from hdamoe_env.placement import Placement, expert_parallel, tensor_parallel

__all__ = ["METHODS", "Method", "method_placement"]


@dataclass(frozen=True)
class Method:
    """A placement method of paper-model.md §9.

    Attributes:
        name: Method name.
        artifact: File name of its placement in a pipeline output directory, or None when the
            placement is built directly (TP).
        agents: Names of the online agents the method adds (resolved by the application layer).
        description: One line.
    """

    name: str
    artifact: str | None
    agents: tuple[str, ...]
    description: str


METHODS: dict[str, Method] = {
    "tp": Method("tp", None, (), "tensor parallelism: every expert split over all D nodes"),
    "ep": Method("ep", "placement_ep.npz", (),
                 "expert parallelism (seeded shuffle), random mapping per layer"),
    "hybrid": Method("hybrid", "placement_hybrid.npz", (),
                     "compute-balanced hybrid TP-EP over R mesh regions (§9.3)"),
    "node_balance": Method("node_balance", "placement_node_balance.npz", (),
                           "Node Balance shares with the random mapping π0"),
    "node_link": Method("node_link", "placement.npz", (),
                        "Node Balance + Link Balance (static HD-MoE placement)"),
    "node_link_raw": Method("node_link_raw", "placement_node_link_raw.npz", (),
                            "Node Balance + Link Balance without the TP guard (ablations)"),
    "hd_moe": Method("hd_moe", "placement.npz", ("prebroadcast", "dispatch"),
                     "node_link + dynamic scheduling (§10)"),
    "hda_moe": Method("hda_moe", "placement.npz", ("prebroadcast", "dispatch", "gating"),
                      "hd_moe + hardware-aware gating (§11)"),
}


def method_placement(name: str, *, num_layers: int, num_experts: int, num_nodes: int,
                     run_dir: str | Path | None = None, seed: int = 0) -> Placement:
    """Return the placement of a method: built (TP; EP without ``run_dir``) or loaded.

    Args:
        name: A key of ``METHODS``.
        num_layers: L.
        num_experts: E.
        num_nodes: D.
        run_dir: Output directory of ``hdamoe place`` holding the method's artifact.
        seed: Seed of a directly built EP placement.

    Raises:
        ConfigError: Unknown method, or an artifact-backed method without ``run_dir``.
    """
    if name not in METHODS:
        raise unknown_name("placement method", name, METHODS)
    method = METHODS[name]
    if name == "tp":
        return tensor_parallel(num_layers, num_experts, num_nodes)
    if name == "ep" and run_dir is None:
        return expert_parallel(num_layers, num_experts, num_nodes, np.random.default_rng(seed))
    if run_dir is None:
        raise ConfigError(f"method {name!r} reads its placement from a `hdamoe place` output "
                          f"directory ({method.artifact}); pass run_dir")
    assert method.artifact is not None
    return Placement.load(Path(run_dir) / method.artifact)

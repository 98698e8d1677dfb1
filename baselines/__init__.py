"""Offline placement methods: TP, EP, hybrid, Node Balance, Link Balance (paper-model.md §7–9).

Modules:

* :mod:`baselines.static` — TP and EP (re-exported data constructors of the core) and the
  compute-balanced hybrid TP-EP baseline (§9.3);
* :mod:`baselines.node_balance.milp` — the Node-Balance MILP in PuLP (one solver factory, group
  compression, warm starts, symmetry breaking) and its heuristic mode (§7);
* :mod:`baselines.link_balance` — Link Balance: BO with scikit-optimize, swap local search,
  simulated annealing, random search and the MST proxy (§8);
* :mod:`baselines.eplb` — EPLB redundant experts (production practice, not in the paper):
  greedy replication by load per copy, balanced packing with S slots per node, hierarchical node
  groups; :mod:`baselines.eplb_dynamic` its periodic rebalancing with weight moves and their DES
  cost, :mod:`baselines.rebalance` the env wrapper that rebalances inside an episode;
* :mod:`baselines.pipeline` — the offline pipeline (§8.5): the run with parallel workers,
  atomic per-layer artifacts and resume; :mod:`baselines.pipeline_layer` the steps of one
  layer, :mod:`baselines.pipeline_config` the run's ``PlaceConfig``;
* :mod:`baselines.batch_guard` — the batch guard: an optimised placement's layers re-checked at
  the evaluation's batch against TP, tile-aligned TP, EP and the hybrid on sampled steps of
  its own (a baseline is kept unless clearly beaten);
* :mod:`baselines.layer_baselines` — the pipeline's per-layer placements (EP, TP, tile-aligned
  TP, hybrid, Node Balance, Node + Link) as arrays, for the placement env's
  ``evaluate_placement``;
* :mod:`baselines.memory_sweep` — the memory-cap sweep over pipeline runs (Fig. 20);
* :mod:`baselines.pool` — the one process pool (``spawn_pool_map``: placement layers and
  ``hdamoe reproduce`` cells);
* ``hdamoe place`` and ``hdamoe sweep-mem`` are commands of the application layer
  (:mod:`hdamoe_env.app.place`).

* :mod:`baselines.store` — the one placement resolver: method name → ``Placement`` (built,
  read from a ``hdamoe place`` directory, or computed once by a cached quick pipeline run).

The online methods HD-MoE and HDA-MoE are the Node+Link placement plus online agents; the
application layer composes them (``hdamoe_env.app.bench``); this package never imports ``agents``.
PuLP, highspy, scikit-optimize and scipy are imported lazily inside the functions that need them.

May import: baselines.node_balance, hdamoe_env, hdamoe_env.config, hdamoe_env.noc,
hdamoe_env.cost, hdamoe_env.decisions, hdamoe_env.sim, traces
"""

from __future__ import annotations

from baselines.store import PLACEMENT_ARTIFACTS, PlacementStore, StoreConfig

__all__ = ["PLACEMENT_ARTIFACTS", "PlacementStore", "StoreConfig"]

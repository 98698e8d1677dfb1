"""``HdMoePlaceEnv``: build one MoE layer's expert placement one decision at a time.

An episode places the routed experts of one MoE layer (drawn over layers and traces, with a
held-out split of layers) on the node grid. The experts are visited in descending frequency
order; every decision chooses, for the current expert, one *holder pattern* from a fixed
discrete set:

* ``node d`` (D actions): the whole expert on cluster d (all U tiles);
* ``region s/r``: the expert split over region r of size s — the grid cut into equal
  rectangles of s clusters (``region_sizes``; 1×2, 2×2, 2×4 on the 4×8 mesh) — in whole tiles:
  ⌊U/s⌋ tiles each, the U mod s remaining tiles on the region's least-loaded clusters;
* ``spread``: the expert's U tiles dealt one at a time to the cluster holding the fewest tiles
  of the layer (ties: the lower cluster). When every expert of a layer is spread, the layer
  equals tile-aligned TP (``tensor_parallel_tiled``, TP itself when D divides U) and is marked
  as an all-reduce layer.

U = 1/``share_unit``: every share the env builds lies on the profile's tile grid. Clusters are
the endpoints (identity mapping): the geometry of a pattern is the geometry of the chip.
Memory caps (``rho_mem`` and the hardware's ``node_dram_gib``, split evenly over the layers as
the pipeline does) are counted in tiles per cluster; ``action_masks()`` hides the patterns that
would exceed them. ``spread`` is always legal (water-filling never passes a cap while the
layer's tiles fit at all), so every action of the space is legal: a masked one is coerced to
``spread`` and reported in ``info`` (``strict=True`` raises ``InvalidAction`` instead).

The reward is paid at the end: −(latency of the finished layer)/(latency of TP), latency =
t_comp + t_comm_moe (the MoE part of the layer; t_nm does not depend on the placement), both
from the package's evaluator (``evaluator``: ``"static"`` = ``MoESimulator.layer_static`` on
expected loads, as ``baselines.pipeline_layer.evaluate_layer``; ``"analytic"`` = the γ-calibrated
analytic twin on ``score_steps`` sampled decode steps, γ fitted once per layer on EP;
``"des"`` = the DES on the same sampled steps). Aggregator draws and sampled steps come from a
stream fixed per (trace, layer), so the reward is a deterministic function of the placement.
Optional shaping (``shaping_weight`` > 0) adds Φ(s') − Φ(s) with the potential
Φ(s) = −w·max_d load_d/(k/D) on non-final steps and Φ(final) = 0: the return of an episode is
unchanged (Φ(start) = 0), only credit moves earlier.

Baselines in the same API: :meth:`HdMoePlaceEnv.evaluate_placement` scores any layer placement
(P, π, all-reduce flag) of the current episode's layer with the same evaluator and streams, so
EP, TP, tile-aligned TP, the hybrid and Node + Link Balance (``baselines``; composed by the
caller, the env never imports them) are compared on the reward the agent sees.

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, hdamoe_env.decisions,
hdamoe_env.sim, traces
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, InvalidAction
from hdamoe_env.env.actions import discrete_action
from hdamoe_env.config.run import RunSpec
from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.cost import perf
from hdamoe_env.sim.calibrate import fit_gamma
from hdamoe_env.sim.evaluator import LayerEvaluator
from hdamoe_env.sim.placement import (Placement, expert_parallel, identity_mapping, share_unit,
                                      tensor_parallel)
from hdamoe_env.sim.simulator import MoESimulator
from hdamoe_env.sim.sources import load_trace

__all__ = ["PLACE_EVALUATORS", "RANDOM_SAMPLERS", "HdMoePlaceEnv", "RandomSearch", "greedy_balance",
           "heldout_layers", "holder_patterns", "random_search", "region_blocks"]

#: Evaluators of the reward (module docstring).
PLACE_EVALUATORS = ("static", "analytic", "des")


def heldout_layers(num_layers: int, every: int = 4) -> tuple[int, ...]:
    """Return the held-out MoE layers: ``layer % every == every − 1`` ([decision], fixed).

    Args:
        num_layers: L.
        every: One layer in ``every`` is held out (4: layers 3, 7, 11, ...).

    Raises:
        ConfigError: ``every`` < 2.
    """
    if every < 2:
        raise ConfigError(f"heldout_every must be >= 2, got {every}")
    return tuple(layer for layer in range(num_layers) if layer % every == every - 1)


def region_blocks(mesh_shape: tuple[int, int], size: int) -> tuple[int, int] | None:
    """Return the (rows, cols) of a rectangle of ``size`` clusters that tiles the grid, or None.

    The most square rectangle with rows ≤ cols (1×2, 2×2, 2×4, 4×4) whose sides divide the
    grid's; None when no rectangle of that size tiles it.
    """
    X, Y = mesh_shape
    best: tuple[int, int] | None = None
    for h in range(1, size + 1):
        if size % h:
            continue
        w = size // h
        if h <= w and X % h == 0 and Y % w == 0 and (best is None or w - h < best[1] - best[0]):
            best = (h, w)
    return best


def holder_patterns(mesh_shape: tuple[int, int], units: int, region_sizes: Sequence[int]
                    ) -> tuple[NDArray[np.bool_], tuple[str, ...]]:
    """Return the holder patterns of the action space: bool [n, D] and their names.

    ``node d`` for every cluster, then ``region s/r`` for every size s of ``region_sizes``
    (ascending) whose rectangle tiles the grid (:func:`region_blocks`) with 1 < s < D and
    s ≤ ``units`` (every cluster of the region gets a tile), regions row-major, then
    ``spread`` (all clusters).
    """
    X, Y = mesh_shape
    D = X * Y
    rows_of, cols_of = np.divmod(np.arange(D), Y)
    patterns, names = [np.eye(D, dtype=bool)], [f"node {d}" for d in range(D)]
    for size in sorted({int(s) for s in region_sizes}):
        block = region_blocks((X, Y), size) if 1 < size < D else None
        if block is None or size > units:
            continue
        h, w = block
        rid = (rows_of // h) * (Y // w) + cols_of // w
        for r in range(D // size):
            patterns.append((rid == r)[None, :])
            names.append(f"region {size}/{r}")
    patterns.append(np.ones((1, D), dtype=bool))
    names.append("spread")
    return np.concatenate(patterns, axis=0), tuple(names)


@dataclass(frozen=True)
class _LayerData:
    """Everything the env needs about one (trace, layer): statistics and evaluator streams."""

    freqs: NDArray[np.float64]          # [E] f_i (Σ = k)
    order: NDArray[np.int64]            # [E] experts by descending f_i (ties: lower id)
    pairs: NDArray[np.float64]          # [E, E] fraction of tokens routed to both i and j
    groups: NDArray[np.int64]           # [G, k]
    group_freqs: NDArray[np.float64]    # [G]
    steps: NDArray[np.int64] | None     # [S, B, k] sampled steps (analytic / des)
    gamma: float | None                 # γ of the analytic twin (fitted on EP)
    eval_seed: np.random.SeedSequence   # aggregator stream (static)
    step_seeds: tuple[np.random.SeedSequence, ...]   # aggregator stream per sampled step
    tp_us: float                        # TP's latency under the evaluator


class HdMoePlaceEnv(gym.Env[dict[str, NDArray[np.float32]], np.int64]):
    """Place the experts of one MoE layer, one expert per step (the placement lever).

    ## Description
    See the module docstring: experts in descending frequency order, one holder pattern each;
    the reward is the finished layer's latency relative to TP.

    ## Action Space
    ``Discrete(D + Σ_s D/s + 1)``: ``node d`` for d < D, then the regions of every size in
    ``region_sizes`` (size-major, regions row-major), then ``spread``. ``action_masks()``
    (bool [n]) marks the patterns within the memory caps; ``action_patterns`` names them.

    ## Observation Space
    | key | shape | meaning |
    |---|---|---|
    | ``freqs`` | [E] | f_i of the layer sorted descending (∈ [0, 1]) |
    | ``expert`` | [4] | position t/E, f of the current expert, unplaced frequency / k, cap |
    | ``coact`` | [D] | Σ_placed j p(cur, j)·P[j, d] / f_cur (∈ [0, k]) |
    | ``load`` | [D] | Σ_placed j f_j P[j, d] / (k/D) (∈ [0, D]) |
    | ``memory`` | [D] | tiles held / (E·U/D) (∈ [0, D]) |
    | ``topology`` | [3·D] | rows, then columns (∈ [0, 1]), then mean grid distance to the |
    | | | other clusters (÷ X + Y − 2) of every cluster; flat (SB3 warns on 2-D boxes) |
    | ``pattern_peak`` | [n] | only with ``pattern_features=True``: per action, the most loaded |
    | | | of its clusters after adding f_cur/size there, minus the least such value over the |
    | | | legal actions of the same size, ÷ (k/D) (∈ [0, D]; D for a masked action) |

    ## Rewards
    0 on every step but the last (plus the shaping terms when ``shaping_weight`` > 0); the
    last pays −latency/latency_TP of the layer (``info["ratio"]`` is latency/latency_TP).

    ## Starting State
    ``reset`` draws a trace and a layer of the split uniformly with ``self.np_random``
    (``options={"layer": l, "trace_index": t}`` fixes them).

    ## Episode End
    Terminates after E decisions. Never truncates.

    ## Arguments
    model, setting, mesh, topology, conventions, batch, trace: the run (``RunSpec.resolve``;
    ``trace`` may also be a ``RoutingTrace``). trace_seeds: seeds of the synthetic traces
    (episodes are drawn over them). trace_requests, trace_tokens: synthetic trace size.
    split: ``"train"``, ``"heldout"`` or ``"all"`` layers (``heldout_every``). region_sizes:
    region pattern sizes. rho_mem: relative memory cap per layer (None: off). evaluator:
    ``PLACE_EVALUATORS``. score_steps: sampled steps of ``analytic``/``des``. eval_seed: seed of
    the evaluator streams (aggregators, sampled steps, the EP of the γ fit). shaping_weight: w
    of the potential. strict: raise on masked actions. pattern_features: add the
    ``pattern_peak`` key to the observation (the per-action criterion of ``greedy_balance``;
    off by default, so the default observation is unchanged).

    ## Version History
    * v1: initial version.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, *, model: str | ModelSpec = "deepseek-v2-lite", setting: str = "5/50",
                 mesh: str | tuple[int, int] = "4x8", topology: str = "mesh",
                 conventions: str = "faithful", batch: int = 128, trace: Any = "synthetic",
                 trace_seeds: Sequence[int] = (0,), trace_requests: int | None = None,
                 trace_tokens: int | None = None, split: str = "train", heldout_every: int = 4,
                 region_sizes: Sequence[int] = (2, 4, 8), rho_mem: float | None = None,
                 evaluator: str = "analytic", score_steps: int = 8, eval_seed: int = 0,
                 shaping_weight: float = 0.0, strict: bool = False,
                 pattern_features: bool = False, render_mode: str | None = None) -> None:
        if render_mode is not None:
            raise ConfigError("HdMoePlaceEnv has no render modes; pass render_mode=None")
        if evaluator not in PLACE_EVALUATORS:
            raise ConfigError(f"evaluator={evaluator!r}; expected one of {list(PLACE_EVALUATORS)}")
        if split not in ("train", "heldout", "all"):
            raise ConfigError(f"split={split!r}; expected 'train', 'heldout' or 'all'")
        if score_steps < 1:
            raise ConfigError(f"score_steps must be >= 1, got {score_steps}")
        if not (math.isfinite(shaping_weight) and shaping_weight >= 0):
            raise ConfigError(f"shaping_weight must be finite and >= 0, got {shaping_weight}")
        run = RunSpec.resolve(model=model, setting=setting, mesh=mesh, topology=topology,
                              conventions=conventions, batch=batch)
        self.run = run
        self.sim = MoESimulator(run.model, run.hardware, run.topology, run.conventions)
        model_spec, conv = self.sim.model, self.sim.conv
        self.model = model_spec
        self.batch = run.batch
        self.num_experts = E = model_spec.num_experts
        self.num_nodes = D = self.sim.num_nodes
        self.top_k = model_spec.top_k
        self.units = U = max(1, round(1.0 / share_unit(model_spec, conv)))
        self.evaluator = evaluator
        self.score_steps = int(score_steps)
        self.eval_seed = int(eval_seed)
        self.shaping_weight = float(shaping_weight)
        self.strict = bool(strict)
        self.pattern_features = bool(pattern_features)
        self.render_mode = render_mode

        if not isinstance(trace, str) and not hasattr(trace, "topk_ids"):
            raise ConfigError("trace must be 'synthetic', a path or a RoutingTrace")
        seeds = tuple(int(s) for s in trace_seeds) if trace == "synthetic" else (0,)
        if not seeds:
            raise ConfigError("trace_seeds must name at least one seed")
        self.traces = [load_trace(trace, model_spec, seed=s, requests=trace_requests,
                                  tokens=trace_tokens) for s in seeds]
        L = model_spec.num_moe_layers
        held = heldout_layers(L, heldout_every)
        layers = {"train": tuple(x for x in range(L) if x not in held), "heldout": held,
                  "all": tuple(range(L))}[split]
        if not layers:
            raise ConfigError(f"split {split!r} of {L} layers is empty; lower heldout_every")
        self.split, self.layers = split, layers
        self.episodes = [(t, layer) for t in range(len(self.traces)) for layer in layers]

        X, Y = self.sim.hw.mesh_shape
        rows_of, cols_of = np.divmod(np.arange(D), Y)
        #: bool [n, D] the clusters of every action's pattern
        self.patterns, names = holder_patterns((X, Y), U, region_sizes)
        self.action_patterns: tuple[str, ...] = names
        self.spread_action = len(names) - 1
        self.action_space = spaces.Discrete(len(names))
        self.cap_tiles: int | None = self._cap_tiles(rho_mem)

        coords = np.stack([rows_of, cols_of], axis=1).astype(np.float64)
        dist = np.abs(coords[:, None, :] - coords[None, :, :]).sum(axis=2)
        mean_dist = dist.sum(axis=1) / max(D - 1, 1) / max(X + Y - 2, 1)
        self._topology_obs = np.concatenate([rows_of / max(X - 1, 1), cols_of / max(Y - 1, 1),
                                             mean_dist]).astype(np.float32)
        obs_spaces = {
            "freqs": spaces.Box(0.0, 1.0, (E,), np.float32),
            "expert": spaces.Box(0.0, 1.0, (4,), np.float32),
            "coact": spaces.Box(0.0, float(self.top_k), (D,), np.float32),
            "load": spaces.Box(0.0, float(D), (D,), np.float32),
            "memory": spaces.Box(0.0, float(D), (D,), np.float32),
            "topology": spaces.Box(0.0, 1.0, (3 * D,), np.float32),
        }
        if self.pattern_features:
            obs_spaces["pattern_peak"] = spaces.Box(0.0, float(D), (len(names),), np.float32)
        self.observation_space = spaces.Dict(obs_spaces)
        self._cache: dict[tuple[int, int], _LayerData] = {}
        self._hops_cache: NDArray[np.float64] | None = None
        self._data: _LayerData | None = None
        self.layer = layers[0]
        self.trace_index = 0
        self._t = 0
        self._tiles = np.zeros((E, D), dtype=np.int64)   # tiles of expert i on cluster d
        self._node_tiles = np.zeros(D, dtype=np.int64)
        self._load = np.zeros(D)
        self._all_spread = True

    def _cap_tiles(self, rho_mem: float | None) -> int | None:
        """Return the memory cap in tiles per cluster and layer (None: no cap)."""
        E, D, U = self.num_experts, self.num_nodes, self.units
        caps = []
        if rho_mem is not None:
            if not (math.isfinite(rho_mem) and rho_mem > 0):
                raise ConfigError(f"rho_mem must be finite and > 0, got {rho_mem}")
            caps.append(math.floor(rho_mem * E * U / D + 1e-9))
        if self.sim.hw.node_dram_bytes is not None:
            # [decision] as the pipeline: every layer gets an equal share of each node's DRAM
            tile_bytes = perf.expert_bytes(self.model, self.sim.conv) / U
            caps.append(math.floor(self.sim.hw.node_dram_bytes / self.model.num_moe_layers
                                   / tile_bytes + 1e-9))
        cap = min(caps) if caps else None
        if cap is not None and cap * D < E * U:
            raise ConfigError(f"memory cap of {cap} tiles per cluster cannot hold the layer's "
                              f"{E * U} tiles on {D} clusters; raise rho_mem (>= 1 always "
                              "fits) or node_dram_gib")
        return cap

    # ------------------------------------------------------------------ layer data
    def _layer_data(self, trace_index: int, layer: int) -> _LayerData:
        key = (trace_index, layer)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        trace = self.traces[trace_index]
        rows = trace.view("content")
        ids = np.asarray(trace.topk_ids[layer, rows], dtype=np.int64)
        E = self.num_experts
        freqs = trace.layer_frequencies(layer, rows)
        order = np.lexsort((np.arange(E), -freqs)).astype(np.int64)
        onehot = np.zeros((ids.shape[0], E))
        np.put_along_axis(onehot, ids, 1.0, axis=1)
        pairs = onehot.T @ onehot / max(ids.shape[0], 1)
        np.fill_diagonal(pairs, 0.0)
        groups, group_freqs = trace.groups(layer, rows)
        ss = np.random.SeedSequence([self.eval_seed, trace_index, layer])
        s_steps, s_gamma, s_agg = ss.spawn(3)
        steps = gamma = None
        if self.evaluator != "static":
            rng = np.random.default_rng(s_steps)
            replace = ids.shape[0] < self.batch
            steps = np.stack([ids[rng.choice(ids.shape[0], size=self.batch, replace=replace)]
                              for _ in range(self.score_steps)])
        if self.evaluator == "analytic":
            g_rng = np.random.default_rng(s_gamma)
            ep = expert_parallel(layer + 1, E, self.num_nodes, g_rng)
            gamma = max(float(fit_gamma(self.sim, ep, layer, ids, self.batch, g_rng).gamma), 0.0)
        # spawned once: SeedSequence.spawn hands out new children on every call
        step_seeds = tuple(s_agg.spawn(self.score_steps)) if steps is not None else ()
        data = _LayerData(freqs, order, pairs, np.asarray(groups, dtype=np.int64), group_freqs,
                          steps, gamma, s_agg, step_seeds, 0.0)
        P_tp = tensor_parallel(1, E, self.num_nodes).P[0]
        tp_us = self._latency(data, layer, P_tp, identity_mapping(1, self.num_nodes)[0],
                              False)["latency_us"]
        data = dataclasses.replace(data, tp_us=tp_us)
        self._cache[key] = data
        return data

    def _latency(self, data: _LayerData, layer: int, P_layer: NDArray[np.float64],
                 pi_layer: NDArray[np.int64], allreduce: bool) -> dict[str, Any]:
        E, D = P_layer.shape
        L = self.model.num_moe_layers
        P = np.full((L, E, D), 1.0 / D)      # the other layers are TP: only `layer` is scored
        P[layer] = P_layer
        pi = identity_mapping(L, D)
        pi[layer] = pi_layer
        red = np.zeros(L, dtype=bool)
        red[layer] = allreduce
        placement = Placement(P=P, pi=pi, method="place-env", allreduce=red)
        placement.validate(self.model, self.sim.hw, self.sim.conv)   # shapes and tile grid
        if self.evaluator == "static":
            res = self.sim.layer_static(placement, layer, data.freqs, data.groups,
                                        data.group_freqs, self.batch,
                                        rng=np.random.default_rng(data.eval_seed))
            comp, comm, nm, mode = res.t_comp_s, res.t_comm_moe_s, res.t_nm_s, res.mode
        else:
            assert data.steps is not None
            ev = LayerEvaluator(self.sim, placement, self.batch, layers=(layer,))
            terms = [ev.evaluate(layer, sets, rng=np.random.default_rng(s),
                                 fidelity="analytic" if self.evaluator == "analytic" else "des",
                                 gamma=data.gamma)
                     for sets, s in zip(data.steps, data.step_seeds, strict=True)]
            comp = float(np.mean([r.t_comp_s for r in terms]))
            comm = float(np.mean([r.t_comm_moe_s for r in terms]))
            nm = float(np.mean([r.t_nm_s for r in terms]))
            mode = terms[0].mode
        return {"latency_us": (comp + comm) * 1e6, "compute_us": comp * 1e6,
                "comm_us": comm * 1e6, "nm_us": nm * 1e6, "mode": mode}

    # ------------------------------------------------------------------ public API
    def evaluate_placement(self, P_layer: NDArray[np.float64],
                           pi_layer: NDArray[np.int64] | None = None, allreduce: bool = False,
                           *, layer: int | None = None, trace_index: int | None = None
                           ) -> dict[str, Any]:
        """Score one layer placement with the env's evaluator and streams (the reward's terms).

        Args:
            P_layer: float [E, D] shares (on the profile's tile grid, or uniform TP rows).
            pi_layer: int [D] mapping (None: identity).
            allreduce: The layer is an all-reduce (tile-aligned TP) layer.
            layer: MoE layer (default: the current episode's).
            trace_index: Trace (default: the current episode's).

        Returns:
            ``latency_us`` (t_comp + t_comm_moe), ``compute_us``, ``comm_us``, ``nm_us``,
            ``mode``, ``tp_latency_us``, ``ratio`` (latency / TP's) and ``reward`` (−ratio).

        Raises:
            ConfigError: Bad shapes or shares off the tile grid.
        """
        layer = self.layer if layer is None else int(layer)
        trace_index = self.trace_index if trace_index is None else int(trace_index)
        data = self._layer_data(trace_index, layer)
        P_layer = np.asarray(P_layer, dtype=np.float64)
        if P_layer.shape != (self.num_experts, self.num_nodes):
            raise ConfigError(f"P_layer must have shape {(self.num_experts, self.num_nodes)}, "
                              f"got {P_layer.shape}")
        pi = identity_mapping(1, self.num_nodes)[0] if pi_layer is None else np.asarray(
            pi_layer, dtype=np.int64)
        if pi.shape != (self.num_nodes,):
            raise ConfigError(f"pi_layer must have shape ({self.num_nodes},), got {pi.shape}")
        out = self._latency(data, layer, P_layer, pi, bool(allreduce))
        out["tp_latency_us"] = data.tp_us
        out["ratio"] = out["latency_us"] / data.tp_us
        out["reward"] = -out["ratio"]
        return out

    def latency_lower_bound(self, *, layer: int | None = None, trace_index: int | None = None,
                            fixed: bool = False, grid_points: int = 64,
                            time_limit_s: float = 120.0) -> dict[str, float]:
        """Return a lower bound on ``evaluate_placement``'s latency over every placement.

        Valid for every layer placement whose shares are whole tiles (multiples of 1/U, the
        env's grid: every pattern of the action space, tile-aligned TP, the pipeline's
        placements), in dispatch mode or marked all-reduce, and for TP itself (whose latency is
        one candidate of the minimum). docs/results/headroom.md derives it; in short, per
        sampled step (``analytic`` / ``des``), with n_e the step's tokens of expert e, h_e its
        holders, τ the expert phase's time t_comp = max_c max(compute_c, stream_c):

        * total compute Σ_c compute_c ≥ Σ_e [G_e(I) + (h_e − 1)·m·o], G_e(c) the tile model's
          time of n_e tokens on c columns (``perf.gemm_tile_time``: rows padded to the token
          tile, one GEMM overhead per matrix and holder); total streaming Σ_i a_i·W_e/(BW·η);
          so τ ≥ either sum / D;
        * the largest holder of e has ≥ ⌈U/h_e⌉ tiles, so τ ≥ M_e(h_e) = max(G_e(⌈U/h_e⌉·I/U),
          ⌈U/h_e⌉/U · W_e/(BW·η)): h_e ≥ h_e(τ), the least h with M_e(h) ≤ τ;
        * a token t reaches |U_t| distinct holder clusters, |U_t| ≥ max_e∈S_t h_e and, as each
          cluster computes at most τ, |U_t| ≥ ⌈Σ_e∈S_t G_e(I) / τ⌉ (and the same for streaming);
          its aggregator is one of them, so each MoE phase carries ≥ |U_t| − 1 messages of the
          token. ``des``: a phase lasts at least its bytes over the injection capacity (D ports
          of ``ni_bw``, or every link) and one message's serialisation, plus α; ``analytic``:
          γ·κ·h·max_c V_c / BW_end with max_c V_c ≥ Σ_t |U_t| / D.
        * all-reduce (tile-aligned TP) layers pay TP's all-reduce instead of the phases.

        Minimising over τ (on a grid that holds every breakpoint of h_e(τ); between grid points
        the capacity term is taken at the interval's upper end) gives the step's bound; the
        layer's is the step mean, capped by TP's latency. The per-step minimum lets every step
        choose its own holder counts, while a placement is fixed over the steps; ``fixed=True``
        removes that freedom (below), which lifts the bound by < 0.5 % on the 12 cells of
        docs/results/headroom.md (the looseness lies in the node mean and the reach terms).
        ``static`` (expected loads) keeps the compute-only
        bound: the node mean of max(Σ_i (n_i·F_e/C + a_i·m·o), Σ_i a_i·W_e/(BW_mem·η)).

        ``fixed=True`` (sampled evaluators) shares the placement across the steps: a placement
        has one holder-count vector h ∈ {1..min(U, D)}^E and one mode for every step, so

            LB_fixed = min(TP, max(LB, min(min_h mean_s B_s(h), min_h mean_s C_s(h) + t_AR)))

        where B_s(h) is the per-step argument above with h_e fixed (τ_s ≥ M_e(h_e) for the
        step's active experts, the node-mean terms with these h_e, |U_t| ≥ max_e∈S_t h_e and
        ≥ ⌈work_t / τ_s⌉, the phases' terms) and C_s(h) its expert phase alone. As
        mean_s min_h ≤ min_h mean_s, LB_fixed ≥ LB. Each min over h is a MILP (SciPy's HiGHS,
        imported lazily; binaries z_e,h and one τ-interval choice per step on a grid of every
        breakpoint plus ``grid_points`` geometric points, capacity at the interval's upper end;
        intervals where a token would need more than D clusters are infeasible; one continuous
        reach per distinct expert set; the hop sum by the affine pieces of the lower convex
        hull of ``_nearest_hops``). Its value is HiGHS's best dual bound, never the incumbent,
        so a time limit keeps it valid. ``static`` returns LB.

        Args:
            layer: MoE layer (default: the current episode's).
            trace_index: Trace (default: the current episode's).
            fixed: Return the fixed-placement bound as ``lower_bound_us``.
            grid_points: Geometric τ points per step of the MILP (besides the breakpoints).
            time_limit_s: HiGHS's time limit per MILP (the dual bound stays valid).

        Returns:
            ``lower_bound_us``; ``compute_bound_us`` and ``stream_bound_us`` (step means of the
            two placement-independent sums / D, one overhead per active expert); for sampled
            evaluators ``dispatch_bound_us`` and ``allreduce_bound_us`` (the step means of the
            two modes' bounds); ``ratio`` (LB / TP's latency on the same steps). With
            ``fixed=True`` also ``perstep_bound_us`` (LB), ``fixed_dispatch_us`` and
            ``fixed_allreduce_us`` (the two MILPs' dual bounds, the latter + t_AR),
            ``fixed_gap`` (the larger relative MIP gap) and ``fixed_solve_s`` (CPU seconds).

        Raises:
            DependencyNotInstalled: ``fixed=True`` with a sampled evaluator and no SciPy.
        """
        layer = self.layer if layer is None else int(layer)
        trace_index = self.trace_index if trace_index is None else int(trace_index)
        data = self._layer_data(trace_index, layer)
        model, hw, conv = self.model, self.sim.hw, self.sim.conv
        E, D = self.num_experts, self.num_nodes
        if data.steps is None:                       # static: expected loads
            n = data.freqs * self.batch
            active = perf.expected_active(data.freqs, self.batch)[None, :]
            n = n[None, :]
        else:
            n = np.stack([np.bincount(s.ravel(), minlength=E)[:E] for s in data.steps]
                         ).astype(np.float64)
            active = (n > 0).astype(np.float64)
        work = n.sum(axis=1) * perf.expert_flops(model, conv) / hw.compute_flops
        if conv.tiled:
            work = work + active.sum(axis=1) * conv.expert_matrices * conv.gemm_overhead_s
        stream = (active.sum(axis=1) * perf.expert_bytes(model, conv)
                  / perf.effective_mem_bw(hw, conv)) if conv.weight_streaming else 0.0 * work
        out = {"compute_bound_us": float(work.mean()) / D * 1e6,
               "stream_bound_us": float(np.mean(stream)) / D * 1e6}
        if data.steps is None:
            out["lower_bound_us"] = float(np.maximum(work, stream).mean()) / D * 1e6
            if fixed:
                out["perstep_bound_us"] = out["lower_bound_us"]
        else:
            t_ar = self.sim.tp_allreduce(self.batch).time_s
            bounds = np.array([self._step_bound(sets, data.gamma) for sets in data.steps])
            out["dispatch_bound_us"] = float(bounds[:, 0].mean()) * 1e6
            out["allreduce_bound_us"] = (float(bounds[:, 1].mean()) + t_ar) * 1e6
            out["lower_bound_us"] = min(float(np.minimum(bounds[:, 0], bounds[:, 1] + t_ar
                                                         ).mean()) * 1e6, data.tp_us)
            if fixed:
                steps = [self._fixed_step_data(sets, grid_points) for sets in data.steps]
                disp = self._fixed_bound_milp(steps, data.steps, data.gamma, True, time_limit_s)
                ared = self._fixed_bound_milp(steps, data.steps, data.gamma, False, time_limit_s)
                out["perstep_bound_us"] = out["lower_bound_us"]
                out["fixed_dispatch_us"] = disp["value_us"]
                out["fixed_allreduce_us"] = ared["value_us"] + t_ar * 1e6
                out["fixed_gap"] = max(disp["gap"], ared["gap"])
                out["fixed_solve_s"] = disp["solve_s"] + ared["solve_s"]
                out["lower_bound_us"] = min(max(out["perstep_bound_us"],
                                                min(out["fixed_dispatch_us"],
                                                    out["fixed_allreduce_us"])), data.tp_us)
        out["ratio"] = out["lower_bound_us"] / data.tp_us
        return out

    def _step_terms(self, sets: NDArray[np.int64]) -> tuple[NDArray[np.bool_], NDArray[
            np.float64], NDArray[np.float64], float, float]:
        """Return one step's compute terms of the bounds (seconds; ``latency_lower_bound``).

        ``act`` bool [E] the active experts; ``total`` [E] G_e(I) (the expert's tokens on all
        columns); ``m_e`` [A, H] M_e(h) of the active experts for h = 1 … min(U, D) (the
        largest holder's compute or streaming, non-increasing in h); ``extra`` m·o, one
        holder's GEMM overheads (0 untiled); ``w_s`` one expert's streaming time (0 off).
        """
        model, hw, conv = self.model, self.sim.hw, self.sim.conv
        E, D, U = self.num_experts, self.num_nodes, self.units
        n = np.bincount(sets.ravel(), minlength=E)[:E].astype(np.float64)
        act = n > 0
        hs = np.arange(1, min(U, D) + 1)
        big = np.ceil(U / hs) / U                               # largest holder's share [H]
        if conv.tiled:
            total = perf.gemm_tile_time(n, model.expert_intermediate, model, hw, conv)
            m_e = perf.gemm_tile_time(n[:, None], big[None, :] * model.expert_intermediate,
                                      model, hw, conv)
            extra = conv.expert_matrices * conv.gemm_overhead_s
        else:
            total = n * perf.expert_flops(model, conv) / hw.compute_flops
            m_e = total[:, None] * big[None, :]
            extra = 0.0
        w_s = (perf.expert_bytes(model, conv) / perf.effective_mem_bw(hw, conv)
               if conv.weight_streaming else 0.0)
        m_e = np.maximum(m_e, act[:, None] * w_s * big[None, :])[act]       # [A, H] ↓ in h
        return act, total, m_e, float(extra), float(w_s)

    @staticmethod
    def _tau_grid(m_e: NDArray[np.float64], points: int
                  ) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        """Return the τ grid [K] of one step and h_e(τ) [K, A] on every [grid_k, grid_k+1).

        The grid holds every breakpoint M_e(h) of ``m_e`` [A, H] (any time unit) within
        [max_e M_e(H), max_e M_e(1)] and ``points`` geometric points; h_e(τ), the least h with
        M_e(h) ≤ τ, is constant between grid points since every breakpoint is one.
        """
        lo, hi = float(m_e[:, -1].max()), float(m_e[:, 0].max())
        grid = np.unique(np.concatenate([m_e.ravel(), np.geomspace(lo, hi, points)]))
        grid = grid[(grid >= lo) & (grid <= hi)]
        ok = m_e[None, :, :] <= grid[:, None, None] * (1.0 + 1e-12)
        return grid, np.argmax(ok, axis=2) + 1

    def _step_bound(self, sets: NDArray[np.int64], gamma: float | None) -> tuple[float, float]:
        """Return (dispatch-mode bound, all-reduce-mode expert phase bound) of one step, seconds.

        ``latency_lower_bound`` states the argument.
        """
        model, conv, topo = self.model, self.sim.conv, self.sim.topology
        E, D = self.num_experts, self.num_nodes
        act, total, m_e, extra, w_s = self._step_terms(sets)
        total_a = total[act]
        stream_mean = float(act.sum()) * w_s / D
        grid, h = self._tau_grid(m_e, 512)                                   # [K], [K, A]
        mean = np.maximum((total_a.sum() + (h - 1).sum(axis=1) * extra) / D, stream_mean)
        comp = np.maximum(grid, mean)                                        # [K]
        # capacity at the interval's upper end (the last interval is unbounded: no capacity)
        upper = np.append(grid[1:], np.inf)
        h_full = np.zeros((grid.size, E), dtype=np.int64)
        h_full[:, act] = h
        need = np.maximum(total[sets].sum(axis=1)[None, :],
                          act[sets].sum(axis=1)[None, :] * w_s) / upper[:, None]
        u_t = np.maximum(h_full[:, sets].max(axis=2), np.ceil(need - 1e-9))  # [K, B]
        u_t = np.maximum(u_t, 1.0)
        if self.evaluator == "des":
            comm = self._comm_bound(u_t, h_full, sets)
        else:                                        # analytic twin (γ ≥ 0)
            peak = np.ceil(u_t.sum(axis=1) / D - 1e-9)
            comm = (gamma or 0.0) * conv.kappa_a * model.hidden_size * peak / topo.bw_end_Bps \
                * (2.0 if conv.gamma_combine_only else 1.0)
        return float((comp + comm).min()), float(comp.min())

    def _fixed_step_data(self, sets: NDArray[np.int64], points: int) -> dict[str, Any]:
        """Return one step's terms of the fixed-placement bound (µs; ``latency_lower_bound``).

        Keys: ``act`` bool [E]; ``total`` (Σ_e∈A G_e(I)), ``extra`` (m·o), ``stream`` (the
        streaming node mean); ``grid`` [K] the τ points (every breakpoint of h_e(τ) and
        ``points`` geometric ones), ``hreq`` int [K, E] (h_e(τ) on [grid_k, grid_k+1); 0 for
        inactive experts), ``cap`` [K, B] (⌈work_t / grid_k+1⌉, ≥ 1); intervals where some
        token would need more than D clusters are dropped.
        """
        E, D = self.num_experts, self.num_nodes
        act, total, m_e, extra, w_s = self._step_terms(sets)
        m_e = m_e * 1e6                                                         # [A, H] µs
        grid, h = self._tau_grid(m_e, max(points, 2))
        hreq = np.zeros((grid.size, E), dtype=np.int64)
        hreq[:, act] = h
        upper = np.append(grid[1:], np.inf)
        need = np.maximum(total[sets].sum(axis=1), act[sets].sum(axis=1) * w_s) * 1e6  # [B]
        cap = np.maximum(np.ceil(need[None, :] / upper[:, None] - 1e-9), 1.0)       # [K, B]
        keep = (cap <= D).all(axis=1)
        return {"act": act, "total": float(total[act].sum()) * 1e6, "extra": extra * 1e6,
                "stream": float(act.sum()) * w_s / D * 1e6, "grid": grid[keep],
                "hreq": hreq[keep], "cap": cap[keep]}

    def _hops_hull(self) -> tuple[NDArray[np.float64], NDArray[np.float64]]:
        """Return (intercepts, slopes) of the lower convex hull of ``_nearest_hops`` (m ≥ 0)."""
        near = self._nearest_hops()
        pts: list[int] = []
        for j in range(near.size):               # monotone chain, lower hull
            while len(pts) >= 2:
                a, b = pts[-2], pts[-1]
                if (near[b] - near[a]) * (j - a) >= (near[j] - near[a]) * (b - a):
                    pts.pop()
                else:
                    break
            pts.append(j)
        xs = np.array(pts, dtype=np.float64)
        ys = near[pts]
        slopes = np.diff(ys) / np.diff(xs) if xs.size > 1 else np.zeros(1)
        inter = ys[:-1] - slopes * xs[:-1] if xs.size > 1 else np.zeros(1)
        return inter, slopes

    def _fixed_bound_milp(self, steps: list[dict[str, Any]], sets_all: NDArray[np.int64],
                          gamma: float | None, comm: bool, time_limit: float
                          ) -> dict[str, float]:
        """Solve min_h mean_s B_s(h) as a MILP (HiGHS via SciPy); the value is the dual bound.

        ``comm=False`` drops the communication terms (the all-reduce mode's expert phase).
        Returns ``value_us`` (HiGHS's best dual bound, µs), ``gap`` (relative MIP gap),
        ``solve_s`` (CPU seconds) and ``optimal`` (1.0 when solved to the gap tolerance).
        """
        import time

        try:
            from scipy.optimize import Bounds, LinearConstraint, milp
            from scipy.sparse import coo_matrix
        except ImportError as exc:
            raise DependencyNotInstalled('the fixed-placement bound needs SciPy (HiGHS); run '
                                         '`pip install "hdamoe-env[opt]"`') from exc

        model, conv, topo = self.model, self.sim.conv, self.sim.topology
        D, U = self.num_nodes, self.units
        H = min(U, D)
        S = len(steps)
        lb_v: list[float] = []
        ub_v: list[float] = []
        integ: list[int] = []
        cost: list[float] = []
        rows: list[tuple[dict[int, float], float, float]] = []

        def var(lo: float, hi: float, integer: bool = False, c: float = 0.0) -> int:
            lb_v.append(lo)
            ub_v.append(hi)
            integ.append(1 if integer else 0)
            cost.append(c)
            return len(lb_v) - 1

        def row(coefs: dict[int, float], lo: float, hi: float = np.inf) -> None:
            rows.append((coefs, lo, hi))

        used = np.flatnonzero(np.any([st["act"] for st in steps], axis=0))
        z = {int(e): [var(0, 1, True) for _ in range(H)] for e in used}
        for e in z:
            row({v: 1.0 for v in z[e]}, 1.0, 1.0)

        def h_expr(e: int, scale: float = 1.0) -> dict[int, float]:
            return {v: scale * (j + 1) for j, v in enumerate(z[e])}

        b = float(self.sim.msg_bytes)
        b_low, bp, split = b, b, False
        if conv.psum_combine:
            bp = float(model.hidden_size * conv.b_psum)
            if bp >= b:
                split = True
            else:
                b_low = bp
        bw = topo.link_bw_Bps
        ni = conv.ni_bw_for(topo.bw_end_Bps)
        links_cap = float(bw.size * bw.max())
        inject_cap = min(D * ni, links_cap) if ni and ni > 0 else links_cap
        bw_sum, bw_max = float(bw.sum()), float(bw.max())
        inter, slopes = self._hops_hull()
        for st, sets in zip(steps, sets_all, strict=True):
            K = st["grid"].size
            y = [var(0, 1, True) for _ in range(K)]
            row({v: 1.0 for v in y}, 1.0, 1.0)
            act_e = np.flatnonzero(st["act"])
            comp = var(st["stream"], np.inf, c=1.0 / S)
            row({comp: 1.0, **{v: -float(g) for v, g in zip(y, st["grid"], strict=True)}}, 0.0)
            if st["extra"] > 0:
                c = {comp: 1.0}
                for e in act_e:
                    for v, k in h_expr(int(e), -st["extra"] / D).items():
                        c[v] = c.get(v, 0.0) + k
                row(c, (st["total"] - st["extra"] * act_e.size) / D)
            else:
                row({comp: 1.0}, st["total"] / D)
            for e in act_e:                       # h_e ≥ h_e(τ_s)
                c = h_expr(int(e))
                for v, k in zip(y, st["hreq"][:, e], strict=True):
                    c[v] = c.get(v, 0.0) - float(k)
                row(c, 0.0)
            if not comm:
                continue
            # tokens with the same expert set are the same token: one variable, a multiplicity
            keys, inv, mult = np.unique(np.sort(sets, axis=1), axis=0, return_inverse=True,
                                        return_counts=True)
            inv = np.asarray(inv).ravel()
            first = np.array([int(np.flatnonzero(inv == i)[0]) for i in range(keys.shape[0])])
            us, hops, xs = [], [], []
            w = var(0, 1, True)
            for i, t in enumerate(first):
                u = var(1.0, float(D))
                us.append(u)
                for e in np.unique(keys[i]):
                    c = {u: 1.0}
                    for v, k in h_expr(int(e), -1.0).items():
                        c[v] = k
                    row(c, 0.0)
                c = {u: 1.0}
                for v, k in zip(y, st["cap"][:, t], strict=True):
                    c[v] = -float(k)
                row(c, 0.0)
                row({u: 1.0, w: -(D - 1.0)}, -np.inf, 1.0)
                if self.evaluator == "des":
                    hp = var(0.0, np.inf)
                    hops.append(hp)
                    for a, s in zip(inter, slopes, strict=True):   # hp ≥ a + s·(u − 1)
                        row({hp: 1.0, u: -float(s)}, float(a - s))
                    if split:
                        x = var(0.0, np.inf)
                        xs.append(x)
                        for e in np.unique(keys[i]):
                            c = {x: 1.0}
                            for v, k in h_expr(int(e), -(bp - b)).items():
                                c[v] = k
                            row(c, -(bp - b))
            m = mult.astype(np.float64)
            if self.evaluator != "des":
                coef = (gamma or 0.0) * conv.kappa_a * model.hidden_size / topo.bw_end_Bps \
                    * (2.0 if conv.gamma_combine_only else 1.0) * 1e6
                peak = var(0.0, np.inf, True, coef / S)
                row({peak: 1.0, **{u: -mi / D for u, mi in zip(us, m, strict=True)}}, 0.0)
                continue
            phases = []
            for bytes_per, with_x in ((b, False), (b_low, split)):
                p = var(0.0, np.inf)
                phases.append(p)
                xc = {x: -mi for x, mi in zip(xs, m, strict=True)} if with_x else {}
                c = {p: 1.0, **{u: -bytes_per * mi / inject_cap * 1e6
                                 for u, mi in zip(us, m, strict=True)}}
                for x, k in xc.items():
                    c[x] = k / inject_cap * 1e6
                row(c, -bytes_per * float(m.sum()) / inject_cap * 1e6)
                c = {p: 1.0, **{hp: -bytes_per * mi / bw_sum * 1e6
                                for hp, mi in zip(hops, m, strict=True)}}
                for x, k in xc.items():
                    c[x] = k / bw_sum * 1e6
                row(c, 0.0)
                row({p: 1.0, w: -min(b, b_low) / bw_max * 1e6}, 0.0)
            if conv.moe_comm == "dispatch+combine":
                cost[phases[0]] += 1.0 / S
                cost[phases[1]] += 1.0 / S
            else:
                cost[phases[1]] += 2.0 / S
            cost[w] += 2.0 * conv.msg_alpha_s * 1e6 / S

        r_i, c_i, vals, lo_r, hi_r = [], [], [], [], []
        for i, (coefs, lo, hi) in enumerate(rows):
            for j, v in coefs.items():
                r_i.append(i)
                c_i.append(j)
                vals.append(v)
            lo_r.append(lo)
            hi_r.append(hi)
        A = coo_matrix((vals, (r_i, c_i)), shape=(len(rows), len(lb_v))).tocsr()
        c0 = time.process_time()
        res = milp(np.array(cost), constraints=LinearConstraint(A, lo_r, hi_r),
                   integrality=np.array(integ), bounds=Bounds(lb_v, ub_v),
                   options={"time_limit": time_limit, "mip_rel_gap": 1e-6})
        solve_s = time.process_time() - c0
        dual = getattr(res, "mip_dual_bound", None)
        if dual is None or not np.isfinite(dual):
            dual = res.fun if res.status == 0 else -np.inf
        gap = float(getattr(res, "mip_gap", np.nan) or 0.0)
        return {"value_us": float(dual), "gap": gap, "solve_s": solve_s,
                "optimal": 1.0 if res.status == 0 else 0.0}

    def _nearest_hops(self) -> NDArray[np.float64]:
        """Return float [D]: entry j is the least Σ of hop counts from one cluster to j others.

        min over clusters a of the sum of the j smallest hop counts from a to the other
        clusters (the shortest candidate route of every pair): a token whose messages go from
        its aggregator to j distinct clusters crosses at least this many links, whatever the
        mapping.
        """
        if self._hops_cache is None:
            topo = self.sim.topology
            n = topo.num_endpoints
            lengths = np.diff(topo.route_ptr).astype(np.float64)
            ptr = topo.pair_route_ptr
            has = np.diff(ptr) > 0
            hops = np.zeros(n * n)
            starts = ptr[:-1][has]
            hops[has] = np.minimum.reduceat(lengths, starts) if starts.size else 0.0
            hops = hops.reshape(n, n)
            np.fill_diagonal(hops, np.inf)
            near = np.sort(hops, axis=1)[:, :n - 1]
            self._hops_cache = np.concatenate([[0.0], np.cumsum(near, axis=1).min(axis=0)])
        return self._hops_cache

    def _comm_bound(self, u_t: NDArray[np.float64], h: NDArray[np.int64],
                    sets: NDArray[np.int64]) -> NDArray[np.float64]:
        """Return the DES dispatch + combine bound [K] of one step (``latency_lower_bound``).

        Per phase: at least the phase's bytes over the injection capacity (D ports of
        ``ni_bw``, else all links), its hop-bytes over the links' total bandwidth, and one
        message's serialisation; plus α. Every token sends |U_t| − 1 messages per phase; under
        ``psum_combine``, at least max_e∈S_t,h_e≥2 h_e − 1 of its combine messages carry
        partial sums (``b_psum``), the rest ``b_msg``.
        """
        model, conv, topo = self.model, self.sim.conv, self.sim.topology
        D = self.num_nodes
        b = float(self.sim.msg_bytes)
        msgs = u_t - 1.0                                                       # [K, B]
        extra = np.zeros_like(msgs)
        b_low = b
        if conv.psum_combine:
            bp = float(model.hidden_size * conv.b_psum)
            if bp >= b:
                split = np.where(h >= 2, h, 0)                                   # [K, E]
                extra = np.maximum(split[:, sets].max(axis=2) - 1.0, 0.0) * (bp - b)
            else:
                b_low = bp
        bw = topo.link_bw_Bps
        ni = self.sim.conv.ni_bw_for(topo.bw_end_Bps)
        links_cap = float(bw.size * bw.max())
        inject_cap = min(D * ni, links_cap) if ni and ni > 0 else links_cap
        near = self._nearest_hops()[np.clip(msgs, 0, D - 1).astype(np.int64)]  # [K, B]
        phases = []
        for bytes_per, add in ((b, 0.0 * extra), (b_low, extra)):      # dispatch, combine
            vol = (msgs * bytes_per + add).sum(axis=1)
            hop_bytes = (near * bytes_per + add).sum(axis=1)
            phase = np.maximum.reduce([vol / inject_cap, hop_bytes / float(bw.sum()),
                                       np.full(vol.shape, min(b, b_low) / float(bw.max()))])
            phases.append(np.where(vol > 0, phase + conv.msg_alpha_s, 0.0))
        if conv.moe_comm == "dispatch+combine":
            return phases[0] + phases[1]
        return 2.0 * phases[1]                       # paper*: the combine, charged twice

    @property
    def expert_order(self) -> NDArray[np.int64]:
        """Experts of the current episode's layer in visiting order (descending f_i), int64 [E].

        Raises:
            InvalidAction: Before the first ``reset``.
        """
        if self._data is None:
            raise InvalidAction("expert_order needs an episode: call reset() first")
        return self._data.order.copy()

    @property
    def expert_frequencies(self) -> NDArray[np.float64]:
        """f_i of the current episode's layer (Σ = k), float [E] by expert id.

        Raises:
            InvalidAction: Before the first ``reset``.
        """
        if self._data is None:
            raise InvalidAction("expert_frequencies needs an episode: call reset() first")
        return self._data.freqs.copy()

    @property
    def node_load(self) -> NDArray[np.float64]:
        """Σ_placed j f_j·P[j, d]: expected compute load of every cluster so far, float [D]."""
        return self._load.copy()

    def placement_layer(self) -> tuple[NDArray[np.float64], bool]:
        """Return the shares built so far, float [E, D] (experts by id), and the all-reduce flag.

        Unplaced experts have zero rows. The flag is True when every expert is spread (the
        layer is then tile-aligned TP).
        """
        spread_all = self._t == self.num_experts and bool(self._all_spread)
        return self._tiles / self.units, spread_all

    def action_masks(self) -> NDArray[np.bool_]:
        """Return bool [n]: the patterns that keep every cluster within the memory cap."""
        if self.cap_tiles is None or self._t >= self.num_experts:
            return np.ones(self.action_space.n, dtype=bool)
        room = self.cap_tiles - self._node_tiles                                  # [D]
        U = self.units
        sizes = self.patterns.sum(axis=1)                                         # [n]
        need = -(-U // sizes)                                                     # ceil
        fits = np.all(~self.patterns | (room[None, :] >= need[:, None]), axis=1)
        fits[self.spread_action] = True
        return fits

    # ------------------------------------------------------------------ gymnasium
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, NDArray[np.float32]], dict[str, Any]]:
        """Start an episode on a layer of the split (``options``: ``layer``, ``trace_index``)."""
        super().reset(seed=seed)
        options = options or {}
        t_idx, layer = self.episodes[int(self.np_random.integers(len(self.episodes)))]
        if "trace_index" in options:
            t_idx = int(options["trace_index"])
            if not 0 <= t_idx < len(self.traces):
                raise ConfigError(f"trace_index {t_idx} not in [0, {len(self.traces)})")
        if "layer" in options:
            layer = int(options["layer"])
            if not 0 <= layer < self.model.num_moe_layers:
                raise ConfigError(f"layer {layer} not in [0, {self.model.num_moe_layers})")
        self.trace_index, self.layer = t_idx, layer
        self._data = self._layer_data(t_idx, layer)
        self._t = 0
        self._tiles[:] = 0
        self._node_tiles[:] = 0
        self._load[:] = 0.0
        self._all_spread = True
        return self._obs(), self._info()

    def step(self, action: Any) -> tuple[dict[str, NDArray[np.float32]], float, bool, bool,
                                         dict[str, Any]]:
        """Place the current expert with the pattern ``action``."""
        if self._data is None or self._t >= self.num_experts:
            raise InvalidAction("step() called before reset() or after the episode ended")
        a = discrete_action(action, int(self.action_space.n))
        mask = self.action_masks()
        coerced = not bool(mask[a])
        if coerced and self.strict:
            raise InvalidAction(f"action {a} ({self.action_patterns[a]}) exceeds the memory cap "
                                f"of {self.cap_tiles} tiles per cluster; see action_masks()")
        taken = self.spread_action if coerced else a
        data = self._data
        expert = int(data.order[self._t])
        phi_before = self._potential()
        self._place(expert, taken)
        self._all_spread = self._all_spread and taken == self.spread_action
        self._t += 1
        terminated = self._t == self.num_experts
        info = self._info()
        info.update(action=taken, requested_action=a, coerced=coerced, expert=expert,
                    pattern=self.action_patterns[taken])
        if terminated:
            P_layer, red = self.placement_layer()
            res = self.evaluate_placement(P_layer, None, red)
            info.update(res)
            # the keys HdMoE-v0's training callback logs (latency/total_us, total_over_tp)
            info.update(total_us=res["latency_us"], tp_total_us=res["tp_latency_us"])
            reward = res["reward"] - phi_before
        else:
            reward = self._potential() - phi_before
        return self._obs(), float(reward), terminated, False, info

    # ------------------------------------------------------------------ internals
    def _place(self, expert: int, action: int) -> None:
        U, tiles = self.units, self._tiles
        if action == self.spread_action:
            for _ in range(U):    # water-filling: fewest tiles, then the lower cluster
                d = int(np.argmin(self._node_tiles))
                tiles[expert, d] += 1
                self._node_tiles[d] += 1
        else:
            nodes = np.flatnonzero(self.patterns[action])
            base, extra = divmod(U, nodes.size)
            add = np.full(nodes.size, base, dtype=np.int64)
            if extra:
                rank = np.lexsort((nodes, self._node_tiles[nodes], self._load[nodes]))
                add[rank[:extra]] += 1
            tiles[expert, nodes] += add
            self._node_tiles[nodes] += add
        assert self._data is not None
        self._load += self._data.freqs[expert] * tiles[expert] / U

    def _potential(self) -> float:
        if self.shaping_weight == 0.0 or self._t >= self.num_experts:
            return 0.0
        return -self.shaping_weight * float(self._load.max()) / (self.top_k / self.num_nodes)

    def _obs(self) -> dict[str, NDArray[np.float32]]:
        assert self._data is not None
        data, E, D, k = self._data, self.num_experts, self.num_nodes, self.top_k
        f_sorted = data.freqs[data.order]
        t = min(self._t, E - 1)
        cur = int(data.order[t])
        placed = data.order[:self._t]
        done = self._t >= E
        coact = np.zeros(D)
        if not done and placed.size and data.freqs[cur] > 0:
            coact = data.pairs[cur, placed] @ (self._tiles[placed] / self.units) / data.freqs[cur]
        unplaced = float(f_sorted[self._t:].sum()) / k
        cap = 1.0 if self.cap_tiles is None else min(self.cap_tiles / (E * self.units), 1.0)
        even_tiles = E * self.units / D
        obs = {
            "freqs": np.clip(f_sorted, 0.0, 1.0).astype(np.float32),
            "expert": np.clip([self._t / E, 0.0 if done else data.freqs[cur], unplaced, cap],
                              0.0, 1.0).astype(np.float32),
            "coact": np.clip(coact, 0.0, k).astype(np.float32),
            "load": np.clip(self._load / (k / D), 0.0, D).astype(np.float32),
            "memory": np.clip(self._node_tiles / even_tiles, 0.0, D).astype(np.float32),
            "topology": self._topology_obs.copy(),
        }
        if self.pattern_features:
            obs["pattern_peak"] = self._pattern_peak(0.0 if done else float(data.freqs[cur]))
        return obs

    def _pattern_peaks(self, f_cur: float) -> NDArray[np.float64]:
        """Per action, the most loaded of its clusters after adding f_cur/size to each, [n]
        (``greedy_balance``'s criterion)."""
        pats = self.patterns
        after = self._load[None, :] + f_cur * pats / pats.sum(axis=1)[:, None]
        return np.where(pats, after, -np.inf).max(axis=1)

    def _pattern_peak(self, f_cur: float) -> NDArray[np.float32]:
        """The ``pattern_peak`` observation: ``_pattern_peaks`` relative to the best legal
        action of the same size."""
        D, pats = self.num_nodes, self.patterns
        sizes = pats.sum(axis=1)
        peak = self._pattern_peaks(f_cur)                                        # [n]
        legal = self.action_masks()
        rel = np.full(peak.shape, float(D))
        for size in np.unique(sizes):
            ok = legal & (sizes == size)
            if ok.any():
                rel[ok] = (peak[ok] - peak[ok].min()) / (self.top_k / D)
        return np.clip(rel, 0.0, D).astype(np.float32)

    def _info(self) -> dict[str, Any]:
        return {"action_mask": self.action_masks(), "layer": self.layer,
                "trace_index": self.trace_index, "split": self.split, "step": self._t,
                "evaluator": self.evaluator, "profile": self.sim.conv.name}


@dataclass(frozen=True)
class RandomSearch:
    """Result of :func:`random_search`.

    Attributes:
        best_ratio: Lowest latency/TP over the episodes.
        best_actions: The action sequence that reached it (experts in visiting order).
        best_placement: float [E, D] its shares, and its all-reduce flag.
        ratios: float [N] latency/TP of every episode, in order.
    """

    best_ratio: float
    best_actions: tuple[int, ...]
    best_placement: tuple[NDArray[np.float64], bool]
    ratios: NDArray[np.float64]


#: Samplers of :func:`random_search`.
RANDOM_SAMPLERS = ("kind", "uniform")


def random_search(env: HdMoePlaceEnv, episodes: int, rng: np.random.Generator, *,
                  layer: int | None = None, trace_index: int = 0,
                  sampler: str = "kind") -> RandomSearch:
    """Play ``episodes`` episodes of random legal actions on one layer; keep the best.

    A simple search reference over the env's action space (not a bound). ``sampler="uniform"``
    draws every decision uniformly over the unmasked patterns (on the 4×8 mesh 32 of the 61
    are whole-node patterns); ``"kind"`` [decision] first draws the pattern's size (node,
    each region size, spread) uniformly among the sizes with an unmasked pattern, then a
    pattern of that size uniformly.

    Args:
        env: The env (its evaluator scores the episodes).
        episodes: N >= 1.
        rng: The caller's generator.
        layer: MoE layer (None: the env draws one per episode from its split).
        trace_index: Trace of the env.
        sampler: ``RANDOM_SAMPLERS``.

    Raises:
        ConfigError: ``episodes`` < 1 or an unknown sampler.
    """
    if episodes < 1:
        raise ConfigError(f"episodes must be >= 1, got {episodes}")
    if sampler not in RANDOM_SAMPLERS:
        raise ConfigError(f"sampler={sampler!r}; expected one of {list(RANDOM_SAMPLERS)}")
    sizes = env.patterns.sum(axis=1)
    options: dict[str, Any] = {"trace_index": trace_index}
    if layer is not None:
        options["layer"] = layer
    ratios = np.empty(episodes)
    best: tuple[float, tuple[int, ...], tuple[NDArray[np.float64], bool]] | None = None
    for episode in range(episodes):
        env.reset(seed=int(rng.integers(2**31)), options=options)
        actions: list[int] = []
        terminated = False
        info: dict[str, Any] = {}
        while not terminated:
            legal = np.flatnonzero(env.action_masks())
            if sampler == "kind":
                kind = rng.choice(np.unique(sizes[legal]))
                legal = legal[sizes[legal] == kind]
            a = int(rng.choice(legal))
            actions.append(a)
            _, _, terminated, _, info = env.step(a)
        ratios[episode] = info["ratio"]
        if best is None or info["ratio"] < best[0]:
            best = (float(info["ratio"]), tuple(actions), env.placement_layer())
    assert best is not None
    return RandomSearch(best[0], best[1], best[2], ratios)


def greedy_balance(env: HdMoePlaceEnv, size: int, *, layer: int | None = None,
                   trace_index: int = 0) -> RandomSearch:
    """Play one episode of the longest-processing-time greedy over patterns of one size.

    Every expert (in the env's descending-frequency order) takes the legal pattern of ``size``
    clusters (1: a node, a region size, or D: spread) whose most loaded cluster
    (``node_load``) is least loaded after adding the expert's shares there (ties: the lower
    action); ``spread`` when no pattern of that size is legal. ``size`` 1 is an LPT
    expert-parallel placement, a region size a compute-balanced hybrid on the env's regions.

    Returns:
        A :class:`RandomSearch` of the one episode.

    Raises:
        ConfigError: No pattern of ``size`` clusters in the action space.
    """
    sizes = env.patterns.sum(axis=1)
    if not (sizes == size).any():
        raise ConfigError(f"no pattern of {size} clusters; sizes are {sorted(set(sizes))}")
    options: dict[str, Any] = {"trace_index": trace_index}
    if layer is not None:
        options["layer"] = layer
    env.reset(options=options)
    actions: list[int] = []
    terminated = False
    info: dict[str, Any] = {}
    while not terminated:
        legal = np.flatnonzero(env.action_masks() & (sizes == size))
        if legal.size == 0:
            a = env.spread_action
        else:
            expert = int(env.expert_order[len(actions)])
            peak = env._pattern_peaks(float(env.expert_frequencies[expert]))[legal]
            a = int(legal[int(np.argmin(peak))])
        actions.append(a)
        _, _, terminated, _, info = env.step(a)
    return RandomSearch(float(info["ratio"]), tuple(actions), env.placement_layer(),
                        np.array([info["ratio"]]))

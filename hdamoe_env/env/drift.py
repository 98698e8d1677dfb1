"""``HdMoeDriftEnv``: keep, re-place or replicate experts while the traffic drifts.

An episode is a stream of decode steps on one MoE layer (drawn per episode) whose routing
switches between *regimes*:

* ``regimes="synthetic"`` (default): R synthetic traces (``sim.sources.load_trace``) with the
  seeds ``regime_seed + r`` and the skew powers ``regime_skews`` (cycled), the expert ids of
  regime r ≥ 1 relabelled by a permutation drawn from ``SeedSequence([regime_seed, r])``
  [decision: the fitted generator keeps the hot experts of a layer across seeds, so without the
  relabelling the regimes would hardly differ];
* ``regimes="categories"``: the six task categories of the real Mixtral traces
  (``experts_<category>_mixtral.json`` in ``trace_dir``; read in place, never copied; the model
  must be ``mixtral-8x7b``; ``categories`` selects a subset); ``"auto"`` picks them when
  ``trace_dir`` exists, else synthetic.

Switch times are seeded: after every decode step the stream leaves its regime with probability
1/``mean_dwell`` (geometric dwell times, mean ``mean_dwell`` decode steps) for another regime drawn
uniformly. Every decode step routes ``batch`` rows drawn uniformly from the current regime's
trace at the episode's layer [decision: independent rows, no request persistence]. All draws
come from ``self.np_random`` (``reset(seed=...)``).

Every ``window`` (K, default 8) decode steps the agent picks one action of ``Discrete(1 + R')``:

* ``0 keep``: the placement stays, nothing moves;
* ``1 + j re-place r_j``: EPLB on the expert loads of the last window with ``redundancy[j]``
  redundant slots per node (default 0, 1, 2): S = ⌈E/D⌉ + r_j whole-expert slots per node,
  D·S physical experts (at most D copies of one expert), replicated greedily by load per copy
  and packed heaviest first to the least-loaded node that has room and lacks the expert — the
  two steps of ``baselines.eplb``, which live in the simulator (``hdamoe_env.sim.eplb``:
  ``eplb_layer``, re-exported here; ``baselines.eplb`` imports the same steps). New node labels
  are matched greedily to the old ones by overlap [decision: greedy, not Hungarian, to keep
  scipy out of the env]; every copy the new placement adds is one weight move of W_e bytes from
  the nearest old holder, dropped copies are free. The memory cap is not enforced [decision].

The moves of a re-placement run on the NoC with the message DES (``noc.des.simulate_messages``:
W_e bytes per move in ``move_chunks`` pipelined messages, the profile's hop latency, switching and
network-interface ports, as ``baselines.eplb_dynamic.simulate_moves``); their makespan is
charged to the window serially [decision: not overlapped, an upper bound, as the
``eplb-dynamic`` wrapper] and their NoC energy (link byte-hops × ``noc_pj_per_bit_hop``,
PHYSICS.md §18) is reported in ``info["move_energy_uj"]``.

Reward of a window: −(Σ_k t_k + t_move) / Σ_k t_k^TP, where t_k is the layer's MoE latency
(t_comp + t_comm_moe, the placement-dependent part; the non-MoE time is the same for every
placement) of decode step k under the current placement and t_k^TP the same step's under tensor
parallelism. With ``energy_weight`` w > 0 the reward also subtracts w·E_move / E_ref, E_ref the
NoC energy of moving every expert of the layer once one hop (a scale, not a physical cost).
The evaluator is the γ-calibrated analytic twin by default (``fidelity="analytic"``, γ fitted
once per layer on EP), the DES on request (``fidelity="des"``); ``info["fidelity"]`` says which.

Baselines in the same API (:func:`static_policy`, :func:`periodic_policy`,
:func:`threshold_policy`: each returns a function env → action for the next window) and
:func:`compare_policies` runs them on the same seeds.

May import: hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost, hdamoe_env.decisions,
hdamoe_env.sim, traces
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, InvalidAction
from hdamoe_env.env.actions import discrete_action
from hdamoe_env.config.run import RunSpec
from hdamoe_env.config.specs import ModelSpec
from hdamoe_env.cost import energy, perf
from hdamoe_env.noc.des import simulate_messages
from hdamoe_env.sim.calibrate import fit_gamma
from hdamoe_env.sim.eplb import eplb_layer
from hdamoe_env.sim.evaluator import LayerEvaluator
from hdamoe_env.sim.placement import Placement, expert_parallel, identity_mapping
from hdamoe_env.sim.simulator import MoESimulator
from hdamoe_env.sim.sources import load_trace

__all__ = ["DEFAULT_MIXTRAL_DIR", "DRIFT_FIDELITIES", "MIXTRAL_CATEGORIES", "HdMoeDriftEnv",
           "MOVE_CHARGES", "DriftHindsight", "compare_policies", "eplb_layer", "hindsight_oracle",
           "once_policy", "periodic_policy", "regime_policy", "static_policy", "threshold_policy",
           "total_variation"]

#: Evaluators of the window latency.
DRIFT_FIDELITIES = ("analytic", "des")
#: How a re-placement's weight moves are charged to the window: ``serial`` = their makespan
#: before the window's steps (no overlap: the pessimistic end); ``free`` = not at all (full
#: overlap with the rest of the decode step: the optimistic end).
MOVE_CHARGES = ("serial", "free")
#: The task categories of the real Mixtral traces (../shared/reference-traces/mixtral).
MIXTRAL_CATEGORIES = ("extraction", "humanities", "reasoning", "roleplay", "stem", "writing")
#: Where the real Mixtral traces are read from, relative to the working directory.
DEFAULT_MIXTRAL_DIR = "../shared/reference-traces/mixtral"

Policy = Callable[["HdMoeDriftEnv"], int]


def total_variation(p: ArrayLike, q: ArrayLike) -> float:
    """Return the total-variation distance ½·Σ|p/Σp − q/Σq| ∈ [0, 1] (0 on empty input)."""
    a = np.asarray(p, dtype=np.float64)
    b = np.asarray(q, dtype=np.float64)
    sa, sb = a.sum(), b.sum()
    if sa <= 0 or sb <= 0:
        return 0.0
    return float(0.5 * np.abs(a / sa - b / sb).sum())


def _relabel(old: NDArray[np.bool_], new: NDArray[np.bool_]) -> NDArray[np.bool_]:
    """Permute the node labels of ``new`` [E, D] to overlap ``old`` greedily (largest first)."""
    D = old.shape[1]
    overlap = new.T.astype(np.int64) @ old.astype(np.int64)        # [new node, old node]
    order = np.lexsort((np.arange(D * D), -overlap.ravel()))
    free_new = np.ones(D, dtype=bool)
    free_old = np.ones(D, dtype=bool)
    out = np.zeros_like(new)
    for flat in order:
        a, b = divmod(int(flat), D)
        if free_new[a] and free_old[b]:
            out[:, b] = new[:, a]
            free_new[a] = free_old[b] = False
    return out


class HdMoeDriftEnv(gym.Env[NDArray[np.float32], np.int64]):
    """Re-place or replicate experts of one MoE layer under drifting traffic.

    ## Description
    See the module docstring: a request stream switching between regimes, one decision per
    window of K decode steps; re-placements are charged their weight moves.

    ## Action Space
    ``Discrete(1 + len(redundancy))``: 0 keeps the placement, 1 + j re-places with EPLB on the
    last window's loads with ``redundancy[j]`` redundant slots per node. Every action is legal;
    ``action_masks()`` is all True.

    ## Observation Space
    ``Box`` float32 [E + D + 2 + len(redundancy)]:

    | slice | meaning | range |
    |---|---|---|
    | [0, E) | the last window's expert load histogram (executed copies / (K·B·k)) | [0, 1] |
    | [E, E+D) | the current placement's per-node load on those loads / (mean node load) | [0, D] |
    | E+D | drift: TV distance between the window's loads and the placement's build loads | [0, 1] |
    | E+D+1 | windows since the last re-placement / episode windows | [0, 1] |
    | the rest | one-hot of the current placement's redundancy level | {0, 1} |

    ## Rewards
    −(window latency incl. the weight moves' makespan, unless ``move_charge="free"``) / (the
    same window under TP);
    ``info["ratio"]`` is the ratio. ``energy_weight`` adds an energy term (module docstring).

    ## Starting State
    ``reset`` draws the layer (``options={"layer": l}`` fixes it) and the first regime; the
    placement is EPLB with ``redundancy[0]`` on the regimes' mean layer frequencies (a static
    offline placement), and the first window is observed under it (not scored).

    ## Episode End
    Terminates after ``num_windows`` decisions. Never truncates.

    ## Arguments
    model, setting, mesh, topology, conventions, batch: the run (``RunSpec.resolve``).
    regimes: ``"synthetic"``, ``"categories"`` or ``"auto"``. trace_dir: the real Mixtral traces.
    categories: the task categories used (default all six).
    num_regimes, regime_seed, regime_skews, trace_requests, trace_tokens: synthetic regimes.
    window: K decode steps per decision. num_windows: decisions per episode. mean_dwell: mean
    regime dwell, decode steps. redundancy: redundant slots per node of the re-place actions.
    layers: MoE layers episodes are drawn over (None: all). fidelity: ``DRIFT_FIDELITIES``.
    move_chunks: pipelined messages per moved expert. move_charge: ``MOVE_CHARGES``.
    energy_weight: w of the energy term. eval_seed: seed of the evaluator's aggregator
    streams and of the γ fit.

    ## Version History
    * v1: initial version.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, *, model: str | ModelSpec = "deepseek-v2-lite", setting: str = "5/50",
                 mesh: str | tuple[int, int] = "4x8", topology: str = "mesh",
                 conventions: str = "faithful", batch: int = 128, regimes: str = "synthetic",
                 trace_dir: str | os.PathLike[str] = DEFAULT_MIXTRAL_DIR,
                 categories: Sequence[str] = MIXTRAL_CATEGORIES, num_regimes: int = 4,
                 regime_seed: int = 0, regime_skews: Sequence[float] = (1.0, 1.5),
                 trace_requests: int | None = None, trace_tokens: int | None = None,
                 window: int = 8, num_windows: int = 16, mean_dwell: float = 32.0,
                 redundancy: Sequence[int] = (0, 1, 2), layers: Sequence[int] | None = None,
                 fidelity: str = "analytic", move_chunks: int = 8, move_charge: str = "serial",
                 energy_weight: float = 0.0,
                 eval_seed: int = 0, render_mode: str | None = None) -> None:
        if render_mode is not None:
            raise ConfigError("HdMoeDriftEnv has no render modes; pass render_mode=None")
        if fidelity not in DRIFT_FIDELITIES:
            raise ConfigError(f"fidelity={fidelity!r}; expected one of {list(DRIFT_FIDELITIES)}")
        if int(window) < 1 or int(num_windows) < 1:
            raise ConfigError(f"window and num_windows must be >= 1, got {window}, {num_windows}")
        if not (math.isfinite(mean_dwell) and mean_dwell >= 1):
            raise ConfigError(f"mean_dwell must be finite and >= 1 decode step, got {mean_dwell}")
        red = tuple(int(r) for r in redundancy)
        if not red or min(red) < 0 or len(set(red)) != len(red):
            raise ConfigError(f"redundancy must be distinct integers >= 0, got {redundancy!r}")
        if not (math.isfinite(energy_weight) and energy_weight >= 0):
            raise ConfigError(f"energy_weight must be finite and >= 0, got {energy_weight}")
        if int(move_chunks) < 1:
            raise ConfigError(f"move_chunks must be >= 1, got {move_chunks}")
        if move_charge not in MOVE_CHARGES:
            raise ConfigError(f"move_charge={move_charge!r}; expected one of {list(MOVE_CHARGES)}")
        run = RunSpec.resolve(model=model, setting=setting, mesh=mesh, topology=topology,
                              conventions=conventions, batch=batch)
        self.run = run
        self.sim = MoESimulator(run.model, run.hardware, run.topology, run.conventions)
        self.model = self.sim.model
        self.batch = run.batch
        self.num_experts = E = self.model.num_experts
        self.num_nodes = D = self.sim.num_nodes
        self.top_k = self.model.top_k
        self.window, self.num_windows = int(window), int(num_windows)
        self.mean_dwell = float(mean_dwell)
        self.redundancy = red
        self.fidelity = fidelity
        self.move_chunks = int(move_chunks)
        self.move_charge = move_charge
        self.energy_weight = float(energy_weight)
        self.eval_seed = int(eval_seed)
        self.render_mode = render_mode
        self.base_slots = -(-E // D)

        self.regime_source, self.regime_names, self._regime_rows = self._load_regimes(
            regimes, trace_dir, tuple(categories), int(num_regimes), int(regime_seed),
            tuple(float(s) for s in regime_skews), trace_requests, trace_tokens)
        L = self.model.num_moe_layers
        self.layers = tuple(range(L)) if layers is None else tuple(int(x) for x in layers)
        if not self.layers or not all(0 <= x < L for x in self.layers):
            raise ConfigError(f"layers must be MoE layers in [0, {L}), got {layers!r}")

        self._expert_bytes = float(perf.expert_bytes(self.model, self.sim.conv))
        conv = self.sim.conv
        self._hop_s = self.sim.hw.hop_latency_for(conv)
        self._espec = energy.energy_spec_for(conv)
        topo = self.sim.topology
        # one hop per expert: the scale of the energy term
        self._energy_ref_j = float(energy.noc_energy_j(E * self._expert_bytes, self._espec))

        self.action_space = spaces.Discrete(1 + len(red))
        self.action_names = ("keep",) + tuple(f"replace r={r}" for r in red)
        n_obs = E + D + 2 + len(red)
        low = np.zeros(n_obs, dtype=np.float32)
        high = np.ones(n_obs, dtype=np.float32)
        high[E:E + D] = float(D)
        self.observation_space = spaces.Box(low, high, dtype=np.float32)
        self._topo = topo
        self._gammas: dict[int, float] = {}
        self._tp_eval: dict[int, LayerEvaluator] = {}
        # episode state
        self.layer = self.layers[0]
        self.regime = 0
        self._t = -1                                       # windows scored; -1: no episode
        self._holds = np.zeros((E, D), dtype=bool)
        self._counts = np.ones(E, dtype=np.int64)
        self._level = 0
        self._built_on = np.zeros(E)
        self._since = 0
        self._replacements = 0
        self._window_loads = np.zeros(E)
        self._eval: LayerEvaluator | None = None

    # ------------------------------------------------------------------ regimes
    def _load_regimes(self, regimes: str, trace_dir: str | os.PathLike[str],
                      categories: tuple[str, ...], num_regimes: int,
                      regime_seed: int, skews: tuple[float, ...], requests: int | None,
                      tokens: int | None
                      ) -> tuple[str, tuple[str, ...], list[NDArray[np.int64]]]:
        """Return (source, names, per regime int64 [L, T, k] rows)."""
        if regimes not in ("synthetic", "categories", "auto"):
            raise ConfigError(f"regimes={regimes!r}; expected 'synthetic', 'categories' or 'auto'")
        have_dir = os.path.isdir(trace_dir)
        if regimes == "categories" or (regimes == "auto" and have_dir):
            if self.model.key != "mixtral-8x7b":
                raise ConfigError(f"regimes='categories' needs model='mixtral-8x7b' (the real "
                                  f"traces are Mixtral's), got {self.model.key!r}")
            if len(categories) < 2 or not set(categories) <= set(MIXTRAL_CATEGORIES) or len(
                    set(categories)) != len(categories):
                raise ConfigError(f"categories must be >= 2 distinct names of "
                                  f"{list(MIXTRAL_CATEGORIES)}, got {categories!r}")
            rows, names = [], []
            for cat in categories:
                path = os.path.join(os.fspath(trace_dir), f"experts_{cat}_mixtral.json")
                trace = load_trace(path, self.model)       # TraceFormatError names a missing file
                rows.append(np.asarray(trace.topk_ids[:, trace.view("content")], dtype=np.int64))
                names.append(cat)
            return "categories", tuple(names), rows
        if num_regimes < 2:
            raise ConfigError(f"num_regimes must be >= 2 for drift, got {num_regimes}")
        if not skews or not all(math.isfinite(s) and s > 0 for s in skews):
            raise ConfigError(f"regime_skews must be finite and > 0, got {skews!r}")
        rows, names = [], []
        for r in range(num_regimes):
            skew = skews[r % len(skews)]
            trace = load_trace("synthetic", self.model, seed=regime_seed + r,
                               requests=requests, tokens=tokens, skew=skew)
            ids = np.asarray(trace.topk_ids[:, trace.view("content")], dtype=np.int64)
            if r:
                perm = np.random.default_rng(np.random.SeedSequence([regime_seed, r])
                                             ).permutation(self.num_experts)
                ids = perm[ids]
            rows.append(ids)
            names.append(f"synthetic seed={regime_seed + r} skew={skew:g}")
        return "synthetic", tuple(names), rows

    def switch_regime(self, regime: int) -> None:
        """Switch the stream to ``regime`` from the next decode step (scripted scenarios, tests).

        Raises:
            ConfigError: ``regime`` not in [0, R).
        """
        if not 0 <= int(regime) < self.num_regimes:
            raise ConfigError(f"regime {regime} not in [0, {self.num_regimes})")
        self.regime = int(regime)

    @property
    def num_regimes(self) -> int:
        """R, the number of regimes."""
        return len(self._regime_rows)

    def regime_frequencies(self, regime: int, layer: int | None = None) -> NDArray[np.float64]:
        """Return f_i of a regime at a layer (Σ = k), float [E]."""
        layer = self.layer if layer is None else int(layer)
        ids = self._regime_rows[int(regime)][layer]
        return np.bincount(ids.ravel(), minlength=self.num_experts) / max(ids.shape[0], 1)

    # ------------------------------------------------------------------ evaluation
    def _placement(self, holds: NDArray[np.bool_] | None) -> Placement:
        """The full-model placement: TP everywhere, the episode's layer from ``holds``."""
        L, E, D = self.model.num_moe_layers, self.num_experts, self.num_nodes
        P = np.full((L, E, D), 1.0 / D)
        if holds is None:
            return Placement(P=P, pi=identity_mapping(L, D), method="drift-tp")
        primary = np.argmax(holds, axis=1)
        P[self.layer] = 0.0
        P[self.layer, np.arange(E), primary] = 1.0
        replicas = np.zeros((L, E, D), dtype=bool)
        replicas[self.layer] = holds
        replicas[self.layer, np.arange(E), primary] = False
        return Placement(P=P, pi=identity_mapping(L, D), method="drift-eplb",
                         replicas=replicas if replicas.any() else None)

    def _gamma(self) -> float | None:
        if self.fidelity != "analytic":
            return None
        g = self._gammas.get(self.layer)
        if g is None:
            rng = np.random.default_rng(np.random.SeedSequence([self.eval_seed, self.layer]))
            ep = expert_parallel(self.model.num_moe_layers, self.num_experts, self.num_nodes, rng)
            rows = np.concatenate([r[self.layer] for r in self._regime_rows])
            g = max(float(fit_gamma(self.sim, ep, self.layer, rows, self.batch, rng).gamma), 0.0)
            self._gammas[self.layer] = g
        return g

    def _latency_s(self, ev: LayerEvaluator, sets: NDArray[np.int64], seed: int) -> float:
        res = ev.evaluate(self.layer, sets, rng=np.random.default_rng(seed),
                          fidelity=self.fidelity, gamma=self._gamma())
        return float(res.t_comp_s + res.t_comm_moe_s)

    def _step_seed(self, step: int) -> int:
        """Seed of the aggregator draws of decode step ``step`` of the episode's layer."""
        return int(np.random.SeedSequence([self.eval_seed, self.layer, step])
                   .generate_state(1)[0])

    def _charged_s(self, move_s: float) -> float:
        """The part of a re-placement's move makespan charged to its window (``move_charge``)."""
        return move_s if self.move_charge == "serial" else 0.0

    def _energy_penalty(self, move_j: float) -> float:
        """The reward's energy term of a re-placement's moves (0 unless ``energy_weight``)."""
        return self.energy_weight * move_j / self._energy_ref_j

    def _moves(self, old: NDArray[np.bool_], new: NDArray[np.bool_]
               ) -> tuple[int, float, float]:
        """Return (moves, makespan s, NoC energy J) of turning holders ``old`` into ``new``."""
        src, dst = [], []
        topo = self._topo
        for i, d in np.argwhere(new & ~old):
            sources = np.flatnonzero(old[i])
            hops = [topo.route(int(s), int(d)).size for s in sources]
            src.append(int(sources[int(np.argmin(hops))]))
            dst.append(int(d))
        if not src:
            return 0, 0.0, 0.0
        conv = self.sim.conv
        res = simulate_messages(topo, np.array(src), np.array(dst),
                                np.full(len(src), self._expert_bytes),
                                hop_latency_s=self._hop_s, chunks=self.move_chunks,
                                switching=conv.switching, ni_bw_Bps=conv.ni_bw_for(topo.bw_end_Bps),
                                ni_latency_s=conv.ni_latency_for(self._hop_s))
        byte_hops = energy.link_byte_hops(res.link_busy_s, topo.link_bw_Bps)
        return len(src), float(res.makespan_s), float(energy.noc_energy_j(byte_hops, self._espec))

    def _build(self, loads: NDArray[np.float64], level: int) -> tuple[NDArray[np.int64],
                                                                       NDArray[np.bool_]]:
        counts, holds = eplb_layer(loads, self.num_nodes, self.base_slots + self.redundancy[level])
        return counts, _relabel(self._holds, holds) if self._holds.any() else holds

    # ------------------------------------------------------------------ stream
    def _next_sets(self) -> NDArray[np.int64]:
        """Draw one decode step's sets from the current regime, then maybe switch regime."""
        rows = self._regime_rows[self.regime][self.layer]
        sets = rows[self.np_random.integers(rows.shape[0], size=self.batch)]
        if self.np_random.random() < 1.0 / self.mean_dwell:
            other = int(self.np_random.integers(self.num_regimes - 1))
            self.regime = other + (other >= self.regime)
        return sets

    def _node_load(self, loads: NDArray[np.float64]) -> NDArray[np.float64]:
        counts = np.maximum(self._holds.sum(axis=1), 1)
        return self._holds.T.astype(np.float64) @ (loads / counts)

    @property
    def drift(self) -> float:
        """TV distance between the last window's loads and the loads the placement was built on."""
        return total_variation(self._window_loads, self._built_on)

    @property
    def windows_since_replace(self) -> int:
        """Windows since the last re-placement (since reset when none)."""
        return self._since

    @property
    def replacements(self) -> int:
        """Re-placements so far in the episode."""
        return self._replacements

    @property
    def holders(self) -> NDArray[np.bool_]:
        """bool [E, D]: the nodes holding a copy of every expert of the episode's layer."""
        return self._holds.copy()

    @property
    def window_index(self) -> int:
        """Windows scored so far in the episode."""
        return max(self._t, 0)

    def _obs(self) -> NDArray[np.float32]:
        D = self.num_nodes
        total = self._window_loads.sum()
        hist = self._window_loads / total if total > 0 else self._window_loads
        node = self._node_load(self._window_loads)
        node = node / (node.sum() / D) if node.sum() > 0 else node
        onehot = np.zeros(len(self.redundancy))
        onehot[self._level] = 1.0
        obs = np.concatenate([hist, np.minimum(node, D), [self.drift],
                              [min(self._since / self.num_windows, 1.0)], onehot])
        return obs.astype(np.float32)

    def _info(self) -> dict[str, Any]:
        return {"layer": self.layer, "regime": self.regime,
                "regime_name": self.regime_names[self.regime],
                "regime_source": self.regime_source, "fidelity": self.fidelity,
                "drift": self.drift, "window": self.window_index,
                "redundancy": self.redundancy[self._level]}

    def action_masks(self) -> NDArray[np.bool_]:
        """Return bool [n]: all True (every action of the space is legal)."""
        return np.ones(self.action_space.n, dtype=bool)

    # ------------------------------------------------------------------ gymnasium
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[NDArray[np.float32], dict[str, Any]]:
        """Start a stream: draw the layer and the first regime, build the static placement."""
        super().reset(seed=seed)
        options = options or {}
        layer = self.layers[int(self.np_random.integers(len(self.layers)))]
        if "layer" in options:
            layer = int(options["layer"])
            if not 0 <= layer < self.model.num_moe_layers:
                raise ConfigError(f"layer {layer} not in [0, {self.model.num_moe_layers})")
        self.layer = layer
        self.regime = int(self.np_random.integers(self.num_regimes))
        if "regime" in options:
            self.regime = int(options["regime"])
            if not 0 <= self.regime < self.num_regimes:
                raise ConfigError(f"regime {self.regime} not in [0, {self.num_regimes})")
        mean_f = np.mean([self.regime_frequencies(r) for r in range(self.num_regimes)], axis=0)
        self._holds = np.zeros((self.num_experts, self.num_nodes), dtype=bool)
        self._level = 0
        self._counts, self._holds = self._build(mean_f, 0)
        self._built_on = mean_f
        self._eval = LayerEvaluator(self.sim, self._placement(self._holds), self.batch,
                                    layers=(self.layer,))
        if self.layer not in self._tp_eval:
            self._tp_eval[self.layer] = LayerEvaluator(self.sim, self._placement(None),
                                                       self.batch, layers=(self.layer,))
        self._since = 0
        self._replacements = 0
        self._window_loads = np.zeros(self.num_experts)
        for _ in range(self.window):                       # a warm-up window, observed only
            self._window_loads += np.bincount(self._next_sets().ravel(),
                                              minlength=self.num_experts)
        self._t = 0
        return self._obs(), self._info()

    def step(self, action: Any) -> tuple[NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        """Apply the decision, then run and score the next window of K decode steps."""
        if self._t < 0 or self._t >= self.num_windows:
            raise InvalidAction("step() called before reset() or after the episode ended")
        a = discrete_action(action, int(self.action_space.n))
        n_moves, move_s, move_j = 0, 0.0, 0.0
        if a > 0:
            loads = self._window_loads / (self.window * self.batch)    # f_i of the window
            counts, holds = self._build(loads, a - 1)
            n_moves, move_s, move_j = self._moves(self._holds, holds)
            self._counts, self._holds, self._level = counts, holds, a - 1
            self._built_on = loads
            self._eval = LayerEvaluator(self.sim, self._placement(holds), self.batch,
                                        layers=(self.layer,))
            self._since = 0
            self._replacements += 1
        else:
            self._since += 1
        assert self._eval is not None
        tp_eval = self._tp_eval[self.layer]
        lat = tp = 0.0
        self._window_loads = np.zeros(self.num_experts)
        base = self._t * self.window
        for k in range(self.window):
            sets = self._next_sets()
            self._window_loads += np.bincount(sets.ravel(), minlength=self.num_experts)
            seed = self._step_seed(base + k)
            lat += self._latency_s(self._eval, sets, seed)
            tp += self._latency_s(tp_eval, sets, seed)
        charged = self._charged_s(move_s)
        ratio = (lat + charged) / tp
        reward = -ratio - self._energy_penalty(move_j)
        self._t += 1
        terminated = self._t >= self.num_windows
        info = self._info()
        info.update(action=a, action_name=self.action_names[a], ratio=ratio,
                    window_us=(lat + charged) * 1e6, tp_window_us=tp * 1e6,
                    move_us=move_s * 1e6, charged_move_us=charged * 1e6, moves=n_moves,
                    move_energy_uj=move_j * 1e6)
        # the keys HdMoE-v0's training callback logs (latency/total_us, latency/total_over_tp)
        info.update(total_us=info["window_us"], tp_total_us=info["tp_window_us"])
        return self._obs(), float(reward), terminated, False, info


# ---------------------------------------------------------------------------------- baselines
def static_policy() -> Policy:
    """Never re-place: the reset's offline EPLB placement all episode."""
    return lambda env: 0


def periodic_policy(period_steps: int, redundancy_level: int = 0) -> Policy:
    """Re-place every ``period_steps`` decode steps (``eplb-dynamic@N``; a multiple of K).

    Raises:
        ConfigError: ``period_steps`` < 1.
    """
    if int(period_steps) < 1:
        raise ConfigError(f"period_steps must be >= 1, got {period_steps}")

    def act(env: HdMoeDriftEnv) -> int:
        every = max(1, round(int(period_steps) / env.window))
        return 1 + redundancy_level if (env.window_index + 1) % every == 0 else 0
    return act


def threshold_policy(threshold: float = 0.15, redundancy_level: int = 0,
                     cooldown_windows: int = 0) -> Policy:
    """Re-place when the drift statistic (TV distance) exceeds ``threshold``.

    With ``cooldown_windows`` = C > 0, not again within C windows of the last re-placement
    (the first re-placement of an episode is never held back; C ≥ the episode's windows: at
    most once per episode).

    Raises:
        ConfigError: ``threshold`` not in [0, 1], or ``cooldown_windows`` < 0.
    """
    if not 0.0 <= float(threshold) <= 1.0:
        raise ConfigError(f"threshold must be in [0, 1], got {threshold}")
    if int(cooldown_windows) < 0:
        raise ConfigError(f"cooldown_windows must be >= 0, got {cooldown_windows}")
    t, c = float(threshold), int(cooldown_windows)

    def act(env: HdMoeDriftEnv) -> int:
        ready = env.replacements == 0 or env.windows_since_replace >= c
        return 1 + redundancy_level if env.drift > t and ready else 0
    return act


def once_policy(window: int, redundancy_level: int = 0) -> Policy:
    """Re-place once, at decision ``window`` of every episode (an open-loop schedule).

    Raises:
        ConfigError: ``window`` < 0.
    """
    if int(window) < 0:
        raise ConfigError(f"window must be >= 0, got {window}")
    w = int(window)

    def act(env: HdMoeDriftEnv) -> int:
        return 1 + redundancy_level if env.window_index == w and env.replacements == 0 else 0
    return act


def regime_policy(redundancy_level: int = 0, max_replacements: int = 1,
                  delay_windows: int = 0) -> Policy:
    """Re-place when the stream's *true* regime differs from the one last re-placed for.

    A privileged reference, not an agent: it reads ``env.regime`` (the stream's current
    regime, that of the last decode step), which the observation does not contain. It knows the
    present but not the future, so it estimates what a causal policy could gain from
    recognising regimes perfectly. A re-placement waits until the regime has lasted
    ``delay_windows`` further windows (its build window then holds only that regime) and stops
    after ``max_replacements`` per episode. The policy keeps its memory in the closure and
    clears it at every episode's first decision, so one instance serves one env at a time.

    Raises:
        ConfigError: ``max_replacements`` < 1 or ``delay_windows`` < 0.
    """
    if int(max_replacements) < 1:
        raise ConfigError(f"max_replacements must be >= 1, got {max_replacements}")
    if int(delay_windows) < 0:
        raise ConfigError(f"delay_windows must be >= 0, got {delay_windows}")
    state = {"placed_for": -1, "current": -1, "seen": 0}

    def act(env: HdMoeDriftEnv) -> int:
        if env.window_index == 0:
            state.update(placed_for=-1, current=env.regime, seen=0)
        if env.regime != state["current"]:
            state.update(current=env.regime, seen=0)
        state["seen"] += 1
        if (env.replacements < int(max_replacements) and env.regime != state["placed_for"]
                and state["seen"] > int(delay_windows)):
            state["placed_for"] = env.regime
            return 1 + redundancy_level
        return 0
    return act


def compare_policies(env: HdMoeDriftEnv, policies: Mapping[str, Policy], seeds: Sequence[int],
                     *, on_step: Callable[[str, int, int, dict[str, Any]], None] | None = None
                     ) -> dict[str, dict[str, float]]:
    """Run every policy on the same seeds; return per policy the mean reward per window, the
    mean window ratio to TP (``ratio``; ``ratio_no_moves`` without the moves' makespan), the
    mean moves per episode and the mean move time per window (µs).

    ``on_step(policy name, seed, window index, info)`` runs after every env step (e.g. a
    TensorBoard writer, ``benchmarks/drift_baselines.py --tensorboard``).
    """
    out: dict[str, dict[str, float]] = {}
    for name, policy in policies.items():
        rewards, ratios, bare, moves, move_us = [], [], [], [], []
        for seed in seeds:
            env.reset(seed=int(seed))
            done, n = False, 0
            while not done:
                _, r, term, trunc, info = env.step(policy(env))
                if on_step is not None:
                    on_step(name, int(seed), int(info["window"]) - 1, info)
                rewards.append(r)
                ratios.append(info["ratio"])
                bare.append((info["window_us"] - info["charged_move_us"]) / info["tp_window_us"])
                move_us.append(info["move_us"])
                n += info["moves"]
                done = term or trunc
            moves.append(n)
        out[name] = {"reward": float(np.mean(rewards)), "ratio": float(np.mean(ratios)),
                     "ratio_no_moves": float(np.mean(bare)),
                     "moves_per_episode": float(np.mean(moves)),
                     "move_us_per_window": float(np.mean(move_us))}
    return out


@dataclass(frozen=True)
class DriftHindsight:
    """Result of :func:`hindsight_oracle` on one episode (one seed).

    Attributes:
        actions: The action of every window, as the dynamic programme chose them.
        ratio: Mean window ratio to TP with the moves, of ``actions`` replayed in the env
            (``compare_policies``' ``ratio``).
        reward: Mean reward per window of the replay.
        moves: Weight moves of the replay.
        dp_ratio: The programme's own value (mean window ratio; equals ``ratio`` up to
            rounding).
        free_ratio: Mean over the windows of the fastest placement the programme's states
            hold by then, moves free: what re-placement could give if moving were free.
        static_ratio: Mean window ratio of never re-placing (the same stream).
    """

    actions: tuple[int, ...]
    ratio: float
    reward: float
    moves: int
    dp_ratio: float
    free_ratio: float
    static_ratio: float


def _record_stream(env: HdMoeDriftEnv) -> tuple[list[list[NDArray[np.int64]]], list[list[int]]]:
    """Return the episode's decode-step sets and aggregator seeds per window; the env's stream
    state is restored (the stream does not depend on the actions)."""
    state = copy.deepcopy(env.np_random.bit_generator.state)
    regime = env.regime
    sets, seeds = [], []
    for w in range(env.num_windows):
        sets.append([env._next_sets() for _ in range(env.window)])
        seeds.append([env._step_seed(w * env.window + k) for k in range(env.window)])
    env.np_random.bit_generator.state = state
    env.regime = regime
    return sets, seeds


def hindsight_oracle(env: HdMoeDriftEnv, seed: int,
                     options: dict[str, Any] | None = None) -> DriftHindsight:
    """Choose every window's action knowing the whole stream, by dynamic programming.

    The stream (regimes, rows, aggregator seeds) does not depend on the actions, so it is
    recorded once. A placement is the reset's, or the EPLB placement one decision built on
    the previous window's loads at one redundancy level: state (j, r) = last re-placement at
    decision j with level r. The programme minimises Σ_w (window latency + move makespan) / TP
    latency (+ the energy term when ``energy_weight`` > 0) over keep / re-place transitions.
    The env relabels every new placement against the one it replaces, so a state's placement
    depends on the path: the programme keeps, per state, the placement of its best path and
    scores windows and moves on it exactly (node labels move the replica dispatch's ties and
    the moves' hops). Keeping one path per state is where it can miss the optimum (a worse
    path to a state may hold better labels). The chosen actions are then replayed in the env
    and ``ratio`` is the replay's value (an achievable sequence: its headroom over a policy
    is a lower bound on the optimum's).

    Args:
        env: The drift env (its episode is reset with ``seed`` and ``options``).
        seed: Episode seed.
        options: ``reset`` options (``layer``, ``regime``).

    Returns:
        The :class:`DriftHindsight`.
    """
    env.reset(seed=int(seed), options=options)
    sets, seeds = _record_stream(env)
    W, K, B, D = env.num_windows, env.window, env.batch, env.num_nodes
    loads_before = [env._window_loads.copy()]
    for w in range(W - 1):
        loads_before.append(sum(np.bincount(x.ravel(), minlength=env.num_experts)
                                for x in sets[w]).astype(np.float64))
    tp_eval = env._tp_eval[env.layer]
    tp = [sum(env._latency_s(tp_eval, x, sd) for x, sd in zip(sets[w], seeds[w], strict=True))
          for w in range(W)]
    evals: dict[bytes, LayerEvaluator] = {}
    lat_cache: dict[tuple[bytes, int], float] = {}

    def lat(held: NDArray[np.bool_], w: int) -> float:
        key = held.tobytes()
        if (key, w) not in lat_cache:
            if key not in evals:
                evals[key] = LayerEvaluator(env.sim, env._placement(held), B, layers=(env.layer,))
            lat_cache[(key, w)] = sum(env._latency_s(evals[key], x, sd)
                                      for x, sd in zip(sets[w], seeds[w], strict=True)) / tp[w]
        return lat_cache[(key, w)]

    def moved(old: NDArray[np.bool_], raw: NDArray[np.bool_], w: int
              ) -> tuple[float, NDArray[np.bool_]]:
        new = _relabel(old, raw)
        _, move_s, move_j = env._moves(old, new)
        return env._charged_s(move_s) / tp[w] + env._energy_penalty(move_j), new

    # state -> (value, actions, the placement its best path holds in the env)
    Entry = tuple[float, tuple[int, ...], NDArray[np.bool_]]
    init = env._holds.copy()
    value: dict[Any, Entry] = {"init": (0.0, (), init)}
    free = 0.0
    for w in range(W):
        nxt: dict[Any, Entry] = {s: (v + lat(held, w), acts + (0,), held)
                                 for s, (v, acts, held) in value.items()}
        f = loads_before[w] / (K * B)
        for r in range(len(env.redundancy)):
            raw = eplb_layer(f, D, env.base_slots + env.redundancy[r])[1]
            best: Entry | None = None
            for v, acts, held in value.values():
                cost, new = moved(held, raw, w)
                total = v + cost + lat(new, w)
                if best is None or total < best[0]:
                    best = (total, acts + (1 + r,), new)
            assert best is not None
            nxt[(w, r)] = best
        free += min(lat(held, w) for _, _, held in nxt.values())
        value = nxt
    dp_value, actions, _ = min(value.values(), key=lambda t: t[0])
    static_ratio = sum(lat(init, w) for w in range(W)) / W
    env.reset(seed=int(seed), options=options)
    ratios, rewards, moves = [], [], 0
    for a in actions:
        _, r, _, _, info = env.step(a)
        ratios.append(info["ratio"])
        rewards.append(r)
        moves += int(info["moves"])
    return DriftHindsight(actions=tuple(int(a) for a in actions), ratio=float(np.mean(ratios)),
                          reward=float(np.mean(rewards)), moves=moves, dp_ratio=dp_value / W,
                          free_ratio=free / W, static_ratio=static_ratio)

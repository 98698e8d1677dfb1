"""Gymnasium environment: one MoE layer of one decode step per ``step`` (paper-model.md §10–11).

The env translates actions into simulator decisions and results into observations, reward and
``info`` (style.md R1, R10). The physics lives below it: routing and batching in ``traces``; the
trace, its router scores and a decode step's candidates in ``hdamoe_env.sim.sources``; the
next-layer predictors in ``hdamoe_env.decisions.prediction``; the online decisions — gating,
dispatch, pre-broadcast traffic, broadcast plans and slots and the excess charge — in
``hdamoe_env.sim.online.DecisionEvaluator`` (built on ``hdamoe_env.decisions``,
``hdamoe_env.noc.broadcast`` and ``hdamoe_env.cost.broadcast``); placement checks in
``MoESimulator``; the γ fit of the analytic twin and its cache in ``hdamoe_env.sim.calibrate``;
the per-layer latency in ``hdamoe_env.sim.evaluator.LayerEvaluator``; the DES in
``hdamoe_env.noc.des`` / ``hdamoe_env.noc.linksim``. Configuration: ``EnvConfig``. Registered
as ``hdamoe_env/HdMoE-v1``. The module is longer than 700 lines because ``HdMoeEnv``'s class
docstring is the env's manual (Gymnasium's headings: spaces, reward, episode end, version
history; about 130 lines) and the action decoding with its masks and coercion belongs to the
env; the arguments are documented once, in ``EnvConfig``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError, InvalidAction
from hdamoe_env.config.run import check_seed
from hdamoe_env.cost.broadcast import BroadcastPlan
from hdamoe_env.cost.energy import EnergyBreakdown
from hdamoe_env.decisions import dispatch, gating
from hdamoe_env.decisions.prediction import StepPredictor
from hdamoe_env.env import render
from hdamoe_env.env.config import INVALID_ACTION_MODES, PREDICTORS, EnvConfig
from hdamoe_env.sim import calibrate, sources
from hdamoe_env.sim.placement import Placement, placement_by_name, tensor_parallel
from hdamoe_env.sim.simulator import LayerResult, MoESimulator, check_trace
from traces import RoutingTrace, batching

__all__ = ["ENV_ID", "INVALID_ACTION_MODES", "PREDICTORS", "EnvConfig", "HdMoeEnv"]

logger = logging.getLogger(__name__)

ENV_ID = "hdamoe_env/HdMoE-v1"


class HdMoeEnv(gym.Env[dict[str, NDArray[np.float32]], NDArray[np.int64]]):
    """MoE decode on a 3D near-memory-processing chip, one MoE layer per step (HDA-MoE online).

    ## Description

    B concurrent request streams decode token by token on an X×Y chip of compute-near-memory
    nodes joined by a NoC (paper-model.md §5). Every env step executes one MoE layer of one decode
    step: the router's scores of the layer's B tokens are (optionally) re-ranked by
    hardware-aware gating (§11), up to k_b experts of the layer have been pre-broadcast to every
    node during the previous layer (§10.3–10.5; their traffic is simulated on the NoC links), the
    tokens of broadcast experts are dispatched to nodes by a dispatch rule (§10.6), and the layer's
    latency t_nm + t_comp + t_comm_moe (+ broadcast time exceeding its budget) is evaluated with
    the discrete-event NoC simulator or its γ-calibrated analytic twin (§5.5, §6). The offline
    placement (TP, EP, or any ``Placement``) is fixed. An episode is ``steps_per_episode`` decode
    steps × L layers.

    ## Action Space

    ``MultiDiscrete([E+1] * max_broadcast + [len(dispatch_rules), len(gating_levels)])``:

    | index | meaning |
    |---|---|
    | 0 .. max_broadcast−1 | pre-broadcast slot: expert e < E, or E = none |
    | max_broadcast | dispatch rule: index into ``dispatch_rules`` |
    | max_broadcast + 1 | gating level: index into ``gating_levels`` |
    | max_broadcast + 2 | only with redundant experts: replica rule, index into ``replica_rules`` |

    A slot value e < E replicates expert e on every node for the current layer (conceptually
    broadcast during the previous layer). The dispatch rule places the (token, broadcast expert)
    pairs (§10.6). A gating level multiplies the default (r_comp, r_comm) of §11.7 (0 = plain
    top-k). A placement with redundant experts (``Placement.replicas``) adds the last
    dimension: the rule that sends each token of a replicated expert to one of its copies
    (``dispatch.dispatch_replicas``; ``replica_rules``, index 0 = ``replica_rule``); without
    replicas the space is exactly the one above.

    Masks (``action_masks()``, repeated in ``info["action_mask"]``; the flat concatenation of the
    per-dimension masks, for sb3-contrib's MaskablePPO; ``action_mask_tuple()`` gives them per
    dimension for ``MultiDiscrete.sample(mask=...)``): slots ≥ k_b of the layer allow only
    "none"; layer 0 allows no broadcast (k_b = 0); experts already held by every node (TP-split
    over all D) are masked. Through ``gymnasium.make``'s wrappers reach them with
    ``env.unwrapped.action_masks()`` or ``env.get_wrapper_attr("action_masks")()``.

    Every element of the action space is a legal argument of ``step`` (the default
    ``invalid_action="coerce"``): a masked slot value becomes "none" and an expert repeated in a
    later slot counts once; ``info["coerced"]`` lists each change as ``(slot, value, reason)``
    with reason ``"masked"`` or ``"duplicate"`` (empty when the action was legal). With
    ``invalid_action="raise"`` (strict) both raise ``InvalidAction`` instead (``duplicates=
    "ignore"`` then still lets a repeated expert count once). Values outside the space,
    non-integer values and wrong shapes raise ``InvalidAction`` in both modes.

    ## Observation Space

    ``Dict`` of float32 ``Box``es (finite bounds, at most 2-D); all describe the CURRENT layer
    (the one the next action acts on):

    | key | shape | bounds | meaning |
    |---|---|---|---|
    | ``pred_load`` | [E] | [0, 1] | predicted tokens per expert ÷ B |
    | ``node_load`` | [D] | [0, D] | predicted expert load per node ÷ TP's load k·B·w/D |
    | ``link_busy`` | [num_links] | [0, 1] | previous layer's busy time per link ÷ its latency |
    | ``replicas`` | [E, D] | [0, 1] | placement shares P_ic of the layer (+ 1 per redundant copy) |
    | ``layer`` | [1] | [0, 1] | l / (L − 1) |
    | ``budget`` | [1] | [0, 1] | k_b / max_broadcast (pre-broadcast slots available) |

    ``pred_load`` and ``node_load`` come from the next-layer predictor (§10.2) and are 0 at
    layer 0 (no prediction). ``link_busy`` covers the MoE messages (DES fidelity only; the
    analytic twin has no per-link traffic) plus the pre-broadcast traffic of the layer, is
    clipped to 1 and is 0 at layer 0. ``replicas`` is [E·D] row-major with
    ``flatten_replicas=True``. With redundant experts ``replicas`` is the fraction of expert i's
    weights held by node c (P_ic, or 1 on a replica node) and ``node_load`` splits a replicated
    expert's predicted tokens evenly over its copies (``dispatch.replica_expected_shares``);
    without replicas both are as before.

    ## Rewards

    −(layer latency) ÷ (TP latency of the same layer and routing), so a TP placement earns ≈ −1
    per step; with ``reward_scale=s`` (seconds) the reward is −latency / s instead.
    ``reward="energy"``: −(layer energy) ÷ (TP's energy of the same layer and routing);
    ``reward="edp"``: −(energy · latency) ÷ (TP's energy · TP's latency) of the layer (the
    per-layer energy-delay product). Layer energy: docs/PHYSICS.md §18 (DRAM, NoC incl. the
    pre-broadcast and EPLB weight moves, compute incl. padded MACs, static power of all nodes
    over the layer's time). ``info["energy_j"]`` gives its breakdown (J: ``dram``, ``noc``,
    ``compute``, ``static``, ``total``) every step whatever the reward; at the end of a decode
    step ``info["step_energy_j"]`` (dense layers included) and ``info["j_per_token"]``.

    ## Starting State

    ``reset(seed=...)`` forms ``steps_per_episode`` decode steps of B rows from the trace
    (``streams`` batching by default, traces.md §6) with ``self.np_random``; aggregator draws and
    predictor noise also come from ``self.np_random``: the same seed gives the same rollout.

    ## Episode End

    ``terminated=True`` after ``steps_per_episode`` decode steps (``steps_per_episode · L`` env
    steps). ``truncated=True`` (``info["truncated_reason"]``) only if the trace cannot supply
    more decode steps (never with the default cycling streams).

    ## Arguments

    ``model``, ``setting`` ("TFLOPS/GBps"), ``mesh`` ("XxY"), ``topology``, ``batch``,
    ``conventions``, ``trace`` ("synthetic", a ``RoutingTrace`` or a path), ``trace_requests``,
    ``placement`` ("tp", "tp-tiled", "ep", a ``Placement`` or a ``.npz`` path),
    ``steps_per_episode``, ``fidelity`` ("des" | "analytic"), ``predictor`` ("noisy_oracle" |
    "oracle" | "trace" | "frequency"), ``max_broadcast``, ``gating_levels``, ``dispatch_rules``,
    ``reward_scale``, ``render_mode`` (None | "ansi" | "rgb_array"); keyword-only extras are
    documented in ``__init__``.

    ## Version History

    * v0: initial version. ``invalid_action`` defaults to ``"coerce"`` (``info["coerced"]``);
      observations, actions and rewards of legal actions are unchanged.
    * v1: the faithful cost model (docs/PHYSICS.md) changes the rewards of the same seed and
      actions; spaces unchanged. The -v0 ids raise a ``ConfigError`` naming -v1
      (``hdamoe_env.env.versions``; policy in docs/ENV.md). ``gymnasium.make_vec(...,
      vectorization_mode="vector_entry_point")`` gives ``hdamoe_env.env.vector.HdMoeVectorEnv``.
    """

    metadata: dict[str, Any] = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, config: EnvConfig | None = None, **kwargs: Any) -> None:
        """Build the environment from an ``EnvConfig`` or from its fields as keyword arguments.

        Args:
            config: The configuration; None builds it from ``kwargs``. With both, ``kwargs``
                replace fields of ``config`` (``dataclasses.replace``).
            **kwargs: The fields of ``EnvConfig``, each documented in its ``Attributes``
                (the run's fields — model, chip, NoC, profile, B, trace — in
                ``hdamoe_env.config.run.RUN_OPTIONS``).

        Raises:
            ConfigError: Any invalid argument (the message names it and the valid values).
        """
        super().__init__()
        if config is None:
            config = EnvConfig.create(**kwargs)
        elif not isinstance(config, EnvConfig):
            raise ConfigError(f"config must be an EnvConfig or None, got "
                              f"{type(config).__name__}; pass the other arguments by keyword")
        elif kwargs:
            config = config.replace(**kwargs)
        self.config = config
        self.render_mode = config.render_mode
        self.model = config.model_spec
        self.hw = config.hardware_spec
        self.conv = config.conv
        self.sim = MoESimulator(self.model, self.hw, config.topology_spec, self.conv)
        self.topology = self.sim.topology
        self.batch = int(config.batch)
        self.steps_per_episode = int(config.steps_per_episode)
        self.fidelity = config.fidelity
        self.predictor = predictor = config.predictor
        self.max_broadcast = int(config.max_broadcast)
        self.dispatch_rules = rules = tuple(config.dispatch_rules)
        self.gating_levels = levels = tuple(config.gating_levels)
        self.reward_scale = config.reward_scale
        self.reward_kind = config.reward
        self._energy = self.sim.energy_account(self.batch)
        self.measure_twin_error = bool(config.measure_twin_error)
        self.invalid_action = config.invalid_action
        self._ignore_duplicates = (config.duplicates == "ignore"
                                   or config.invalid_action == "coerce")
        self.batch_mode = config.resolved_batch_mode
        self.view = view = config.view
        self._batch_options = dict(config.batch_options or {})
        L, E, D = self.model.num_moe_layers, self.model.num_experts, self.hw.num_nodes
        self.num_layers, self.num_experts, self.num_nodes = L, E, D
        self.top_k = self.model.top_k

        # --- trace
        self.trace = config.load_trace()
        check_trace(self.sim, self.trace)
        self._routing = (self.trace.orig_topk_ids if self.trace.orig_topk_ids is not None
                         else self.trace.topk_ids)
        self._trace_seed = int(config.trace_seed)
        self._scored: RoutingTrace | None = None
        self._cand_key: int | None = None
        self._cand_step: tuple[NDArray[np.int64], NDArray[np.float64]] | None = None
        self.score_kind = self.trace.meta.get("score_kind")
        rows = self.trace.view(view)
        if rows.size == 0:
            raise ConfigError(f"view {view!r} of the trace has no rows")
        self._freqs = np.stack([self.trace.layer_frequencies(layer, rows) for layer in range(L)])
        # --- predictor (§10.2; checks that "trace" has recorded predictions)
        self._pred_acc = config.accuracies()
        self._predictor = StepPredictor(predictor, self._freqs, self.top_k, self.batch,
                                        self._pred_acc, recorded=self.trace.pred_ids)

        # --- placement
        placement = config.placement
        self.placement = (placement if isinstance(placement, Placement) else
                          placement_by_name(placement, self.model, D, config.placement_seed,
                                            record_seed=False, conv=self.conv))
        self.sim.check_placement(self.placement)
        P = self.placement.P
        reps = self.placement.replicas
        self.replica_rules: tuple[str, ...] = (tuple(config.replica_rules) if reps is not None
                                               else ())

        # --- gating coefficients
        gating_coefficients = config.gating_coefficients
        if gating_coefficients is None:
            coef, self.gating_source = gating.default_coefficients(
                self.model.key, self.hw.setting, self.conv.expert_matrices)
        else:
            coef, self.gating_source = (float(gating_coefficients[0]),
                                        float(gating_coefficients[1])), "user"
        self.gating_coefficients = coef
        if self.gating_source != self.model.key:
            logger.info("gating coefficients for %s: %s", self.model.key, self.gating_source)

        # --- the simulator side of the online decisions (gating, broadcast, dispatch, §10–11)
        self._bind_decisions()
        self._tp_evaluator = (self.evaluator if self.placement.method == "tp" and np.allclose(
            P, 1.0 / D) else self.sim.evaluator(tensor_parallel(L, E, D), self.batch))
        self._dense_s = self.sim.dense_time(self.batch)
        self._dense_j = self._energy.dense() + EnergyBreakdown(
            static_j=self._energy.spec.static_w_per_node * self.num_nodes * self._dense_s)

        # --- γ of the analytic twin
        self._gammas: NDArray[np.float64] | None = (
            None if config.gammas is None else np.asarray(config.gammas, dtype=np.float64))
        self._gamma_seed = int(config.gamma_seed)

        # --- spaces
        tail = [len(self.replica_rules)] if self.replica_rules else []
        self._nvec = np.array([E + 1] * self.max_broadcast + [len(rules), len(levels)] + tail,
                              dtype=np.int64)
        self._nvec_list = self._nvec.tolist()
        self._mask_splits = np.cumsum(self._nvec)[:-1]
        self._coerced: tuple[tuple[int, int, str], ...] = ()
        self.action_space = spaces.MultiDiscrete(self._nvec)
        self.observation_space = spaces.Dict({
            "pred_load": spaces.Box(0.0, 1.0, (E,), np.float32),
            "node_load": spaces.Box(0.0, float(D), (D,), np.float32),
            "link_busy": spaces.Box(0.0, 1.0, (self.topology.num_links,), np.float32),
            "replicas": spaces.Box(0.0, 1.0, (E * D,) if config.flatten_replicas else (E, D),
                                   np.float32),
            "layer": spaces.Box(0.0, 1.0, (1,), np.float32),
            "budget": spaces.Box(0.0, 1.0, (1,), np.float32),
        })
        self._bind_views()
        self._zeros_links = np.zeros(self.topology.num_links, dtype=np.float32)

        # --- episode state
        self._pending_charge_s = 0.0
        self._pending_busy_s: NDArray[np.float64] | None = None
        self._pending_fractions: NDArray[np.float64] | None = None
        self._rows: NDArray[np.int64] = np.zeros((0, self.batch), dtype=np.int64)
        self._sets: NDArray[np.int64] = np.zeros((L, self.batch, self.top_k), dtype=np.int64)
        self._decode_step = 0
        self._layer = 0
        self._episode_over = True
        self._pred_all: NDArray[np.int64] | None = None
        self._pred_counts_all = np.zeros((L, E))
        self._obs_pred = np.zeros((L, E), dtype=np.float32)
        self._obs_node = np.zeros((L, D), dtype=np.float32)
        self._prev_busy: NDArray[np.float32] = self._zeros_links
        self._step_latency_s = 0.0
        self._tp_totals = np.zeros(L)
        self._tp_energy = np.zeros(L)
        self._step_energy_j = EnergyBreakdown()
        self._tbts_us: list[float] = []
        self._twin_rng = np.random.default_rng(0)
        self.last_layer: LayerResult | None = None
        self.last_sets: NDArray[np.int64] | None = None
        self.last_info: dict[str, Any] = {}

    # ------------------------------------------------------------------ description
    def describe(self) -> dict[str, Any]:
        """Return the configuration agents and harnesses need (plain Python values)."""
        return {
            "env_id": ENV_ID, "model": self.model.key, "num_layers": self.num_layers,
            "num_experts": self.num_experts, "top_k": self.top_k, "num_nodes": self.num_nodes,
            "num_links": self.topology.num_links, "batch": self.batch,
            "hardware": self.hw.to_dict(), "topology": self.sim.topology_spec.to_dict(),
            "conventions": self.conv.to_dict(), "placement": self.placement.method,
            "fidelity": self.fidelity, "predictor": self.predictor,
            "max_broadcast": self.max_broadcast, "dispatch_rules": list(self.dispatch_rules),
            "gating_levels": list(self.gating_levels),
            "gating_coefficients": list(self.gating_coefficients),
            "gating_coefficients_source": self.gating_source,
            "w_flops": self.w_flops, "compute_flops": self.compute_flops,
            "k_b": self.k_b.tolist(), "bc_budget_s": self._budget_s.tolist(),
            "steps_per_episode": self.steps_per_episode, "trace_id": self.trace.trace_id,
            "score_kind": self.score_kind, "ref_bookkeeping": self.conv.ref_bookkeeping,
            "skip_zero_priority": self.conv.skip_zero_priority,
            **({"replica_rules": list(self.replica_rules)} if self.replica_rules else {}),
        }

    def _bind_decisions(self) -> None:
        """Build the placement-dependent physics: decision evaluator, broadcast plans, k_b."""
        config = self.config
        self.decisions = self.sim.decision_evaluator(
            self.placement, self.batch, freqs=self._freqs, max_broadcast=self.max_broadcast,
            bc_max_messages=config.bc_max_messages, gating_coefficients=self.gating_coefficients,
            gating_streaming=bool(config.gating_streaming),
            gating_options=dict(                             # validated by EnvConfig
                comp_penalty=config.gating_comp_penalty,
                comm_penalty=config.gating_comm_penalty,
                protect_top=int(config.gating_protect_top),
                candidate_window=config.gating_candidate_window,
                include_future=bool(config.gating_include_future),
                renormalize=self.model.renormalize_topk, diagnostics=False))
        self.evaluator = self.decisions.evaluator
        self.w_flops = self.decisions.w_flops
        self.compute_flops = self.decisions.compute_flops
        self.plans = self.decisions.plans
        self.k_b = self.decisions.broadcast_slots(config.k_b)   # k_b validated by EnvConfig
        self._budget_s = np.array(self.decisions.budgets_s)

    def _bind_views(self) -> None:
        """Build the placement-dependent observation parts and action masks."""
        L, D = self.num_layers, self.num_nodes
        P, reps = self.placement.P, self.placement.replicas
        held = P if reps is None else P + reps                 # a redundant copy holds 1
        self._replicas = [np.ascontiguousarray(held[layer], dtype=np.float32)
                          for layer in range(L)]
        if self.config.flatten_replicas:
            self._replicas = [r.ravel() for r in self._replicas]
        self._node_scale_all = np.ascontiguousarray(
            self.decisions.expected_shares.transpose(0, 2, 1)
            * (D / (self.top_k * self.batch)))                                 # [L, D, E]
        broadcastable = (P > 0).sum(axis=2) < D                # [L, E]: not already everywhere
        self._masks = [self._layer_mask(int(self.k_b[layer]), broadcastable[layer])
                       for layer in range(L)]
        self._slot_allowed = [m[:self.max_broadcast * (self.num_experts + 1)]
                              .reshape(self.max_broadcast, self.num_experts + 1)
                              for m in self._masks]
        self._layer_frac = [np.array([layer / (L - 1) if L > 1 else 0.0], dtype=np.float32)
                            for layer in range(L)]
        self._budget_frac = [np.array([min(1.0, self.k_b[layer] / self.max_broadcast)
                                       if self.max_broadcast else 0.0], dtype=np.float32)
                             for layer in range(L)]

    def set_replica_fractions(self, fractions: ArrayLike | None) -> None:
        """Route the next step's redundant-expert tokens by per-copy fractions (rule ``shares``).

        For the next ``step`` only, the replica dispatch uses ``dispatch.dispatch_replicas``
        with ``rule="shares"`` and these fractions instead of the action's replica rule
        (``info["replica_rule"]`` = ``"shares"``). Column 0 is the primary copy, column 1 + c
        the replica on cluster c (ignored where there is none; renormalised over the expert's
        copies; an all-zero row splits evenly; an all-NaN row leaves that expert to the
        least-loaded rule). ``hdamoe_env.env.wrappers.ReplicaSharesWrapper`` sets it from a discrete
        action.

        Args:
            fractions: float [E, 1 + D] >= 0 (rows may be all NaN), or None to clear.

        Raises:
            ConfigError: The placement has no redundant experts, or a bad shape / value.
        """
        if fractions is None:
            self._pending_fractions = None
            return
        if not self.replica_rules:
            raise ConfigError("set_replica_fractions needs a placement with redundant experts "
                              "(Placement.replicas), e.g. the 'eplb' placement")
        fr = np.asarray(fractions, dtype=np.float64)
        shape = (self.num_experts, 1 + self.num_nodes)
        if fr.shape != shape or not dispatch.valid_fractions(fr):
            raise ConfigError(f"replica fractions must be finite, >= 0 (or a whole row NaN: "
                              f"least-loaded), of shape {shape} [experts, primary + one column "
                              f"per cluster]; got shape {fr.shape}")
        self._pending_fractions = fr

    def replace_placement(self, placement: Placement, *, charge_s: float = 0.0,
                          charge_link_busy_s: NDArray[np.float64] | None = None
                          ) -> dict[str, NDArray[np.float32]]:
        """Swap the placement between decode steps (e.g. a periodic rebalance of the experts).

        The new placement takes effect from the next ``step``; ``charge_s`` (e.g. the NoC
        makespan of the weight moves, ``baselines.eplb.simulate_moves``) is added to that
        step's latency (``t_extra_us``, reported as ``rebalance_us`` in its ``info``). The
        action space does not change, so a placement with redundant experts can only replace
        one with redundant experts (and one without, one without).

        Args:
            placement: The new placement (same model and mesh).
            charge_s: Seconds charged to the next layer, >= 0.
            charge_link_busy_s: float [num_links] link busy time of the weight moves (the DES
                result's ``link_busy_s``), charged to the next layer's NoC energy, or None.

        Returns:
            The observation of the current layer under the new placement.

        Raises:
            ConfigError: Called inside a decode step (after layer 0), a mismatched placement,
                a change in whether the placement has redundant experts, or a negative charge.
        """
        if not self._episode_over and self._layer != 0:
            raise ConfigError(f"replace_placement inside decode step {self._decode_step} (at "
                              f"layer {self._layer}); call it between decode steps")
        if not (math.isfinite(charge_s) and charge_s >= 0):
            raise ConfigError(f"charge_s={charge_s!r} must be a finite number of seconds >= 0")
        busy = None
        if charge_link_busy_s is not None:
            busy = np.asarray(charge_link_busy_s, dtype=np.float64)
            if busy.shape != (self.topology.num_links,) or not (np.isfinite(busy).all()
                                                                and (busy >= 0).all()):
                raise ConfigError(f"charge_link_busy_s must be {self.topology.num_links} finite "
                                  f"seconds >= 0 (one per directed link), got shape "
                                  f"{busy.shape}")
        placement = self.sim.check_replacement(placement)
        if placement.has_replicas != bool(self.replica_rules):
            raise ConfigError("the new placement " + ("has" if placement.has_replicas else
                              "lacks") + " redundant experts but the env's action space was "
                              "built " + ("without" if placement.has_replicas else "with") +
                              " the replica-rule dimension; build a new env for it")
        self.placement = placement
        self._bind_decisions()
        self._bind_views()
        if self.config.gammas is None:
            self._gammas = None                              # refitted lazily for the new one
        self._pending_charge_s += float(charge_s)
        if busy is not None:
            self._pending_busy_s = busy if self._pending_busy_s is None \
                else self._pending_busy_s + busy
        return self._observation()

    def _layer_mask(self, kb: int, broadcastable: NDArray[np.bool_]) -> NDArray[np.bool_]:
        E = self.num_experts
        slots = np.zeros((self.max_broadcast, E + 1), dtype=bool)
        slots[:, E] = True
        slots[:kb, :E] = broadcastable
        tail = np.ones(len(self.dispatch_rules) + len(self.gating_levels)
                       + len(self.replica_rules), dtype=bool)
        mask = np.concatenate([slots.ravel(), tail])
        mask.flags.writeable = False
        return mask

    # ------------------------------------------------------------------ gymnasium API
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[dict[str, NDArray[np.float32]], dict[str, Any]]:
        """Start an episode: form the decode steps from the trace with ``self.np_random``.

        Args:
            seed: Seed of ``self.np_random`` (batching, aggregators, predictor noise).
            options: Unused.

        Returns:
            The observation of layer 0 of the first decode step and an info dict.
        """
        super().reset(seed=None if seed is None else check_seed(seed, "reset(seed=...)"))
        rng = self.np_random
        kwargs: dict[str, Any] = {"n_steps": self.steps_per_episode, "view": self.view}
        if self.batch_mode == "streams":
            kwargs["cycle"] = True
        kwargs.update(self._batch_options)
        try:
            steps = batching.make_steps(self.batch_mode, self.trace, self.batch, rng, **kwargs)
            self._rows = batching.take(steps, self.steps_per_episode)
            self._cand_key = None
        except ValueError as exc:
            raise ConfigError(f"cannot form decode steps of B={self.batch} ({self.batch_mode}) "
                              f"from the trace: {exc}") from None
        if self._rows.shape[0] == 0:
            raise ConfigError(f"the trace supplies no decode step of B={self.batch} "
                              f"({self.batch_mode})")
        self._twin_rng = np.random.default_rng(int(rng.integers(2**63)))
        self._decode_step = 0
        self._tbts_us = []
        self._episode_over = False
        self._begin_decode_step()
        obs = self._observation()
        info = {"action_mask": self._masks[0].copy(), "decode_step": 0, "layer": 0,
                "k_b": int(self.k_b[0]), "fidelity": self.fidelity}
        return obs, info

    def _begin_decode_step(self) -> None:
        rows = self._rows[self._decode_step]
        self._sets = self._routing[:, rows, :].astype(np.int64)
        self._tp_totals = self._tp_evaluator.tp_totals(self._sets)
        self._tp_energy = self._tp_energy_of(self._sets, self._tp_totals)
        self._predict_step()
        self._layer = 0
        self._step_latency_s = 0.0
        self._step_energy_j = EnergyBreakdown()
        self._prev_busy = self._zeros_links

    def _tp_energy_of(self, sets: NDArray[np.int64], tp_totals: NDArray[np.float64]
                      ) -> NDArray[np.float64]:
        """Return TP's energy [L] of a decode step's layers (the energy/EDP reward reference);
        zeros under ``reward="latency"``, which does not read it."""
        if self.reward_kind == "latency":
            return np.zeros(tp_totals.shape)
        L, E = sets.shape[0], self.num_experts
        flat = (sets.reshape(L, -1) + (np.arange(L) * E)[:, None]).ravel()
        counts = np.bincount(flat, minlength=L * E).astype(np.float64).reshape(L, E)
        return self._energy.tp_layers(counts, tp_totals)

    def action_masks(self) -> NDArray[np.bool_]:
        """Return the flat bool mask of the next action (sb3-contrib ``MaskablePPO``).

        Through ``gymnasium.make``'s wrappers call ``env.unwrapped.action_masks()`` or
        ``env.get_wrapper_attr("action_masks")()`` (sb3-contrib's ``get_action_masks`` does the
        latter).
        """
        return self._masks[self._layer].copy()

    def action_mask_tuple(self) -> tuple[NDArray[np.int8], ...]:
        """Return the mask of the next action per dimension, for ``MultiDiscrete.sample``.

        ``env.action_space.sample(mask=env.unwrapped.action_mask_tuple())`` draws an action
        that respects every per-dimension mask (it may still repeat an expert in two slots;
        the default ``invalid_action="coerce"`` counts it once).

        Returns:
            One int8 array (1 = allowed) of length ``nvec[i]`` per action dimension.
        """
        mask = self._masks[self._layer]
        return tuple(part.astype(np.int8) for part in np.split(mask, self._mask_splits))

    def step(self, action: Any) -> tuple[dict[str, NDArray[np.float32]], SupportsFloat, bool,
                                         bool, dict[str, Any]]:
        """Execute the current MoE layer with the action's pre-broadcast, dispatch and gating.

        Args:
            action: int array of the action space (see the class docstring).

        Returns:
            ``(obs, reward, terminated, truncated, info)``; ``info`` holds the layer's breakdown
            in µs, per-link busy time, the broadcast, k_b, gating statistics and, at the end of a
            decode step, ``tbt_us`` (``episode_tbt_us`` at the end of the episode).

        Raises:
            InvalidAction: The action is outside the space, violates the mask or repeats an
                expert.
            ConfigError: ``step`` called before ``reset`` or after the episode ended.
        """
        if self._episode_over:
            raise ConfigError("step() called before reset() or after the episode ended; call "
                              "reset()")
        layer = self._layer
        broadcast, rule_idx, level_idx, rep_idx = self._decode_action(action)
        rule = self.dispatch_rules[rule_idx]
        level = self.gating_levels[level_idx]
        rep_rule = self.replica_rules[rep_idx] if self.replica_rules else "least_loaded"
        fractions, self._pending_fractions = self._pending_fractions, None
        if fractions is not None:
            rep_rule = "shares"
        need_gamma = self.fidelity == "analytic" or self.measure_twin_error
        out = self.decisions.evaluate(
            layer, self._sets[layer], rng=self.np_random, broadcast=broadcast,
            dispatch_rule=rule, gating_level=level,
            candidates=self._candidates(layer) if level > 0 else None, fidelity=self.fidelity,
            gamma=self._gamma(layer) if need_gamma else None,
            twin_rng=self._twin_rng if self.measure_twin_error else None,
            replica_rule=rep_rule, replica_fractions=fractions)
        res, busy, bres, g = out.result, out.link_busy_s, out.broadcast, out.gating
        gstats = (0.0, 1.0, 1.0) if g is None else (g.changed_fraction, g.top1_retention,
                                                    g.score_mass_kept)
        bc_busy = None if bres is None else bres.link_busy_s
        bc_makespan = 0.0 if bres is None else bres.makespan_s
        bc_chunks = 0 if bres is None else bres.chunks
        total = res.total_s
        charge, self._pending_charge_s = self._pending_charge_s, 0.0
        total += charge
        tp_total = float(self._tp_totals[layer])
        moves, self._pending_busy_s = self._pending_busy_s, None
        extra_busy = bc_busy if moves is None else (moves if bc_busy is None
                                                    else bc_busy + moves)
        joules = self._energy.layer(res, extra_link_busy_s=extra_busy, extra_s=charge)
        energy_j = joules.total_j
        if self.reward_kind == "latency":
            reward = -total / (tp_total if self.reward_scale is None else self.reward_scale)
        elif self.reward_kind == "energy":
            reward = -energy_j / float(self._tp_energy[layer])
        else:
            reward = -(energy_j * total) / (float(self._tp_energy[layer]) * tp_total)
        info: dict[str, Any] = {
            "decode_step": self._decode_step, "layer": layer, "mode": res.mode,
            "t_nm_us": res.t_nm_s * 1e6, "t_comp_us": res.t_comp_s * 1e6,
            "t_dispatch_us": res.t_dispatch_s * 1e6, "t_combine_us": res.t_combine_s * 1e6,
            "t_comm_us": res.t_comm_moe_s * 1e6, "t_extra_us": (res.t_extra_s + charge) * 1e6,
            "total_us": total * 1e6, "tp_total_us": tp_total * 1e6,
            "compute_us": (res.t_nm_compute_s + res.t_comp_compute_s) * 1e6,
            "memory_us": res.memory_s * 1e6,           # exposed memory (no non-MoE comm)
            "t_nm_comm_us": res.t_nm_comm_s * 1e6,     # non-MoE all-reduce inside t_nm
            "link_busy_us": (np.zeros(self.topology.num_links) if busy is None else busy * 1e6),
            "broadcast": tuple(broadcast), "k_b": int(self.k_b[layer]),
            "bc_link_busy_us": (np.zeros(self.topology.num_links) if bc_busy is None
                                else bc_busy * 1e6),
            "bc_makespan_us": bc_makespan * 1e6,
            "bc_budget_us": float(self._budget_s[layer]) * 1e6,
            "bc_chunks": bc_chunks,
            "dispatch_rule": rule, "gating_level": level,
            "changed_fraction": gstats[0], "top1_retention": gstats[1],
            "score_mass_kept": gstats[2],
            "coerced": self._coerced,
            "energy_j": joules.to_dict(),
            "balancedness": (1.0 if res.t_comp_compute_s <= 0 else float(
                res.node_compute_s.sum()) / (self.num_nodes * res.t_comp_compute_s)),
        }
        if self.replica_rules:
            info["replica_rule"] = rep_rule
        if charge:
            info["rebalance_us"] = charge * 1e6
        if out.twin is not None:
            self._report_twin(info, res, out.twin)
        self.last_layer = res
        self.last_sets = out.token_sets             # the executed (gated) expert sets [B, k]
        self._step_latency_s += total
        self._step_energy_j = self._step_energy_j + joules
        self._prev_busy = (self._zeros_links if busy is None or total <= 0 else
                           np.minimum(busy / total, 1.0).astype(np.float32))
        terminated = truncated = False
        if layer + 1 < self.num_layers:
            self._layer = layer + 1
        else:
            tbt_us = (self._step_latency_s + self._dense_s) * 1e6
            info["tbt_us"] = tbt_us
            step_j = self._step_energy_j + self._dense_j
            info["step_energy_j"] = step_j.to_dict()
            info["j_per_token"] = step_j.total_j / self.batch
            self._tbts_us.append(tbt_us)
            self._decode_step += 1
            if self._decode_step >= self.steps_per_episode:
                terminated = True
            elif self._decode_step >= self._rows.shape[0]:
                truncated = True
                info["truncated_reason"] = (
                    f"the trace supplied only {self._rows.shape[0]} decode steps of "
                    f"B={self.batch} ({self.batch_mode}); the episode needs "
                    f"{self.steps_per_episode}")
            else:
                self._begin_decode_step()
            if terminated or truncated:
                info["episode_tbt_us"] = float(np.mean(self._tbts_us))
                self._episode_over = True
                self._layer = 0
                self._prev_busy = self._zeros_links
        obs = self._observation()
        info["action_mask"] = self._masks[self._layer].copy()
        self.last_info = info
        return obs, float(reward), terminated, truncated, info

    def render(self) -> str | NDArray[np.uint8] | None:
        """Render the last layer: a one-line text (``"ansi"``) or a link heat map (``"rgb_array"``).

        ``"rgb_array"`` returns uint8 [H, W, 3]: every directed link coloured by its busy time
        (MoE messages + pre-broadcast traffic) ÷ the layer's latency (``env.render``; layouts in
        ``hdamoe_env.env.render``). Before the first step the links are idle.
        """
        if self.render_mode == "rgb_array":
            return render.link_heatmap_rgb(self.topology, self._last_link_util())
        if self.render_mode != "ansi":
            return None
        info = self.last_info
        if not info:
            return "HdMoE: no step yet"
        return (f"step {info['decode_step']} layer {info['layer']}: {info['total_us']:.2f} us "
                f"(nm {info['t_nm_us']:.2f}, comp {info['t_comp_us']:.2f}, comm "
                f"{info['t_comm_us']:.2f}, extra {info['t_extra_us']:.2f}); broadcast "
                f"{list(info['broadcast'])} of k_b={info['k_b']}, dispatch "
                f"{info['dispatch_rule']}, gating x{info['gating_level']:g}")

    def _last_link_util(self) -> NDArray[np.float64]:
        """[num_links] busy time of the last layer's links ÷ its latency (0 before any step)."""
        info = self.last_info
        if not info or info["total_us"] <= 0:
            return np.zeros(self.topology.num_links)
        busy = np.asarray(info["link_busy_us"]) + np.asarray(info["bc_link_busy_us"])
        out: NDArray[np.float64] = np.clip(busy / info["total_us"], 0.0, 1.0)
        return out

    # ------------------------------------------------------------------ internals
    def _decode_action(self, action: Any) -> tuple[list[int], int, int, int]:
        """Validate an action; return (broadcast list, dispatch, gating, replica-rule index)."""
        n = self._nvec.size
        if type(action) is np.ndarray and action.dtype == np.int64 and action.shape == (n,):
            a = action                                   # the common case (SB3, agents)
        else:
            a = np.asarray(action)
        if a.shape != (n,):
            raise InvalidAction(f"action must have shape ({n},) = {self.max_broadcast} broadcast "
                                f"slots + dispatch + gating"
                                + (" + replica rule" if self.replica_rules else "")
                                + f", got shape {a.shape}")
        if a.dtype.kind not in "iu":
            if a.dtype.kind != "f" or not np.all(np.isfinite(a)) or np.any(a != np.round(a)):
                raise InvalidAction(f"action must hold integers, got {a.tolist()} (dtype "
                                    f"{a.dtype})")
        values = a.astype(np.int64, copy=False).tolist()
        if min(values) < 0 or any(v >= hi for v, hi in zip(values, self._nvec_list,
                                                              strict=True)):
            i = next(j for j, (v, hi) in enumerate(zip(values, self._nvec_list, strict=True))
                     if not 0 <= v < hi)
            raise InvalidAction(f"action[{i}] ({self._slot_name(i)}) = {values[i]} is outside "
                                f"[0, {self._nvec_list[i] - 1}]")
        E, mb = self.num_experts, self.max_broadcast
        broadcast: list[int] = []
        coerced: list[tuple[int, int, str]] = []
        if mb and values[:mb].count(E) < mb:
            allowed = self._slot_allowed[self._layer]
            for i, v in enumerate(values[:mb]):
                if v == E:
                    continue
                if not allowed[i, v]:
                    if self.invalid_action == "coerce":
                        coerced.append((i, v, "masked"))
                        continue
                    raise InvalidAction(self._mask_message(i, v))
                if v in broadcast:
                    if self._ignore_duplicates:
                        coerced.append((i, v, "duplicate"))
                        continue
                    raise InvalidAction(f"action[{i}] (broadcast slot {i}) repeats expert {v}; "
                                        f"each expert may be broadcast once (use {E} = none)")
                broadcast.append(v)
        self._coerced = tuple(coerced)
        return broadcast, values[mb], values[mb + 1], values[mb + 2] if self.replica_rules else 0

    def _slot_name(self, i: int) -> str:
        mb = self.max_broadcast
        if i < mb:
            return f"broadcast slot {i}"
        return {mb: "dispatch rule", mb + 1: "gating level"}.get(i, "replica rule")

    def _mask_message(self, slot: int, value: int) -> str:
        E = self.num_experts
        layer = self._layer
        kb = int(self.k_b[layer])
        if slot >= kb:
            why = ("layer 0 allows no broadcast" if layer == 0 else
                   f"only {kb} pre-broadcast slot(s) fit the budget of layer {layer}")
            return (f"action[{slot}] (broadcast slot {slot}) = {value} is masked: {why}; allowed "
                    f"values: [{E}] (none)")
        return (f"action[{slot}] (broadcast slot {slot}) = {value} is masked at layer {layer}: "
                f"expert {value} is already held by every node; allowed values: the unmasked "
                f"experts of action_masks() or {E} (none)")

    def _candidates(self, layer: int) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """Return the router candidates (ids, scores) [B, k + J] of the current decode step.

        Gathered for every layer at the first gated layer of a decode step (one indexing
        operation instead of one per layer), as the int64/float64 arrays gating works on.
        """
        key = self._decode_step                      # reset() clears the key
        if self._cand_key != key or self._cand_step is None:
            self._cand_step = sources.step_candidates(self._scored_trace(),
                                                      self._rows[self._decode_step])
            self._cand_key = key
        return self._cand_step[0][layer], self._cand_step[1][layer]

    def _scored_trace(self) -> RoutingTrace:
        """Return the trace with router candidates, synthesising scores once if it has none."""
        if self._scored is None:
            self._scored = sources.with_router_scores(self.trace, self._trace_seed)
            if self._scored is not self.trace:
                self.score_kind = "synthetic"
        return self._scored

    def _gamma(self, layer: int) -> float:
        """Return γ of the analytic twin for ``layer`` (fitted lazily, §5.5)."""
        if self._gammas is None:
            self._gammas = calibrate.twin_gammas(self.sim, self.placement, self.trace,
                                                 self._routing, self.view, self.batch,
                                                 self._gamma_seed)
        return float(self._gammas[layer])

    def _report_twin(self, info: dict[str, Any], res: LayerResult, twin: LayerResult) -> None:
        """Report the other fidelity's result and the analytic twin's error vs the DES."""
        des, ana = (res, twin) if self.fidelity == "des" else (twin, res)
        info["twin_total_us"] = twin.total_s * 1e6
        info["twin_comm_us"] = twin.t_comm_moe_s * 1e6
        info["twin_error"] = (ana.total_s - des.total_s) / des.total_s if des.total_s else 0.0
        info["twin_comm_error"] = ((ana.t_comm_moe_s - des.t_comm_moe_s) / des.t_comm_moe_s
                                   if des.t_comm_moe_s else 0.0)

    def _predict_step(self) -> None:
        """Predict layers 1..L−1 of the decode step (each made at layer l − 1, §10.2).

        Only the per-expert counts n̂_i enter the observation; layer 0 has no prediction.
        """
        out = self._predictor.predict(self._sets, self._rows[self._decode_step], self.np_random)
        self._pred_all = out.sets
        self._pred_counts_all = counts = out.counts
        node = np.matmul(self._node_scale_all, counts[:, :, None])[:, :, 0]          # [L, D]
        self._obs_pred = np.minimum(counts / self.batch, 1.0).astype(np.float32)
        self._obs_node = np.minimum(node, float(self.num_nodes)).astype(np.float32)

    def _observation(self) -> dict[str, NDArray[np.float32]]:
        layer = self._layer
        if self._episode_over:
            pred = np.zeros(self.num_experts, dtype=np.float32)
            node = np.zeros(self.num_nodes, dtype=np.float32)
        else:
            pred = self._obs_pred[layer].copy()
            node = self._obs_node[layer].copy()
        return {
            "pred_load": pred,
            "node_load": node,
            "link_busy": self._prev_busy.copy(),
            "replicas": self._replicas[layer].copy(),
            "layer": self._layer_frac[layer].copy(),
            "budget": self._budget_frac[layer].copy(),
        }

    # ------------------------------------------------------------------ accessors for agents
    @property
    def current_layer(self) -> int:
        """MoE layer the next action acts on."""
        return self._layer

    @property
    def decode_step(self) -> int:
        """Decode step (within the episode) of the next action."""
        return self._decode_step

    @property
    def predicted_sets(self) -> NDArray[np.int64] | None:
        """int [B, k] predicted sets of the current layer (−1 at layer 0; None: ``frequency``)."""
        return None if self._pred_all is None else self._pred_all[self._layer]

    @property
    def predicted_counts(self) -> NDArray[np.float64]:
        """float [E] predicted tokens per expert n̂_i of the current layer (0 at layer 0)."""
        return self._pred_counts_all[self._layer].copy()

    @property
    def episode_steps(self) -> int:
        """Decode steps formed by the last ``reset`` (0 before the first one)."""
        rows = getattr(self, "_rows", None)
        return 0 if rows is None else int(rows.shape[0])

    def episode_candidates(self, decode_step: int
                           ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        """Return the router candidates of one decode step of the current episode.

        Used to measure gating quality without simulating (``hdamoe_env.app.matched``); the
        episode's state is not changed.

        Args:
            decode_step: Index in ``[0, episode_steps)``.

        Returns:
            (ids int64 [L, B, k + J], scores float64 [L, B, k + J]), synthesised scores when the
            trace has none (``score_kind``).

        Raises:
            ConfigError: Before ``reset`` or a decode step out of range.
        """
        if not 0 <= decode_step < self.episode_steps:
            raise ConfigError(f"decode_step={decode_step} is out of range; expected 0 <= "
                              f"decode_step < {self.episode_steps} (call reset() first)")
        return sources.step_candidates(self._scored_trace(), self._rows[decode_step])

    def plan(self, layer: int | None = None) -> BroadcastPlan | None:
        """Return the pre-broadcast plan (budget, k_b, chunk, T_bc*) of a layer (None: layer 0)."""
        return self.plans[self._layer if layer is None else layer]

    def config_digest(self) -> str:
        """Return a short hash of the configuration (for caching results)."""
        blob = json.dumps(self.describe(), sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:12]


    # ------------------------------------------------------------------ episode state
    def get_state(self) -> tuple[dict[str, Any], dict[str, NDArray[Any]]]:
        """Return the episode state as JSON-ready values and arrays (resumable training).

        Everything a rollout reads from that is not rebuilt from the configuration: the
        decode steps of the episode, the position in it, the predictions already drawn, the
        last link utilisation, and the bit-generator states of ``np_random`` and the twin's
        generator. :meth:`set_state` on an env built from the same configuration continues
        the episode exactly as this one would. Caches derived from the configuration (router
        candidates, γ of the twin) are not part of it; neither are ``last_info`` /
        ``last_layer`` (rendering only).

        Returns:
            ``(meta, arrays)``: ``meta`` holds plain Python values (``json.dumps`` accepts it),
            ``arrays`` numpy arrays (``np.savez`` accepts them, no objects).
        """
        meta: dict[str, Any] = {
            "format": "hdamoe-env-state", "format_version": 1,
            "config_digest": self.config_digest(),
            "np_random": _jsonable_state(self.np_random.bit_generator.state),
            "twin_rng": _jsonable_state(self._twin_rng.bit_generator.state),
            "decode_step": int(self._decode_step), "layer": int(self._layer),
            "episode_over": bool(self._episode_over),
            "step_latency_s": float(self._step_latency_s),
            "pending_charge_s": float(self._pending_charge_s),
            "tbts_us": [float(t) for t in self._tbts_us],
            "step_energy_j": [self._step_energy_j.dram_j, self._step_energy_j.noc_j,
                              self._step_energy_j.compute_j, self._step_energy_j.static_j],
        }
        arrays: dict[str, NDArray[Any]] = {
            "rows": self._rows, "sets": self._sets, "tp_totals": self._tp_totals,
            "pred_counts_all": self._pred_counts_all, "obs_pred": self._obs_pred,
            "obs_node": self._obs_node, "prev_busy": self._prev_busy,
        }
        if self._pred_all is not None:
            arrays["pred_all"] = self._pred_all
        if self._pending_fractions is not None:
            arrays["pending_fractions"] = self._pending_fractions
        if self._pending_busy_s is not None:
            arrays["pending_busy_s"] = self._pending_busy_s
        return meta, {k: np.array(v, copy=True) for k, v in arrays.items()}

    def set_state(self, meta: dict[str, Any], arrays: dict[str, NDArray[Any]]
                  ) -> dict[str, NDArray[np.float32]]:
        """Continue the episode saved by :meth:`get_state` (same configuration).

        Args:
            meta: The JSON part of :meth:`get_state`.
            arrays: Its arrays.

        Returns:
            The observation of the restored state (what the last ``step`` / ``reset`` of the
            saved env returned).

        Raises:
            ConfigError: Not a state of this package, one of an env with another
                configuration, or a missing / mis-shaped array.
        """
        if not isinstance(meta, dict) or meta.get("format") != "hdamoe-env-state":
            raise ConfigError("set_state: not an env state written by HdMoeEnv.get_state")
        if meta.get("config_digest") != self.config_digest():
            raise ConfigError(f"set_state: the state is of an env with configuration "
                              f"{meta.get('config_digest')!r}, this env's is "
                              f"{self.config_digest()!r}; build the env with the same arguments")
        L, E, D = self.num_layers, self.num_experts, self.num_nodes
        shapes = {"sets": (L, self.batch, self.top_k), "tp_totals": (L,),
                  "pred_counts_all": (L, E), "obs_pred": (L, E), "obs_node": (L, D),
                  "prev_busy": (self.topology.num_links,)}
        for key, shape in shapes.items():
            if key not in arrays or tuple(np.shape(arrays[key])) != shape:
                raise ConfigError(f"set_state: array {key!r} missing or not of shape {shape}")
        rows = np.asarray(arrays.get("rows", np.zeros(0)), dtype=np.int64)
        if rows.ndim != 2 or rows.shape[1] != self.batch:
            raise ConfigError(f"set_state: array 'rows' must have shape [steps, {self.batch}]")
        try:
            rng, twin = _generator(meta["np_random"]), _generator(meta["twin_rng"])
            decode_step, layer = int(meta["decode_step"]), int(meta["layer"])
            episode_over = bool(meta["episode_over"])
            latency, charge = float(meta["step_latency_s"]), float(meta["pending_charge_s"])
            tbts = [float(t) for t in meta["tbts_us"]]
            step_j = EnergyBreakdown(*(float(v) for v in meta.get("step_energy_j", ())))
        except (KeyError, TypeError, ValueError) as exc:
            raise ConfigError(f"set_state: damaged env state ({type(exc).__name__}: {exc})"
                              ) from None
        if not 0 <= layer < L or not 0 <= decode_step <= rows.shape[0]:
            raise ConfigError(f"set_state: layer {layer} / decode step {decode_step} out of range")
        self._np_random = rng
        self._twin_rng = twin
        self._rows = rows
        self._sets = np.asarray(arrays["sets"], dtype=np.int64).copy()
        self._tp_totals = np.asarray(arrays["tp_totals"], dtype=np.float64).copy()
        self._tp_energy = self._tp_energy_of(self._sets, self._tp_totals)
        self._step_energy_j = step_j
        self._pending_busy_s = (None if "pending_busy_s" not in arrays else
                                np.asarray(arrays["pending_busy_s"], np.float64).copy())
        self._pred_all = (None if "pred_all" not in arrays
                          else np.asarray(arrays["pred_all"], dtype=np.int64).copy())
        self._pred_counts_all = np.asarray(arrays["pred_counts_all"], dtype=np.float64).copy()
        self._obs_pred = np.asarray(arrays["obs_pred"], dtype=np.float32).copy()
        self._obs_node = np.asarray(arrays["obs_node"], dtype=np.float32).copy()
        self._prev_busy = np.asarray(arrays["prev_busy"], dtype=np.float32).copy()
        self._pending_fractions = (None if "pending_fractions" not in arrays else
                                   np.asarray(arrays["pending_fractions"], np.float64).copy())
        self._decode_step, self._layer, self._episode_over = decode_step, layer, episode_over
        self._step_latency_s, self._pending_charge_s = latency, charge
        self._tbts_us = tbts
        self._cand_key, self._cand_step = None, None           # recomputed on demand
        return self._observation()

    # ------------------------------------------------------------------ pickling
    def __getstate__(self) -> dict[str, Any]:
        """Pickle without a synthetic trace: it is rebuilt from the configuration on load.

        A synthetic trace is a deterministic function of the configuration (seed, requests,
        tokens, skew) and is ~90 % of an env's bytes; it, the routing view of it and the
        synthesised router scores are left out, and so are the parts rebuilt from the
        placement (observation parts, masks, the TP evaluator), so an env pickles to under
        2 MB (``tests/hdamoe_env/env/test_vector.py``). Traces given as objects or files are
        kept.
        """
        state = self.__dict__.copy()
        # rebuilt on load: the observation parts and masks (``_bind_views``) and a TP
        # evaluator that is not the env's own
        for key in ("_replicas", "_node_scale_all", "_masks", "_slot_allowed"):
            state[key] = None
        if self._tp_evaluator is not self.evaluator:
            state["_tp_evaluator"] = None
        if isinstance(self.config.trace, str) and self.config.trace == "synthetic":
            state.update(trace=None, _routing=None, _scored=None, _cand_key=None,
                         _cand_step=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        """Restore a pickled env, regenerating a left-out synthetic trace (``__getstate__``)."""
        self.__dict__.update(state)
        if self._replicas is None:
            self._bind_views()
        if self._tp_evaluator is None:
            self._tp_evaluator = self.sim.evaluator(
                tensor_parallel(self.num_layers, self.num_experts, self.num_nodes), self.batch)
        if self.trace is None:
            self.trace = self.config.load_trace()
            self._routing = (self.trace.orig_topk_ids if self.trace.orig_topk_ids is not None
                             else self.trace.topk_ids)


def _jsonable_state(state: Any) -> Any:
    """Return a bit generator's state with numpy values as plain Python values (JSON)."""
    if isinstance(state, dict):
        return {str(k): _jsonable_state(v) for k, v in state.items()}
    if isinstance(state, np.ndarray):
        return state.tolist()
    if isinstance(state, np.generic):
        return state.item()
    return state


def _generator(state: dict[str, Any]) -> np.random.Generator:
    """Return a Generator whose bit generator (numpy's, by name) has ``state``."""
    name = state["bit_generator"]
    if name not in ("PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"):
        raise ValueError(f"unknown bit generator {name!r}")
    bit = getattr(np.random, name)()
    bit.state = state
    return np.random.Generator(bit)

"""Public Gymnasium wrappers of ``HdMoE-v1`` that need only the env.

Implements two reshapings of the env's interface (paper-model.md §10–11 define the decisions
themselves; these wrappers change only how a policy sees or encodes them):

* :class:`FlattenReplicasWrapper` — the ``replicas`` observation [E, D] as a row-major [E·D]
  vector, the same observation as ``HdMoeEnv(flatten_replicas=True)``, for policies (and SB3's
  ``MultiInputPolicy``) that want only 1-D boxes.
* :class:`RankedBroadcastWrapper` — the action design that makes pre-broadcast learnable: a
  slot picks the c-th most-loaded predicted expert (§10.5's greedy priority order) instead of
  an expert id, so each slot has K + 1 values rather than E + 1.
* :class:`ReplicaSharesWrapper` — per-expert replica routing shares appended to the action
  (placements with redundant experts): the share of an expert's tokens its primary copy keeps.
* :class:`QualityRewardWrapper` — the reward charged for lost model quality (top-1 retention
  under gating), with a fixed weight or a Lagrange multiplier updated by dual ascent.

All are importable classes, so RL Zoo's ``env_wrapper`` option can name them, and all expose
``action_masks()`` (sb3-contrib's ``MaskablePPO``) mapped from the env's. The ranked and share
mappings are also available as pure functions (:func:`ranked_candidates`, :func:`ranked_mask`,
:func:`ranked_to_full`, :func:`replica_share_fractions`), which a trained agent applies at
inference on an unwrapped env.

A wrapper that needs an agent (the residual action over HDA-MoE) lives in ``agents.wrappers``:
the core never imports agents (style.md §2).
"""

from __future__ import annotations

from typing import Any, SupportsFloat

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

from hdamoe_env.env.actions import ActionLayout
from hdamoe_env.config.errors import ConfigError, InvalidAction

__all__ = [
    "FlattenReplicasWrapper",
    "QualityRewardWrapper",
    "RankedBroadcastWrapper",
    "ReplicaSharesWrapper",
    "ranked_candidates",
    "ranked_candidates_many",
    "ranked_mask",
    "ranked_mask_many",
    "ranked_to_full",
    "ranked_to_full_many",
    "replica_share_fractions",
    "replica_share_values",
]


def _inner_action_masks(env: gym.Env[Any, Any]) -> NDArray[np.bool_]:
    """Return the ``action_masks()`` of the nearest layer of ``env`` that defines one."""
    return np.asarray(env.get_wrapper_attr("action_masks")(), dtype=bool)


# -------------------------------------------------------------------------- flatten replicas
class FlattenReplicasWrapper(gym.ObservationWrapper[dict[str, NDArray[np.float32]], Any,
                                                    dict[str, NDArray[np.float32]]]):
    """Give the ``replicas`` observation as a row-major [E·D] vector instead of [E, D].

    The same observation as ``HdMoeEnv(..., flatten_replicas=True)``; every other key is passed
    through unchanged, and so are actions and ``action_masks()``. An env that already flattens
    is accepted (the wrapper is then the identity).

    Args:
        env: An ``HdMoE-v1`` env (or a wrapper of one) with a Dict observation holding
            ``replicas``.

    Raises:
        ConfigError: The observation space has no ``replicas`` Box.
    """

    def __init__(self, env: gym.Env[Any, Any]) -> None:
        super().__init__(env)
        obs_space = env.observation_space
        if not isinstance(obs_space, spaces.Dict) or "replicas" not in obs_space.spaces:
            raise ConfigError("FlattenReplicasWrapper needs a Dict observation with a "
                              f"'replicas' Box; got {obs_space}")
        box = obs_space.spaces["replicas"]
        assert isinstance(box, spaces.Box)
        size = int(np.prod(box.shape))
        flat = spaces.Box(np.asarray(box.low, dtype=box.dtype).reshape(size),
                          np.asarray(box.high, dtype=box.dtype).reshape(size), (size,),
                          box.dtype)
        self.observation_space = spaces.Dict({**obs_space.spaces, "replicas": flat})

    def observation(self, observation: dict[str, NDArray[np.float32]]
                    ) -> dict[str, NDArray[np.float32]]:
        """Return ``observation`` with ``replicas`` float32 [E·D] (row-major)."""
        out = dict(observation)
        out["replicas"] = np.ascontiguousarray(observation["replicas"]).reshape(-1).copy()
        return out

    def action_masks(self) -> NDArray[np.bool_]:
        """Return the env's flat action mask (actions are unchanged)."""
        return _inner_action_masks(self.env)


# ------------------------------------------------------------------------------ ranked actions
def ranked_candidates(pred_load: NDArray[Any], allowed: NDArray[np.bool_],
                      num_candidates: int) -> NDArray[np.int64]:
    """Return up to ``num_candidates`` broadcastable experts, highest predicted load first.

    Args:
        pred_load: float [E] predicted tokens per expert ÷ B (observation ``pred_load``).
        allowed: bool [E] experts the env allows in a slot (not already on every node).
        num_candidates: K.

    Returns:
        int64 [≤ K] expert ids with positive predicted load, by decreasing load (ties: lower id).
    """
    load = np.where(allowed, np.asarray(pred_load, dtype=np.float64).reshape(-1), -1.0)
    order = np.lexsort((np.arange(load.size), -load))
    return order[load[order] > 0][:num_candidates].astype(np.int64)


def ranked_mask(full_mask: NDArray[np.bool_], layout: ActionLayout,
                num_candidates: int, pred_load: NDArray[Any]) -> NDArray[np.bool_]:
    """Map a flat ``HdMoE-v1`` mask to the ranked action space (:class:`RankedBroadcastWrapper`).

    Args:
        full_mask: bool [sum(layout.nvec)] the env's ``action_masks()``.
        layout: The env's action layout.
        num_candidates: K.
        pred_load: float [E] the observation's ``pred_load``.

    Returns:
        bool [max_broadcast · (K + 1) + R + G (+ RR with a replica-rule dimension)]; "none"
        (value K) is always allowed.
    """
    parts = layout.split_mask(full_mask)
    cands = ranked_candidates(pred_load, parts[0][:layout.num_experts], num_candidates)
    slots = []
    for slot in range(layout.max_broadcast):
        m = np.zeros(num_candidates + 1, dtype=bool)
        m[num_candidates] = True                                    # "none" is always allowed
        if parts[slot][:layout.num_experts].any():
            m[:cands.size] = parts[slot][cands]
        slots.append(m)
    return np.concatenate([*slots, *parts[layout.max_broadcast:]])


def ranked_to_full(action: NDArray[Any], layout: ActionLayout, num_candidates: int,
                   pred_load: NDArray[Any], full_mask: NDArray[np.bool_] | None
                   ) -> NDArray[np.int64]:
    """Translate a ranked action into an ``HdMoE-v1`` action (slot value c → c-th candidate).

    Args:
        action: int [layout.size] in the ranked space (slot values 0..K, K = none; the
            dispatch, gating and replica-rule dimensions as in the env).
        layout: The env's action layout.
        num_candidates: K.
        pred_load: float [E] the observation's ``pred_load``.
        full_mask: The env's flat mask (None: every expert allowed).

    Returns:
        int64 [layout.size] in the env's space; a slot whose candidate does not exist becomes
        "none" (E).
    """
    allowed = (np.ones(layout.num_experts, dtype=bool) if full_mask is None
               else layout.split_mask(full_mask)[0][:layout.num_experts])
    cands = ranked_candidates(pred_load, allowed, num_candidates)
    action = np.asarray(action, dtype=np.int64).reshape(-1)
    full = np.full(layout.size, layout.none, dtype=np.int64)
    for slot in range(layout.max_broadcast):
        c = int(action[slot])
        if c < cands.size:
            full[slot] = cands[c]
    full[layout.max_broadcast:] = action[layout.max_broadcast:]
    return full


def ranked_candidates_many(pred_load: NDArray[Any], allowed: NDArray[np.bool_],
                           num_candidates: int) -> tuple[NDArray[np.int64], NDArray[np.int64]]:
    """:func:`ranked_candidates` of N copies at once (the batched training backend).

    Args:
        pred_load: float [N, E] predicted tokens per expert ÷ B of every copy.
        allowed: bool [N, E] experts each copy allows in a slot.
        num_candidates: K.

    Returns:
        ``(cands, count)``: int64 [N, K] and int64 [N]; row i's first ``count[i]`` entries
        are ``ranked_candidates(pred_load[i], allowed[i], K)`` (the rest is padding).
    """
    load = np.where(allowed, np.asarray(pred_load, dtype=np.float64), -1.0)
    order = np.argsort(-load, axis=1, kind="stable")      # = lexsort((arange, -load)) per row
    k = min(int(num_candidates), load.shape[1])
    cands = np.zeros((load.shape[0], int(num_candidates)), dtype=np.int64)
    cands[:, :k] = order[:, :k]
    count = np.minimum((load > 0).sum(axis=1), k).astype(np.int64)
    return cands, count


def ranked_mask_many(full_masks: NDArray[np.bool_], layout: ActionLayout,
                     num_candidates: int, pred_load: NDArray[Any]) -> NDArray[np.bool_]:
    """:func:`ranked_mask` of N copies at once: bool [N, ranked mask size] from [N, flat size].

    Row i equals ``ranked_mask(full_masks[i], layout, num_candidates, pred_load[i])``.
    """
    full_masks = np.asarray(full_masks, dtype=bool)
    n, e, k = full_masks.shape[0], layout.num_experts, int(num_candidates)
    ends = np.cumsum(layout.nvec)
    starts = ends - layout.nvec
    cands, count = ranked_candidates_many(pred_load, full_masks[:, :e], k)
    valid = np.arange(k)[None, :] < count[:, None]                      # [N, K]
    rows = np.arange(n)[:, None]
    out = [np.empty((n, 0), dtype=bool)]
    for slot in range(layout.max_broadcast):
        part = full_masks[:, starts[slot]:starts[slot] + e]
        m = np.zeros((n, k + 1), dtype=bool)
        m[:, k] = True                                                  # "none" always allowed
        m[:, :k] = part[rows, cands] & valid & part.any(axis=1)[:, None]
        out.append(m)
    out.append(full_masks[:, starts[layout.max_broadcast]:])
    return np.concatenate(out, axis=1)


def ranked_to_full_many(actions: NDArray[Any], layout: ActionLayout, num_candidates: int,
                        pred_load: NDArray[Any], full_masks: NDArray[np.bool_]
                        ) -> NDArray[np.int64]:
    """:func:`ranked_to_full` of N copies at once: int64 [N, layout.size].

    Row i equals ``ranked_to_full(actions[i], layout, num_candidates, pred_load[i],
    full_masks[i])``.
    """
    actions = np.asarray(actions, dtype=np.int64).reshape(len(full_masks), -1)
    e, mb = layout.num_experts, layout.max_broadcast
    cands, count = ranked_candidates_many(pred_load, np.asarray(full_masks, dtype=bool)[:, :e],
                                          num_candidates)
    slot_vals = actions[:, :mb]
    ok = (slot_vals >= 0) & (slot_vals < count[:, None])
    picked = np.take_along_axis(cands, np.clip(slot_vals, 0, cands.shape[1] - 1), axis=1)
    full = np.empty((actions.shape[0], layout.size), dtype=np.int64)
    full[:, :mb] = np.where(ok, picked, layout.none)
    full[:, mb:] = actions[:, mb:]
    return full


class RankedBroadcastWrapper(gym.Wrapper[Any, NDArray[np.int64], Any, NDArray[np.int64]]):
    """Action design for learning: slot value c picks the c-th most-loaded predicted expert.

    The raw ``HdMoE-v1`` slot has E + 1 values (E = 64 for DeepSeek-V2-Lite), so an untrained
    policy almost never samples "none" (1/65) and spends most of its steps learning that one
    value. Here a slot has K + 1 values: candidate c < K is the c-th broadcastable expert by
    predicted load ``pred_load`` (the greedy's own priority order, paper-model.md §10.5),
    K = none. Dispatch, gating and (with redundant experts) the replica rule are unchanged.
    Observations are unchanged.

    Action space: ``MultiDiscrete([K + 1] * max_broadcast + [R, G])``, plus the env's
    replica-rule dimension ``[RR]`` on a placement with redundant experts.

    Args:
        env: An ``HdMoE-v1`` env (or a wrapper of one that keeps its action space).
        num_candidates: K, the number of ranked candidates per slot.

    Raises:
        ConfigError: ``num_candidates`` < 1.
    """

    def __init__(self, env: gym.Env[Any, Any], num_candidates: int = 4) -> None:
        super().__init__(env)
        if int(num_candidates) < 1:
            raise ConfigError(f"num_candidates must be >= 1, got {num_candidates}")
        self.layout = ActionLayout.from_env(env)
        experts = int(env.unwrapped.model.num_experts)
        if int(num_candidates) > experts:
            raise ConfigError(f"num_candidates={num_candidates} exceeds the model's E={experts} "
                              f"experts; use at most {experts} (e.g. --candidates 4)")
        self.num_candidates = int(num_candidates)
        lay = self.layout
        if lay.max_broadcast < 1:
            raise ConfigError("the ranked action needs max_broadcast >= 1 pre-broadcast slot, "
                              "got 0; use --max-broadcast 1 or more")
        self.action_space = spaces.MultiDiscrete(
            [self.num_candidates + 1] * lay.max_broadcast
            + lay.nvec[lay.max_broadcast:].tolist())           # R, G (and RR with replicas)
        self._obs: Any = None

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[Any, dict[str, Any]]:
        """Reset the env and remember the observation (its ``pred_load`` ranks the experts)."""
        obs, info = self.env.reset(seed=seed, options=options)
        self._obs = obs
        return obs, info

    def sync_observation(self, obs: Any) -> None:
        """Take ``obs`` as the env's last observation (after the env's state was restored)."""
        self._obs = obs

    def _require_obs(self) -> Any:
        if self._obs is None:
            raise ConfigError("RankedBroadcastWrapper: call reset() before step() or "
                              "action_masks()")
        return self._obs

    def action_masks(self) -> NDArray[np.bool_]:
        """Return the env's mask mapped to the ranked space (:func:`ranked_mask`)."""
        return ranked_mask(_inner_action_masks(self.env), self.layout, self.num_candidates,
                           self._require_obs()["pred_load"])

    def step(self, action: NDArray[np.int64]
             ) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Translate the ranked action (:func:`ranked_to_full`) and step the env."""
        full = ranked_to_full(action, self.layout, self.num_candidates,
                              self._require_obs()["pred_load"], _inner_action_masks(self.env))
        obs, reward, terminated, truncated, info = self.env.step(full)
        self._obs = obs
        return obs, reward, terminated, truncated, info


# ------------------------------------------------------------------------- replica routing shares
def replica_share_values(levels: int, rule_value: bool = False) -> int:
    """Number of values of one share dimension: K + 1, or K + 2 with the rule value."""
    return int(levels) + (2 if rule_value else 1)


def replica_share_fractions(shares: NDArray[Any], replicas: NDArray[np.bool_],
                            levels: int, *, rule_value: bool = False) -> NDArray[np.float64]:
    """Map share values to the per-copy fractions of ``HdMoeEnv.set_replica_fractions``.

    Share value v ∈ {0, …, K} of expert e sends v / K of its tokens to its primary copy and
    splits the rest evenly over its replica nodes; an expert without a replica keeps every token
    on its primary copy (its value is ignored). With ``rule_value``, the values are
    {0, …, K + 1}: 0 leaves the expert to the least-loaded rule (an all-NaN row) and v ≥ 1
    means (v − 1) / K on the primary, so that value 0 everywhere is exactly the env's default
    replica dispatch (the residual start of a learned policy). The one mapping of
    :class:`ReplicaSharesWrapper` and of a learned agent trained with it
    (``agents.learned.policy.LearnedAgent``).

    Args:
        shares: int [E] share values in [0, K] ([0, K + 1] with ``rule_value``).
        replicas: bool [E, D] the layer's replica nodes (``Placement.replicas[layer]``).
        levels: K (>= 1).
        rule_value: Value 0 means "the least-loaded rule" (see above).

    Returns:
        float64 [E, 1 + D]: column 0 the primary copy, column 1 + d the replica on node d; every
        row sums to 1 (or is all NaN: the least-loaded rule).

    Raises:
        ConfigError: ``levels`` < 1, or shapes that do not match.
    """
    if int(levels) < 1:
        raise ConfigError(f"levels must be >= 1 share step, got {levels!r}")
    reps = np.asarray(replicas, dtype=np.float64)                        # [E, D]
    values = np.asarray(shares, dtype=np.float64).reshape(-1)
    if reps.ndim != 2 or values.size != reps.shape[0]:
        raise ConfigError(f"replica shares need one value per expert: got {values.size} values "
                          f"for replicas of shape {reps.shape} [experts, nodes]")
    rule = values == 0 if rule_value else np.zeros(values.size, dtype=bool)
    primary = (np.maximum(values - 1.0, 0.0) if rule_value else values) / int(levels)
    n_rep = reps.sum(axis=1)
    rest = np.where(n_rep > 0, (1.0 - primary) / np.maximum(n_rep, 1.0), 0.0)
    out = np.empty((reps.shape[0], 1 + reps.shape[1]))
    out[:, 0] = np.where(n_rep > 0, primary, 1.0)
    out[:, 1:] = reps * rest[:, None]
    out[rule & (n_rep > 0)] = np.nan
    return out


class ReplicaSharesWrapper(gym.Wrapper[Any, NDArray[np.int64], Any, NDArray[np.int64]]):
    """Per-expert replica routing shares as part of the action (redundant-expert placements).

    Appends one dimension per routed expert to the env's ``MultiDiscrete`` action: value
    v ∈ {0, …, K} sends the fraction v / K of the expert's tokens in this layer to its primary
    copy and splits the rest evenly over its replica nodes (experts without a replica ignore
    it). The wrapper turns it into per-copy fractions (:func:`replica_share_fractions`) and calls
    ``HdMoeEnv.set_replica_fractions`` before each step, so the replica dispatch runs the
    ``shares`` rule (``dispatch.dispatch_replicas``; the action's own replica-rule dimension
    is then ignored). Every value is legal (the added dimensions are never masked).

    With ``rule_value=True`` each dimension has K + 2 values: 0 leaves the expert's tokens to
    the least-loaded rule (the env's default replica dispatch) and v ≥ 1 means the fraction
    (v − 1) / K on the primary. An all-zero share vector then reproduces the env's default
    dispatch exactly, the start point of a residual policy (``hdamoe train --action-mode
    residual --replica-shares K``).

    Action space: ``MultiDiscrete([*env.action_space.nvec, *[K + 1] * E])`` (``K + 2`` with
    ``rule_value``). ``env`` may be an action wrapper (ranked, residual): the share dimensions
    follow its action space and ``action_masks()`` is its mask followed by all-True share masks.

    Args:
        env: An ``HdMoE-v1`` env with a redundant-expert placement, or a wrapper of one (e.g.
            :class:`RankedBroadcastWrapper` or ``agents.wrappers.ResidualHDAWrapper``).
        levels: K, the number of share steps (>= 1).
        rule_value: Add value 0 = "the least-loaded rule" (see above).

    Raises:
        ConfigError: ``levels`` < 1 or a placement without redundant experts.
    """

    def __init__(self, env: gym.Env[Any, Any], levels: int = 4, *,
                 rule_value: bool = False) -> None:
        super().__init__(env)
        if int(levels) < 1:
            raise ConfigError(f"levels must be >= 1 share step, got {levels!r}")
        base = env.unwrapped
        if getattr(base, "placement", None) is None or not base.placement.has_replicas:
            raise ConfigError("ReplicaSharesWrapper needs a placement with redundant experts "
                              "(Placement.replicas), e.g. the 'eplb' placement")
        self.levels = int(levels)
        self.rule_value = bool(rule_value)
        #: Values per share dimension (:func:`replica_share_values`).
        self.values = replica_share_values(self.levels, self.rule_value)
        self._inner = np.asarray(env.action_space.nvec, dtype=np.int64)
        E = base.num_experts
        self.action_space = spaces.MultiDiscrete(
            np.concatenate([self._inner, np.full(E, self.values, dtype=np.int64)]))

    def action_masks(self) -> NDArray[np.bool_]:
        """Return the env's mask followed by all-True masks of the share dimensions."""
        inner = _inner_action_masks(self.env)
        extra = np.ones(int(self.values * self.env.unwrapped.num_experts), dtype=bool)
        return np.concatenate([inner, extra])

    def fractions(self, shares: NDArray[np.int64], layer: int) -> NDArray[np.float64]:
        """Return the per-copy fractions [E, 1 + D] of share values ``shares`` [E] at ``layer``.

        :func:`replica_share_fractions` with the placement's replicas of ``layer``.
        """
        return replica_share_fractions(shares, self.env.unwrapped.placement.replicas[layer],
                                       self.levels, rule_value=self.rule_value)

    def step(self, action: NDArray[np.int64]
             ) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Set the share fractions of the current layer, then step the env with the rest."""
        a = np.asarray(action)
        n = self._inner.size
        if a.shape != self.action_space.shape:
            raise InvalidAction(f"action must have shape {self.action_space.shape} (env action "
                                f"+ one share per expert), got {a.shape}")
        shares = a[n:].astype(np.int64)
        if shares.min(initial=0) < 0 or shares.max(initial=0) > self.values - 1:
            raise InvalidAction(f"replica share values must lie in [0, {self.values - 1}], got "
                                f"{shares.tolist()}")
        base = self.env.unwrapped
        base.set_replica_fractions(self.fractions(shares, base.current_layer))
        try:
            return self.env.step(a[:n])
        finally:
            base.set_replica_fractions(None)     # never carried over to a later step


# ------------------------------------------------------------------------- reward with quality
class QualityRewardWrapper(gym.Wrapper[Any, Any, Any, Any]):
    """Charge the reward for the model quality gating gives up (top-1 retention).

    Every env step reports ``info["top1_retention"]``: the fraction of the layer's tokens
    whose top-1 expert survived hardware-aware gating (1.0 when gating is off). With
    ``q = info["top1_retention"]`` (1.0 if absent) and the target ``τ``, the reward becomes

        r' = r − λ · max(0, τ − q)

    * fixed weight (``lagrangian=False``): ``λ = weight`` throughout. Example: r = −0.9,
      τ = 0.99, q = 0.95, weight = 100 → r' = −0.9 − 100 · 0.04 = −4.9. The env's reward is
      ≈ −1 per layer (latency ÷ TP latency), so weight 100 makes one percentage point of lost
      top-1 retention on a layer cost as much as one whole TP layer.
    * Lagrangian (``lagrangian=True``): λ starts at ``lambda_init`` and, after each step, is
      updated by projected dual ascent on the signed constraint value g = τ − q:

          λ ← min(lambda_max, max(0, λ + dual_step · (τ − q)))

      so λ rises while steps violate the target, never goes below 0, and falls back while they
      satisfy it (q > τ). Over many steps λ settles where the *mean* retention meets τ — the
      constraint of the tuned-heuristic search (``agents.tuned``). The penalty of a step uses
      λ before its update. λ persists across episodes (it is the run's dual variable); every
      copy of a vectorised env keeps its own λ. Default ``dual_step`` 50: a layer with
      q = 0.8 raises λ by 9.5, an ungated layer (q = 1, τ = 0.99) lowers it by 0.5.

    ``info`` gains ``quality_lambda`` (λ used for this step), ``quality_violation``
    (max(0, τ − q)), ``quality_penalty`` (λ · violation) and ``latency_reward`` (the env's r).

    Args:
        env: An ``HdMoE-v1`` env or a wrapper of one.
        target: τ in [0, 1] (default 0.99).
        weight: λ of the fixed-weight form (>= 0).
        lagrangian: Use the Lagrangian form instead.
        dual_step: Step size of the dual ascent (> 0).
        lambda_init: Initial λ of the Lagrangian form (>= 0).
        lambda_max: Upper bound of λ (projection; > 0).

    Raises:
        ConfigError: A value outside its range.
    """

    def __init__(self, env: gym.Env[Any, Any], target: float = 0.99, weight: float = 100.0, *,
                 lagrangian: bool = False, dual_step: float = 50.0, lambda_init: float = 0.0,
                 lambda_max: float = 1e4) -> None:
        super().__init__(env)
        self.validate(target, weight, lagrangian=lagrangian, dual_step=dual_step,
                      lambda_init=lambda_init, lambda_max=lambda_max)
        self.target = float(target)
        self.weight = float(weight)
        self.lagrangian = bool(lagrangian)
        self.dual_step = float(dual_step)
        self.lambda_max = float(lambda_max)
        self.lam = min(float(lambda_init), self.lambda_max) if lagrangian else self.weight

    @staticmethod
    def validate(target: float = 0.99, weight: float = 100.0, *, lagrangian: bool = False,
                 dual_step: float = 50.0, lambda_init: float = 0.0,
                 lambda_max: float = 1e4) -> None:
        """Check the wrapper's arguments without an env (same rules as the constructor).

        Raises:
            ConfigError: A value outside its range.
        """
        if not 0.0 <= float(target) <= 1.0:
            raise ConfigError(f"quality target must lie in [0, 1], got {target}; e.g. 0.99")
        if float(weight) < 0 or float(lambda_init) < 0:
            raise ConfigError(f"quality weight and lambda_init must be >= 0, got {weight}, "
                              f"{lambda_init}")
        if float(dual_step) <= 0 or float(lambda_max) <= 0:
            raise ConfigError(f"dual_step and lambda_max must be > 0, got {dual_step}, "
                              f"{lambda_max}")

    def step(self, action: Any) -> tuple[Any, SupportsFloat, bool, bool, dict[str, Any]]:
        """Step the env and subtract the quality penalty (class docstring)."""
        obs, reward, terminated, truncated, info = self.env.step(action)
        q = float(info.get("top1_retention", 1.0))
        violation = max(0.0, self.target - q)
        lam = self.lam
        penalty = lam * violation
        info = dict(info, quality_lambda=lam, quality_violation=violation,
                    quality_penalty=penalty, latency_reward=float(reward))
        if self.lagrangian:
            self.lam = min(self.lambda_max, max(0.0, lam + self.dual_step * (self.target - q)))
        return obs, float(reward) - penalty, terminated, truncated, info

    def action_masks(self) -> NDArray[np.bool_]:
        """Return the env's flat action mask (actions are unchanged)."""
        return _inner_action_masks(self.env)

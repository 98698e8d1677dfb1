"""The per-layer hindsight oracle of the tuned heuristic, and its LP replica shares.

:func:`per_layer_oracle` is the per-step hindsight bound over the knob grid of
``agents.tuned.knobs`` (:class:`OracleResult` documents exactly what it bounds). With a placement
that has redundant experts every point also gets an :data:`~agents.tuned.knobs.LP_SHARES` twin
whose replicated experts' tokens are split by :func:`balanced_replica_fractions`, a linear
program on the layer's executed sets (scipy, the ``opt`` extra, imported lazily).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from agents.gating import HardwareAwareGatingAgent
from agents.tuned.knobs import LP_SHARES, TunedKnobs
from agents.tuned.search import OPT_INSTALL_HINT, DEFAULT_QUALITY_TARGET
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

__all__ = ["OracleResult", "balanced_replica_fractions", "per_layer_oracle"]


@dataclass(frozen=True)
class OracleResult:
    """Per-layer hindsight oracle over a knob grid, on identical draws.

    For every MoE layer of every decode step, every grid point's action (the point's greedy
    agent on the same observation, with the point's k_b budget) is evaluated by the env's layer
    physics (``DecisionEvaluator.evaluate``) on the layer's actual routing, with one generator
    seeded by (episode seed, decode step, layer) shared by all points, so all points see the
    same aggregator draws. Then

    * ``constrained``: per layer the fastest point whose top-1 retention *on that layer* is
      ≥ ``target`` (gating off always qualifies). No per-layer policy that picks one of the grid
      points' actions in each layer and keeps every layer's top-1 retention ≥ target can have a
      lower TBT on these steps: its TBT is a sum of per-layer terms, each ≥ the per-layer
      minimum. It does NOT bound a policy that meets the target only on average over layers,
      nor actions outside the grid (e.g. other broadcast sets).
    * ``unconstrained``: per layer the fastest point, quality ignored: a lower bound for every
      per-layer policy over the grid's actions, whatever its quality.

    TBT of a step = Σ_layers latency + the dense layers' time (as the env's ``tbt_us``).

    Attributes:
        points: The grid points, in order.
        fixed_tbt_us: float [K, S] TBT of each point held fixed, per decode step.
        fixed_top1: float [K] mean per-layer top-1 retention of each fixed point.
        constrained_tbt_us: float [S] the constrained oracle per decode step.
        constrained_top1: Mean top-1 retention of the constrained oracle's choices.
        unconstrained_tbt_us: float [S].
        unconstrained_top1: Mean top-1 retention of the unconstrained oracle's choices.
        target: The per-layer quality target.
        choices: How often each point was the constrained oracle's choice (per point, [K]).
        layer_s: float [S, K, L] every point's MoE-layer seconds per decode step and layer
            (the terms of the oracles; e.g. an oracle over a subset of the points).
        layer_top1: float [S, K, L] the matching per-layer top-1 retention.
        dense_s: Seconds per decode step outside the MoE layers (added to every TBT).
    """

    points: tuple[TunedKnobs, ...]
    fixed_tbt_us: np.ndarray
    fixed_top1: np.ndarray
    constrained_tbt_us: np.ndarray
    constrained_top1: float
    unconstrained_tbt_us: np.ndarray
    unconstrained_top1: float
    target: float
    choices: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    layer_s: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    layer_top1: np.ndarray = field(default_factory=lambda: np.zeros((0, 0, 0)))
    dense_s: float = 0.0

    def best_fixed(self) -> int | None:
        """Index of the fastest fixed point with mean top-1 retention ≥ target (None: none)."""
        ok = np.flatnonzero(self.fixed_top1 >= self.target)
        if ok.size == 0:
            return None
        means = self.fixed_tbt_us.mean(axis=1)
        return int(ok[np.argmin(means[ok])])

    def summary(self) -> dict[str, Any]:
        """Return the headline numbers as plain JSON values."""
        best = self.best_fixed()
        fixed = None if best is None else float(self.fixed_tbt_us[best].mean())
        cons = float(self.constrained_tbt_us.mean())
        return {
            "target": self.target,
            "decode_steps": int(self.constrained_tbt_us.size),
            "constrained_tbt_us": cons, "constrained_top1": self.constrained_top1,
            "unconstrained_tbt_us": float(self.unconstrained_tbt_us.mean()),
            "unconstrained_top1": self.unconstrained_top1,
            "best_fixed": None if best is None else self.points[best].to_dict(),
            "best_fixed_tbt_us": fixed,
            "best_fixed_top1": None if best is None else float(self.fixed_top1[best]),
            "constrained_over_best_fixed": None if fixed is None else cons / fixed,
            "unconstrained_over_best_fixed": (None if fixed is None else
                                              float(self.unconstrained_tbt_us.mean()) / fixed),
            "fixed": [{"knobs": p.to_dict(), "tbt_us": float(self.fixed_tbt_us[i].mean()),
                       "top1_retention": float(self.fixed_top1[i]),
                       "oracle_choices": int(self.choices[i]) if self.choices.size else 0}
                      for i, p in enumerate(self.points)],
        }


def balanced_replica_fractions(token_sets: np.ndarray, P: np.ndarray, replicas: np.ndarray
                               ) -> np.ndarray:
    """Per-copy fractions of the replicated experts that minimise the busiest node's tokens.

    The hindsight split of one layer's redundant experts (the ``shares`` replica rule of
    ``dispatch.dispatch_replicas``), from the layer's executed expert sets: a linear program
    over y_ej ≥ 0, the tokens of replicated expert e sent to copy j (copy 0 the primary group,
    its tokens counted on node c with weight P_ec; copy j ≥ 1 a whole replica node), with
    Σ_j y_ej = n_e, minimising T subject to, on every node c,
    Σ_{e not replicated} P_ec·n_e + Σ_e (y_e0·P_ec + y_e,c) ≤ T. Fluid token counts: the work
    per (token, expert) is the same for every expert of a layer, and the tile model's padding,
    weight streaming and the NoC are not in the objective (the DES measures the result).
    Experts without tokens, without replicas, or with an all-zero row of ``P`` (pre-broadcast)
    keep fraction 1 on the primary.

    Args:
        token_sets: int [B, k] expert sets of the layer.
        P: float [E, D] shares of the layer.
        replicas: bool [E, D] replica mask of the layer.

    Returns:
        float [E, 1 + D]: column 0 the primary's fraction, column 1 + c the replica on node c.

    Raises:
        DependencyNotInstalled: scipy (the ``opt`` extra) is missing.
        ConfigError: Bad shapes.
    """
    from hdamoe_env.decisions.dispatch import replica_inputs

    sets, shares, reps = replica_inputs(token_sets, P, replicas, "balanced_replica_fractions")
    E, D = shares.shape
    counts = np.bincount(sets.ravel(), minlength=E)[:E].astype(np.float64)
    out = np.zeros((E, 1 + D))
    out[:, 0] = 1.0
    movable = [e for e in range(E) if counts[e] > 0 and reps[e].any() and shares[e].sum() > 0]
    if not movable:
        return out
    try:
        from scipy.optimize import linprog
    except ImportError as exc:                                  # pragma: no cover - extra
        raise DependencyNotInstalled(f"the LP replica shares need scipy: {OPT_INSTALL_HINT}") from exc
    fixed = np.ones(E, dtype=bool)
    fixed[movable] = False
    base = (shares[fixed] * counts[fixed, None]).sum(axis=0)          # [D]
    columns: list[tuple[int, int]] = []                                # (expert, copy column)
    for e in movable:
        columns.append((e, 0))
        columns.extend((e, 1 + int(c)) for c in np.flatnonzero(reps[e]))
    n_var = len(columns) + 1                                           # + T
    a_ub = np.zeros((D, n_var))
    a_eq = np.zeros((len(movable), n_var))
    row = {e: i for i, e in enumerate(movable)}
    for j, (e, col) in enumerate(columns):
        if col == 0:
            a_ub[:, j] = shares[e]
        else:
            a_ub[col - 1, j] = 1.0
        a_eq[row[e], j] = 1.0
    a_ub[:, -1] = -1.0
    cost = np.zeros(n_var)
    cost[-1] = 1.0
    res = linprog(cost, A_ub=a_ub, b_ub=-base, A_eq=a_eq, b_eq=counts[movable],
                  bounds=[(0, None)] * n_var, method="highs")
    if res.status != 0:                                                # pragma: no cover
        raise ConfigError(f"the replica-share LP failed ({res.message}); please report it")
    y = np.maximum(res.x[:-1], 0.0)
    for j, (e, col) in enumerate(columns):
        out[e, col] = y[j] / counts[e]
    return out


class _LayerTap:
    """Stand-in for an env's ``decisions`` that reports every evaluated layer, then delegates."""

    def __init__(self, inner: Any, on_layer: Callable[..., None]) -> None:
        """Wrap ``inner``; ``on_layer(layer, token_sets, kwargs)`` runs before each evaluation."""
        self._inner = inner
        self._on_layer = on_layer

    def evaluate(self, layer: int, token_sets: np.ndarray, **kwargs: Any) -> Any:
        self._on_layer(layer, token_sets, kwargs)
        return self._inner.evaluate(layer, token_sets, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


def per_layer_oracle(env_kwargs: dict[str, Any], points: Iterable[TunedKnobs],
                     seeds: Sequence[int], *, target: float = DEFAULT_QUALITY_TARGET,
                     lp_shares: bool = True) -> OracleResult:
    """Compute the per-layer hindsight oracle over ``points`` on the seeds' episodes.

    A driver env (``env_kwargs``, gating at the default level, no broadcast) forms the decode
    steps, the observations and the router candidates; its layer evaluations are tapped, and
    for each one every point's action is evaluated with the point's own env's
    ``DecisionEvaluator`` (its ``protect_top``) and k_b, on one generator per (seed, decode
    step, layer). See :class:`OracleResult` for what the result bounds.

    With a placement that has redundant experts, each point runs its own replica rule, and
    (``lp_shares``) every point also gets an :data:`LP_SHARES` twin: the same action with the
    replicated experts' tokens split per layer by :func:`balanced_replica_fractions` of the
    layer's executed sets, the hindsight optimum of the share action
    (``hdamoe_env.env.wrappers.ReplicaSharesWrapper``) for the busiest node's token count.

    Args:
        env_kwargs: ``HdMoeEnv`` keyword arguments of the cell (loaded trace and placement
            recommended).
        points: Knob points (e.g. ``KnobGrid.points()``).
        seeds: Episode seeds (held-out ones for a held-out bound).
        target: Per-layer top-1 retention target of the constrained oracle.
        lp_shares: Add the :data:`LP_SHARES` twin of every point (placements with replicas).

    Raises:
        ConfigError: No points or no seeds.
    """
    from hdamoe_env.env.environment import HdMoeEnv

    pts = tuple(points)
    if not pts or not seeds:
        raise ConfigError("per_layer_oracle needs at least one point and one seed")
    base = dict(env_kwargs)
    driver = HdMoeEnv(**{**base, "gating_levels": (0.0, 1.0)})
    has_replicas = bool(driver.replica_rules)
    if has_replicas and lp_shares:
        have = {p.key() for p in pts}
        twins: dict[str, TunedKnobs] = {}
        for p in pts:                                  # one twin per point up to its rule
            q = dataclasses.replace(p, replica_rule=LP_SHARES)
            if q.key() not in have:
                twins.setdefault(q.key(), q)
        pts = pts + tuple(twins.values())
    envs: dict[str, Any] = {}
    knob_envs, policies = [], []
    for p in pts:
        kw = p.env_kwargs()
        key = json.dumps({k: kw[k] for k in sorted(kw)}, default=str)
        if key not in envs:
            envs[key] = HdMoeEnv(**{**base, **kw})
        knob_envs.append(envs[key])
        policies.append(p.make_agent(envs[key]))
    dense_s = float(driver.sim.dense_time(driver.batch))
    E, mb = driver.num_experts, driver.max_broadcast
    K = len(pts)
    step_lat: list[np.ndarray] = []     # [K, L] per decode step
    step_top1: list[np.ndarray] = []
    cur_lat = np.zeros((K, driver.num_layers))
    cur_top1 = np.ones((K, driver.num_layers))
    state: dict[str, Any] = {"obs": None, "seed": 0, "step": 0}

    def on_layer(layer: int, token_sets: np.ndarray, kw: dict[str, Any]) -> None:
        obs = state["obs"]
        rng_key = (int(state["seed"]), int(state["step"]), int(layer))
        cache: dict[tuple[Any, ...], tuple[float, float]] = {}
        for i, (env_i, agent) in enumerate(zip(knob_envs, policies, strict=True)):
            replica_rule = pts[i].replica_rule or (env_i.replica_rules[0] if has_replicas
                                                   else "least_loaded")
            kb = int(env_i.k_b[layer])
            frac = min(1.0, kb / env_i.max_broadcast) if env_i.max_broadcast else 0.0
            o = dict(obs, budget=np.array([frac], dtype=np.float32))
            action, _ = agent.predict(o, deterministic=True)
            a = np.asarray(action).tolist()
            bc: list[int] = []
            for v in a[:mb]:
                if v < E and v not in bc:
                    bc.append(int(v))
            lay = agent.layout
            rule = lay.dispatch_rules[a[lay.rule_slot]] if bc else "least_loaded"
            level = float(lay.gating_levels[a[lay.level_slot]])
            ckey = (id(env_i.decisions), tuple(bc), rule, level, replica_rule)
            hit = cache.get(ckey)
            if hit is None:
                candidates = kw.get("candidates") if level > 0 else None
                run_rule, fr = replica_rule, None
                if replica_rule == LP_SHARES:            # the LP on the sets the layer executes
                    executed = (token_sets if candidates is None else
                                env_i.decisions.gate(layer, candidates, level).sets)
                    P_layer = np.array(env_i.placement.P[layer], dtype=np.float64)
                    P_layer[bc] = 0.0                    # broadcast experts: not split by shares
                    fr = balanced_replica_fractions(executed, P_layer,
                                                    env_i.placement.replicas[layer])
                    run_rule = "shares"
                out = env_i.decisions.evaluate(
                    layer, token_sets, rng=np.random.default_rng(rng_key), broadcast=bc,
                    dispatch_rule=rule, gating_level=level, candidates=candidates,
                    fidelity=kw.get("fidelity", "des"), gamma=kw.get("gamma"),
                    replica_rule=run_rule, replica_fractions=fr)
                q = 1.0 if out.gating is None else float(out.gating.top1_retention)
                hit = cache[ckey] = (float(out.result.total_s), q)
            cur_lat[i, layer], cur_top1[i, layer] = hit

    driver.decisions = _LayerTap(driver.decisions, on_layer)
    driver_agent = HardwareAwareGatingAgent.from_env(driver, level=1.0)
    for seed in seeds:
        obs, _ = driver.reset(seed=int(seed))
        state.update(seed=int(seed), step=0)
        done = False
        while not done:
            state["obs"] = obs
            action, _ = driver_agent.predict(obs, deterministic=True)
            obs, _r, terminated, truncated, info = driver.step(action)
            done = bool(terminated or truncated)
            if "tbt_us" in info:
                step_lat.append(cur_lat.copy())
                step_top1.append(cur_top1.copy())
                state["step"] += 1
    lat = np.stack(step_lat)            # [S, K, L]
    top1 = np.stack(step_top1)
    fixed = (lat.sum(axis=2) + dense_s).T * 1e6                    # [K, S]
    ok = top1 >= target
    masked = np.where(ok, lat, np.inf)
    pick = masked.argmin(axis=1)                                    # [S, L]
    if not np.isfinite(np.take_along_axis(masked, pick[:, None, :], axis=1)).all():
        raise ConfigError("some layer has no grid point meeting the quality target; include "
                          "gating level 0 in the grid")
    cons = np.take_along_axis(lat, pick[:, None, :], axis=1)[:, 0, :]
    cons_q = np.take_along_axis(top1, pick[:, None, :], axis=1)[:, 0, :]
    upick = lat.argmin(axis=1)
    uncons = np.take_along_axis(lat, upick[:, None, :], axis=1)[:, 0, :]
    uncons_q = np.take_along_axis(top1, upick[:, None, :], axis=1)[:, 0, :]
    return OracleResult(
        points=pts, fixed_tbt_us=fixed, fixed_top1=top1.mean(axis=(0, 2)),
        constrained_tbt_us=(cons.sum(axis=1) + dense_s) * 1e6,
        constrained_top1=float(cons_q.mean()),
        unconstrained_tbt_us=(uncons.sum(axis=1) + dense_s) * 1e6,
        unconstrained_top1=float(uncons_q.mean()), target=float(target),
        choices=np.bincount(pick.ravel(), minlength=K).astype(np.int64),
        layer_s=lat, layer_top1=top1, dense_s=dense_s)

"""``HdMoeQualityEnv``: spend a top-1 retention budget on gating across layers and decode steps.

An episode is ``steps_per_episode`` (S) decode steps × L MoE layers of one
configuration (model, mesh, setting, batch, placement, profile: the arguments of ``HdMoE-v1``,
``EnvConfig``). At every (decode step, layer) the agent picks one gating action of a grid
(level × protect-top; level 0 = plain top-k), executed by the same compiled gating as
``HdMoE-v1`` (``gating.gated_sets``, the fused path of ``hardware_aware_gating``; the
reference path when the fused one does not apply).

**Budget.** The episode may lose at most ``budget = ⌊(1 − target) · B · L · S⌋`` top-1
choices: a row (token) of a layer *loses* its top-1 when the gated set no longer contains the
router's highest-scored candidate. ``target`` is an env argument (a number, or a sequence from
which every episode draws one; ``reset(options={"target": t})`` sets it) and is part of the
observation, so one policy can serve several targets.

**Costs known before acting.** The router scores of the current layer are known when it is
gated, so the env computes, for every action, the top-1 choices it would lose and the layer's
latency it would give, before the agent acts, and puts both in the observation. An action
whose loss exceeds the remaining budget is masked (``action_masks()``): every episode meets its
target [decision: masks, exact, instead of the Lagrangian of
``wrappers.QualityRewardWrapper``, which meets a target only on average]. Every action of the
space is legal: a masked one is coerced to action 0 (level 0, no loss) and reported in
``info["coerced"]``; ``invalid_action="raise"`` (strict) raises ``InvalidAction`` instead;
values outside the space raise ``InvalidAction`` in both modes.

**Latency.** The layer latency t_nm + t_comp + t_comm_moe of the gated sets on the placement,
from ``DecisionEvaluator.evaluate`` (no pre-broadcast) with the γ-calibrated analytic twin by
default (``fidelity="analytic"``; ``"des"`` on request: the observation's latencies then stay
the analytic estimate and the reward is the DES's). Every (decode step, layer) draws its
aggregators from its own generator, seeded by the episode and the position, the same for every
action (common random numbers): an action's latency does not depend on earlier actions, so the
episode's decisions are a multiple-choice knapsack (:func:`knapsack_oracle`).

**Reward** of a step: −t / T̄, t the layer's latency under the action, T̄ the mean TP latency
of the episode's S·L layers (fixed at reset; ``tensor_parallel`` with the same routing), so
−T̄·(return) is the episode's total MoE latency and a TP placement without gating earns ≈ −1 per
step. ``info["tbt_us"]`` at the end of each decode step adds the dense layers (the TBT of
``HdMoE-v1``).

Baselines in the same API (policies: env → action): :func:`single_scale_policy` (the paper's
HDA-MoE: one action for every layer and step), :func:`price_policy` (the greedy allocator: the
action minimising latency + λ·loss among the legal ones, λ tuned on training episodes), and the
hindsight bound :func:`knapsack_oracle` (exact dynamic programme over the integer losses, and its
LP relaxation) on :meth:`HdMoeQualityEnv.episode_table`. :func:`run_policy` runs one episode.

May import: hdamoe_env.config, hdamoe_env.decisions, hdamoe_env.sim, hdamoe_env.env, traces
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError, InvalidAction
from hdamoe_env.decisions import gating
from hdamoe_env.env.actions import discrete_action
from hdamoe_env.env.environment import HdMoeEnv
from hdamoe_env.sim import calibrate, sources
from hdamoe_env.sim.placement import tensor_parallel
from traces import batching

__all__ = ["DEFAULT_LEVELS", "DEFAULT_PROTECT", "QUALITY_FIDELITIES", "HdMoeQualityEnv",
           "KnapsackResult", "knapsack_oracle", "lp_bound", "price_policy", "run_policy",
           "single_scale_policy"]

#: Gating levels (multiples of the §11.7 coefficients) of the action grid, besides level 0.
DEFAULT_LEVELS: tuple[float, ...] = (0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0)
#: protect-top values of the grid (those ≥ k are dropped: they equal level 0).
DEFAULT_PROTECT: tuple[int, ...] = (0, 1, 2)
QUALITY_FIDELITIES = ("analytic", "des")
#: Tables of the last episodes kept (reset with the same seed reuses them).
_TABLE_CACHE = 8

Policy = Callable[["HdMoeQualityEnv"], int]


class HdMoeQualityEnv(gym.Env[NDArray[np.float32], np.int64]):
    """Spend a top-1 retention budget on hardware-aware gating (module docstring).

    ## Action Space
    ``Discrete(A)``: action 0 = level 0 (plain top-k); action 1 + i·P + j = level
    ``levels[i]`` with protect-top ``protect[j]`` (``action_names``). Masked actions (loss above
    the remaining budget) are coerced to 0 (``info["coerced"]``), or raise with
    ``invalid_action="raise"``.

    ## Observation Space
    ``Box`` float32 [2A + 5]:

    | slice | meaning | range |
    |---|---|---|
    | [0, A) | top-1 choices each action loses at this layer ÷ B | [0, 1] |
    | [A, 2A) | latency saved by each action ÷ the layer's level-0 latency (analytic) | [−1, 1] |
    | 2A | remaining budget ÷ episode budget (1 with a zero budget) | [0, 1] |
    | 2A+1 | remaining budget ÷ (B · decisions left), clipped | [0, 1] |
    | 2A+2 | decisions done ÷ S·L | [0, 1] |
    | 2A+3 | layer ÷ (L − 1) | [0, 1] |
    | 2A+4 | 1 − target | [0, 1] |

    ## Rewards
    −(layer latency) ÷ T̄, T̄ the episode's mean TP layer latency.

    ## Episode End
    ``terminated`` after S·L steps.
    """

    metadata: dict[str, Any] = {"render_modes": []}

    def __init__(self, *, target: float | Sequence[float] = 0.95,
                 levels: Sequence[float] = DEFAULT_LEVELS,
                 protect: Sequence[int] = DEFAULT_PROTECT, steps_per_episode: int = 4,
                 fidelity: str = "analytic", invalid_action: str = "coerce",
                 **env_kwargs: Any) -> None:
        """Build the env.

        Args:
            target: Top-1 retention target in [0, 1], or a non-empty sequence of them (one drawn
                per episode).
            levels: Gating levels > 0 of the grid (distinct).
            protect: protect-top values ≥ 0 of the grid; values ≥ k are dropped.
            steps_per_episode: Decode steps S per episode.
            fidelity: ``"analytic"`` (default) or ``"des"``: the evaluator of the reward.
            invalid_action: ``"coerce"`` (default) or ``"raise"`` for masked actions.
            **env_kwargs: Arguments of ``HdMoE-v1`` (``EnvConfig``: model, setting, mesh, batch,
                conventions, trace, placement, gating coefficients and penalties, ...).

        Raises:
            ConfigError: A bad argument.
        """
        super().__init__()
        targets = (target,) if np.isscalar(target) else tuple(target)
        if not targets or not all(isinstance(t, int | float | np.number)
                                  and not isinstance(t, bool) and 0.0 <= float(t) <= 1.0
                                  for t in targets):
            raise ConfigError(f"target must be a number in [0, 1] or a non-empty sequence of "
                              f"them, got {target!r}")
        self.targets = tuple(float(t) for t in targets)
        if fidelity not in QUALITY_FIDELITIES:
            raise ConfigError(f"fidelity must be one of {list(QUALITY_FIDELITIES)}, got "
                              f"{fidelity!r}")
        if invalid_action not in ("coerce", "raise"):
            raise ConfigError(f"invalid_action must be 'coerce' or 'raise', got "
                              f"{invalid_action!r}")
        if int(steps_per_episode) < 1:
            raise ConfigError(f"steps_per_episode must be >= 1, got {steps_per_episode}")
        lv = tuple(float(v) for v in levels)
        if not lv or not all(math.isfinite(v) and v > 0 for v in lv) or len(set(lv)) < len(lv):
            raise ConfigError(f"levels must be distinct finite numbers > 0, got {list(levels)}")
        for name in ("fidelity", "steps_per_episode", "gating_levels", "max_broadcast"):
            if name in env_kwargs:
                raise ConfigError(f"{name} is set by HdMoeQualityEnv, not an HdMoE-v1 argument "
                                  f"here")
        self.fidelity = fidelity
        self.invalid_action = invalid_action
        self.steps_per_episode = int(steps_per_episode)
        base = HdMoeEnv(fidelity="analytic", steps_per_episode=self.steps_per_episode,
                        max_broadcast=0, gating_levels=(0.0,), **env_kwargs)
        self.base = base
        self.model, self.sim, self.decisions = base.model, base.sim, base.decisions
        self.batch, self.num_layers, self.top_k = base.batch, base.num_layers, base.top_k
        pr = tuple(int(p) for p in protect)
        if not pr or min(pr) < 0 or len(set(pr)) < len(pr):
            raise ConfigError(f"protect must be distinct integers >= 0, got {list(protect)}")
        pr = tuple(p for p in pr if p < self.top_k)
        if not pr:
            raise ConfigError(f"protect leaves no value below k = {self.top_k}")
        self.levels, self.protect = lv, pr
        self.actions: tuple[tuple[float, int], ...] = ((0.0, 0),) + tuple(
            (v, p) for v in lv for p in pr)
        self.action_names = tuple("level 0" if v == 0 else f"level {v:g} protect {p}"
                                  for v, p in self.actions)
        A = len(self.actions)
        self.action_space = spaces.Discrete(A)
        low = np.zeros(2 * A + 5, dtype=np.float32)
        low[A:2 * A] = -1.0
        self.observation_space = spaces.Box(low, np.ones(2 * A + 5, dtype=np.float32),
                                            dtype=np.float32)
        cfg = base.config
        self._config = cfg
        self._trace = base.trace
        self._routing = (self._trace.orig_topk_ids if self._trace.orig_topk_ids is not None
                         else self._trace.topk_ids)
        self._scored = sources.with_router_scores(self._trace, int(cfg.trace_seed))
        L, E, D = self.num_layers, self.model.num_experts, base.num_nodes
        self._tp_eval = self.sim.evaluator(tensor_parallel(L, E, D), self.batch)
        self.dense_s = float(self.sim.dense_time(self.batch))
        self._gammas = (np.asarray(cfg.gammas, dtype=np.float64) if cfg.gammas is not None
                        else calibrate.twin_gammas(self.sim, base.placement, self._trace,
                                                   self._routing, cfg.view, self.batch,
                                                   int(cfg.gamma_seed)))
        opts = self.decisions.gating_options
        self._gate_opts = dict(comp_penalty=opts.get("comp_penalty", "marginal_max"),
                               comm_penalty=opts.get("comm_penalty", "dispersion"))
        self._cache: dict[int, dict[str, Any]] = {}
        self._ep: dict[str, Any] | None = None
        self._t = -1
        self._lost = 0
        self._step_s = 0.0
        self._tbts: list[float] = []
        self._target = self.targets[0]

    # ------------------------------------------------------------------ episode tables
    @property
    def num_decisions(self) -> int:
        """S·L decisions per episode."""
        return self.steps_per_episode * self.num_layers

    @property
    def target(self) -> float:
        """The current episode's top-1 retention target."""
        return self._target

    @property
    def budget(self) -> int:
        """Top-1 choices the episode may lose, ⌊(1 − target)·B·L·S⌋."""
        return int(math.floor((1.0 - self._target) * self.batch * self.num_decisions + 1e-9))

    @property
    def remaining(self) -> int:
        """Top-1 choices still to lose."""
        return self.budget - self._lost

    def _form_episode(self, key: int) -> dict[str, Any]:
        """Decode steps, candidates and TP reference of the episode with generator key ``key``."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        cfg, base = self._config, self.base
        rng = np.random.default_rng(key)
        kwargs: dict[str, Any] = {"n_steps": self.steps_per_episode, "view": cfg.view}
        if base.batch_mode == "streams":
            kwargs["cycle"] = True
        kwargs.update(dict(cfg.batch_options or {}))
        try:
            rows = batching.take(batching.make_steps(base.batch_mode, self._trace, self.batch,
                                                     rng, **kwargs), self.steps_per_episode)
        except ValueError as exc:
            raise ConfigError(f"cannot form decode steps of B={self.batch} from the trace: "
                              f"{exc}") from None
        if rows.shape[0] < self.steps_per_episode:
            raise ConfigError(f"the trace supplies only {rows.shape[0]} decode steps of "
                              f"B={self.batch}; the episode needs {self.steps_per_episode}")
        S, L, A = self.steps_per_episode, self.num_layers, len(self.actions)
        sets = np.stack([self._routing[:, r, :].astype(np.int64) for r in rows])   # [S, L, B, k]
        cands = [sources.step_candidates(self._scored, r) for r in rows]
        tp = np.stack([self._tp_eval.tp_totals(s) for s in sets])                  # [S, L]
        ep = {"rows": rows, "sets": sets, "cands": cands, "tp_mean": float(tp.mean()),
              "tp": tp, "lat": np.full((S, L, A), np.nan), "loss": np.full((S, L, A), -1,
                                                                           dtype=np.int64),
              "key": key}
        if len(self._cache) >= _TABLE_CACHE:
            self._cache.pop(next(iter(self._cache)))
        self._cache[key] = ep
        return ep

    def _gated(self, layer: int, cands: tuple[NDArray[np.int64], NDArray[np.float64]],
               level: float, protect: int) -> NDArray[np.int64]:
        dec = self.decisions
        r_comp, r_comm = dec.gating_coefficients
        P = dec.expected_shares[layer]
        tile = dec.gating_tile_cost(layer)
        out = gating.gated_sets(cands, self.top_k, P, dec.w_flops, dec.compute_flops,
                                level * r_comp, level * r_comm, protect_top=protect,
                                tile_cost=tile, **self._gate_opts)
        if out is None:
            out = gating.hardware_aware_gating(
                cands, self.top_k, P, dec.w_flops, dec.compute_flops, level * r_comp,
                level * r_comm, protect_top=protect, tile_cost=tile, diagnostics=False,
                **self._gate_opts).sets
        return out

    def _layer_rng(self, ep: dict[str, Any], step: int, layer: int) -> np.random.Generator:
        return np.random.default_rng(np.random.SeedSequence([ep["key"] % 2**63, step, layer]))

    def _latency(self, layer: int, sets: NDArray[np.int64], rng: np.random.Generator,
                 fidelity: str) -> float:
        res = self.decisions.evaluate(layer, sets, rng=rng, fidelity=fidelity,
                                      gamma=float(self._gammas[layer])).result
        return float(res.total_s)

    def _layer_candidates(self, ep: dict[str, Any], step: int, layer: int
                          ) -> tuple[NDArray[np.int64], NDArray[np.float64]]:
        ids, scores = ep["cands"][step]
        return np.ascontiguousarray(ids[layer]), np.ascontiguousarray(scores[layer])

    def _action_sets(self, ep: dict[str, Any], step: int, layer: int, a: int
                     ) -> NDArray[np.int64]:
        """The executed sets [B, k] of action ``a`` at (step, layer)."""
        if a == 0:
            return ep["sets"][step, layer]
        level, protect = self.actions[a]
        return self._gated(layer, self._layer_candidates(ep, step, layer), level, protect)

    def _fill(self, ep: dict[str, Any], step: int, layer: int) -> None:
        """Compute loss and analytic latency of every action at (step, layer) (cached)."""
        if ep["loss"][step, layer, 0] >= 0:
            return
        ids, scores = self._layer_candidates(ep, step, layer)
        B = self.batch
        top1 = ids[np.arange(B), np.argmax(scores, axis=1)]
        for a in range(len(self.actions)):
            s = self._action_sets(ep, step, layer, a)
            ep["loss"][step, layer, a] = 0 if a == 0 else int(
                B - np.count_nonzero((s == top1[:, None]).any(axis=1)))
            ep["lat"][step, layer, a] = self._latency(layer, s, self._layer_rng(ep, step, layer),
                                                      "analytic")

    def episode_table(self, fidelity: str = "analytic"
                      ) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        """Return the current episode's (latency s [S, L, A], lost top-1 [S, L, A]) of every
        action at every decision (hindsight: computes the layers not yet reached).

        Args:
            fidelity: ``"analytic"`` (the observation's estimates, the reward of the default
                env) or ``"des"`` (what a ``fidelity="des"`` env charges; S·L·A DES runs).

        Raises:
            ConfigError: Before ``reset``, or an unknown fidelity.
        """
        if self._ep is None:
            raise ConfigError("episode_table() needs reset() first")
        if fidelity not in QUALITY_FIDELITIES:
            raise ConfigError(f"fidelity must be one of {list(QUALITY_FIDELITIES)}, got "
                              f"{fidelity!r}")
        ep = self._ep
        for s in range(self.steps_per_episode):
            for layer in range(self.num_layers):
                self._fill(ep, s, layer)
        if fidelity == "des":
            if "lat_des" not in ep:
                lat = np.zeros_like(ep["lat"])
                for s, layer, a in np.ndindex(*lat.shape):
                    lat[s, layer, a] = self._latency(
                        layer, self._action_sets(ep, s, layer, a),
                        self._layer_rng(ep, s, layer), "des")
                ep["lat_des"] = lat
            return ep["lat_des"].copy(), ep["loss"].copy()
        return ep["lat"].copy(), ep["loss"].copy()

    # ------------------------------------------------------------------ observation
    def current_costs(self) -> tuple[NDArray[np.float64], NDArray[np.int64]]:
        """Return (analytic latency s [A], lost top-1 [A]) of every action at this decision."""
        s, layer = divmod(self._t, self.num_layers)
        self._fill(self._ep, s, layer)
        return self._ep["lat"][s, layer].copy(), self._ep["loss"][s, layer].copy()

    def action_masks(self) -> NDArray[np.bool_]:
        """Return bool [A]: the actions whose loss fits the remaining budget (action 0 always)."""
        if self._ep is None or self._t >= self.num_decisions:
            return np.ones(self.action_space.n, dtype=bool)
        _, loss = self.current_costs()
        return loss <= self.remaining

    def _obs(self) -> NDArray[np.float32]:
        A = len(self.actions)
        obs = np.zeros(2 * A + 5, dtype=np.float32)
        n = self.num_decisions
        if self._t < n:
            lat, loss = self.current_costs()
            obs[:A] = loss / self.batch
            obs[A:2 * A] = np.clip((lat[0] - lat) / lat[0], -1.0, 1.0) if lat[0] > 0 else 0.0
        obs[2 * A] = self.remaining / self.budget if self.budget > 0 else 1.0
        left = n - self._t
        obs[2 * A + 1] = min(1.0, self.remaining / (self.batch * left)) if left > 0 else 0.0
        obs[2 * A + 2] = min(self._t, n) / n
        obs[2 * A + 3] = ((self._t % self.num_layers) / (self.num_layers - 1)
                          if self.num_layers > 1 and self._t < n else 0.0)
        obs[2 * A + 4] = 1.0 - self._target
        return obs

    # ------------------------------------------------------------------ gymnasium
    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None
              ) -> tuple[NDArray[np.float32], dict[str, Any]]:
        """Draw the episode's decode steps (and target); return the first decision's view."""
        super().reset(seed=seed)
        options = options or {}
        key = int(self.np_random.integers(2**63))
        self._target = self.targets[int(self.np_random.integers(len(self.targets)))]
        if "target" in options:
            t = float(options["target"])
            if not 0.0 <= t <= 1.0:
                raise ConfigError(f"options['target'] must be in [0, 1], got {t}")
            self._target = t
        self._ep = self._form_episode(key)
        self._t = 0
        self._lost = 0
        self._step_s = 0.0
        self._tbts = []
        return self._obs(), {"budget": self.budget, "target": self._target,
                             "action_mask": self.action_masks()}

    def step(self, action: Any) -> tuple[NDArray[np.float32], float, bool, bool, dict[str, Any]]:
        """Gate the current layer with the action; score it; move to the next decision."""
        if self._ep is None or not 0 <= self._t < self.num_decisions:
            raise InvalidAction("step() called before reset() or after the episode ended")
        a = discrete_action(action, int(self.action_space.n))
        ep = self._ep
        s, layer = divmod(self._t, self.num_layers)
        lat, loss = self.current_costs()
        coerced: tuple[tuple[int, int, str], ...] = ()
        if loss[a] > self.remaining:
            if self.invalid_action == "raise":
                raise InvalidAction(f"action {a} ({self.action_names[a]}) loses {loss[a]} top-1 "
                                    f"choices, more than the remaining budget {self.remaining}; "
                                    f"see action_masks()")
            coerced = ((0, a, "masked"),)
            a = 0
        if self.fidelity == "analytic":
            t = float(lat[a])
        else:
            t = self._latency(layer, self._action_sets(ep, s, layer, a),
                              self._layer_rng(ep, s, layer), "des")
        self._lost += int(loss[a])
        self._step_s += t
        reward = -t / ep["tp_mean"]
        info: dict[str, Any] = {
            "decode_step": s, "layer": layer, "action": a, "action_name": self.action_names[a],
            "coerced": coerced, "lost": int(loss[a]), "remaining": self.remaining,
            "budget": self.budget, "target": self._target, "fidelity": self.fidelity,
            "total_us": t * 1e6, "ungated_us": float(lat[0]) * 1e6,
            "tp_total_us": float(ep["tp"][s, layer]) * 1e6}
        self._t += 1
        if layer == self.num_layers - 1:
            tbt = (self._step_s + self.dense_s) * 1e6
            self._tbts.append(tbt)
            info["tbt_us"] = tbt
            self._step_s = 0.0
        terminated = self._t >= self.num_decisions
        if terminated:
            info["episode_tbt_us"] = float(np.mean(self._tbts))
            info["top1_retention"] = 1.0 - self._lost / (self.batch * self.num_decisions)
        obs = self._obs()
        info["action_mask"] = self.action_masks()
        return obs, float(reward), terminated, False, info


# ---------------------------------------------------------------------------------- baselines
def single_scale_policy(action: int) -> Policy:
    """The paper's single-scale HDA-MoE: the same action at every layer and decode step
    (coerced to level 0 by the env once the budget cannot pay for it)."""
    return lambda env: int(action)


def price_policy(price: float) -> Policy:
    """Greedy allocator: the legal action minimising t_a / t_0 + ``price`` · loss_a / B.

    ``price`` (λ) is the fraction of the layer's level-0 latency that losing the top-1 choice
    of all B tokens of the layer is worth (0 = the fastest legal action while the budget
    lasts); tuned per target on training episodes (``benchmarks/quality_budget.py``).
    """
    lam = float(price)

    def act(env: HdMoeQualityEnv) -> int:
        lat, loss = env.current_costs()
        ok = loss <= env.remaining
        score = lat / lat[0] + lam * loss / env.batch
        return int(np.argmin(np.where(ok, score, np.inf)))
    return act


def run_policy(env: HdMoeQualityEnv, policy: Policy, seed: int,
               options: dict[str, Any] | None = None,
               on_step: Callable[[int, dict[str, Any]], None] | None = None
               ) -> dict[str, float]:
    """Run one episode; return its mean TBT (µs), top-1 retention, return and coercions."""
    env.reset(seed=int(seed), options=options)
    done, ret, n, coerced = False, 0.0, 0, 0
    info: dict[str, Any] = {}
    while not done:
        _, r, term, trunc, info = env.step(policy(env))
        if on_step is not None:
            on_step(n, info)
        ret += r
        n += 1
        coerced += len(info["coerced"])
        done = term or trunc
    return {"tbt_us": float(info["episode_tbt_us"]), "top1": float(info["top1_retention"]),
            "return": ret, "coerced": float(coerced)}


# ---------------------------------------------------------------------------------- oracle
@dataclass(frozen=True)
class KnapsackResult:
    """The hindsight multiple-choice knapsack of one episode.

    Attributes:
        latency_s: Σ latency of the optimal choices (exact DP).
        choices: int [N] the chosen action of every decision (flattened [S·L]).
        lost: Σ lost top-1 choices of ``choices`` (≤ the budget).
        lp_bound_s: The LP relaxation's value (≤ ``latency_s``).
        front_s: float [cap + 1] the optimum for every smaller budget b = 0 … cap
            (cap = min(budget, the largest possible loss)): the oracle's whole Pareto front.
    """

    latency_s: float
    choices: NDArray[np.int64]
    lost: int
    lp_bound_s: float
    front_s: NDArray[np.float64]


def lp_bound(lat: NDArray[np.float64], loss: NDArray[np.int64], budget: int) -> float:
    """Return the LP relaxation of the multiple-choice knapsack (a lower bound on Σ latency).

    Lagrangian dual max_λ≥0 Σ_n min_a (t_na + λ·loss_na) − λ·budget, which equals the LP
    relaxation's value (one convex constraint); the dual is concave piecewise linear in λ and
    maximised at a breakpoint, found by bisection on the subgradient over the candidate slopes.
    """
    t = np.asarray(lat, dtype=np.float64).reshape(-1, lat.shape[-1])
    w = np.asarray(loss, dtype=np.float64).reshape(t.shape)

    def dual(lam: float) -> tuple[float, float]:
        v = t + lam * w
        j = np.argmin(v, axis=1)
        rows = np.arange(t.shape[0])
        return float(v[rows, j].sum() - lam * budget), float(w[rows, j].sum() - budget)

    val0, g0 = dual(0.0)
    if g0 <= 0:
        return val0                       # the unconstrained optimum fits the budget
    # slopes where the argmin can change: (t_a − t_b)/(w_b − w_a) > 0
    cand = []
    for n in range(t.shape[0]):
        dt = t[n][:, None] - t[n][None, :]
        dw = w[n][None, :] - w[n][:, None]
        with np.errstate(divide="ignore", invalid="ignore"):
            r = dt / dw
        cand.append(r[(dw > 0) & (r > 0) & np.isfinite(r)])
    lams = np.unique(np.concatenate(cand + [np.zeros(1)]))
    lo, hi = 0, lams.size - 1
    while lo < hi:                            # first λ where the subgradient ≤ 0
        mid = (lo + hi) // 2
        if dual(float(lams[mid]))[1] <= 0:
            hi = mid
        else:
            lo = mid + 1
    best = max(dual(float(lams[i]))[0] for i in {max(lo - 1, 0), lo})
    return float(best)


def knapsack_oracle(lat: NDArray[np.float64], loss: NDArray[np.int64], budget: int
                    ) -> KnapsackResult:
    """Return the exact hindsight optimum of an episode's gating choices under the budget.

    Multiple-choice knapsack: one action per decision n, minimise Σ t_{n,a} subject to
    Σ loss_{n,a} ≤ budget; exact dynamic programme over the integer budget (O(N·A·budget)),
    with the LP relaxation (:func:`lp_bound`) for the record.

    Args:
        lat: float [..., A] latency of every action at every decision.
        loss: int [..., A] lost top-1 choices, ≥ 0, with an action of loss 0 at every decision.
        budget: Integer budget ≥ 0.

    Raises:
        ConfigError: Shapes differ, a negative loss or budget, or a decision without a free
            action.
    """
    t = np.asarray(lat, dtype=np.float64)
    t = t.reshape(-1, t.shape[-1])
    w = np.asarray(loss, dtype=np.int64).reshape(t.shape) if np.shape(loss) == np.shape(lat) \
        else None
    if w is None:
        raise ConfigError(f"lat and loss must have the same shape, got {np.shape(lat)} and "
                          f"{np.shape(loss)}")
    budget = int(budget)
    if budget < 0 or (w < 0).any() or not (w.min(axis=1) == 0).all():
        raise ConfigError("knapsack_oracle needs budget >= 0, losses >= 0 and a free action "
                          "at every decision")
    N, A = t.shape
    cap = min(budget, int(w.max(axis=1).sum()))
    dp = np.zeros(cap + 1)                         # dp[b]: min Σ t of decisions so far, loss ≤ b
    arg = np.zeros((N, cap + 1), dtype=np.int64)
    for n in range(N):
        new = np.full(cap + 1, np.inf)
        for a in range(A):
            c = int(w[n, a])
            if c > cap:
                continue
            cand = np.full(cap + 1, np.inf)
            cand[c:] = dp[:cap + 1 - c] + t[n, a]
            better = cand < new
            new[better] = cand[better]
            arg[n, better] = a
        dp = new
    choices = np.zeros(N, dtype=np.int64)
    b = cap
    for n in range(N - 1, -1, -1):
        a = int(arg[n, b])
        choices[n] = a
        b -= int(w[n, a])
    lost = int(w[np.arange(N), choices].sum())
    return KnapsackResult(latency_s=float(dp[cap]), choices=choices, lost=lost,
                          lp_bound_s=lp_bound(t, w, budget), front_s=dp)

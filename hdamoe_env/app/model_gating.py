"""Hardware-aware gating inside a real model's forward pass (paper-model.md §11–12).

``traces.capture.record.RoutingRecorder`` patches a routing *policy* into the routers of a transformers MoE
model; this module builds the hardware-aware one from the package's pure gating functions
(``hdamoe_env.decisions.gating.hardware_aware_gating``: the sequential greedy of §11.2 with the
``marginal_max`` computation and ``dispersion`` communication penalties of §11.3–11.4, selection
over all experts, weights = the original probabilities post-processed by the model's rule, §11.5).
It lives in ``agents`` because ``traces`` may not import the core (style.md §2).

Hardware view [decision, stated in every result]: the recorded model's routing (E, k and its own
number of MoE layers L) is evaluated with the layer shapes (h, I, attention) of a model preset —
by default Mixtral-8x7B, whose E = 8 and k = 2 match the tiny model — with ``num_moe_layers``
replaced by L. Penalties use that preset's w = F_e and the setting's C (under a profile with the
tile model, the evaluator's tile-model node cost, ``sim.online.gating_tile_cost``); the
coefficients are
``level × (r_comp, r_comm)`` of the preset's §11.7 defaults; the placement is EP (seeded) or TP.
Gating is applied to consecutive rows in chunks of ``batch`` (one decode step of B tokens; the
running counts restart with every chunk), and :meth:`GatingSetup.simulate` runs exactly those
chunks as decode steps through ``hdamoe_env.sim.simulator.MoESimulator`` with the original and the
gated routing.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.decisions import gating
from hdamoe_env.cost import perf
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.sim.online import gating_tile_cost
from hdamoe_env.sim.placement import TRIVIAL_PLACEMENTS, Placement, placement_by_name
from hdamoe_env.config.profiles import Conventions, get_profile
from hdamoe_env.config.specs import HardwareSpec, ModelSpec, get_model, hardware_from_setting
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = ["GatingSetup", "RoutingPolicy", "hag_policy"]

RoutingPolicy = Callable[[int, NDArray[np.float64], NDArray[np.int64]], NDArray[np.int64]]


def hag_policy(P: NDArray[np.float64], w_flops: float, compute_flops: float, r_comp: float,
               r_comm: float, *, batch: int = 32, renormalize: bool = True,
               tile_costs: Sequence[gating.TileCost | None] | None = None,
               **options: Any) -> RoutingPolicy:
    """Return a routing policy running hardware-aware gating on chunks of ``batch`` rows.

    Args:
        P: float [L, E, D] placement shares (layer l's matrix gates layer l).
        w_flops: Work per (token, expert), FLOP.
        compute_flops: Node throughput C, FLOP/s.
        r_comp: Computation coefficient (1/s, negative).
        r_comm: Communication coefficient (negative).
        batch: Rows gated together (a decode step); counts restart per chunk.
        renormalize: Passed to the gating (does not affect the selected sets).
        tile_costs: Per layer, the evaluator's tile-model node cost of ``P[layer]``
            (``gating_tile_cost``), or None for the fluid penalties.
        **options: Further ``hardware_aware_gating`` options (``protect_top``, ...).

    Returns:
        ``policy(layer, scores [N, E], orig_ids [N, k]) -> ids [N, k]``.
    """
    if batch < 1:
        raise ConfigError(f"gating batch must be >= 1, got {batch}")

    def policy(layer: int, scores: NDArray[np.float64], orig: NDArray[np.int64]
               ) -> NDArray[np.int64]:
        k = orig.shape[1]
        if r_comp == 0 and r_comm == 0:
            return orig.copy()
        out = np.empty_like(orig)
        for start in range(0, scores.shape[0], batch):
            chunk = scores[start:start + batch]
            res = gating.hardware_aware_gating(
                chunk, k, P[layer], w_flops, compute_flops, r_comp, r_comm,
                renormalize=renormalize, diagnostics=False,
                tile_cost=None if tile_costs is None else tile_costs[layer], **options)
            out[start:start + batch] = res.sets
        return out

    return policy


@dataclass(frozen=True, eq=False)
class GatingSetup:
    """Hardware, placement and coefficients used to gate (and simulate) a recorded model.

    Attributes:
        model: ModelSpec of the simulated model (preset shapes, the recorded model's L).
        hw: Hardware spec.
        conv: Convention profile.
        placement: Placement of the L layers.
        coefficients: Default (r_comp, r_comm) of the preset and setting (§11.7).
        coefficient_source: Where they come from.
    """

    model: ModelSpec
    hw: HardwareSpec
    conv: Conventions
    placement: Placement
    coefficients: tuple[float, float]
    coefficient_source: str

    @classmethod
    def for_model(cls, num_experts: int, top_k: int, num_layers: int, *,
                  sim_model: str = "mixtral-8x7b", setting: str = RUN_DEFAULTS.setting,
                  mesh: str = RUN_DEFAULTS.mesh,
                  conventions: str | Conventions = "paper", placement: str = "ep",
                  seed: int = 0
                  ) -> GatingSetup:
        """Build the setup for a recorded model with E experts, top-k and L MoE layers.

        Raises:
            ConfigError: The preset's E or k differ from the recorded model's, or an unknown
                placement name.
        """
        base = get_model(sim_model)
        if (base.num_experts, base.top_k) != (num_experts, top_k):
            raise ConfigError(
                f"--sim-model {sim_model!r} has E={base.num_experts}, k={base.top_k} but the "
                f"recorded model has E={num_experts}, k={top_k}; choose a preset with the same "
                "E and k (mixtral-8x7b for E=8, k=2)")
        spec = dataclasses.replace(base, key=f"{base.key}@L{num_layers}",
                                   name=f"{base.name} layer shapes, {num_layers} MoE layers",
                                   num_moe_layers=int(num_layers))
        hw = hardware_from_setting(setting, mesh)
        conv = get_profile(conventions)
        if placement not in TRIVIAL_PLACEMENTS:
            raise ConfigError(f"unknown placement {placement!r}; expected 'ep' or 'tp'")
        plc = placement_by_name(placement, spec, hw.num_nodes, seed, record_seed=False)
        coef, source = gating.default_coefficients(base.key, hw.setting, conv.expert_matrices)
        return cls(spec, hw, conv, plc, coef, source)

    @property
    def w_flops(self) -> float:
        """Work per (token, expert) of the simulated model, FLOP."""
        return perf.expert_flops(self.model, self.conv)

    def policy(self, level: float, *, batch: int = 32, **options: Any) -> RoutingPolicy:
        """Return the hardware-aware policy with coefficients ``level × defaults``."""
        tiles = [gating_tile_cost(P, self.model, self.hw, self.conv) for P in self.placement.P]
        return hag_policy(self.placement.P, self.w_flops, self.hw.compute_flops,
                          level * self.coefficients[0], level * self.coefficients[1],
                          batch=batch, renormalize=self.model.renormalize_topk,
                          tile_costs=tiles, **options)

    def simulate(self, orig_ids: NDArray[np.integer[Any]], new_ids: NDArray[np.integer[Any]],
                 *, batch: int = 32, seed: int = 0) -> dict[str, float]:
        """Simulate the chunks of ``batch`` consecutive rows as decode steps, both routings.

        Only complete chunks are simulated; both routings use the same aggregator seed per step.

        Args:
            orig_ids: int [L, N, k] original routing.
            new_ids: int [L, N, k] adjusted routing of the same rows.
            batch: B.
            seed: Seed of the aggregator draws.

        Returns:
            Mean TBT (µs) of both, the speed-up TBT_orig / TBT_gated, the steps, and the mean
            expert-compute and MoE-communication times per step (µs).
        """
        from hdamoe_env.sim.simulator import MoESimulator

        sim = MoESimulator(self.model, self.hw, "mesh", self.conv)
        orig = np.asarray(orig_ids, dtype=np.int64)
        new = np.asarray(new_ids, dtype=np.int64)
        steps = orig.shape[1] // batch
        if steps < 1:
            raise ConfigError(f"{orig.shape[1]} rows are fewer than one step of B={batch}")
        out: dict[str, list[float]] = {k: [] for k in ("o", "g", "oc", "gc", "om", "gm")}
        for step in range(steps):
            rows = slice(step * batch, (step + 1) * batch)
            ss = np.random.SeedSequence([seed, step])
            r_o = sim.step(self.placement, orig[:, rows], rng=np.random.default_rng(ss))
            r_g = sim.step(self.placement, new[:, rows], rng=np.random.default_rng(ss))
            out["o"].append(r_o.tbt_s)
            out["g"].append(r_g.tbt_s)
            out["oc"].append(sum(lr.t_comp_s for lr in r_o.layers))
            out["gc"].append(sum(lr.t_comp_s for lr in r_g.layers))
            out["om"].append(sum(lr.t_comm_moe_s for lr in r_o.layers))
            out["gm"].append(sum(lr.t_comm_moe_s for lr in r_g.layers))
        mean = {k: float(np.mean(v)) * 1e6 for k, v in out.items()}
        return {"tbt_orig_us": mean["o"], "tbt_gated_us": mean["g"],
                "speedup": mean["o"] / mean["g"], "sim_steps": steps,
                "t_comp_orig_us": mean["oc"], "t_comp_gated_us": mean["gc"],
                "t_comm_orig_us": mean["om"], "t_comm_gated_us": mean["gm"]}

    def describe(self) -> dict[str, Any]:
        """Return the setup as a JSON-ready dict."""
        return {"model": self.model.to_dict(), "setting": self.hw.setting,
                "mesh": list(self.hw.mesh_shape), "conventions": self.conv.name,
                "placement": self.placement.method, "coefficients": list(self.coefficients),
                "coefficient_source": self.coefficient_source, "w_flops": self.w_flops,
                "compute_flops": self.hw.compute_flops}

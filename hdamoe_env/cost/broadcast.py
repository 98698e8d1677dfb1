"""Pre-broadcast closed forms (paper-model.md §10.3–10.4): budget, α–β broadcast model, k_b.

The time budget a layer offers for broadcasting the next layer's hot experts (``layer``:
t_nm + t_comp of the layer; ``hd``: the conference formula of §10.3, Q14), the pipelined α–β
model of broadcasting m experts' weights (payload S, depth H, start-up α per message, link
bandwidth), the number of broadcast slots k_b that fit the budget, and the plan of one layer
that puts them together (``BroadcastPlan``, ``broadcast_plan``, ``broadcast_slots``). Pure
functions in SI units, scalar or array arguments, as in :mod:`hdamoe_env.cost.perf`. The DES of
the same traffic is ``hdamoe_env.noc.broadcast.simulate_broadcast``; which experts are
broadcast is ``hdamoe_env.decisions.broadcast.priority_broadcast``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.cost.nonmoe import generic_terms
from hdamoe_env.cost.perf import expert_bytes
from hdamoe_env.cost.units import FloatOrArray, as_output, check_tokens, check_positive
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec

__all__ = ["HD_BUDGET_CTX_LEN", "BroadcastPlan", "broadcast_budget", "broadcast_chunk",
           "broadcast_depth", "broadcast_payload", "broadcast_plan", "broadcast_slots",
           "broadcast_time", "broadcast_time_chunked", "hd_budget", "num_broadcast"]

#: L_ctx of the conference pre-broadcast budget formula (§10.3, Q14).
HD_BUDGET_CTX_LEN = 1024


# --------------------------------------------------------------------------------------------
# §10.3–10.4 Pre-broadcast: budget, α–β broadcast model, k_b
# --------------------------------------------------------------------------------------------


def broadcast_time_chunked(
    c: ArrayLike,
    m: ArrayLike,
    S: float,
    H: float,
    alpha: float,
    bw: float,
) -> FloatOrArray:
    """Return T_bc(c; m) = α·(H + S/c) + β·m·(S + c·H), a pipelined broadcast (§10.4).

    m experts of S bytes each are broadcast together in chunks of c bytes over a pipeline of H
    hops, sharing every link; β = 1/BW.

    Args:
        c: Chunk size, bytes (scalar or array, > 0).
        m: Number of experts broadcast together (scalar or array).
        S: Payload per expert, bytes.
        H: Pipeline depth, hops.
        alpha: Start-up latency per message, seconds.
        bw: Link bandwidth, B/s.

    Returns:
        Seconds, broadcast shape of ``c`` and ``m``.
    """
    chunk = np.asarray(c, dtype=np.float64)
    beta = 1.0 / check_positive("bw", bw)
    count = np.asarray(m, dtype=np.float64)
    return as_output(alpha * (H + S / chunk) + beta * count * (S + chunk * H))


def broadcast_chunk(m: ArrayLike, S: float, H: float, alpha: float, bw: float) -> FloatOrArray:
    """Return the optimal chunk size c*(m) = sqrt(α·S/(β·m·H)) (§10.4).

    Args:
        m: Number of experts broadcast together (scalar or array, > 0).
        S: Payload per expert, bytes.
        H: Pipeline depth, hops.
        alpha: Start-up latency per message, seconds.
        bw: Link bandwidth, B/s.

    Returns:
        Bytes, shape of ``m``.
    """
    beta = 1.0 / check_positive("bw", bw)
    count = np.asarray(m, dtype=np.float64)
    return as_output(np.sqrt(alpha * S / (beta * count * H)))


def broadcast_time(m: ArrayLike, S: float, H: float, alpha: float, bw: float) -> FloatOrArray:
    """Return T_bc*(m) = α·H + β·m·S + 2·sqrt(α·β·m·S·H), the broadcast time at c*(m) (§10.4).

    [decision] T_bc*(0) = 0: nothing is broadcast (the formula would give α·H).

    Args:
        m: Number of experts broadcast together (scalar or array, >= 0).
        S: Payload per expert, bytes.
        H: Pipeline depth, hops.
        alpha: Start-up latency per message, seconds.
        bw: Link bandwidth, B/s.

    Returns:
        Seconds, shape of ``m``.
    """
    beta = 1.0 / check_positive("bw", bw)
    count = np.asarray(m, dtype=np.float64)
    time = alpha * H + beta * count * S + 2.0 * np.sqrt(alpha * beta * count * S * H)
    return as_output(np.where(count > 0, time, 0.0))


def broadcast_payload(model: ModelSpec, conv: Conventions) -> float:
    """Return the broadcast payload S of one expert, bytes (§10.4, Q15).

    * ``bc_payload="paper"``: 2·h·I (two matrices at one byte, the reference's value);
    * ``bc_payload="weights"``: W_e = m·h·I·b_w, the expert's weights as counted everywhere
      else (``faithful``: 3·h·I·2). [decision] W_e rather than a literal 3·h·I·b_w, so that the
      broadcast moves exactly the bytes a node streams when it computes the replica (§10.8).

    Args:
        model: The model (h, I).
        conv: The conventions (``bc_payload``, m, b_w).

    Returns:
        Bytes.
    """
    if conv.bc_payload == "paper":
        return float(2 * model.hidden_size * model.expert_intermediate)
    return expert_bytes(model, conv)


def broadcast_depth(conv: Conventions, num_nodes: int, diameter: int | None = None) -> float:
    """Return the broadcast pipeline depth H, hops (§10.4).

    * ``bc_depth="2sqrtD"`` (``paper*``): 2·√D, even for non-square meshes (Q15);
    * ``bc_depth="diameter"`` (``faithful``): the topology diameter ((X−1)+(Y−1) for a mesh,
      ⌊X/2⌋+⌊Y/2⌋ for a torus, 6 for the fat-tree; ``Topology.diameter``).

    Args:
        conv: The conventions (``bc_depth``).
        num_nodes: D.
        diameter: The topology diameter in hops; required for ``"diameter"``.

    Returns:
        Hops (a float: 2·√D is not an integer).

    Raises:
        ConfigError: ``bc_depth="diameter"`` and no diameter was given.
    """
    if conv.bc_depth == "2sqrtD":
        return 2.0 * math.sqrt(num_nodes)
    if diameter is None:
        raise ConfigError(
            "bc_depth='diameter' needs the topology diameter; pass "
            "diameter=topology.diameter (or use bc_depth='2sqrtD')"
        )
    return float(diameter)


def hd_budget(
    model: ModelSpec,
    hw: HardwareSpec,
    B: ArrayLike,
    ctx_len: int = HD_BUDGET_CTX_LEN,
) -> FloatOrArray:
    """Return the ``paper*`` pre-broadcast budget (§10.3, the conference formula, Q14).

    t_budget = (3·B·h² + 2·B·L_ctx·h + B·h² + 2·k·B·I·h)/(D·C)
             + (2·B·h·L_ctx + 3·h·(B+h) + h·(B+h) + 2·E·I·h + B·h·(I/h+1))/(D·BW_mem),
    i.e. the generic non-MoE term with L_ctx = 1024 plus the MoE FFN at one matrix per expert.
    It is the reference's formula with its constants, so it takes no conventions.

    Args:
        model: The model.
        hw: The hardware (D, C, BW_mem).
        B: Tokens per decode step (scalar or array).
        ctx_len: L_ctx, default 1024.

    Returns:
        Seconds, shape of ``B``.
    """
    batch = check_tokens(B)
    flops, nbytes = generic_terms(model, batch, float(ctx_len))
    h, inter = model.hidden_size, model.expert_intermediate
    flops = flops + 2 * model.top_k * batch * inter * h  # the MoE FFN of the layer (2·h·I)
    nodes = hw.num_nodes
    return as_output(flops / (nodes * hw.compute_flops) + nbytes / (nodes * hw.mem_bw_Bps))


def broadcast_budget(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    t_nm_s: ArrayLike | None = None,
    t_comp_s: ArrayLike | None = None,
) -> FloatOrArray:
    """Return the time a pre-broadcast may hide behind (§10.3).

    * ``bc_budget="hd"`` (``paper*``): ``hd_budget`` (one value per run);
    * ``bc_budget="layer"`` (``faithful``): t_nm(l) + t_comp(l) of the layer the broadcast hides
      behind (static evaluator at the current B), passed in by the caller.

    Args:
        model: The model.
        hw: The hardware.
        conv: The conventions (``bc_budget``).
        B: Tokens per decode step.
        t_nm_s: The layer's non-MoE time, seconds (``"layer"`` only).
        t_comp_s: The layer's expert phase, seconds (``"layer"`` only).

    Returns:
        Seconds.

    Raises:
        ConfigError: ``bc_budget="layer"`` without ``t_nm_s`` and ``t_comp_s``.
    """
    if conv.bc_budget == "hd":
        return hd_budget(model, hw, B)
    if t_nm_s is None or t_comp_s is None:
        raise ConfigError(
            "bc_budget='layer' needs the layer's t_nm_s and t_comp_s (static "
            "evaluator at the current B); pass both, or use bc_budget='hd'"
        )
    return as_output(np.asarray(t_nm_s, np.float64) + np.asarray(t_comp_s, np.float64))


def num_broadcast(
    budget_s: float,
    S: float,
    H: float,
    alpha: float,
    bw: float,
    max_m: int,
) -> int:
    """Return k_b = max{m ∈ 0..max_m : T_bc*(m) < budget} (§10.3).

    T_bc*(m) increases with m, so this is the reference's search "m = 1, 2, … while
    T_bc*(m) < t_budget; k_b = m − 1", capped at ``max_m`` (e.g. E).

    Args:
        budget_s: The budget, seconds.
        S: Payload per expert, bytes.
        H: Pipeline depth, hops.
        alpha: Start-up latency per message, seconds.
        bw: Link bandwidth, B/s.
        max_m: Largest admissible k_b (>= 0).

    Returns:
        k_b.
    """
    if max_m < 0:
        raise ConfigError(f"max_m must be >= 0, got {max_m}")
    counts = np.arange(1, max_m + 1)
    fits = np.asarray(broadcast_time(counts, S, H, alpha, bw)) < budget_s
    # Number of leading fits (T_bc* is monotone, so this equals fits.sum()).
    return int(max_m if fits.all() else np.argmin(fits))


# --------------------------------------------------------------------------------------------
# §10.3–10.4 The plan of one layer: budget, k_b, payload, depth, chunk size
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BroadcastPlan:
    """The pre-broadcast budget of a layer and what fits into it (§10.3–10.4).

    Attributes:
        budget_s: Time the broadcast may hide behind, seconds.
        k_b: Number of experts that fit, max{m : T_bc*(m) < budget}, capped at ``max_m``.
        payload_bytes: S, bytes per expert.
        depth_hops: H, pipeline depth.
        chunk_bytes: c*(k_b) (c*(1) when k_b = 0), bytes.
        time_s: T_bc*(k_b), seconds (0 when k_b = 0).
    """

    budget_s: float
    k_b: int
    payload_bytes: float
    depth_hops: float
    chunk_bytes: float
    time_s: float


def broadcast_plan(model: ModelSpec, hw: HardwareSpec, conv: Conventions, batch: int,
                   topology_diameter: int | None, t_nm_prev: float | None,
                   t_comp_prev: float | None, max_m: int, fanout: int = 1) -> BroadcastPlan:
    """Return the budget, k_b, payload, depth and chunk size of a pre-broadcast (§10.3–10.4).

    Args:
        model: The model (S from h, I).
        hw: The hardware (D, C, BW, BW_mem).
        conv: The conventions (``bc_budget``, ``bc_payload``, ``bc_depth``, ``broadcast_alpha_s``).
        batch: Tokens per decode step B.
        topology_diameter: Diameter in hops (``bc_depth="diameter"``).
        t_nm_prev: t_nm of the layer the broadcast hides behind (``bc_budget="layer"``), s.
        t_comp_prev: Its expert phase (static evaluator at B), s.
        max_m: Cap on k_b (e.g. the env's ``max_broadcast``, at most E).
        fanout: Largest number of children of a node in the broadcast trees when every node
            injects through one network-interface port (``ni_ports``): that port carries each
            chunk once per child, so the pipeline runs at BW / fanout (docs/PHYSICS.md §16).
            1 (the default, and ``paper*``): the links are the only limit.

    Returns:
        The plan.
    """
    if isinstance(fanout, bool) or not isinstance(fanout, int | np.integer) or fanout < 1:
        raise ConfigError(f"fanout must be an integer >= 1, got {fanout!r}")
    budget = float(broadcast_budget(model, hw, conv, batch, t_nm_prev, t_comp_prev))
    S = broadcast_payload(model, conv)
    H = broadcast_depth(conv, hw.num_nodes, topology_diameter)
    alpha, bw = conv.broadcast_alpha_s, hw.link_bw_Bps / int(fanout)
    k_b = num_broadcast(budget, S, H, alpha, bw, max_m)
    chunk = float(broadcast_chunk(max(k_b, 1), S, H, alpha, bw))
    time = float(broadcast_time(k_b, S, H, alpha, bw))
    return BroadcastPlan(budget, k_b, S, H, chunk, time)


def broadcast_slots(model: ModelSpec, hw: HardwareSpec, conv: Conventions, batch: int,
                    topology_diameter: int | None, t_nm_prev: float | None,
                    t_comp_prev: float | None, max_m: int) -> int:
    """Return k_b, the number of experts pre-broadcast for one layer (§10.3).

    ``paper*`` (``bc_budget="hd"``): the HD budget formula, the same for every layer;
    ``faithful`` (``"layer"``): t_nm(l−1) + t_comp(l−1). k_b = max{m : T_bc*(m) < budget} with
    the α–β model at the optimal chunk size. See ``broadcast_plan`` for the arguments.
    """
    return broadcast_plan(model, hw, conv, batch, topology_diameter, t_nm_prev, t_comp_prev,
                          max_m).k_b

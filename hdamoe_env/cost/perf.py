"""Closed-form pieces of the performance model, as pure vectorised numpy functions.

Implements paper-model.md:

* §5.2 — expert computation (paper Eq. 1), static and sampled, with the ``faithful`` per-node
  roofline max(compute, DRAM streaming of the active shards) and the ``faithful`` tile model of
  the expert GEMMs (docs/PHYSICS.md: rows and columns padded to tiles, a fixed overhead per GEMM);
* §5.3 — the non-MoE per-layer term t_nm lives in :mod:`hdamoe_env.cost.nonmoe`;
* §5.5 — the analytic communication estimator (Eq. 2), static (groups) and sampled (tokens);
* §5.6 — the TP all-reduce (constant or ring);
* §7.3 — R_cc and the Node-Balance TP-ratio cap (constraint 11);
* §10.3–10.4 — the pre-broadcast closed forms live in :mod:`hdamoe_env.cost.broadcast`;
* the unit and shape checks shared by these modules live in :mod:`hdamoe_env.cost.units`.

Assumptions (the paper's, §5.1): the non-MoE work of a layer is split evenly over the D nodes;
there are no efficiency factors; phases are serial, rooflines apply only inside a compute phase.
Every function is pure (no state, no randomness). Inputs and outputs are SI: seconds, bytes,
FLOP, B/s, FLOP/s; hidden-vector volumes of the estimator are in elements. Functions of the batch
size B (or of the broadcast count m) accept a scalar or an array and return a Python float or an
array of the same shape. The deterministic check values of paper-model.md §14 are pinned by
``tests/hdamoe_env/cost/test_perf.py``.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.config.run import RUN_DEFAULTS
from hdamoe_env.cost.units import (FloatArray, FloatOrArray, as_output, check_tokens,
                                   check_positive)

__all__ = [
    "analytic_comm_sampled",
    "analytic_comm_static",
    "effective_mem_bw",
    "expected_active",
    "expert_bytes",
    "expert_compute_times",
    "expert_flops",
    "gemm_tile_time",
    "min_shards",
    "r_cc",
    "t_comp",
    "t_comp_sampled",
    "t_comp_static",
    "tile_columns",
    "tiled_node_compute",
    "tp_allreduce_time",
    "tp_expert_compute_time",
    "tp_ratio_cap",
]

def _nodes(hw: HardwareSpec, num_nodes: int | None) -> int:
    """Return D: ``num_nodes`` if given, else the hardware's node count."""
    nodes = hw.num_nodes if num_nodes is None else num_nodes
    if not (isinstance(nodes, int | np.integer) and nodes >= 1):
        raise ConfigError(f"num_nodes must be a positive integer, got {num_nodes!r}")
    return int(nodes)


# --------------------------------------------------------------------------------------------
# §5.2 Expert computation (paper Eq. 1)
# --------------------------------------------------------------------------------------------


def expert_flops(model: ModelSpec, conv: Conventions) -> float:
    """Return F_e, the FLOPs of one (token, routed expert) pair: 2·m·h·I (§1, §4.1 Q1).

    Args:
        model: The model (h, I).
        conv: The conventions (m = ``expert_matrices``).

    Returns:
        FLOP per (token, expert).
    """
    return float(2 * conv.expert_matrices * model.hidden_size * model.expert_intermediate)


def expert_bytes(model: ModelSpec, conv: Conventions) -> float:
    """Return W_e, the weight bytes of one routed expert: m·h·I·b_w (§1, §4.1 Q1).

    Args:
        model: The model (h, I).
        conv: The conventions (m = ``expert_matrices``, ``b_w``).

    Returns:
        Bytes per routed expert.
    """
    return float(conv.expert_matrices * model.hidden_size * model.expert_intermediate * conv.b_w)


def effective_mem_bw(hw: HardwareSpec, conv: Conventions) -> float:
    """Return the sustained DRAM streaming bandwidth per node, BW_mem·η (docs/PHYSICS.md §12).

    η = ``conv.dram_efficiency``: ``faithful`` 0.85 (row-buffer misses, refresh and bank
    conflicts of sequential weight streaming), ``paper*`` 1 (the ideal roofline).

    Args:
        hw: The hardware (peak ``mem_bw_gbps``).
        conv: The conventions (``dram_efficiency``).

    Returns:
        Bytes per second.
    """
    return hw.mem_bw_Bps * conv.dram_efficiency


def tile_columns(P: ArrayLike, model: ModelSpec, conv: Conventions) -> FloatArray:
    """Return the padded GEMM columns of every shard, ceil(P_ic·I / T_c)·T_c (PHYSICS.md §4).

    T_c = ``conv.col_pad`` = min(``col_granularity``, ``tile_cols``): the MAC array's column
    granularity; ``tile_cols`` itself is the share grid of placements.

    Args:
        P: Placement shares P_ic, shape [..., E, D].
        model: The model (I).
        conv: The conventions (``col_granularity``, ``tile_cols``).

    Returns:
        Columns per shard, shape of ``P`` (0 where P_ic = 0).
    """
    pad = conv.col_pad
    cols = np.asarray(P, dtype=np.float64) * model.expert_intermediate / pad
    # 1e-9 absorbs the rounding of P·I (1/32 · 1408 is 44 exactly, 1/3 · 1407 may not be 469)
    return np.ceil(np.maximum(cols - 1e-9, 0.0)) * pad


def gemm_tile_time(tokens: ArrayLike, columns: ArrayLike, model: ModelSpec, hw: HardwareSpec,
                   conv: Conventions) -> FloatOrArray:
    """Return the time of the m GEMMs of one expert shard under the tile model (PHYSICS.md).

    Each of the m = ``expert_matrices`` GEMMs of shape (t tokens, c columns) costs
    ceil(t/T_tok)·T_tok × ceil(c/T_c)·T_c × h × 2 FLOP at peak C plus a fixed overhead o
    (T_c = ``conv.col_pad``);
    a shard with no tokens or no columns costs nothing.

    Args:
        tokens: Tokens t of the shard (scalar or array).
        columns: Columns c = P_ic·I of the shard (broadcastable against ``tokens``).
        model: The model (h).
        hw: The hardware (C).
        conv: The conventions (m, ``tile_tokens``, ``col_pad``, ``gemm_overhead_s``).

    Returns:
        Seconds, shape of ``tokens`` broadcast against ``columns``.
    """
    t = np.asarray(tokens, dtype=np.float64)
    c = np.asarray(columns, dtype=np.float64)
    rows = np.ceil(np.maximum(t / conv.tile_tokens - 1e-9, 0.0)) * conv.tile_tokens
    cols = np.ceil(np.maximum(c / conv.col_pad - 1e-9, 0.0)) * conv.col_pad
    runs = (t > 0) & (c > 0)
    per_gemm = rows * cols * (2.0 * model.hidden_size / hw.compute_flops) + conv.gemm_overhead_s
    return as_output(np.where(runs, conv.expert_matrices * per_gemm, 0.0))


def tiled_node_compute(P: ArrayLike, tokens: ArrayLike, active: ArrayLike, model: ModelSpec,
                       hw: HardwareSpec, conv: Conventions) -> FloatArray:
    """Return the per-node expert compute time under the tile model (PHYSICS.md).

    compute_c = Σ_i m·[ceil(n_i/T_tok)·T_tok · ceil(P_ic·I/T_c)·T_c · 2h/C + a_i·o]
    over the shards c holds (P_ic > 0). With tiles of 1 and o = 0 this is Eq. 1 up to the
    rounding of n_i and P_ic·I to integers; callers use the fluid form then (``conv.tiled``).

    Args:
        P: Placement shares, shape [..., E, D].
        tokens: Tokens n_i per expert, shape [..., E] (the static form passes f_i·B: the
            padding of the expected count, a [judgement] of PHYSICS.md).
        active: a_i, whether (or the probability that) expert i runs at all, shape [..., E].
        model: The model.
        hw: The hardware.
        conv: The conventions.

    Returns:
        Seconds, shape [..., D].
    """
    shares = np.asarray(P, dtype=np.float64)
    n = np.asarray(tokens, dtype=np.float64)
    rows = np.ceil(np.maximum(n / conv.tile_tokens - 1e-9, 0.0)) * conv.tile_tokens
    cols = tile_columns(shares, model, conv)
    per_flop = conv.expert_matrices * 2.0 * model.hidden_size / hw.compute_flops
    work = np.einsum("...ed,...e->...d", cols, rows) * per_flop
    held = (shares > 0).astype(np.float64)
    gemms = np.einsum("...ed,...e->...d", held, np.asarray(active, dtype=np.float64))
    return work + gemms * (conv.expert_matrices * conv.gemm_overhead_s)


def expected_active(f: ArrayLike, B: ArrayLike) -> FloatArray:
    """Return the probability that each expert is active in a step of B tokens (§5.2).

    a_i = 1 − (1 − f_i)^B, the expected form of 1[n_i > 0] when tokens route independently.

    Args:
        f: Activation frequencies f_i, shape [..., E] (tokens routed to i ÷ tokens, in [0, 1]).
        B: Tokens per decode step (scalar, or an array broadcastable against ``f``).

    Returns:
        a, shape of ``f`` broadcast against ``B``, in [0, 1].
    """
    freq = np.clip(np.asarray(f, dtype=np.float64), 0.0, 1.0)
    return 1.0 - (1.0 - freq) ** check_tokens(B)


def expert_compute_times(
    P: ArrayLike,
    load_tokens: ArrayLike,
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    active: ArrayLike | None = None,
) -> tuple[FloatArray, FloatArray]:
    """Return the per-node expert compute time and weight-streaming time of one MoE layer (§5.2).

    compute_c = Σ_i P_ic · n_i · F_e / C (paper Eq. 1 for one node), or with ``conv.tiled``
    (``faithful``) the tile model ``tiled_node_compute`` (PHYSICS.md);
    stream_c  = Σ_i P_ic · a_i · W_e / (BW_mem·η) when ``conv.weight_streaming``
    (``faithful``; η = ``dram_efficiency``), else zero (``paper*``: the weights sit in the
    placement-independent memory term, Q7).

    The static (expected) form passes n_i = f_i·B and a_i = ``expected_active(f, B)``; the
    sampled form passes the step's counts n_i and a_i = 1[n_i > 0] (the default when ``active``
    is None). ``t_comp_static`` and ``t_comp_sampled`` wrap both.

    Args:
        P: Placement shares P_ic, shape [..., E, D] (rows sum to 1; leading axes, e.g. layers,
            broadcast against ``load_tokens``).
        load_tokens: Tokens n_i routed to each expert, shape [..., E] (may be fractional).
        model: The model (F_e, W_e; E must equal ``model.num_experts``).
        hw: The hardware (C, BW_mem).
        conv: The conventions (m, b_w, ``weight_streaming``).
        active: Activity a_i of each expert in [0, 1], shape [..., E]; None means
            1[load_tokens > 0].

    Returns:
        (compute_s, stream_s), each of shape [..., D], in seconds.

    Raises:
        ConfigError: The shapes of ``P``, ``load_tokens`` and ``active`` disagree, or E differs
            from the model's.
    """
    shares = np.asarray(P, dtype=np.float64)
    tokens = np.asarray(load_tokens, dtype=np.float64)
    if shares.ndim < 2 or tokens.ndim < 1 or shares.shape[-2] != tokens.shape[-1]:
        raise ConfigError(
            f"P must have shape [..., E, D] and load_tokens [..., E]; got "
            f"{shares.shape} and {tokens.shape}"
        )
    if tokens.shape[-1] != model.num_experts:
        raise ConfigError(
            f"load_tokens has {tokens.shape[-1]} experts but model "
            f"{model.key!r} has E={model.num_experts}"
        )
    act = (tokens > 0).astype(np.float64) if active is None else np.asarray(active, np.float64)
    if act.shape[-1] != tokens.shape[-1]:
        raise ConfigError(
            f"active must have shape [..., E] like load_tokens {tokens.shape}, got {act.shape}"
        )
    if conv.tiled:  # faithful: tile model of the GEMMs (PHYSICS.md)
        compute = tiled_node_compute(shares, tokens, act, model, hw, conv)
    else:  # Eq. 1: per-node share of every token's FLOPs of every expert.
        compute = np.einsum("...ed,...e->...d", shares, tokens) * (
            expert_flops(model, conv) / hw.compute_flops
        )
    if not conv.weight_streaming:
        return compute, np.zeros_like(compute)
    # §5.2 faithful: a node streams the weights of every shard it holds whose expert is active.
    stream = np.einsum("...ed,...e->...d", shares, act) * (
        expert_bytes(model, conv) / effective_mem_bw(hw, conv)
    )
    return compute, stream


def t_comp(compute_s: ArrayLike, stream_s: ArrayLike) -> FloatOrArray:
    """Return t_comp = max_c max(compute_c, stream_c), the expert phase of a layer (§5.2).

    With ``paper*`` conventions ``stream_s`` is zero, so this is max_c compute_c (Eq. 1);
    with ``faithful`` it is the per-node roofline.

    Args:
        compute_s: Per-node compute time, shape [..., D], seconds.
        stream_s: Per-node weight-streaming time, shape [..., D], seconds.

    Returns:
        Seconds; a float for [D] inputs, else shape [...].
    """
    per_node = np.maximum(np.asarray(compute_s, np.float64), np.asarray(stream_s, np.float64))
    return as_output(per_node.max(axis=-1))


def t_comp_static(
    P: ArrayLike,
    f: ArrayLike,
    B: float,
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
) -> FloatOrArray:
    """Return the static (expected-load) expert phase t_comp of a layer (§5.2, §5.7).

    n_i = f_i·B and a_i = 1 − (1 − f_i)^B.

    Args:
        P: Placement shares, shape [..., E, D].
        f: Activation frequencies f_i, shape [..., E] (Σ_i f_i = k).
        B: Tokens per decode step.
        model: The model.
        hw: The hardware.
        conv: The conventions.

    Returns:
        Seconds; a float for one layer, else shape [...].
    """
    freq = np.asarray(f, dtype=np.float64)
    batch = float(check_tokens(B))
    compute, stream = expert_compute_times(
        P, freq * batch, model, hw, conv, active=expected_active(freq, batch)
    )
    return t_comp(compute, stream)


def t_comp_sampled(
    P: ArrayLike,
    counts: ArrayLike,
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
) -> FloatOrArray:
    """Return the sampled expert phase t_comp of one decode step (§5.2, §5.7).

    Args:
        P: Placement shares, shape [..., E, D].
        counts: Tokens n_i of the step routed to each expert, shape [..., E].
        model: The model.
        hw: The hardware.
        conv: The conventions.

    Returns:
        Seconds; a float for one layer, else shape [...].
    """
    compute, stream = expert_compute_times(P, counts, model, hw, conv)
    return t_comp(compute, stream)


def tp_expert_compute_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    num_nodes: int | None = None,
) -> FloatOrArray:
    """Return TP's expert compute time per layer, k·B·F_e/(D·C) (§7.3, §14.1).

    Every node holds 1/D of every expert, so its load is k/D activations per token whatever the
    routing. Weight streaming is not included (use ``expert_compute_times`` for the roofline).

    Args:
        model: The model (k, h, I).
        hw: The hardware (C; D unless ``num_nodes`` is given).
        conv: The conventions (m).
        B: Tokens per decode step (scalar or array).
        num_nodes: D, default ``hw.num_nodes``.

    Returns:
        Seconds, shape of ``B``.
    """
    nodes = _nodes(hw, num_nodes)
    return as_output(model.top_k * check_tokens(B) * expert_flops(model, conv)
                     / (nodes * hw.compute_flops))


# --------------------------------------------------------------------------------------------
# §5.6 TP all-reduce
# --------------------------------------------------------------------------------------------


def tp_allreduce_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    bw_end_Bps: float | None = None,
    num_nodes: int | None = None,
) -> FloatOrArray:
    """Return TP's MoE all-reduce time per layer (§5.6).

    * ``tp_allreduce="const"`` (``paper*``, Q4): tp_const·B·h/BW (16 journal, 8 conference);
    * ``tp_allreduce="ring"`` or ``"best"`` (``faithful``): 2·(D−1)·(α + hop + B·h·b_psum/(D·BW)),
      reduce-scatter then all-gather over a ring of physical neighbours; α = ``msg_alpha_s``
      per step, hop = ``hw.hop_latency_for(conv)`` (one α–β model, docs/PHYSICS.md). This is
      the documented closed form of the 1-D ring; the evaluators use the best DES-simulated
      algorithm (``collectives.best_allreduce``).

    Args:
        model: The model (h).
        hw: The hardware (D, link bandwidth, hop latency).
        conv: The conventions (``tp_allreduce``, ``tp_const``, ``b_psum``).
        B: Tokens per decode step (scalar or array).
        bw_end_Bps: Bandwidth BW to use (fat-tree: the endpoint-side BW_el); default the
            hardware link bandwidth.
        num_nodes: D, default ``hw.num_nodes``.

    Returns:
        Seconds, shape of ``B``.
    """
    batch = check_tokens(B)
    bw = check_positive("bw_end_Bps", hw.link_bw_Bps if bw_end_Bps is None else bw_end_Bps)
    h = model.hidden_size
    if conv.tp_allreduce == "const":
        return as_output(conv.tp_const * batch * h / bw)
    nodes = _nodes(hw, num_nodes)
    step_s = conv.msg_alpha_s + hw.hop_latency_for(conv)
    return as_output(2 * (nodes - 1) * (batch * h * conv.b_psum / (nodes * bw) + step_s))


# --------------------------------------------------------------------------------------------
# §5.5 Analytic estimator (paper Eq. 2)
# --------------------------------------------------------------------------------------------


def _support_matrix(support: ArrayLike) -> NDArray[np.bool_]:
    """Return the boolean [E, D] holder matrix (P_ic > 0) of a support or share matrix."""
    holders = np.asarray(support)
    if holders.ndim != 2:
        raise ConfigError(
            f"support must have shape [E, D] (bool, or shares P_ic), got {holders.shape}"
        )
    return holders > 0


def _touch_matrix(holders: NDArray[np.bool_], sets: ArrayLike, what: str) -> NDArray[np.bool_]:
    """Return touch[s, c] = ∃ i ∈ sets[s] : holders[i, c]; entries < 0 are padding."""
    members = np.asarray(sets)
    if members.ndim != 2 or not np.issubdtype(members.dtype, np.integer):
        raise ConfigError(
            f"{what} must be an integer array of shape [N, k], got dtype "
            f"{members.dtype} and shape {members.shape}"
        )
    num_experts = holders.shape[0]
    if members.size and members.max() >= num_experts:
        raise ConfigError(
            f"{what} names expert {int(members.max())} but support has only "
            f"{num_experts} experts (rows)"
        )
    valid = members >= 0
    touched = holders[np.where(valid, members, 0)] & valid[:, :, None]  # [N, k, D]
    touch: NDArray[np.bool_] = np.any(touched, axis=1)
    return touch


def analytic_comm_static(
    support: ArrayLike,
    groups: ArrayLike,
    f_g: ArrayLike,
    B: float,
    h: int,
    kappa_a: float,
    bw_end_Bps: float,
) -> tuple[float, FloatArray]:
    """Return the static analytic communication estimate of a layer (paper Eq. 2, §5.5).

    V_c = B·h·Σ_g f_g·1[∃ i ∈ g : P_ic > 0] (elements; one hidden vector per token whose group
    touches c, however many of its experts c holds), t_comm = kappa_a·max_c V_c / BW_end.
    Multiply by γ for Eq. 3.

    Args:
        support: Holder matrix, shape [E, D]: bool, or the shares P_ic (holder when > 0).
        groups: Co-activation groups, int shape [G, k] (expert ids; −1 pads shorter groups).
        f_g: Group frequencies, shape [G] (Σ_g f_g = 1).
        B: Tokens per decode step.
        h: Hidden size, elements.
        kappa_a: Estimator constant, bytes per element and direction (``conv.kappa_a``).
        bw_end_Bps: Endpoint-side bandwidth BW_end, B/s.

    Returns:
        (t_comm_s, V_c) with V_c of shape [D] in elements.

    Raises:
        ConfigError: Shapes disagree or a group names an expert outside the support.
    """
    holders = _support_matrix(support)
    freq = np.asarray(f_g, dtype=np.float64)
    touch = _touch_matrix(holders, groups, "groups")  # [G, D]
    if freq.shape != (touch.shape[0],):
        raise ConfigError(f"f_g must have shape [G] = ({touch.shape[0]},), got {freq.shape}")
    volume = float(check_tokens(B)) * h * (freq @ touch)
    bw = check_positive("bw_end_Bps", bw_end_Bps)
    return float(kappa_a * volume.max(initial=0.0) / bw), volume


def analytic_comm_sampled(
    support: ArrayLike,
    token_sets: ArrayLike,
    h: int,
    kappa_a: float,
    bw_end_Bps: float,
) -> tuple[float, FloatArray]:
    """Return the sampled analytic communication estimate of one decode step (§5.5).

    V_c = h·|{t : S_t ∩ {i : P_ic > 0} ≠ ∅}| (elements), t_comm = kappa_a·max_c V_c / BW_end.

    Args:
        support: Holder matrix, shape [E, D]: bool, or the shares P_ic (holder when > 0).
        token_sets: Expert set S_t of every token, int shape [T, k] (−1 pads).
        h: Hidden size, elements.
        kappa_a: Estimator constant, bytes per element and direction (``conv.kappa_a``).
        bw_end_Bps: Endpoint-side bandwidth BW_end, B/s.

    Returns:
        (t_comm_s, V_c) with V_c of shape [D] in elements.

    Raises:
        ConfigError: Shapes disagree or a token names an expert outside the support.
    """
    holders = _support_matrix(support)
    touch = _touch_matrix(holders, token_sets, "token_sets")  # [T, D]
    volume = float(h) * touch.sum(axis=0, dtype=np.float64)
    bw = check_positive("bw_end_Bps", bw_end_Bps)
    return float(kappa_a * volume.max(initial=0.0) / bw), volume


# --------------------------------------------------------------------------------------------
# §7.3 R_cc and the TP-ratio cap
# --------------------------------------------------------------------------------------------


def r_cc(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    num_nodes: int | None = None,
    B: float = RUN_DEFAULTS.batch,
    bw_end_Bps: float | None = None,
) -> float:
    """Return R_cc, TP's per-node compute time over TP's communication time (§7.3).

    * ``paper*``: t_comp_TP / (kappa_a·B·h/BW), the analytic estimate of TP; with m = 1 and
      kappa_a = 4 this is BW·I·k/(2·D·C), independent of B.
    * ``faithful``: t_comp_TP / t_TP with t_TP from ``tp_allreduce_time`` (ring); independent of
      B unless a hop latency is set.

    t_comp_TP = k·B·F_e/(D·C) (no weight streaming).

    Args:
        model: The model.
        hw: The hardware.
        conv: The conventions.
        num_nodes: D, default ``hw.num_nodes``.
        B: Tokens per decode step (the offline optimisation uses 128).
        bw_end_Bps: Endpoint-side bandwidth, default the hardware link bandwidth.

    Returns:
        The dimensionless ratio.
    """
    nodes = _nodes(hw, num_nodes)
    batch = check_positive("B", float(B))
    compute = float(tp_expert_compute_time(model, hw, conv, batch, num_nodes=nodes))
    if conv.is_paper:
        # [decision] kappa_a rather than a literal 4: identical in paper*, and it keeps the
        # denominator equal to the profile's analytic estimate of TP (§5.6).
        bw = check_positive("bw_end_Bps", hw.link_bw_Bps if bw_end_Bps is None else bw_end_Bps)
        comm = conv.kappa_a * batch * model.hidden_size / bw
    else:
        comm = float(tp_allreduce_time(model, hw, conv, batch, bw_end_Bps, num_nodes=nodes))
    if comm <= 0:
        raise ConfigError(
            f"TP communication time is {comm} s for D={nodes}; R_cc is undefined "
            "(a single node needs no TP-ratio cap)"
        )
    return compute / comm


def tp_ratio_cap(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    num_nodes: int | None = None,
    B: float = RUN_DEFAULTS.batch,
    bw_end_Bps: float | None = None,
) -> float:
    """Return the Node-Balance TP-ratio cap (k/D)·(1 + 1/R_cc) (§7.3, constraint 11).

    No node may carry more expected activations per token than this: TP's compute plus
    communication time, expressed as load.

    Args:
        model: The model.
        hw: The hardware.
        conv: The conventions.
        num_nodes: D, default ``hw.num_nodes``.
        B: Tokens per decode step.
        bw_end_Bps: Endpoint-side bandwidth, default the hardware link bandwidth.

    Returns:
        The cap on Σ_i f_i·P_ic (activations per token).
    """
    nodes = _nodes(hw, num_nodes)
    ratio = r_cc(model, hw, conv, nodes, B, bw_end_Bps)
    return model.top_k / nodes * (1.0 + 1.0 / ratio)


def min_shards(f: ArrayLike, cap: float) -> NDArray[np.int64]:
    """Return the fewest clusters each expert must be split over under the cap, ⌈f_i / cap⌉ (§7.3).

    Args:
        f: Activation frequencies f_i, shape [..., E].
        cap: The TP-ratio cap (``tp_ratio_cap``).

    Returns:
        Integer shard counts, shape of ``f`` (at least 1).
    """
    need = np.ceil(np.asarray(f, dtype=np.float64) / check_positive("cap", cap))
    return np.maximum(need, 1).astype(np.int64)

"""Closed-form pieces of the performance model, as pure vectorised numpy functions.

Implements paper-model.md:

* §5.2 — expert computation (paper Eq. 1), static and sampled, with the ``faithful`` per-node
  roofline max(compute, DRAM streaming of the active shards);
* §5.3 — the non-MoE per-layer term t_nm: journal per-model formulas (§5.3.1, Qwen3.5 via the
  package formula of §5.3.3), the conference generic formula (§5.3.2) and the architecture
  roofline (§5.3.4) with full-attention and Gated-DeltaNet layers, DeepSeek's dense layer 0, the
  optional LM head and the optional non-MoE all-reduce;
* §5.5 — the analytic communication estimator (Eq. 2), static (groups) and sampled (tokens);
* §5.6 — the TP all-reduce (constant or ring);
* §7.3 — R_cc and the Node-Balance TP-ratio cap (constraint 11);
* §10.3–10.4 — the pre-broadcast budget, the α–β pipelined broadcast model and k_b.

Assumptions (the paper's, §5.1): the non-MoE work of a layer is split evenly over the D nodes;
there are no efficiency factors; phases are serial, rooflines apply only inside a compute phase.
Every function is pure (no state, no randomness). Inputs and outputs are SI: seconds, bytes,
FLOP, B/s, FLOP/s; hidden-vector volumes of the estimator are in elements. Functions of the batch
size B (or of the broadcast count m) accept a scalar or an array and return a Python float or an
array of the same shape. The deterministic check values of paper-model.md §14 are pinned by
``tests/hdamoe_env/test_perf.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TypeAlias

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.errors import ConfigError
from hdamoe_env.profiles import Conventions
from hdamoe_env.specs import HardwareSpec, ModelSpec

__all__ = [
    "HD_BUDGET_CTX_LEN",
    "NonMoeTime",
    "analytic_comm_sampled",
    "analytic_comm_static",
    "broadcast_budget",
    "broadcast_chunk",
    "broadcast_depth",
    "broadcast_payload",
    "broadcast_time",
    "broadcast_time_chunked",
    "dense_layer_time",
    "expected_active",
    "expert_bytes",
    "expert_compute_times",
    "expert_flops",
    "hd_budget",
    "lm_head_time",
    "min_shards",
    "nonmoe_allreduce_time",
    "nonmoe_step_time",
    "nonmoe_time",
    "num_broadcast",
    "r_cc",
    "t_comp",
    "t_comp_sampled",
    "t_comp_static",
    "tp_allreduce_time",
    "tp_expert_compute_time",
    "tp_ratio_cap",
]

FloatArray: TypeAlias = NDArray[np.float64]
FloatOrArray: TypeAlias = float | NDArray[np.float64]

#: L_ctx of the conference pre-broadcast budget formula (§10.3, Q14).
HD_BUDGET_CTX_LEN = 1024
#: Bytes per cached K/V element in the architecture formula (bf16, §5.3.4).
_KV_BYTES = 2
#: Bytes per element of the Gated-DeltaNet recurrent state (fp32, §5.3.4).
_STATE_BYTES = 4


def _out(x: FloatArray | np.floating | float) -> FloatOrArray:
    """Return a Python float for 0-d results, else the array itself."""
    arr = np.asarray(x, dtype=np.float64)
    return float(arr) if arr.ndim == 0 else arr


def _batch(B: ArrayLike) -> FloatArray:
    """Convert a batch size (scalar or array, tokens) to float64 and check it is >= 0."""
    b = np.asarray(B, dtype=np.float64)
    if not np.all(np.isfinite(b)) or np.any(b < 0):
        raise ConfigError(f"batch size B must be finite and >= 0, got {B!r}")
    return b


def _positive(name: str, value: float) -> float:
    """Check that a rate or size is a finite positive number."""
    if not (math.isfinite(value) and value > 0):
        raise ConfigError(f"{name} must be a finite positive number, got {value!r}")
    return float(value)


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
    return 1.0 - (1.0 - freq) ** _batch(B)


def expert_compute_times(
    P: ArrayLike,
    load_tokens: ArrayLike,
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    active: ArrayLike | None = None,
) -> tuple[FloatArray, FloatArray]:
    """Return the per-node expert compute time and weight-streaming time of one MoE layer (§5.2).

    compute_c = Σ_i P_ic · n_i · F_e / C (paper Eq. 1 for one node);
    stream_c  = Σ_i P_ic · a_i · W_e / BW_mem when ``conv.weight_streaming`` (``faithful``),
    else zero (``paper*``: the weights sit in the placement-independent memory term, Q7).

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
    # Eq. 1: per-node share of every token's FLOPs of every expert.
    compute = np.einsum("...ed,...e->...d", shares, tokens) * (
        expert_flops(model, conv) / hw.compute_flops
    )
    if not conv.weight_streaming:
        return compute, np.zeros_like(compute)
    act = (tokens > 0).astype(np.float64) if active is None else np.asarray(active, np.float64)
    if act.shape[-1] != tokens.shape[-1]:
        raise ConfigError(
            f"active must have shape [..., E] like load_tokens {tokens.shape}, got {act.shape}"
        )
    # §5.2 faithful: a node streams the weights of every shard it holds whose expert is active.
    stream = np.einsum("...ed,...e->...d", shares, act) * (
        expert_bytes(model, conv) / hw.mem_bw_Bps
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
    return _out(per_node.max(axis=-1))


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
    batch = float(_batch(B))
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
    return _out(model.top_k * _batch(B) * expert_flops(model, conv) / (nodes * hw.compute_flops))


# --------------------------------------------------------------------------------------------
# §5.3 Non-MoE per-layer term t_nm
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class NonMoeTime:
    """The non-MoE time of one layer (or of the LM head), split into its parts (§5.3).

    Attributes:
        compute_s: Attention (and shared-expert) compute, t_attn, seconds.
        memory_s: DRAM traffic, t_mem, seconds.
        comm_s: Optional non-MoE all-reduce (knob ``nonmoe_allreduce``), seconds; 0 when off.
        total_s: The layer's non-MoE time t_nm, seconds: compute + memory (serial, the paper's
            formulas) or max(compute, memory) (``faithful`` roofline), plus ``comm_s``.

    Each attribute is a float, or an array shaped like the batch-size argument.
    """

    compute_s: FloatOrArray
    memory_s: FloatOrArray
    comm_s: FloatOrArray
    total_s: FloatOrArray


def _journal_terms(model: ModelSpec, B: FloatArray, L: float) -> tuple[FloatArray, FloatArray]:
    """Return (FLOPs, bytes) of one layer by the journal per-model formulas (§5.3.1, §5.3.3).

    The reference's FLOP conventions are kept exactly (projections partly at 1 FLOP per weight,
    shared experts as 2·h·I_s; "2·(E+n)·I·h" is every expert's one-matrix bf16 weights, with the
    shared experts counted in routed-expert units n = I_s / I).
    """
    h = float(model.hidden_size)
    I = float(model.expert_intermediate)  # noqa: E741 - the paper's symbol
    I_s = float(model.shared_intermediate)
    E = float(model.num_experts)
    shared_units = I_s / I
    act = B * h * (I / h + 1.0)  # B·h·(I/h + 1): activations of the expert FFN
    formula = model.nonmoe_formula
    if formula == "deepseek":
        # MLA: q_proj h→3072, KV latent 512 → 16·(128+128) = 4096, shared experts 2·h·I_s.
        flops = B * (h * h + 512 * 4096 + h * 3072 + 2 * h * I_s + 2 * 2 * h * L)
        nbytes = (
            h * (3072 + B)
            + h * (h + B)
            + 512 * 4096
            + 2 * 512 * L
            + 2 * (E + shared_units) * I * h
            + act
        )
    elif formula == "mixtral":
        flops = 4 * B * h * h + 2 * B * h * L
        nbytes = 2 * B * h * L + 4 * h * (B + h) + 2 * E * I * h + act
    elif formula == "qwen2":
        # K/V width taken as h/4 (the reference's convention); I_s = 20480 (Q8).
        flops = B * (h * h + 2 * 0.25 * h * h + 0.25 * h * h + 2 * h * I_s + 2 * 0.25 * h * L)
        nbytes = (
            2 * 0.25 * B * h * L
            + 1.5 * h * (B + h)
            + 0.25 * h * (B + h)
            + 2 * (E + shared_units) * I * h
            + act
        )
    else:  # "qwen35": [decision] §5.3.3, the Mixtral form plus the shared expert
        flops = 4 * B * h * h + 2 * B * h * L + 2 * B * h * I_s
        nbytes = 2 * B * h * L + 4 * h * (B + h) + 2 * (E + shared_units) * I * h + act
    return flops, nbytes


def _generic_terms(model: ModelSpec, B: FloatArray, L: float) -> tuple[FloatArray, FloatArray]:
    """Return (FLOPs, bytes) of one layer by the conference generic formula (§5.3.2)."""
    h = float(model.hidden_size)
    I = float(model.expert_intermediate)  # noqa: E741 - the paper's symbol
    E = float(model.num_experts)
    flops = 3 * B * h * h + 2 * B * L * h + B * h * h
    nbytes = 2 * B * h * L + 3 * h * (B + h) + h * (B + h) + 2 * E * I * h + B * h * (I / h + 1)
    return flops, nbytes


def _arch_attention(model: ModelSpec, layer: int, L: float) -> tuple[float, float, float]:
    """Return (W_attn elements, core FLOPs per token, state bytes per token) of a layer (§5.3.4).

    Full softmax attention reads L_ctx cached tokens of K/V (bf16); a Gated-DeltaNet layer
    (Qwen3.5) reads and writes a fixed fp32 recurrent state per sequence.
    """
    if model.is_full_attention(layer):
        return (
            float(model.attn_weight_elements),
            model.core_flops_per_ctx_token * L,
            L * model.kv_elements_per_token * _KV_BYTES,
        )
    return (
        float(model.linear_attn_weight_elements),
        float(model.linear_core_flops_per_token),
        2.0 * model.linear_state_elements * _STATE_BYTES,
    )


def _arch_terms(
    model: ModelSpec, conv: Conventions, B: FloatArray, layer: int, ffn_intermediate: float
) -> tuple[FloatArray, FloatArray]:
    """Return (FLOPs, bytes) of one layer by the architecture formula (§5.3.4).

    FLOP_nm = B·(2·W_attn + F_core + 6·h·I_ffn); bytes_nm = b_w·(W_attn + 3·h·I_ffn) + B·KV_bytes,
    where I_ffn is I_s for an MoE layer and I_dense for a dense leading layer (SwiGLU, three
    matrices, independent of ``expert_matrices``).
    """
    h = float(model.hidden_size)
    weights, core_flops, state_bytes = _arch_attention(model, layer, float(conv.nonmoe_ctx_len))
    flops = B * (2 * weights + core_flops + 6 * h * ffn_intermediate)
    nbytes = conv.b_w * (weights + 3 * h * ffn_intermediate) + B * state_bytes
    return flops, nbytes


def _combine(
    compute: FloatArray, memory: FloatArray, comm: FloatArray, roofline: bool
) -> NonMoeTime:
    """Build a ``NonMoeTime`` with a serial or roofline total."""
    total = (np.maximum(compute, memory) if roofline else compute + memory) + comm
    return NonMoeTime(_out(compute), _out(memory), _out(comm), _out(total))


def _arch_roofline(conv: Conventions) -> bool:
    """Whether the architecture formula overlaps compute and DRAM (§5.3.4).

    [decision] ``faithful`` (and profiles derived from it) take the roofline max; a ``paper*``
    profile that selects ``nonmoe="arch"`` keeps the paper's serial composition compute + memory.
    """
    return not conv.is_paper


def nonmoe_allreduce_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    bw_end_Bps: float | None = None,
) -> FloatOrArray:
    """Return the optional per-layer all-reduce of a TP attention (§5.3.4 ``nonmoe_allreduce``).

    [decision] B·h activations are all-reduced with the profile's TP all-reduce model (§5.6);
    the term is zero when the knob is off (the paper's assumption).

    Args:
        model: The model (h).
        hw: The hardware.
        conv: The conventions (``nonmoe_allreduce`` and the §5.6 knobs).
        B: Tokens per decode step (scalar or array).
        bw_end_Bps: Endpoint-side bandwidth, default the hardware link bandwidth.

    Returns:
        Seconds, shape of ``B``.
    """
    batch = _batch(B)
    if not conv.nonmoe_allreduce:
        return _out(np.zeros_like(batch))
    return tp_allreduce_time(model, hw, conv, batch, bw_end_Bps=bw_end_Bps)


def nonmoe_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    layer: int = 0,
    bw_end_Bps: float | None = None,
) -> NonMoeTime:
    """Return the non-MoE term t_nm of MoE layer ``layer`` (§5.3).

    ``conv.nonmoe`` selects the formula and ``conv.nonmoe_ctx_len`` its context length:

    * ``"journal"`` (§5.3.1; Qwen3.5 by §5.3.3): t_attn + t_mem, L_dec = ``nonmoe_ctx_len``;
    * ``"generic"`` (§5.3.2): t_attn + t_mem, L_kv = ``nonmoe_ctx_len``;
    * ``"arch"`` (§5.3.4): full or Gated-DeltaNet attention by ``model.is_full_attention(layer)``,
      shared experts 6·h·I_s FLOPs and 3·h·I_s·b_w bytes, KV traffic over L_ctx cached tokens;
      max(compute, memory) in ``faithful``, compute + memory in ``paper*`` profiles.

    All work is split evenly over the D nodes. The optional all-reduce (``nonmoe_allreduce``)
    is added serially.

    Args:
        model: The model.
        hw: The hardware (D, C, BW_mem).
        conv: The conventions.
        B: Tokens per decode step (scalar or array).
        layer: MoE layer index l (0..L−1); only the ``"arch"`` formula depends on it.
        bw_end_Bps: Endpoint-side bandwidth for the optional all-reduce.

    Returns:
        The layer's ``NonMoeTime`` (seconds).

    Raises:
        ConfigError: ``layer`` is outside 0..L−1 or B is negative.
    """
    if not 0 <= layer < model.num_moe_layers:
        raise ConfigError(
            f"layer must be in 0..{model.num_moe_layers - 1} for model {model.key!r}, got {layer}"
        )
    batch = _batch(B)
    ctx = float(conv.nonmoe_ctx_len)
    if conv.nonmoe == "journal":
        flops, nbytes = _journal_terms(model, batch, ctx)
        roofline = False
    elif conv.nonmoe == "generic":
        flops, nbytes = _generic_terms(model, batch, ctx)
        roofline = False
    else:
        flops, nbytes = _arch_terms(model, conv, batch, layer, float(model.shared_intermediate))
        roofline = _arch_roofline(conv)
    nodes = hw.num_nodes
    compute = flops / (nodes * hw.compute_flops)
    memory = nbytes / (nodes * hw.mem_bw_Bps)
    comm = np.asarray(nonmoe_allreduce_time(model, hw, conv, batch, bw_end_Bps), np.float64)
    return _combine(np.asarray(compute), np.asarray(memory), comm, roofline)


def dense_layer_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    bw_end_Bps: float | None = None,
) -> NonMoeTime:
    """Return the time of one dense leading decoder layer (DeepSeek's layer 0, §5.3.4).

    The architecture formula with 6·h·I_dense FLOPs and 3·h·I_dense·b_w bytes in place of the
    shared-expert terms, full attention, L_ctx = ``conv.nonmoe_ctx_len``. It is computed whatever
    ``conv.dense_layers`` says; ``nonmoe_step_time`` adds it only when the knob is on.

    Args:
        model: The model (``dense_intermediate``).
        hw: The hardware.
        conv: The conventions.
        B: Tokens per decode step (scalar or array).
        bw_end_Bps: Endpoint-side bandwidth for the optional all-reduce.

    Returns:
        One dense layer's ``NonMoeTime`` (seconds).
    """
    batch = _batch(B)
    h = float(model.hidden_size)
    weights = float(model.attn_weight_elements)
    core_flops = model.core_flops_per_ctx_token * conv.nonmoe_ctx_len
    kv_bytes = conv.nonmoe_ctx_len * model.kv_elements_per_token * _KV_BYTES
    flops = batch * (2 * weights + core_flops + 6 * h * model.dense_intermediate)
    nbytes = conv.b_w * (weights + 3 * h * model.dense_intermediate) + batch * kv_bytes
    nodes = hw.num_nodes
    comm = np.asarray(nonmoe_allreduce_time(model, hw, conv, batch, bw_end_Bps), np.float64)
    return _combine(
        flops / (nodes * hw.compute_flops),
        nbytes / (nodes * hw.mem_bw_Bps),
        comm,
        _arch_roofline(conv),
    )


def lm_head_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
) -> NonMoeTime:
    """Return the LM-head time of one decode step (§5.3.4, knob ``include_lm_head``).

    [decision] vocab·h weights read once (b_w bytes each) and 2·B·vocab·h FLOPs, split over the
    D nodes, combined like the architecture formula. Computed whatever ``conv.include_lm_head``
    says; ``nonmoe_step_time`` adds it only when the knob is on.

    Args:
        model: The model (``vocab_size``, h).
        hw: The hardware.
        conv: The conventions (b_w, profile family for the combination rule).
        B: Tokens per decode step (scalar or array).

    Returns:
        The LM head's ``NonMoeTime`` (seconds).
    """
    batch = _batch(B)
    weights = float(model.vocab_size) * model.hidden_size
    nodes = hw.num_nodes
    compute = 2.0 * batch * weights / (nodes * hw.compute_flops)
    memory = np.broadcast_to(conv.b_w * weights / (nodes * hw.mem_bw_Bps), batch.shape)
    return _combine(
        compute, np.asarray(memory, np.float64), np.zeros_like(batch), _arch_roofline(conv)
    )


def nonmoe_step_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    bw_end_Bps: float | None = None,
) -> FloatOrArray:
    """Return the whole step's non-MoE time: Σ_l t_nm(l) + dense layers + LM head (§5.1, §5.3).

    Dense leading layers are added when ``conv.dense_layers`` and ``model.num_dense_layers > 0``;
    the LM head when ``conv.include_lm_head``.

    Args:
        model: The model.
        hw: The hardware.
        conv: The conventions.
        B: Tokens per decode step (scalar or array).
        bw_end_Bps: Endpoint-side bandwidth for the optional all-reduce.

    Returns:
        Seconds, shape of ``B``.
    """
    batch = _batch(B)
    per_layer: dict[bool, FloatArray] = {}  # t_nm depends on the layer only via its attention
    total = np.zeros_like(batch)
    for layer in range(model.num_moe_layers):
        kind = conv.nonmoe == "arch" and model.is_full_attention(layer)
        if kind not in per_layer:
            per_layer[kind] = np.asarray(
                nonmoe_time(model, hw, conv, batch, layer, bw_end_Bps).total_s, np.float64
            )
        total = total + per_layer[kind]
    if conv.dense_layers and model.num_dense_layers > 0:
        dense = dense_layer_time(model, hw, conv, batch, bw_end_Bps).total_s
        total = total + model.num_dense_layers * np.asarray(dense, np.float64)
    if conv.include_lm_head:
        total = total + np.asarray(lm_head_time(model, hw, conv, batch).total_s, np.float64)
    return _out(total)


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
    * ``tp_allreduce="ring"`` (``faithful``): 2·(D−1)·(B·h·b_psum/(D·BW) + hop_latency_s),
      reduce-scatter then all-gather over a ring of physical neighbours.

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
    batch = _batch(B)
    bw = _positive("bw_end_Bps", hw.link_bw_Bps if bw_end_Bps is None else bw_end_Bps)
    h = model.hidden_size
    if conv.tp_allreduce == "const":
        return _out(conv.tp_const * batch * h / bw)
    nodes = _nodes(hw, num_nodes)
    return _out(2 * (nodes - 1) * (batch * h * conv.b_psum / (nodes * bw) + hw.hop_latency_s))


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
    volume = float(_batch(B)) * h * (freq @ touch)
    bw = _positive("bw_end_Bps", bw_end_Bps)
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
    bw = _positive("bw_end_Bps", bw_end_Bps)
    return float(kappa_a * volume.max(initial=0.0) / bw), volume


# --------------------------------------------------------------------------------------------
# §7.3 R_cc and the TP-ratio cap
# --------------------------------------------------------------------------------------------


def r_cc(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    num_nodes: int | None = None,
    B: float = 128,
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
    batch = _positive("B", float(B))
    compute = float(tp_expert_compute_time(model, hw, conv, batch, num_nodes=nodes))
    if conv.is_paper:
        # [decision] kappa_a rather than a literal 4: identical in paper*, and it keeps the
        # denominator equal to the profile's analytic estimate of TP (§5.6).
        bw = _positive("bw_end_Bps", hw.link_bw_Bps if bw_end_Bps is None else bw_end_Bps)
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
    B: float = 128,
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
    need = np.ceil(np.asarray(f, dtype=np.float64) / _positive("cap", cap))
    return np.maximum(need, 1).astype(np.int64)


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
    beta = 1.0 / _positive("bw", bw)
    count = np.asarray(m, dtype=np.float64)
    return _out(alpha * (H + S / chunk) + beta * count * (S + chunk * H))


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
    beta = 1.0 / _positive("bw", bw)
    count = np.asarray(m, dtype=np.float64)
    return _out(np.sqrt(alpha * S / (beta * count * H)))


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
    beta = 1.0 / _positive("bw", bw)
    count = np.asarray(m, dtype=np.float64)
    time = alpha * H + beta * count * S + 2.0 * np.sqrt(alpha * beta * count * S * H)
    return _out(np.where(count > 0, time, 0.0))


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
    batch = _batch(B)
    flops, nbytes = _generic_terms(model, batch, float(ctx_len))
    h, inter = model.hidden_size, model.expert_intermediate
    flops = flops + 2 * model.top_k * batch * inter * h  # the MoE FFN of the layer (2·h·I)
    nodes = hw.num_nodes
    return _out(flops / (nodes * hw.compute_flops) + nbytes / (nodes * hw.mem_bw_Bps))


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
    return _out(np.asarray(t_nm_s, np.float64) + np.asarray(t_comp_s, np.float64))


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

"""The non-MoE per-layer term t_nm of the performance model (paper-model.md §5.3).

Journal per-model formulas (§5.3.1, Qwen3.5 via the package formula of §5.3.3), the conference
generic formula (§5.3.2) and the architecture roofline (§5.3.4) with full-attention and
Gated-DeltaNet layers, DeepSeek's dense layer 0, the optional LM head and the optional non-MoE
all-reduce (on in ``faithful``: the split work's collective, docs/PHYSICS.md). Assumption (the
paper's, §5.1): the non-MoE work of a layer is split evenly over the D nodes. Pure functions,
SI units, scalar or array batch sizes, as in :mod:`hdamoe_env.cost.perf` (whose argument checks this
module shares). Pinned by ``tests/hdamoe_env/cost/test_nonmoe.py`` (paper-model.md §14).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike

from hdamoe_env.noc import collectives
from hdamoe_env.config.errors import ConfigError
from hdamoe_env.cost.perf import effective_mem_bw, tp_allreduce_time
from hdamoe_env.cost.units import FloatArray, FloatOrArray, as_output, check_tokens
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec
from hdamoe_env.noc.topology import Topology

__all__ = ["NonMoeTime", "dense_layer_time", "lm_head_time", "nonmoe_allreduce_time",
           "nonmoe_step_time", "nonmoe_time"]

#: Bytes per cached K/V element in the architecture formula (bf16, §5.3.4).
_KV_BYTES = 2
#: Bytes per element of the Gated-DeltaNet recurrent state (fp32, §5.3.4).
_STATE_BYTES = 4


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


def generic_terms(model: ModelSpec, B: FloatArray, L: float) -> tuple[FloatArray, FloatArray]:
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
    model: ModelSpec, conv: Conventions, B: FloatArray, layer: int, ffn_intermediate: float,
    ctx: float,
) -> tuple[FloatArray, FloatArray]:
    """Return (FLOPs, bytes) of one layer by the architecture formula (§5.3.4).

    FLOP_nm = B·(2·W_attn + F_core + 6·h·I_ffn); bytes_nm = b_w·(W_attn + 3·h·I_ffn) + B·KV_bytes,
    where I_ffn is I_s for an MoE layer and I_dense for a dense leading layer (SwiGLU, three
    matrices, independent of ``expert_matrices``).
    """
    h = float(model.hidden_size)
    weights, core_flops, state_bytes = _arch_attention(model, layer, ctx)
    flops = B * (2 * weights + core_flops + 6 * h * ffn_intermediate)
    nbytes = conv.b_w * (weights + 3 * h * ffn_intermediate) + B * state_bytes
    return flops, nbytes


def _context(conv: Conventions, ctx_len: float | None) -> float:
    """Return the context length to charge: ``ctx_len`` if given, else ``conv.nonmoe_ctx_len``."""
    if ctx_len is None:
        return float(conv.nonmoe_ctx_len)
    ctx = float(ctx_len)
    if not (np.isfinite(ctx) and ctx >= 0):
        raise ConfigError(f"ctx_len must be a finite number of tokens >= 0, got {ctx_len!r}")
    return ctx


def _combine(
    compute: FloatArray, memory: FloatArray, comm: FloatArray, roofline: bool
) -> NonMoeTime:
    """Build a ``NonMoeTime`` with a serial or roofline total."""
    total = (np.maximum(compute, memory) if roofline else compute + memory) + comm
    return NonMoeTime(as_output(compute), as_output(memory), as_output(comm), as_output(total))


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
    topology: Topology | None = None,
) -> FloatOrArray:
    """Return the per-layer all-reduce of a TP attention (§5.3.4 ``nonmoe_allreduce``).

    [decision] B·h activations (b_psum bytes each) are all-reduced with the profile's TP
    all-reduce model (§5.6): a token lives on its home node, so attention and shared experts
    split over the D nodes need a reduce-scatter of the partial outputs to the homes and an
    all-gather of the inputs, i.e. one all-reduce per layer (docs/PHYSICS.md). With
    ``tp_allreduce="best"`` and a ``topology``, the fastest DES algorithm of
    ``collectives.best_allreduce``; otherwise the closed form ``perf.tp_allreduce_time``. The
    term is zero when the knob is off (the paper's assumption, ``paper*``).

    Args:
        model: The model (h).
        hw: The hardware.
        conv: The conventions (``nonmoe_allreduce`` and the §5.6 knobs).
        B: Tokens per decode step (scalar or array).
        bw_end_Bps: Endpoint-side bandwidth, default the hardware link bandwidth.
        topology: The NoC for the DES algorithms (``tp_allreduce="best"``).

    Returns:
        Seconds, shape of ``B``.
    """
    batch = check_tokens(B)
    if not conv.nonmoe_allreduce:
        return as_output(np.zeros_like(batch))
    if conv.tp_allreduce == "best" and topology is not None:
        alpha, hop = conv.msg_alpha_s, hw.hop_latency_for(conv)
        ni = conv.ni_bw_for(topology.bw_end_Bps)
        times = [collectives.best_allreduce(topology, float(b) * model.hidden_size * conv.b_psum,
                                            alpha_s=alpha, hop_latency_s=hop,
                                            switching=conv.switching, ni_bw_Bps=ni,
                                            ni_latency_s=conv.ni_latency_for(hop)).time_s
                 for b in batch.reshape(-1)]
        return as_output(np.array(times, dtype=np.float64).reshape(batch.shape))
    return tp_allreduce_time(model, hw, conv, batch, bw_end_Bps=bw_end_Bps)


def nonmoe_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    layer: int = 0,
    bw_end_Bps: float | None = None,
    topology: Topology | None = None,
    ctx_len: float | None = None,
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
        topology: The NoC for the all-reduce's DES algorithms (``nonmoe_allreduce_time``).
        ctx_len: Mean context length of the step's requests, overriding
            ``conv.nonmoe_ctx_len`` (``cost.context.step_nonmoe_time``: every formula is linear
            in the context, so the batch's mean gives the cost of its per-request lengths).

    Returns:
        The layer's ``NonMoeTime`` (seconds).

    Raises:
        ConfigError: ``layer`` is outside 0..L−1, B is negative or ``ctx_len`` is negative.
    """
    if not 0 <= layer < model.num_moe_layers:
        raise ConfigError(
            f"layer must be in 0..{model.num_moe_layers - 1} for model {model.key!r}, got {layer}"
        )
    batch = check_tokens(B)
    ctx = _context(conv, ctx_len)
    if conv.nonmoe == "journal":
        flops, nbytes = _journal_terms(model, batch, ctx)
        roofline = False
    elif conv.nonmoe == "generic":
        flops, nbytes = generic_terms(model, batch, ctx)
        roofline = False
    else:
        flops, nbytes = _arch_terms(model, conv, batch, layer, float(model.shared_intermediate),
                                    ctx)
        roofline = _arch_roofline(conv)
    nodes = hw.num_nodes
    compute = flops / (nodes * hw.compute_flops)
    memory = nbytes / (nodes * effective_mem_bw(hw, conv))
    comm = np.asarray(nonmoe_allreduce_time(model, hw, conv, batch, bw_end_Bps, topology),
                      np.float64)
    return _combine(np.asarray(compute), np.asarray(memory), comm, roofline)


def dense_layer_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    bw_end_Bps: float | None = None,
    topology: Topology | None = None,
    ctx_len: float | None = None,
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
        topology: The NoC for the all-reduce's DES algorithms (``nonmoe_allreduce_time``).
        ctx_len: Mean context length overriding ``conv.nonmoe_ctx_len`` (as ``nonmoe_time``).

    Returns:
        One dense layer's ``NonMoeTime`` (seconds).
    """
    batch = check_tokens(B)
    h = float(model.hidden_size)
    weights = float(model.attn_weight_elements)
    ctx = _context(conv, ctx_len)
    core_flops = model.core_flops_per_ctx_token * ctx
    kv_bytes = ctx * model.kv_elements_per_token * _KV_BYTES
    flops = batch * (2 * weights + core_flops + 6 * h * model.dense_intermediate)
    nbytes = conv.b_w * (weights + 3 * h * model.dense_intermediate) + batch * kv_bytes
    nodes = hw.num_nodes
    comm = np.asarray(nonmoe_allreduce_time(model, hw, conv, batch, bw_end_Bps, topology),
                      np.float64)
    return _combine(
        flops / (nodes * hw.compute_flops),
        nbytes / (nodes * effective_mem_bw(hw, conv)),
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
    batch = check_tokens(B)
    weights = float(model.vocab_size) * model.hidden_size
    nodes = hw.num_nodes
    compute = 2.0 * batch * weights / (nodes * hw.compute_flops)
    memory = np.broadcast_to(conv.b_w * weights / (nodes * effective_mem_bw(hw, conv)),
                             batch.shape)
    return _combine(
        compute, np.asarray(memory, np.float64), np.zeros_like(batch), _arch_roofline(conv)
    )


def nonmoe_step_time(
    model: ModelSpec,
    hw: HardwareSpec,
    conv: Conventions,
    B: ArrayLike,
    bw_end_Bps: float | None = None,
    topology: Topology | None = None,
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
        topology: The NoC for the all-reduce's DES algorithms.

    Returns:
        Seconds, shape of ``B``.
    """
    batch = check_tokens(B)
    per_layer: dict[bool, FloatArray] = {}  # t_nm depends on the layer only via its attention
    total = np.zeros_like(batch)
    for layer in range(model.num_moe_layers):
        kind = conv.nonmoe == "arch" and model.is_full_attention(layer)
        if kind not in per_layer:
            per_layer[kind] = np.asarray(
                nonmoe_time(model, hw, conv, batch, layer, bw_end_Bps, topology).total_s, np.float64
            )
        total = total + per_layer[kind]
    if conv.dense_layers and model.num_dense_layers > 0:
        dense = dense_layer_time(model, hw, conv, batch, bw_end_Bps, topology).total_s
        total = total + model.num_dense_layers * np.asarray(dense, np.float64)
    if conv.include_lm_head:
        total = total + np.asarray(lm_head_time(model, hw, conv, batch).total_s, np.float64)
    return as_output(total)



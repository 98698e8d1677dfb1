"""Model, hardware and topology specifications (paper-model.md §2–3).

All specs are frozen, slotted dataclasses validated in ``__post_init__``; units are in the field
names and everything internal is SI (convert once, in properties). Presets are module-level dicts;
variants come from ``dataclasses.replace``; JSON round-trips through ``to_dict``/``from_dict``.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
from dataclasses import dataclass, field
from typing import Any, Protocol

from hdamoe_env.config.errors import ConfigError, unknown_name


class _HopLatencyProfile(Protocol):
    """What ``HardwareSpec.hop_latency_for`` reads of a profile (``profiles.Conventions``)."""

    hop_latency_s: float

__all__ = [
    "HARDWARE_PRESETS",
    "MODEL_ALIASES",
    "MODEL_PRESETS",
    "TOPOLOGY_KINDS",
    "HardwareSpec",
    "ModelSpec",
    "TopologySpec",
    "get_model",
    "hardware_from_setting",
    "parse_mesh",
    "parse_setting",
]


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """An MoE language model as the performance model sees it (paper-model.md §2.1).

    Sizes are in elements (not bytes); the convention profile decides bytes per element and the
    number of matrices counted per expert.
    """

    key: str                              # package id, e.g. "deepseek-v2-lite"
    name: str                             # human-readable model name
    num_moe_layers: int                   # L
    num_experts: int                      # E routed experts per MoE layer
    top_k: int                            # k
    hidden_size: int                      # h
    expert_intermediate: int              # I of one routed expert
    shared_intermediate: int = 0          # I_s, total over the shared expert(s) of a layer
    num_dense_layers: int = 0             # leading dense FFN decoder layers (DeepSeek: 1)
    dense_intermediate: int = 0           # I_dense of those layers
    layer_key_offset: int = 0             # trace layer key of MoE layer l is str(l + offset)
    hybrid_regions: int = 8               # R of the compute-balanced hybrid baseline (§9.3)
    renormalize_topk: bool = False        # router weight rule (§2.1, §11.5)
    nonmoe_formula: str = "mixtral"       # which `paper` non-MoE formula applies (§5.3.1/§5.3.3)
    # attention (faithful non-MoE term, §5.3.4)
    attn_weight_elements: float = 0.0     # W_attn of a (full-attention) layer
    kv_elements_per_token: int = 0        # cached K/V elements per token per full layer
    core_flops_per_ctx_token: float = 0.0  # F_core / L_ctx = 2·n_q·(d_qk + d_v)
    # hybrid linear attention (Qwen3.5): every `full_attention_interval`-th layer is full softmax
    full_attention_interval: int = 1
    linear_attn_weight_elements: float = 0.0
    linear_core_flops_per_token: float = 0.0
    linear_state_elements: int = 0        # recurrent state per sequence (fp32)
    vocab_size: int = 0                   # for the optional LM-head term
    notes: tuple[str, ...] = field(default_factory=tuple)

    def __post_init__(self) -> None:
        for name in ("num_moe_layers", "num_experts", "top_k", "hidden_size",
                     "expert_intermediate"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ConfigError(f"ModelSpec.{name} must be a positive integer, got {value!r}")
        if self.top_k > self.num_experts:
            raise ConfigError(f"ModelSpec.top_k={self.top_k} exceeds num_experts="
                              f"{self.num_experts}; top_k must be <= num_experts")
        if self.nonmoe_formula not in ("mixtral", "deepseek", "qwen2", "qwen35"):
            raise ConfigError(f"ModelSpec.nonmoe_formula={self.nonmoe_formula!r}; expected "
                              "'mixtral', 'deepseek', 'qwen2' or 'qwen35'")
        if self.full_attention_interval < 1:
            raise ConfigError("ModelSpec.full_attention_interval must be >= 1, got "
                              f"{self.full_attention_interval}")

    def is_full_attention(self, layer: int) -> bool:
        """Return whether MoE layer ``layer`` uses full softmax attention (else linear)."""
        return (layer + 1) % self.full_attention_interval == 0

    def layer_key(self, layer: int) -> str:
        """Return the trace layer key of MoE layer ``layer`` (traces.md §2)."""
        return str(layer + self.layer_key_offset)

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["notes"] = list(self.notes)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelSpec:
        """Build a spec from ``to_dict`` output."""
        data = dict(data)
        data["notes"] = tuple(data.get("notes", ()))
        return cls(**data)


MODEL_PRESETS: dict[str, ModelSpec] = {
    "mixtral-8x7b": ModelSpec(
        key="mixtral-8x7b", name="Mixtral-8x7B-Instruct-v0.1", num_moe_layers=32,
        num_experts=8, top_k=2, hidden_size=4096, expert_intermediate=14336,
        hybrid_regions=2, renormalize_topk=True, nonmoe_formula="mixtral",
        attn_weight_elements=41_943_040, kv_elements_per_token=2 * 8 * 128,
        core_flops_per_ctx_token=2 * 32 * (128 + 128), vocab_size=32000,
    ),
    "deepseek-v2-lite": ModelSpec(
        key="deepseek-v2-lite", name="DeepSeek-V2-Lite-Chat", num_moe_layers=26,
        num_experts=64, top_k=6, hidden_size=2048, expert_intermediate=1408,
        shared_intermediate=2816, num_dense_layers=1, dense_intermediate=10944,
        layer_key_offset=1, hybrid_regions=8, renormalize_topk=False,
        nonmoe_formula="deepseek", attn_weight_elements=13_762_560,
        kv_elements_per_token=512 + 64, core_flops_per_ctx_token=2 * 16 * (192 + 128),
        vocab_size=102400, notes=("I_dense = 10944 [verify]",),
    ),
    "qwen2-57b-a14b": ModelSpec(
        key="qwen2-57b-a14b", name="Qwen2-57B-A14B-Instruct", num_moe_layers=28,
        num_experts=64, top_k=8, hidden_size=3584, expert_intermediate=2560,
        shared_intermediate=20480, hybrid_regions=8, renormalize_topk=False,
        nonmoe_formula="qwen2", attn_weight_elements=29_360_128,
        kv_elements_per_token=2 * 4 * 128, core_flops_per_ctx_token=2 * 28 * (128 + 128),
        vocab_size=151936,
    ),
    "qwen3.5-35b-a3b": ModelSpec(
        key="qwen3.5-35b-a3b", name="Qwen3.5-35B-A3B", num_moe_layers=40,
        num_experts=256, top_k=8, hidden_size=2048, expert_intermediate=512,
        shared_intermediate=512, hybrid_regions=8, renormalize_topk=True,
        nonmoe_formula="qwen35", attn_weight_elements=27_262_976,
        kv_elements_per_token=2 * 2 * 256, core_flops_per_ctx_token=2 * 16 * (256 + 256),
        full_attention_interval=4, linear_attn_weight_elements=33_685_504,
        linear_core_flops_per_token=3_145_728, linear_state_elements=32 * 128 * 128,
        vocab_size=248320,
        notes=("head counts, I_s and router normalisation are [verify] model-card values",
               "paper* non-MoE term uses the package-defined formula of paper-model.md §5.3.3",
               "no real routing exists: results use synthetic routing"),
    ),
}

MODEL_ALIASES: dict[str, str] = {
    "mixtral": "mixtral-8x7b",
    "deepseek": "deepseek-v2-lite",
    "qwen2": "qwen2-57b-a14b",
    "qwen35": "qwen3.5-35b-a3b",
    "qwen3.5": "qwen3.5-35b-a3b",
}


def get_model(name: str | ModelSpec) -> ModelSpec:
    """Look up a model preset by id (or a short alias such as ``"deepseek"``).

    Args:
        name: A preset id of ``MODEL_PRESETS``, an alias of ``MODEL_ALIASES`` or a ``ModelSpec``.

    Returns:
        The model spec.

    Raises:
        ConfigError: The name is unknown (the message suggests the nearest id).
    """
    if isinstance(name, ModelSpec):
        return name
    if not isinstance(name, str):
        raise ConfigError(f"model must be a preset name or a ModelSpec, got {name!r}; e.g. "
                          "'mixtral-8x7b'")
    key = MODEL_ALIASES.get(name, name)
    if key not in MODEL_PRESETS:
        raise unknown_name("model preset", name, MODEL_PRESETS)
    return MODEL_PRESETS[key]


@dataclass(frozen=True, slots=True)
class HardwareSpec:
    """A 3D near-memory-processing chip: X×Y compute-near-memory nodes joined by a NoC (§3)."""

    mesh_shape: tuple[int, int] = (4, 8)   # rows X, columns Y (also the fat-tree endpoint grid)
    compute_tflops: float = 5.0            # per node
    link_bw_gbps: float = 50.0             # per directed link, GB/s = 1e9 B/s
    mem_bw_gbps: float = 625.0             # per node DRAM
    hop_latency_ns: float | None = None    # per hop; None = the profile's hop_latency_s
    node_dram_gib: float | None = None     # DRAM capacity per node (None = unconstrained)

    def __post_init__(self) -> None:
        try:
            shape = tuple(self.mesh_shape)
        except TypeError:
            shape = ()
        if len(shape) != 2 or not all(isinstance(v, int) and v >= 1 for v in shape):
            raise ConfigError(f"mesh_shape must be two positive integers (rows, cols), got "
                              f"{self.mesh_shape!r}; e.g. (4, 8)")
        object.__setattr__(self, "mesh_shape", shape)
        for name in ("compute_tflops", "link_bw_gbps", "mem_bw_gbps"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(f"HardwareSpec.{name} must be a positive number, got {value!r}")
        if self.hop_latency_ns is not None and not (
                isinstance(self.hop_latency_ns, int | float) and self.hop_latency_ns >= 0
                and math.isfinite(self.hop_latency_ns)):
            raise ConfigError(f"hop_latency_ns must be >= 0, got {self.hop_latency_ns!r}")
        if self.node_dram_gib is not None and not self.node_dram_gib > 0:
            raise ConfigError(f"node_dram_gib must be positive or None, got {self.node_dram_gib!r}")

    @property
    def num_nodes(self) -> int:
        """Number of nodes D = X·Y."""
        return self.mesh_shape[0] * self.mesh_shape[1]

    @property
    def compute_flops(self) -> float:
        """Compute throughput per node C in FLOP/s."""
        return self.compute_tflops * 1e12

    @property
    def link_bw_Bps(self) -> float:  # noqa: N802 - unit suffix
        """Bandwidth of one directed link in B/s."""
        return self.link_bw_gbps * 1e9

    @property
    def mem_bw_Bps(self) -> float:  # noqa: N802 - unit suffix
        """DRAM bandwidth per node in B/s."""
        return self.mem_bw_gbps * 1e9

    @property
    def hop_latency_s(self) -> float | None:
        """The explicit per-hop latency in seconds, or None (use ``hop_latency_for``)."""
        return None if self.hop_latency_ns is None else self.hop_latency_ns * 1e-9

    def hop_latency_for(self, conv: _HopLatencyProfile) -> float:
        """Return the effective per-hop latency in seconds under a convention profile.

        An explicit ``hop_latency_ns`` overrides the profile's ``hop_latency_s`` (one α–β model:
        the DES hops and the collective steps read the same value, docs/PHYSICS.md).
        """
        if self.hop_latency_ns is None:
            return float(conv.hop_latency_s)
        return self.hop_latency_ns * 1e-9

    @property
    def node_dram_bytes(self) -> float | None:
        """DRAM capacity per node in bytes, or None."""
        return None if self.node_dram_gib is None else self.node_dram_gib * 2**30

    @property
    def setting(self) -> str:
        """The compute/bandwidth setting label, e.g. ``"5/50"``."""
        return f"{self.compute_tflops:g}/{self.link_bw_gbps:g}"

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict."""
        d = dataclasses.asdict(self)
        d["mesh_shape"] = list(self.mesh_shape)
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> HardwareSpec:
        """Build a spec from ``to_dict`` output."""
        data = dict(data)
        data["mesh_shape"] = tuple(data["mesh_shape"])
        return cls(**data)


#: The paper's three (node compute, link bandwidth) pairs on the default 4×8 mesh (§3).
HARDWARE_PRESETS: dict[str, HardwareSpec] = {
    "2.5/75": HardwareSpec(compute_tflops=2.5, link_bw_gbps=75.0),
    "5/50": HardwareSpec(compute_tflops=5.0, link_bw_gbps=50.0),
    "10/25": HardwareSpec(compute_tflops=10.0, link_bw_gbps=25.0),
}


def parse_setting(text: str) -> tuple[float, float]:
    """Parse a setting label ``"TFLOPS/GBps"`` such as ``"5/50"``.

    Raises:
        ConfigError: The text is not of that form.
    """
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*/\s*([0-9]*\.?[0-9]+)\s*", str(text))
    if not m:
        raise ConfigError(f"setting {text!r} is not of the form 'TFLOPS/GBps'; expected e.g. "
                          f"one of {sorted(HARDWARE_PRESETS)}")
    return float(m.group(1)), float(m.group(2))


def parse_mesh(text: str | tuple[int, int]) -> tuple[int, int]:
    """Parse a mesh shape ``"XxY"`` such as ``"4x8"``, or check a (rows, cols) pair.

    Raises:
        ConfigError: The text is not of that form, or the pair is not two positive integers.
    """
    if not isinstance(text, str):
        ok = (isinstance(text, tuple | list) and len(text) == 2
              and all(isinstance(v, numbers.Integral) and not isinstance(v, bool) and v >= 1
                      for v in text))
        if not ok:
            raise ConfigError(f"mesh {text!r} is not 'XxY' or a pair of positive integers "
                              "(X, Y); e.g. '4x8' or (4, 8)")
        return int(text[0]), int(text[1])
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ConfigError(f"mesh {text!r} is not of the form 'XxY' with positive X, Y; e.g. '4x8'")
    return int(m.group(1)), int(m.group(2))


def hardware_from_setting(setting: str = "5/50", mesh: str | tuple[int, int] = (4, 8),
                          **overrides: Any) -> HardwareSpec:
    """Build a ``HardwareSpec`` from a setting label and a mesh shape.

    Args:
        setting: ``"TFLOPS/GBps"``, e.g. one of ``HARDWARE_PRESETS``.
        mesh: ``"XxY"`` or a (rows, cols) tuple.
        **overrides: Further ``HardwareSpec`` fields (``mem_bw_gbps``, ``hop_latency_ns``, ...).

    Returns:
        The hardware spec.
    """
    tflops, gbps = parse_setting(setting)
    shape = parse_mesh(mesh)
    return HardwareSpec(mesh_shape=shape, compute_tflops=tflops, link_bw_gbps=gbps, **overrides)


TOPOLOGY_KINDS = ("mesh", "torus", "fattree")


@dataclass(frozen=True, slots=True)
class TopologySpec:
    """Which NoC connects the nodes (§3, §6.1).

    For ``mesh`` and ``torus`` the grid is the hardware's ``mesh_shape`` and every directed link
    has the hardware's link bandwidth. For ``fattree`` the endpoints are numbered row-major on the
    ``mesh_shape`` grid; the tier bandwidths default to the hardware link bandwidth.
    """

    kind: str = "mesh"
    pods: int = 4
    leaves_per_pod: int = 4
    endpoints_per_leaf: int = 2
    aggs_per_pod: int = 2
    core_switches: int = 4
    bw_el_gbps: float | None = None        # endpoint–leaf
    bw_la_gbps: float | None = None        # leaf–aggregation
    bw_ac_gbps: float | None = None        # aggregation–core
    oversubscription: float = 1.0

    def __post_init__(self) -> None:
        if self.kind not in TOPOLOGY_KINDS:
            raise unknown_name("topology", self.kind, TOPOLOGY_KINDS)
        for name in ("pods", "leaves_per_pod", "endpoints_per_leaf", "aggs_per_pod",
                     "core_switches"):
            if getattr(self, name) < 1:
                raise ConfigError(f"TopologySpec.{name} must be >= 1, got {getattr(self, name)}")
        if not self.oversubscription > 0:
            raise ConfigError(f"oversubscription must be > 0, got {self.oversubscription}")

    @property
    def fattree_endpoints(self) -> int:
        """Number of endpoints of the fat-tree."""
        return self.pods * self.leaves_per_pod * self.endpoints_per_leaf

    def to_dict(self) -> dict[str, Any]:
        """Return a JSON-serialisable dict."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TopologySpec:
        """Build a spec from ``to_dict`` output."""
        return cls(**data)

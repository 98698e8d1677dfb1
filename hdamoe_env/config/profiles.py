"""Convention profiles: ``faithful`` (default), ``paper`` (journal) and ``paper-hd`` (conference).

Implements paper-model.md §4. A profile is a frozen set of knob values; overriding knobs gives a
derived profile whose name records the base and the overrides (``faithful+b_msg=1``). Every result
carries ``Conventions.to_dict()`` so that every number says which conventions produced it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

from hdamoe_env.config.errors import ConfigError, unknown_name

__all__ = ["PROFILES", "Conventions", "get_profile"]

_CHOICES: dict[str, tuple[Any, ...]] = {
    "moe_comm": ("dispatch+combine", "2xcombine"),
    "tp_allreduce": ("best", "ring", "const"),
    "nonmoe": ("arch", "journal", "generic"),
    "aggregator": ("uniform", "ref", "first"),
    "tie_break": ("fifo", "ref"),
    "gamma_fit": ("origin", "ols"),
    "nb_group_constraint": ("per_expert", "aggregated"),
    "lb_noise": ("crn", "redraw"),
    "hybrid_eval": ("des", "ref"),
    "bc_payload": ("weights", "paper"),
    "bc_depth": ("diameter", "2sqrtD"),
    "bc_budget": ("layer", "hd"),
    "switching": ("store_and_forward", "cut_through"),
}


@dataclass(frozen=True, slots=True)
class Conventions:
    """Every unit and modelling convention knob (paper-model.md §4.1).

    Attributes are documented in the table of §4.1; the defaults are the ``faithful`` profile.
    """

    name: str = "faithful"
    expert_matrices: int = 3          # m: F_e = 2·m·h·I FLOPs, W_e = m·h·I·b_w bytes (Q1)
    b_w: int = 2                      # bytes per weight
    b_msg: int = 2                    # bytes per hidden element in MoE messages (Q2)
    kappa_a: float = 2.0              # analytic estimator constant (Eq. 2, §5.5)
    moe_comm: str = "dispatch+combine"  # or "2xcombine" (Q3)
    nb_comm_factor: float = 1.0       # Node-Balance objective t_comp + factor·t̂_comm
    tp_allreduce: str = "best"        # fastest DES all-reduce (collectives), "ring" closed
                                      # form, or "const": tp_const·B·h/BW (Q4)
    tp_const: float = 16.0            # 16 journal, 8 conference
    b_psum: int = 4                   # bytes per partial-sum element (fp32 sums, PHYSICS.md)
    weight_streaming: bool = True     # per-node roofline over active shards (Q7)
    nonmoe: str = "arch"              # "arch" §5.3.4, "journal" §5.3.1, "generic" §5.3.2
    nonmoe_ctx_len: int = 1226        # L_ctx (arch) / L_dec (journal) / L_kv (generic): mean
                                      # decode-step context of the Azure 2023 conversation
                                      # trace (cost/context.py, docs/PHYSICS.md)
    dense_layers: bool = True         # include DeepSeek's dense layer 0 as a non-MoE layer
    include_lm_head: bool = False
    nonmoe_allreduce: bool = True     # attention/shared experts split over D: one all-reduce
    aggregator: str = "uniform"       # §6.2 (Q6)
    tie_break: str = "fifo"           # §6.3 (Q19)
    chunks: int = 1                   # split every MoE message into this many parts
    gamma_fit: str = "origin"         # least squares through the origin, or OLS slope (Q9)
    gamma_batch_lo: float = 0.5       # origin fit: batch sizes in [lo·B, hi·B]
    gamma_batch_hi: float = 2.0
    gamma_points: int = 64
    gamma_paper_batches: tuple[int, int, int] = (256, 640, 2)  # range(start, stop, step) for OLS
    gamma_combine_only: bool = False  # fit y = combine DES only (paper) or dispatch + combine
    nb_group_constraint: str = "per_expert"
    lb_noise: str = "crn"
    hybrid_eval: str = "des"
    hybrid_ref_slip: bool = False
    bc_payload: str = "weights"       # S = W_e (3·h·I·b_w), or "paper": 2·h·I bytes (Q15)
    bc_depth: str = "diameter"        # H = topology diameter, or 2·sqrt(D)
    bc_budget: str = "layer"          # t_nm(l) + t_comp(l), or the HD budget formula (Q14)
    bc_alpha_s: float | None = None   # broadcast start-up per message; None = msg_alpha_s
    bc_charge_excess: bool = True     # add max(0, T_bc − budget) to the layer latency
    ref_bookkeeping: bool = False     # §10.9 (Q16)
    skip_zero_priority: bool = True   # §10.5 [decision]
    batch_mode: str = "streams"       # decode-step formation (traces.md §6)
    # α–β cost of every message and collective step (docs/PHYSICS.md)
    msg_alpha_s: float = 100e-9       # start-up α per message / collective step (DMA + NI)
    hop_latency_s: float = 2e-9       # router + link per hop; HardwareSpec.hop_latency_ns wins
    switching: str = "cut_through"    # NoC DES: or "store_and_forward" (docs/PHYSICS.md)
    ni_ports: bool = True             # one injection + one ejection port per node at BW_end
    ni_latency_hops: float = 0.75     # latency of each port in hop latencies: BookSim's
                                      # zero-load 6 + 4·hops cycles (docs/PHYSICS.md §16)
    # tile model of the expert GEMMs (docs/PHYSICS.md); 1, 1, 0 = the fluid model of §5.2
    tile_tokens: int = 8              # GEMM rows (tokens) are padded to a multiple of this
    tile_cols: int = 64               # GEMM columns padded to a multiple; shares on a tile_cols/I grid
    gemm_overhead_s: float = 100e-9   # fixed time per GEMM (array fill/drain)
    col_granularity: int = 8          # MAC-array column granularity: GEMM columns pad to
                                      # min(col_granularity, tile_cols) (docs/PHYSICS.md §4)
    # partial sums and DRAM (docs/PHYSICS.md)
    psum_combine: bool = True         # combine messages of partial-shard holders at b_psum
    dram_efficiency: float = 0.85     # sustained streaming-read share of peak DRAM bandwidth

    def __post_init__(self) -> None:
        for knob, choices in _CHOICES.items():
            value = getattr(self, knob)
            if value not in choices:
                raise ConfigError(f"Conventions.{knob}={value!r}; expected one of "
                                  f"{list(choices)}")
        if self.expert_matrices not in (1, 2, 3):
            raise ConfigError(f"expert_matrices must be 1, 2 or 3, got {self.expert_matrices}")
        for knob in ("b_w", "b_msg", "b_psum", "chunks", "nonmoe_ctx_len", "gamma_points",
                     "tile_tokens", "tile_cols", "col_granularity"):
            if getattr(self, knob) < 1:
                raise ConfigError(f"Conventions.{knob} must be >= 1, got {getattr(self, knob)}")
        if not self.kappa_a > 0 or not self.tp_const > 0:
            raise ConfigError("kappa_a and tp_const must be positive")
        for knob in ("msg_alpha_s", "hop_latency_s", "bc_alpha_s", "gemm_overhead_s",
                     "ni_latency_hops"):
            value = getattr(self, knob)
            if value is None and knob == "bc_alpha_s":
                continue
            if not (isinstance(value, int | float) and math.isfinite(value) and value >= 0):
                unit = " (hop latencies)" if knob == "ni_latency_hops" else " (seconds)"
                raise ConfigError(f"Conventions.{knob} must be a finite number >= 0{unit}, "
                                  f"got {value!r}")
        eff = self.dram_efficiency
        if not (isinstance(eff, int | float) and math.isfinite(eff) and 0 < eff <= 1):
            raise ConfigError(f"Conventions.dram_efficiency must be in (0, 1], got {eff!r}")
        object.__setattr__(self, "gamma_paper_batches", tuple(self.gamma_paper_batches))

    @property
    def col_pad(self) -> int:
        """Columns a GEMM pads to: min(``col_granularity``, ``tile_cols``) (docs/PHYSICS.md §4).

        [decision] A share grid (``tile_cols``) finer than the MAC array's column granularity
        would waste columns on every shard; the array is taken to split at least as finely as
        the placement grid, so ``tile_cols`` = 1 (the old "no column padding" spelling) still
        means no column padding.
        """
        return min(self.col_granularity, self.tile_cols)

    @property
    def tiled(self) -> bool:
        """Whether the expert GEMMs follow the tile model (else the fluid model of §5.2)."""
        return self.tile_tokens > 1 or self.col_pad > 1 or self.gemm_overhead_s > 0

    def ni_bw_for(self, bw_end_Bps: float) -> float | None:
        """The DES network-interface port bandwidth: ``bw_end_Bps`` with ``ni_ports``, else None."""
        return float(bw_end_Bps) if self.ni_ports else None

    def ni_latency_for(self, hop_latency_s: float) -> float:
        """The DES latency of one network-interface port: ``ni_latency_hops`` · hop latency.

        Only read where ``ni_bw_for`` gives a port bandwidth (docs/PHYSICS.md §16).
        """
        return float(self.ni_latency_hops) * float(hop_latency_s)

    @property
    def broadcast_alpha_s(self) -> float:
        """Start-up latency α of one broadcast message (§10.4): ``bc_alpha_s``, else α_msg."""
        return self.msg_alpha_s if self.bc_alpha_s is None else float(self.bc_alpha_s)

    @property
    def is_paper(self) -> bool:
        """Whether the base profile is one of the reference-compatible ``paper*`` profiles."""
        return self.name.split("+")[0] in ("paper", "paper-hd")

    def knobs(self) -> dict[str, Any]:
        """Return every knob except the name, JSON-serialisable."""
        d = dataclasses.asdict(self)
        d.pop("name")
        d["gamma_paper_batches"] = list(self.gamma_paper_batches)
        return d

    def to_dict(self) -> dict[str, Any]:
        """Return the name, the knobs and a short hash of the knobs."""
        knobs = self.knobs()
        digest = hashlib.sha256(json.dumps(knobs, sort_keys=True).encode()).hexdigest()[:12]
        return {"name": self.name, "knobs": knobs, "knobs_sha256": digest}

    def derive(self, **overrides: Any) -> Conventions:
        """Return a derived profile with ``overrides``; its name records them.

        Raises:
            ConfigError: An override names an unknown knob or gives an invalid value.
        """
        fields = {f.name for f in dataclasses.fields(self)} - {"name"}
        for knob in overrides:
            if knob not in fields:
                raise unknown_name("convention knob", knob, fields)
        changed = {k: v for k, v in overrides.items() if getattr(self, k) != v}
        if not changed:
            return self
        suffix = "+".join(f"{k}={v}" for k, v in sorted(changed.items()))
        return dataclasses.replace(self, name=f"{self.name}+{suffix}", **changed)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Conventions:
        """Rebuild a profile from ``to_dict`` output."""
        return cls(name=data["name"], **data["knobs"])


_PAPER = Conventions(
    name="paper", expert_matrices=1, b_msg=1, b_psum=2, kappa_a=4.0, moe_comm="2xcombine",
    nb_comm_factor=2.0, tp_allreduce="const", tp_const=16.0, weight_streaming=False,
    nonmoe="journal", nonmoe_ctx_len=64, dense_layers=False, aggregator="ref", tie_break="ref",
    gamma_fit="ols", gamma_combine_only=True, nb_group_constraint="aggregated",
    lb_noise="redraw", hybrid_eval="ref", bc_payload="paper", bc_depth="2sqrtD",
    bc_budget="hd", bc_charge_excess=False, ref_bookkeeping=True, skip_zero_priority=False,
    bc_alpha_s=100e-9, msg_alpha_s=0.0, hop_latency_s=0.0, tile_tokens=1, tile_cols=1,
    gemm_overhead_s=0.0, nonmoe_allreduce=False, col_granularity=1, psum_combine=False,
    dram_efficiency=1.0, switching="store_and_forward", ni_ports=False,
)

PROFILES: dict[str, Conventions] = {
    "faithful": Conventions(),
    "paper": _PAPER,
    "paper-hd": dataclasses.replace(_PAPER, name="paper-hd", tp_const=8.0, nonmoe="generic",
                                    nonmoe_ctx_len=1024),
}


def get_profile(name: str | Conventions, **overrides: Any) -> Conventions:
    """Look up a convention profile by name (or derived name) and apply knob overrides.

    A derived profile's name records its base and overrides (``"faithful+b_psum=4+chunks=2"``);
    such a name resolves to the same profile, so derived profiles travel wherever a profile name
    does (CLI options, JSON configurations, cache keys).

    Args:
        name: ``"faithful"``, ``"paper"``, ``"paper-hd"``, a derived name, or a ``Conventions``.
        **overrides: Knob values; the result's name records them.

    Raises:
        ConfigError: Unknown profile or knob, or an override value of the wrong type.
    """
    if isinstance(name, Conventions):
        base = name
    elif not isinstance(name, str):
        raise ConfigError(f"conventions must be a profile name or a Conventions object, got "
                          f"{name!r}; e.g. 'faithful' or 'faithful+b_psum=4'")
    else:
        head, *parts = str(name).split("+")
        if head not in PROFILES:
            raise unknown_name("convention profile", head, PROFILES)
        base = PROFILES[head]
        if parts:
            pairs = [_parse_override(base, part, str(name)) for part in parts]
            knobs = [knob for knob, _ in pairs]
            repeated = sorted({k for k in knobs if knobs.count(k) > 1})
            if repeated:
                raise ConfigError(f"profile {str(name)!r} sets {repeated} more than once (only "
                                  "the last would count); give each knob once")
            base = base.derive(**dict(pairs))
    return base.derive(**overrides) if overrides else base


def _parse_override(base: Conventions, text: str, whole: str) -> tuple[str, Any]:
    """Parse one ``knob=value`` of a derived profile name, typed like the knob's current value."""
    knob, sep, raw = text.partition("=")
    fields = {f.name for f in dataclasses.fields(base)} - {"name"}
    if not sep or knob not in fields:
        if sep:
            raise unknown_name("convention knob", knob, fields)
        raise ConfigError(f"profile {whole!r}: {text!r} is not knob=value; write e.g. "
                          "'faithful+b_psum=4'")
    current = getattr(base, knob)
    if knob == "bc_alpha_s":  # float | None
        if raw == "None":
            return knob, None
        current = 0.0
    try:
        if isinstance(current, bool):
            if raw not in ("True", "False", "true", "false", "1", "0"):
                raise ValueError(raw)
            value: Any = raw in ("True", "true", "1")
        elif isinstance(current, int):
            value = int(raw)
        elif isinstance(current, float):
            value = float(raw)
        elif isinstance(current, tuple):
            value = tuple(int(v) for v in raw.strip("()[] ").split(","))
        else:
            value = raw
    except ValueError:
        raise ConfigError(f"profile {whole!r}: {knob}={raw!r} is not a valid "
                          f"{type(current).__name__}; e.g. {knob}={current!r}") from None
    return knob, value

"""The energy model: joules charged to the same events as the time model (docs/PHYSICS.md §18).

Four parts, each a pure function of a count the time model already charges:

* **DRAM**: ``dram_pj_per_bit`` for every bit read from a node's stacked DRAM through the
  hybrid-bonded interface: expert weights streamed by active shards (the bytes behind
  ``node_stream_s``) and the non-MoE bytes (attention / shared-expert weights, KV cache) behind
  ``NonMoeTime.memory_s``.
* **NoC**: ``noc_pj_per_bit_hop`` (router + link) for every bit that crosses a directed link:
  Σ_links busy time × bandwidth of the DES (dispatch, combine, pre-broadcast, EPLB moves) and the
  message schedules of the all-reduces (TP's and the non-MoE one), ``allreduce_byte_hops``.
* **Compute**: ``mac_pj`` per multiply-accumulate at the logic die's precision, padded MACs of the
  tile model included (a padded row or column occupies the array and burns its energy).
* **Static**: ``static_w_per_node`` (logic-die leakage plus DRAM background and refresh) × step
  time × every node.

Pure functions, SI units (J, s, B). ``EnergySpec`` is part of the profile machinery: every
convention profile has one (``energy_spec_for``), derived names such as
``faithful+mac_pj=0.2`` override its knobs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
from numpy.typing import ArrayLike, NDArray

from hdamoe_env.config.cache import BoundedCache
from hdamoe_env.config.errors import ConfigError, unknown_name
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.noc import collectives
from hdamoe_env.noc.topology import Topology

__all__ = ["ENERGY_PROFILES", "PICO", "EnergyBreakdown", "EnergySpec", "allreduce_byte_hops",
           "compute_energy_j", "dram_energy_j", "energy_spec_for", "link_byte_hops",
           "noc_energy_j", "static_energy_j"]

#: Joules per picojoule.
PICO = 1e-12
_BITS = 8.0


@dataclass(frozen=True, slots=True)
class EnergySpec:
    """Energy cost of every event the time model charges (docs/PHYSICS.md §18).

    Attributes:
        name: Profile name (a derived name records its overrides).
        dram_pj_per_bit: Read energy of one bit from the stacked DRAM through the
            hybrid-bonded interface to the logic die, pJ.
        noc_pj_per_bit_hop: Energy of one bit crossing one router and one link, pJ.
        mac_pj: Energy of one multiply-accumulate of the logic die's MAC array at the weight
            precision (bf16 products, fp32 accumulation), pJ.
        static_w_per_node: Static power of one node (logic-die leakage, DRAM background and
            refresh), W.
    """

    name: str = "faithful"
    dram_pj_per_bit: float = 0.66
    noc_pj_per_bit_hop: float = 0.7
    mac_pj: float = 0.4
    static_w_per_node: float = 0.6

    def __post_init__(self) -> None:
        for knob in _KNOBS:
            value = getattr(self, knob)
            if not (isinstance(value, int | float) and not isinstance(value, bool)
                    and math.isfinite(value) and value >= 0):
                raise ConfigError(f"EnergySpec.{knob} must be a finite number >= 0, got "
                                  f"{value!r}")

    def derive(self, **overrides: Any) -> EnergySpec:
        """Return a spec with ``overrides``; its name records them.

        Raises:
            ConfigError: Unknown knob or invalid value.
        """
        for knob in overrides:
            if knob not in _KNOBS:
                raise unknown_name("energy knob", knob, _KNOBS)
        changed = {k: float(v) for k, v in overrides.items() if getattr(self, k) != v}
        if not changed:
            return self
        suffix = "+".join(f"{k}={v:g}" for k, v in sorted(changed.items()))
        return dataclasses.replace(self, name=f"{self.name}+{suffix}", **changed)

    def to_dict(self) -> dict[str, Any]:
        """Return the name and the knobs (JSON-serialisable)."""
        return {"name": self.name, **{k: getattr(self, k) for k in _KNOBS}}


_KNOBS = ("dram_pj_per_bit", "noc_pj_per_bit_hop", "mac_pj", "static_w_per_node")

#: The energy spec of every convention profile. The paper has no energy model; ``paper`` and
#: ``paper-hd`` carry the same sourced values as ``faithful`` so that their records can report
#: energy too (their latencies are unaffected).
ENERGY_PROFILES: dict[str, EnergySpec] = {
    "faithful": EnergySpec(),
    "paper": EnergySpec(name="paper"),
    "paper-hd": EnergySpec(name="paper-hd"),
}


def energy_spec_for(conv: Conventions | str, **overrides: Any) -> EnergySpec:
    """Return the energy spec of a convention profile (its base name's), with overrides.

    Args:
        conv: A ``Conventions`` or a profile name (derived names resolve to their base; a
            ``Conventions`` built by hand under another name gets the ``faithful`` values).
        **overrides: Energy knob values (``EnergySpec`` fields).

    Raises:
        ConfigError: Unknown profile or knob.
    """
    name = conv.name if isinstance(conv, Conventions) else str(conv)
    head = name.split("+")[0]
    if head in ENERGY_PROFILES:
        base = ENERGY_PROFILES[head]
    elif isinstance(conv, Conventions):   # a hand-built profile: the faithful values
        base = dataclasses.replace(ENERGY_PROFILES["faithful"], name=head)
    else:
        raise unknown_name("convention profile", head, ENERGY_PROFILES)
    return base.derive(**overrides) if overrides else base


# ------------------------------------------------------------------------------ pure functions
def dram_energy_j(nbytes: ArrayLike, spec: EnergySpec) -> Any:
    """Return the DRAM read energy of ``nbytes`` bytes, J (8 bits × pJ/bit)."""
    return np.asarray(nbytes, dtype=np.float64) * (_BITS * spec.dram_pj_per_bit * PICO)


def noc_energy_j(byte_hops: ArrayLike, spec: EnergySpec) -> Any:
    """Return the NoC energy of ``byte_hops`` (Σ over messages of bytes × links crossed), J."""
    return np.asarray(byte_hops, dtype=np.float64) * (_BITS * spec.noc_pj_per_bit_hop * PICO)


def compute_energy_j(macs: ArrayLike, spec: EnergySpec) -> Any:
    """Return the MAC-array energy of ``macs`` multiply-accumulates (padded ones included), J."""
    return np.asarray(macs, dtype=np.float64) * (spec.mac_pj * PICO)


def static_energy_j(seconds: ArrayLike, num_nodes: int, spec: EnergySpec) -> Any:
    """Return the static energy of ``num_nodes`` nodes over ``seconds``, J."""
    return np.asarray(seconds, dtype=np.float64) * (num_nodes * spec.static_w_per_node)


def link_byte_hops(link_busy_s: NDArray[np.float64] | None, link_bw_Bps: NDArray[np.float64]
                   ) -> float:
    """Return Σ_links busy time × bandwidth: the bytes × links crossed of a DES run.

    A directed link of the DES is busy for n / BW per message of n bytes that crosses it
    (``noc.des``), so the sum over links is Σ_messages n · hops, whatever the switching.
    """
    if link_busy_s is None:
        return 0.0
    return float(np.dot(link_busy_s, link_bw_Bps))


#: Byte-hops per byte all-reduced by (topology id, algorithm); a value keeps its topology.
_HOPS: BoundedCache[tuple[int, str], tuple[Topology, float]] = BoundedCache(
    256, name="hdamoe_env.cost.energy.allreduce_byte_hops")


def allreduce_byte_hops(topology: Topology, size_bytes: float, algorithm: str) -> float:
    """Return Σ_messages bytes × links crossed of one all-reduce of ``size_bytes`` per node.

    The schedule of ``collectives`` (``ring``, ``biring``, ``ring2d``); the closed forms
    ``"ring"`` and ``"const"`` of ``perf.tp_allreduce_time`` are charged the ring schedule. Each
    message crosses the links of its route (``Topology.hop_counts``).

    Raises:
        ConfigError: Unknown algorithm or a negative size.
    """
    if not (math.isfinite(size_bytes) and size_bytes >= 0):
        raise ConfigError(f"size_bytes must be a finite number >= 0, got {size_bytes!r}")
    name = "ring" if algorithm == "const" else algorithm
    if name not in collectives.ALGORITHMS:
        raise unknown_name("all-reduce algorithm", algorithm,
                           (*collectives.ALGORITHMS, "const"))
    if topology.num_endpoints <= 1 or size_bytes == 0:
        return 0.0
    key = (id(topology), name)
    entry = _HOPS.get(key)
    if entry is None or entry[0] is not topology:
        hops = topology.hop_counts()
        per_byte = math.fsum(count * part * float(hops[src, dst].sum())
                             for count, src, dst, part in collectives.schedule(topology, name,
                                                                                1.0))
        entry = _HOPS.put(key, (topology, per_byte))
    return entry[1] * float(size_bytes)


# ------------------------------------------------------------------------------ breakdown
@dataclass(frozen=True, slots=True)
class EnergyBreakdown:
    """Energy of a layer or a decode step by part, J.

    Attributes:
        dram_j: DRAM reads (weights, KV cache).
        noc_j: NoC traffic (router + link per hop).
        compute_j: MAC array (padded MACs included).
        static_j: Static power of all nodes over the time.
    """

    dram_j: float = 0.0
    noc_j: float = 0.0
    compute_j: float = 0.0
    static_j: float = 0.0

    @property
    def total_j(self) -> float:
        """Sum of the four parts, J."""
        return self.dram_j + self.noc_j + self.compute_j + self.static_j

    def __add__(self, other: EnergyBreakdown) -> EnergyBreakdown:
        return EnergyBreakdown(self.dram_j + other.dram_j, self.noc_j + other.noc_j,
                               self.compute_j + other.compute_j,
                               self.static_j + other.static_j)

    def scaled(self, factor: float) -> EnergyBreakdown:
        """Return every part multiplied by ``factor`` (e.g. 1/B for per-token values)."""
        return EnergyBreakdown(self.dram_j * factor, self.noc_j * factor,
                               self.compute_j * factor, self.static_j * factor)

    def to_dict(self) -> dict[str, float]:
        """Return ``{"dram": J, "noc": J, "compute": J, "static": J, "total": J}``."""
        return {"dram": self.dram_j, "noc": self.noc_j, "compute": self.compute_j,
                "static": self.static_j, "total": self.total_j}

"""Expert placements: shares ``P[L, E, D]`` and logical→physical mappings ``pi[L, D]``.

Implements paper-model.md §1 (P_ic, π_l), §7.7 (storage), §9.1–9.2 (TP and EP data constructors)
and the memory checks of §7.3 (10). A placement is data; the optimisers that produce better ones
live in ``baselines``. ``P[l, i, c]`` is the share of routed expert ``i`` of MoE layer ``l`` held by
logical cluster ``c`` (rows sum to 1); ``pi[l, c]`` is the endpoint of cluster ``c`` in layer ``l``.

Redundant experts (production serving practice, e.g. DeepSeek's EPLB; not in the paper): the
optional ``replicas[l, i, c]`` marks a *whole* extra copy of expert ``i`` on cluster ``c``. The
expert then has ``1 + Σ_c replicas[l, i, c]`` copies: the primary one described by the shares
``P[l, i, :]`` (one node for a whole expert, several for a sharded one) and every replica node.
Every step each token of the expert is computed by exactly one copy, chosen by a replica
dispatch rule (``hdamoe_env.decisions.dispatch``); a replica node never also holds a share of
the same expert.

All-reduce layers (tile-aligned TP, :func:`tensor_parallel_tiled`): the optional
``allreduce[l]`` marks a layer whose MoE communication is TP's all-reduce of the layer output
(every node adds its partial sums into the full output), although its shares are not the
uniform 1/D of plain TP; the simulator charges TP's all-reduce for it (a uniform TP layer is
charged the same way without the mark).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError, InfeasibleError
from hdamoe_env.config.fileio import atomic_write, check_input_file, json_default
from hdamoe_env.config.profiles import Conventions
from hdamoe_env.config.specs import HardwareSpec, ModelSpec

__all__ = [
    "TRIVIAL_PLACEMENTS",
    "Placement",
    "check_memory",
    "check_tile_grid",
    "expert_parallel",
    "identity_mapping",
    "import_reference_layers",
    "placement_by_name",
    "node_weight_bytes",
    "off_grid",
    "random_mapping",
    "share_unit",
    "snap_shares",
    "tensor_parallel",
    "tensor_parallel_tiled",
]

PLACEMENT_FORMAT = "hdamoe-placement"
#: 2: optional ``replicas`` array; 3: optional ``allreduce`` layer mask. A file is written with
#: the lowest version that holds its arrays (1 without either), so older readers keep working.
PLACEMENT_FORMAT_VERSION = 3
_ROW_TOL = 1e-6
_GRID_TOL = 1e-9   # |share/unit − round(share/unit)| allowed by the tile-grid check


@dataclass(frozen=True)
class Placement:
    """A placement of every MoE layer's routed experts on the D logical clusters.

    Attributes:
        P: float64 [L, E, D], shares; every row ``P[l, i, :]`` sums to 1.
        pi: int64 [L, D], ``pi[l, c]`` = endpoint of logical cluster ``c`` (a permutation).
        method: Name of the method that produced it (``"tp"``, ``"ep"``, ...).
        meta: JSON-serialisable metadata (seeds, solver records, profile, trace id, ...).
        replicas: bool [L, E, D] whole redundant copies beyond the shares (module docstring),
            or None (no redundant experts; an all-False array is normalised to None).
        allreduce: bool [L] layers whose MoE communication is TP's all-reduce (tile-aligned
            TP, module docstring), or None (none marked; all-False is normalised to None).
    """

    P: NDArray[np.float64]
    pi: NDArray[np.int64]
    method: str = "custom"
    meta: dict[str, Any] = field(default_factory=dict)
    replicas: NDArray[np.bool_] | None = None
    allreduce: NDArray[np.bool_] | None = None

    def __post_init__(self) -> None:
        try:
            raw_P, raw_pi = np.asarray(self.P), np.asarray(self.pi)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"placement arrays P and pi must be numeric arrays: {exc}") from None
        if raw_P.dtype.kind not in "fiu":
            raise ConfigError(f"placement P must hold real numbers, got dtype {raw_P.dtype}; "
                              "expected float64 shares [L, E, D]")
        if raw_pi.dtype.kind not in "iuf" or (
                raw_pi.dtype.kind == "f" and not np.array_equal(raw_pi, np.trunc(raw_pi))):
            raise ConfigError(f"placement pi must hold integer endpoints, got dtype {raw_pi.dtype}"
                              + (f" with non-integer values {raw_pi[raw_pi != np.trunc(raw_pi)][:3]}"
                                 if raw_pi.dtype.kind == "f" else "")
                              + "; expected int64 [L, D] (a permutation per layer)")
        P = np.ascontiguousarray(raw_P.astype(np.float64, copy=False))
        pi = np.ascontiguousarray(raw_pi.astype(np.int64, copy=False))
        object.__setattr__(self, "P", P)
        object.__setattr__(self, "pi", pi)
        if self.replicas is not None:
            raw_r = np.asarray(self.replicas)
            if raw_r.dtype.kind not in "biu" or (raw_r.dtype.kind != "b"
                                                 and not np.isin(raw_r, (0, 1)).all()):
                raise ConfigError(f"placement replicas must be a bool mask [L, E, D], got dtype "
                                  f"{raw_r.dtype}; mark each whole extra copy with True")
            reps = np.ascontiguousarray(raw_r.astype(bool, copy=False))
            object.__setattr__(self, "replicas", reps if reps.any() else None)
        if self.allreduce is not None:
            raw_a = np.asarray(self.allreduce)
            if raw_a.dtype.kind not in "biu" or (raw_a.dtype.kind != "b"
                                                 and not np.isin(raw_a, (0, 1)).all()):
                raise ConfigError(f"placement allreduce must be a bool mask [L], got dtype "
                                  f"{raw_a.dtype}; mark each all-reduce layer with True")
            red = np.ascontiguousarray(raw_a.astype(bool, copy=False))
            object.__setattr__(self, "allreduce", red if red.any() else None)
        self.validate()

    # ----------------------------------------------------------------------------- properties
    @property
    def num_layers(self) -> int:
        """Number of MoE layers L."""
        return int(self.P.shape[0])

    @property
    def num_experts(self) -> int:
        """Number of routed experts E."""
        return int(self.P.shape[1])

    @property
    def num_nodes(self) -> int:
        """Number of logical clusters D."""
        return int(self.P.shape[2])

    def support(self, layer: int) -> NDArray[np.bool_]:
        """Return the bool [E, D] mask ``P[layer] > 0`` (which clusters hold a shard)."""
        return self.P[layer] > 0

    def is_allreduce(self, layer: int) -> bool:
        """Return whether ``layer`` is marked as an all-reduce (tile-aligned TP) layer."""
        return self.allreduce is not None and bool(self.allreduce[layer])

    @property
    def has_replicas(self) -> bool:
        """True when some expert has a redundant whole copy (``replicas`` is set)."""
        return self.replicas is not None

    def copies(self, layer: int | None = None) -> NDArray[np.int64]:
        """Return the number of copies of every expert: 1 + its replicas.

        Args:
            layer: One MoE layer (int64 [E]) or all (None: int64 [L, E]).
        """
        shape = self.P.shape[:2] if layer is None else self.P.shape[1:2]
        if self.replicas is None:
            return np.ones(shape, dtype=np.int64)
        reps = self.replicas if layer is None else self.replicas[layer]
        out: NDArray[np.int64] = 1 + reps.sum(axis=-1, dtype=np.int64)
        return out

    def held_experts(self) -> NDArray[np.float64]:
        """Return float64 [L, D]: experts' worth of weights per cluster (shares + replicas)."""
        held = self.P.sum(axis=1)
        if self.replicas is not None:
            held = held + self.replicas.sum(axis=1)
        out: NDArray[np.float64] = held
        return out

    def validate(self, model: ModelSpec | None = None, hw: HardwareSpec | None = None,
                 conv: Conventions | None = None) -> None:
        """Check shapes, shares and mappings (and, if given, agreement with model and hardware).

        Args:
            model: Check L and E against this model (and, with ``conv``, the tile grid).
            hw: Check D against this hardware.
            conv: With ``model``: every share must lie on the tile grid of
                :func:`check_tile_grid` (``tile_cols`` of the profile).

        Raises:
            ConfigError: Wrong shape, negative or non-finite shares, rows not summing to 1,
                a mapping that is not a permutation, a mismatch with ``model``/``hw``, or a share
                off the tile grid.
        """
        P, pi = self.P, self.pi
        if P.ndim != 3:
            raise ConfigError(f"placement P must have shape [L, E, D], got shape {P.shape}")
        L, E, D = P.shape
        if pi.shape != (L, D):
            raise ConfigError(f"placement pi must have shape [L, D] = {(L, D)}, got {pi.shape}")
        if not np.all(np.isfinite(P)) or (P < 0).any():
            bad = np.argwhere(~np.isfinite(P) | (P < 0))[0]
            raise ConfigError(f"placement share P{tuple(int(v) for v in bad)} = "
                              f"{P[tuple(bad)]!r}; shares must be finite and >= 0")
        sums = P.sum(axis=2)
        off = np.abs(sums - 1.0) > _ROW_TOL
        if off.any():
            layer, expert = (int(v) for v in np.argwhere(off)[0])
            raise ConfigError(f"placement row P[{layer}, {expert}, :] sums to "
                              f"{sums[layer, expert]:.6g}; every expert's shares must sum to 1 "
                              "(normalise the rows)")
        reps = self.replicas
        if reps is not None:
            if reps.shape != P.shape:
                raise ConfigError(f"placement replicas must have the shape of P {P.shape}, got "
                                  f"{reps.shape}")
            clash = reps & (P > 0)
            if clash.any():
                layer, expert, node = (int(v) for v in np.argwhere(clash)[0])
                raise ConfigError(f"placement replicas[{layer}, {expert}, {node}] marks a whole "
                                  f"copy of expert {expert} on cluster {node}, which already holds "
                                  f"a share P = {P[layer, expert, node]:.6g} of it; drop the "
                                  "replica or move it to a cluster without a share")
        if self.allreduce is not None and self.allreduce.shape != (L,):
            raise ConfigError(f"placement allreduce must have shape [L] = ({L},), got "
                              f"{self.allreduce.shape}")
        expected = np.arange(D)
        for layer in range(L):
            if not np.array_equal(np.sort(pi[layer]), expected):
                raise ConfigError(f"placement mapping pi[{layer}] = {pi[layer].tolist()} is not a "
                                  f"permutation of 0..{D - 1}")
        if model is not None:
            if (L, E) != (model.num_moe_layers, model.num_experts):
                raise ConfigError(f"placement has L={L}, E={E} but model {model.key!r} has "
                                  f"L={model.num_moe_layers}, E={model.num_experts}; build the "
                                  "placement for this model")
        if hw is not None and D != hw.num_nodes:
            raise ConfigError(f"placement has D={D} clusters but the hardware has "
                              f"{hw.num_nodes} nodes (mesh {hw.mesh_shape}); build the placement "
                              "for this mesh")
        if model is not None and conv is not None:
            check_tile_grid(self, model, conv)

    def with_layers(self, P: NDArray[np.float64] | None = None,
                    pi: NDArray[np.int64] | None = None, method: str | None = None,
                    *, replicas: NDArray[np.bool_] | None | bool = True,
                    allreduce: NDArray[np.bool_] | None | bool = True,
                    **meta: Any) -> Placement:
        """Return a copy with replaced arrays, method or extra metadata.

        ``replicas`` / ``allreduce``: the new mask, None (or False) to drop it, or True
        (default) to keep it.
        """
        reps = self.replicas if replicas is True else (None if replicas is False else replicas)
        red = self.allreduce if allreduce is True else (
            None if allreduce is False else allreduce)
        return Placement(P=self.P if P is None else P, pi=self.pi if pi is None else pi,
                         method=self.method if method is None else method,
                         meta={**self.meta, **meta}, replicas=reps, allreduce=red)

    # ----------------------------------------------------------------------------- storage
    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the placement atomically as ``.npz`` (arrays ``P``, ``pi``, JSON ``meta``).

        Returns:
            The path written.
        """
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        version = 3 if self.allreduce is not None else (2 if self.replicas is not None else 1)
        meta = {"format": PLACEMENT_FORMAT, "format_version": version,
                "method": self.method, **self.meta}
        meta_bytes = np.frombuffer(json.dumps(meta, sort_keys=True, default=json_default)
                                   .encode(), dtype=np.uint8)
        arrays: dict[str, NDArray[Any]] = {"P": self.P, "pi": self.pi, "meta": meta_bytes}
        if self.replicas is not None:
            arrays["replicas"] = self.replicas
        if self.allreduce is not None:
            arrays["allreduce"] = self.allreduce
        atomic_write(path, lambda fh: np.savez_compressed(fh, **arrays), "wb")
        return path

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Placement:
        """Read a placement written by :meth:`save`.

        Raises:
            ConfigError: The file is missing, not a placement, or of a newer format version.
        """
        if not isinstance(path, str | os.PathLike):
            raise ConfigError(f"placement file must be a path, got {path!r} "
                              f"({type(path).__name__})")
        path = Path(path)
        if not path.exists():
            raise ConfigError(f"placement file {str(path)!r} does not exist")
        if path.is_dir():
            raise ConfigError(f"placement file {str(path)!r} is a directory; expected a .npz file "
                              "(for an `hdamoe place` output give DIR/placement.npz)")
        check_input_file(path, "placement file")
        try:
            with np.load(path, allow_pickle=False) as data:
                if not hasattr(data, "files"):
                    raise ValueError("a bare .npy array, not an .npz archive")
                P, pi, meta_raw = data["P"], data["pi"], data["meta"]
                reps = data["replicas"] if "replicas" in data.files else None
                red = data["allreduce"] if "allreduce" in data.files else None
        except Exception as exc:  # noqa: BLE001 - truncated/bit-flipped archives raise anything
            raise ConfigError(f"{str(path)!r} is not a placement file (readable .npz with P, pi, "
                              f"meta): {type(exc).__name__}: {exc}; rewrite it with "
                              "Placement.save or `hdamoe place`") from None
        try:
            if meta_raw.dtype != np.uint8 or meta_raw.ndim != 1:
                raise ValueError(f"dtype {meta_raw.dtype}, shape {meta_raw.shape}")
            meta = json.loads(bytes(meta_raw).decode())
        except (ValueError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{str(path)!r}: array 'meta' is not UTF-8 JSON bytes ({exc}); "
                              "expected a file written by Placement.save") from None
        if not isinstance(meta, dict):
            raise ConfigError(f"{str(path)!r}: meta is a JSON {type(meta).__name__}, expected an "
                              "object; the file was not written by Placement.save")
        if P.dtype.kind != "f" or pi.dtype.kind not in "iu":
            raise ConfigError(f"{str(path)!r}: P has dtype {P.dtype} and pi {pi.dtype}; expected "
                              "float shares and integer endpoints (a float pi would be "
                              "truncated)")
        version = meta.get("format_version", 0)
        if not isinstance(version, int) or isinstance(version, bool):
            raise ConfigError(f"{str(path)!r}: meta.format_version={version!r}, expected an "
                              "integer")
        if not isinstance(meta.get("method", "custom"), str):
            raise ConfigError(f"{str(path)!r}: meta.method={meta.get('method')!r}, expected a "
                              "string")
        if meta.get("format") != PLACEMENT_FORMAT:
            raise ConfigError(f"{str(path)!r}: meta.format={meta.get('format')!r}, expected "
                              f"{PLACEMENT_FORMAT!r}")
        if meta.get("format_version", 0) > PLACEMENT_FORMAT_VERSION:
            raise ConfigError(f"{str(path)!r}: format_version {meta['format_version']} is newer "
                              f"than this reader ({PLACEMENT_FORMAT_VERSION}); upgrade hdamoe-env")
        method = meta.pop("method", "custom")
        meta.pop("format", None)
        meta.pop("format_version", None)
        try:
            return cls(P=P, pi=pi, method=method, meta=meta, replicas=reps, allreduce=red)
        except ConfigError as exc:
            raise ConfigError(f"{str(path)!r}: {exc}") from None


# --------------------------------------------------------------------------------- constructors
def identity_mapping(num_layers: int, num_nodes: int) -> NDArray[np.int64]:
    """Return ``pi`` [L, D] with cluster c on endpoint c in every layer."""
    return np.tile(np.arange(num_nodes, dtype=np.int64), (num_layers, 1))


def random_mapping(num_layers: int, num_nodes: int, rng: np.random.Generator
                   ) -> NDArray[np.int64]:
    """Return ``pi`` [L, D] with an independent uniformly random permutation per layer."""
    return np.stack([rng.permutation(num_nodes) for _ in range(num_layers)]).astype(np.int64)


def tensor_parallel(num_layers: int, num_experts: int, num_nodes: int) -> Placement:
    """TP placement (§9.1): every expert split evenly over all D clusters, identity mapping."""
    P = np.full((num_layers, num_experts, num_nodes), 1.0 / num_nodes)
    return Placement(P=P, pi=identity_mapping(num_layers, num_nodes), method="tp")


def tensor_parallel_tiled(num_layers: int, num_experts: int, num_nodes: int,
                          unit: float) -> Placement:
    """Tile-aligned TP: every expert's column tiles dealt round-robin over all D clusters.

    An expert has U = round(1/unit) tiles (``share_unit``: 22 for DeepSeek-V2-Lite, 40 for
    Qwen2-57B at 64-column tiles). Tile j of expert i goes to cluster (i·U + j) mod D: the deal
    continues where the previous expert stopped, so every cluster holds ⌊E·U/D⌋ or ⌈E·U/D⌉
    tiles of the layer, and P[i, c] = (tiles of i on c) / U lies on the tile grid. When D
    divides U this is plain TP (every share 1/D). Every layer is marked ``allreduce``: the
    layer's partial sums are reduced with TP's all-reduce of the layer output, as in TP.
    Identity mapping.

    Args:
        num_layers: L.
        num_experts: E.
        num_nodes: D.
        unit: The share unit u (``share_unit(model, conv)``); 1/u is rounded to an integer.

    Raises:
        ConfigError: ``unit`` not in (0, 1].
    """
    if not (0 < unit <= 1):
        raise ConfigError(f"share unit must be in (0, 1], got {unit}; use share_unit(model, conv)")
    U = _units(unit)
    tiles = np.arange(num_experts * U).reshape(num_experts, U) % num_nodes      # [E, U] owner
    counts = np.zeros((num_experts, num_nodes))
    np.add.at(counts, (np.repeat(np.arange(num_experts), U), tiles.ravel()), 1.0)
    P1 = counts / U
    if U % num_nodes == 0:
        P1 = np.full((num_experts, num_nodes), 1.0 / num_nodes)
    P = np.broadcast_to(P1, (num_layers, num_experts, num_nodes)).copy()
    return Placement(P=P, pi=identity_mapping(num_layers, num_nodes), method="tp-tiled",
                     allreduce=np.ones(num_layers, dtype=bool))


def _split_units(U: int, size: int) -> NDArray[np.float64]:
    """Return ``size`` shares of one expert in whole units of 1/U, as even as possible.

    The first U mod size entries get one unit more; with more nodes than units the last
    size − U entries get nothing.
    """
    base, extra = divmod(U, size)
    return np.array([base + (1 if j < extra else 0) for j in range(size)], dtype=np.float64) / U


def expert_parallel(num_layers: int, num_experts: int, num_nodes: int,
                    rng: np.random.Generator, *, unit: float | None = None) -> Placement:
    """EP placement (§9.2), seeded.

    D ≥ E: shuffle the clusters, give expert i a contiguous slice of ⌊D/E⌋ clusters (the first
    D mod E experts one more), P = 1/slice size. D < E: shuffle the experts, cluster c receives
    ⌊E/D⌋ whole experts (the first E mod D clusters one more). The same P is used for all
    layers; the physical mapping is a uniformly random permutation drawn per layer.

    With ``unit`` (the tile unit of ``share_unit``) and D > E, an expert's slice is cut into
    whole tiles instead: the U = 1/u tiles are split as evenly as possible over the slice
    (U mod size clusters one tile more; clusters beyond U tiles hold nothing), so that every
    share lies on the tile grid. Where 1/size already is a whole number of tiles the shares
    are unchanged; the random draws never depend on ``unit``.
    """
    P1 = np.zeros((num_experts, num_nodes))
    if num_nodes >= num_experts:
        clusters = rng.permutation(num_nodes)
        base, extra = divmod(num_nodes, num_experts)
        U = None if unit is None else _units(unit)
        start = 0
        for expert in range(num_experts):
            size = base + (1 if expert < extra else 0)
            if U is None or U % size == 0:
                P1[expert, clusters[start:start + size]] = 1.0 / size
            else:
                P1[expert, clusters[start:start + size]] = _split_units(U, size)
            start += size
    else:
        experts = rng.permutation(num_experts)
        base, extra = divmod(num_experts, num_nodes)
        start = 0
        for node in range(num_nodes):
            size = base + (1 if node < extra else 0)
            P1[experts[start:start + size], node] = 1.0
            start += size
    P = np.broadcast_to(P1, (num_layers, num_experts, num_nodes)).copy()
    return Placement(P=P, pi=random_mapping(num_layers, num_nodes, rng), method="ep")


TRIVIAL_PLACEMENTS = ("tp", "tp-tiled", "ep")


def placement_by_name(name: str | os.PathLike[str], model: ModelSpec, num_nodes: int,
                      seed: int = 0, *, record_seed: bool = True,
                      conv: Conventions | None = None) -> Placement:
    """Return a trivial placement by name, or a placement file by path (§9.1–9.2, §7.7).

    The data-constructor half of placement resolution: ``"tp"``, ``"tp-tiled"``, ``"ep"`` and
    ``.npz`` paths. Optimised methods (node_balance, node_link, hybrid, ...) are resolved by
    ``baselines``, which calls this function for these cases.

    Args:
        name: ``"tp"``, ``"tp-tiled"`` (or ``"tp_tiled"``), ``"ep"`` or a path to a placement
            ``.npz`` (``Placement.save``).
        model: The model (L, E).
        num_nodes: D.
        seed: Seed of the EP placement (``np.random.default_rng(seed)``: cluster or expert
            shuffle, then one mapping per layer).
        record_seed: Record ``seed`` in the EP placement's ``meta`` (the CLI does; the env
            passes False and keeps an empty ``meta``). The arrays do not depend on it.
        conv: The profile: its tile grid (``share_unit``) cuts ``tp-tiled`` and EP on more
            clusters than experts into whole tiles. Needed by ``tp-tiled``; EP without it (or
            with ``tile_cols`` = 1) keeps the even 1/slice shares.

    Returns:
        The placement.

    Raises:
        ConfigError: The file is missing or not a placement, or ``tp-tiled`` without ``conv``.
    """
    tiled = conv is not None and conv.tile_cols > 1
    if isinstance(name, str) and name == "tp":
        return tensor_parallel(model.num_moe_layers, model.num_experts, num_nodes)
    if isinstance(name, str) and name in ("tp-tiled", "tp_tiled"):
        if conv is None:
            raise ConfigError("placement 'tp-tiled' needs the profile (conv=) for its tile grid")
        return tensor_parallel_tiled(model.num_moe_layers, model.num_experts, num_nodes,
                                     share_unit(model, conv))
    if isinstance(name, str) and name == "ep":
        placement = expert_parallel(model.num_moe_layers, model.num_experts, num_nodes,
                                    np.random.default_rng(seed),
                                    unit=share_unit(model, conv) if tiled and conv else None)
        return placement.with_layers(seed=seed) if record_seed else placement
    return Placement.load(name)


# --------------------------------------------------------------------------------- tile grid
def share_unit(model: ModelSpec, conv: Conventions) -> float:
    """Return the share unit u = tile_cols / I: one PE-array tile of an expert's columns.

    A placement share P[l, i, c] must be a whole number of units (docs/PHYSICS.md, tile grid): with
    ``tile_cols`` = 64, DeepSeek-V2-Lite (I = 1408) has u = 1/22, Mixtral (I = 14336) 1/224,
    Qwen2-57B (I = 2560) 1/40, Qwen3.5-35B (I = 512) 1/8. ``tile_cols`` = 1 (``paper*``) gives
    u = 1/I, effectively continuous. [decision] When the tile does not divide I the expert has
    U = ceil(I / tile_cols) tiles (the last one padded) and u = 1/U, so that whole tiles always
    add up to one expert; a tile wider than the expert gives u = 1 (whole experts only).
    """
    return 1.0 / math.ceil(model.expert_intermediate / conv.tile_cols)


def _units(unit: float) -> int:
    """Return U = round(1/u), the number of units in one expert (u = 1/U by construction)."""
    return max(1, round(1.0 / unit))


def snap_shares(P_layer: NDArray[np.float64], unit: float) -> NDArray[np.float64]:
    """Round every row of ``P_layer`` to multiples of ``unit`` (largest-remainder rounding).

    Each row is scaled to U = 1/unit units; every entry gets the floor of its units and the
    remaining units of the row go to the entries with the largest fractional remainders (ties:
    the larger share, then the lower node). Rows then sum to exactly U units, so to 1 up to the
    float rounding of n/U. An entry is never raised above ceil(share/unit) units nor lowered
    below floor(share/unit), so a share that is already on the grid is kept exactly.

    Args:
        P_layer: float [E, D] (or [L, E, D]) shares; rows sum to 1.
        unit: The share unit u (e.g. :func:`share_unit`); 1/u should be an integer (it is
            rounded to the nearest one).

    Returns:
        float array of the same shape, every entry n/U with integer n ≥ 0.

    Raises:
        ConfigError: ``unit`` is not in (0, 1], or shares are negative or non-finite.
    """
    if not (0 < unit <= 1):
        raise ConfigError(f"share unit must be in (0, 1], got {unit}; use share_unit(model, conv)")
    P = np.asarray(P_layer, dtype=np.float64)
    if not np.all(np.isfinite(P)) or (P < 0).any():
        raise ConfigError("snap_shares needs finite shares >= 0")
    U = _units(unit)
    flat = P.reshape(-1, P.shape[-1])
    sums = flat.sum(axis=1, keepdims=True)
    scaled = flat / np.where(sums > 0, sums, 1.0) * U
    n = np.floor(scaled + _GRID_TOL).astype(np.int64)
    rem = scaled - n
    missing = U - n.sum(axis=1)
    for r in np.flatnonzero(missing > 0):
        order = np.lexsort((np.arange(flat.shape[1]), -flat[r], -rem[r]))
        n[r, order[:missing[r]]] += 1
    return (n / U).reshape(P.shape)


def off_grid(P: NDArray[np.float64], unit: float) -> NDArray[np.bool_]:
    """Return the bool mask of shares that are not a whole number of units.

    Exactly uniform TP rows (every share = 1/D) are exempt (:func:`check_tile_grid`).
    """
    P = np.asarray(P, dtype=np.float64)
    U = _units(unit)
    x = P * U
    bad = np.abs(x - np.rint(x)) > _GRID_TOL
    D = P.shape[-1]
    uniform = np.all(np.abs(P - 1.0 / D) <= _GRID_TOL, axis=-1, keepdims=True)
    return bad & ~uniform


def check_tile_grid(placement: Placement, model: ModelSpec, conv: Conventions) -> None:
    """Check that every share is a whole number of tile units u = tile_cols / I (or zero).

    [decision] Exception: an exactly uniform row (every share = 1/D, tensor parallelism) is
    legal even off the grid: TP is executed as D padded shards, and the tile model of the compute
    term charges the padding. EP rows (0/1) are always on the grid. Tolerance: share/u must be
    within 1e-9 of an integer. [decision] ``tile_cols`` = 1 (``paper*``) means continuous shares
    (the reference's model; its optimisers produce arbitrary floats): nothing is checked.

    Raises:
        ConfigError: A share is off the grid; names layer, expert, node, share and the unit.
    """
    if conv.tile_cols == 1:
        return
    unit = share_unit(model, conv)
    bad = off_grid(placement.P, unit)
    if bad.any():
        layer, expert, node = (int(v) for v in np.argwhere(bad)[0])
        share = placement.P[layer, expert, node]
        U = _units(unit)
        raise ConfigError(
            f"placement share P[{layer}, {expert}, {node}] = {share:.4f} is not a multiple of the "
            f"tile unit 1/{U} = {unit:.4f} ({conv.tile_cols} of {model.expert_intermediate} "
            f"columns); {int(bad.sum())} shares are off the grid. Snap them with "
            f"hdamoe_env.sim.placement.snap_shares(P, {unit:.6g}) or place with "
            f"tile_cols={conv.tile_cols} (e.g. profile '{conv.name.split('+')[0]}+tile_cols=1' "
            "for continuous shares)")


# --------------------------------------------------------------------------------- memory
def node_weight_bytes(placement: Placement, model: ModelSpec, conv: Conventions
                      ) -> NDArray[np.float64]:
    """Return the routed-expert weight bytes held by every logical cluster, summed over layers.

    Returns:
        float64 [D]: Σ_l (Σ_i P[l, i, c] + replicas[l, i, c]) · W_e with W_e = m·h·I·b_w of
        the profile.
    """
    w_e = conv.expert_matrices * model.hidden_size * model.expert_intermediate * conv.b_w
    out: NDArray[np.float64] = placement.held_experts().sum(axis=0) * w_e
    return out


def check_memory(placement: Placement, model: ModelSpec, hw: HardwareSpec, conv: Conventions,
                 *, rho_mem: float | None = None, reserved_bytes: float = 0.0) -> None:
    """Check the memory-capacity constraints of §7.3 (10).

    Args:
        placement: The placement to check.
        model: Model whose experts are placed.
        hw: Hardware (``node_dram_gib`` gives the absolute cap when set).
        conv: Convention profile (bytes per expert).
        rho_mem: Relative cap: per layer Σ_i P_ic (+ the node's replicas) ≤ ρ_mem·E/D on every
            node (None = off).
        reserved_bytes: Bytes per node taken by non-expert data (attention weights, KV cache).

    Raises:
        InfeasibleError: A node exceeds a cap; the message names the node and the numbers.
    """
    D = placement.num_nodes
    if rho_mem is not None:
        per_layer = placement.held_experts()                     # [L, D] experts per node
        cap = rho_mem * placement.num_experts / D
        if (per_layer > cap + 1e-9).any():
            layer, node = (int(v) for v in np.argwhere(per_layer > cap + 1e-9)[0])
            raise InfeasibleError(f"layer {layer}: node {node} holds {per_layer[layer, node]:.3f}"
                                  f" experts but rho_mem={rho_mem} allows {cap:.3f} "
                                  f"(= rho_mem·E/D); raise rho_mem (>= 1 is always feasible)")
    cap_bytes = hw.node_dram_bytes
    if cap_bytes is not None:
        need = node_weight_bytes(placement, model, conv) + reserved_bytes
        if (need > cap_bytes).any():
            node = int(np.argmax(need))
            raise InfeasibleError(f"placement needs {need[node] / 2**30:.2f} GiB on node {node} "
                                  f"but node_dram_gib={hw.node_dram_gib}; raise node_dram_gib or "
                                  "use a placement that spreads experts more evenly")


# --------------------------------------------------------------------------------- importer
def import_reference_layers(layer_arrays: list[NDArray[np.float64]],
                            mappings: list[NDArray[np.float64]] | None = None,
                            method: str = "reference") -> Placement:
    """Build a placement from the reference's per-layer layout (§7.7).

    The reference wrote one array per layer, each of shape [L, E, D] with only slice ``l`` filled,
    plus a one-hot mapping of shape [D, X, Y] per layer (cluster d at cell (x, y)).

    Args:
        layer_arrays: L arrays of shape [L, E, D]; slice ``l`` of array ``l`` is used.
        mappings: Optional L arrays of shape [D, X, Y] (one-hot); identity when None.
        method: Method name to record.

    Raises:
        ConfigError: Shapes disagree or a mapping is not one-hot.
    """
    L = len(layer_arrays)
    if L == 0:
        raise ConfigError("import_reference_layers needs at least one layer array")
    first = np.asarray(layer_arrays[0])
    if first.ndim != 3 or first.shape[0] != L:
        raise ConfigError(f"reference layer arrays must have shape [L={L}, E, D], got "
                          f"{first.shape}")
    P = np.stack([np.asarray(a, dtype=np.float64)[layer] for layer, a in enumerate(layer_arrays)])
    D = P.shape[2]
    if mappings is None:
        pi = identity_mapping(L, D)
    else:
        pi = np.empty((L, D), dtype=np.int64)
        for layer, onehot in enumerate(mappings):
            onehot = np.asarray(onehot)
            if onehot.shape[0] != D or onehot.reshape(D, -1).shape[1] != D:
                raise ConfigError(f"reference mapping of layer {layer} has shape {onehot.shape}; "
                                  f"expected [D={D}, X, Y] with X·Y = D")
            flat = onehot.reshape(D, -1)
            if not np.array_equal(flat.sum(axis=1), np.ones(D)) or not np.all(
                    np.isin(flat, (0, 1))):
                raise ConfigError(f"reference mapping of layer {layer} is not one-hot per cluster")
            pi[layer] = flat.argmax(axis=1)
    return Placement(P=P, pi=pi, method=method, meta={"imported_from": "reference per-layer"})

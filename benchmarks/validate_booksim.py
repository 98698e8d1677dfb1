"""Validate the NoC DES against BookSim 2.0 on the same message lists (issue #27).

The same messages — MoE dispatch and combine of one layer, one TP all-reduce step and a
pre-broadcast — go through

* the DES of ``hdamoe_env.noc.des`` with ``switching="store_and_forward"`` and ``"cut_through"``,
* the analytic link-load bound ``des.link_load_bound`` (busiest link, or longest route, at
  bandwidth; it has no per-hop serialisation term, so it is the same for both switchings),
* the package's analytic twin (``fidelity="analytic"``, paper-model.md §5.5): for dispatch and
  combine γ·t_comm of Eq. 2–3 with the ``faithful`` estimator (κ_a·max_c V_c / BW_end) and γ
  fitted by ``sim.calibrate.fit_gamma`` (64 batch sizes in [B/2, 2B], dispatch + combine,
  least squares through the origin) against the CT+NI DES of the same setting, the layer's
  estimate split evenly between the two phases; for an all-reduce step the closed-form ring
  step of ``perf.tp_allreduce_time`` (hop + bytes/BW); for the broadcast the α–β pipeline
  T_bc(c; m) of ``cost.broadcast.broadcast_time_chunked`` (m = 2, H = the diameter, α = 0),
* BookSim 2.0, cycle-accurate, driven by the trace traffic manager of ``benchmarks/booksim/``
  (built outside the repository by ``benchmarks/booksim/build.sh``).

BookSim configuration (every choice is in ``BOOKSIM_CONFIG`` and ``docs/results/validation.md``):
64-byte flits at 0.78125 GHz (one flit per 1.28 ns cycle = 50 GB/s per link, the faithful link
bandwidth), k-ary 2-cube mesh or torus with dimension-order routing (the DES's routes: row index
first, on a torus tie the +1 direction), input-queued routers with 8 VCs of 1024 flits each
(deeper than any message, so a blocked packet is buffered whole: virtual cut-through) and input
speedup 2 (as BookSim's own mesh88_lat example), iSLIP allocators, 1-cycle VC and switch
allocation. The DES gets the hop
latency BookSim shows at zero load (measured here from single-flit messages: arrival = a + b·hops
cycles, hop latency b), and its ports (``+NI``) the ``faithful`` ``ni_latency_hops`` (BookSim's
a = 6 cycles of injection plus ejection = 0.75·b per port), so the comparison is about
contention and pipelining, not about latency constants. Grids: 8x8 natively; a 4x8 mesh
is the 4 x 8 corner of the 8x8 mesh (DOR never leaves the rectangle of its endpoints); a 4x8
torus cannot be built by BookSim's k-ary n-cube (k equal in every dimension) and is left out;
B = 512 runs on the 4x8 mesh only unless ``--full`` (BookSim is slow there).

Message lists: model presets of ``hdamoe_env.config.specs``; token rows from the reference traces
in ``../shared/reference-traces`` read in place (Mixtral: real reasoning trace; DeepSeek-V2-Lite
and Qwen2: the short extracts, rows drawn with replacement), layer 1 (Qwen2: layer 1 of 0–1);
expert-parallel holders (expert e on node e mod D; with E < D expert e on every node c with
c mod E = e), uniform aggregators from a seeded generator, message bytes h·b_msg (b_msg = 2).
Sizes are whole flits by construction (h·2 is a multiple of 64 for the three models).

Usage::

    python benchmarks/validate_booksim.py                 # full grid, writes the results page
    python benchmarks/validate_booksim.py --quick         # B in {16, 128}, 8x8 only
    python benchmarks/validate_booksim.py --booksim PATH  # use a built binary
    python benchmarks/validate_booksim.py --hol CASE ...  # head-of-line study (prints only)

Writes ``docs/results/validation.md`` (tables) and the CI fixture
``benchmarks/booksim/fixtures/booksim_makespans.csv`` (message-list hash, BookSim makespan, DES
makespans) that ``tests/benchmarks/test_validate_booksim.py`` checks without BookSim. Exits 0
with a one-line "skipped" message when g++, make, flex or bison are missing.
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import hashlib
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hdamoe_env.config.profiles import PROFILES, Conventions  # noqa: E402
from hdamoe_env.config.specs import MODEL_PRESETS, HardwareSpec  # noqa: E402
from hdamoe_env.cost import perf  # noqa: E402
from hdamoe_env.cost.broadcast import broadcast_time_chunked  # noqa: E402
from hdamoe_env.noc import collectives  # noqa: E402
from hdamoe_env.noc.broadcast import broadcast_messages  # noqa: E402
from hdamoe_env.noc.des import link_load_bound, simulate_messages  # noqa: E402
from hdamoe_env.noc.linksim import choose_aggregators, layer_messages  # noqa: E402
from hdamoe_env.noc.topology import Topology, make_topology  # noqa: E402
from hdamoe_env.sim.calibrate import fit_gamma  # noqa: E402
from hdamoe_env.sim.placement import Placement  # noqa: E402
from hdamoe_env.sim.simulator import MoESimulator  # noqa: E402

TRACES = ROOT.parent / "shared" / "reference-traces"
FIXTURE = ROOT / "benchmarks" / "booksim" / "fixtures" / "booksim_makespans.csv"
RESULTS = ROOT / "docs" / "results" / "validation.md"

HAND_WRITTEN = "<!-- hand-written reading below: kept when the tables are regenerated -->"
FLIT_BYTES = 64
LINK_BW_GBPS = 50.0
CYCLE_S = FLIT_BYTES / (LINK_BW_GBPS * 1e9)   # 1.28 ns
B_MSG = 2                                      # bytes per hidden element (faithful)
SEED = 27
BROADCAST_BYTES = 64 * 1024                   # per broadcast expert (a slice; see the page)
BROADCAST_CHUNKS = 8

BOOKSIM_CONFIG = """\
topology = {topology};
k = 8;
n = 2;
routing_function = dim_order;
num_vcs = {num_vcs};
vc_buf_size = 1024;
wait_for_tail_credit = 0;
router = iq;
vc_allocator = islip;
sw_allocator = islip;
alloc_iters = 1;
credit_delay = 1;
routing_delay = 0;
vc_alloc_delay = 1;
sw_alloc_delay = 1;
input_speedup = {input_speedup};
output_speedup = {output_speedup};
internal_speedup = {internal_speedup};
sim_type = trace;
trace_file = {trace};
trace_out = {out};
seed = 27;
"""

#: the validation's router (``BOOKSIM_CONFIG``); ``--hol`` varies it
ROUTER = {"num_vcs": 8, "input_speedup": 2, "output_speedup": 1, "internal_speedup": 1.0}
#: router variants of the head-of-line study (``--hol``), from plain to output-queued: input
#: speedup = VCs gives every VC its own crossbar input (no head-of-line blocking behind another
#: VC of the same port), output speedup 5 (a mesh router's inputs) lets every input write to an
#: output at once into its unbounded output buffer, i.e. an output-queued router as in the DES
HOL_ROUTERS = (
    {"num_vcs": 2, "input_speedup": 1, "output_speedup": 1, "internal_speedup": 1.0},
    {"num_vcs": 8, "input_speedup": 1, "output_speedup": 1, "internal_speedup": 1.0},
    ROUTER,
    {"num_vcs": 8, "input_speedup": 8, "output_speedup": 1, "internal_speedup": 1.0},
    {"num_vcs": 8, "input_speedup": 8, "output_speedup": 5, "internal_speedup": 1.0},
)

MODELS = {  # package key -> (trace file under TRACES, layer)
    "deepseek-v2-lite": ("ds/hd_gating/experts_reasoning_hd_sim_4_4.original_selected_experts.json",
                         1),
    "mixtral-8x7b": ("mixtral/experts_reasoning_mixtral.json", 1),
    "qwen2-57b-a14b": (
        "qwen/hd_gating/experts_reasoning_hd_sim_4_4.original_selected_experts.layers0-1.json", 1),
}
SHORT = {"deepseek-v2-lite": "DS-V2-Lite", "mixtral-8x7b": "Mixtral", "qwen2-57b-a14b": "Qwen2"}
BATCHES = (16, 32, 128, 512)
SETTINGS = (("mesh", (4, 8)), ("mesh", (8, 8)), ("torus", (8, 8)))
KINDS = ("dispatch", "combine", "allreduce", "broadcast")


@dataclass(frozen=True)
class Messages:
    """One message list in whole flits and cycles (the exact input of both simulators)."""

    src: NDArray[np.int64]
    dst: NDArray[np.int64]
    flits: NDArray[np.int64]
    ready_cycle: NDArray[np.int64]

    @property
    def size_bytes(self) -> NDArray[np.float64]:
        return self.flits.astype(np.float64) * FLIT_BYTES

    @property
    def ready_s(self) -> NDArray[np.float64]:
        return self.ready_cycle.astype(np.float64) * CYCLE_S

    def digest(self) -> str:
        """SHA-256 (first 16 hex digits) of the four arrays as little-endian int64."""
        h = hashlib.sha256()
        for a in (self.src, self.dst, self.flits, self.ready_cycle):
            h.update(np.ascontiguousarray(a, dtype="<i8").tobytes())
        return h.hexdigest()[:16]


def topology_for(kind: str, grid: tuple[int, int]) -> Topology:
    """The DES topology of a setting (50 GB/s links)."""
    return make_topology(kind, HardwareSpec(mesh_shape=grid, link_bw_gbps=LINK_BW_GBPS))


def booksim_node(grid: tuple[int, int], endpoint: NDArray[np.int64]) -> NDArray[np.int64]:
    """BookSim node of every DES endpoint: row along dimension 0, column along dimension 1."""
    row, col = np.divmod(endpoint, grid[1])
    return row + 8 * col


@functools.lru_cache(maxsize=None)
def _layer_rows(model: str) -> NDArray[np.int64]:
    """All token rows [T, k] of the model's trace layer (read once)."""
    from traces.reference import read_reference_json

    path, layer = MODELS[model]
    trace = read_reference_json(TRACES / path, model_key=model)
    return np.asarray(trace.topk_ids[layer], dtype=np.int64)


def _token_rows(model: str, batch: int) -> NDArray[np.int64]:
    """B token rows [B, k] of the model's reference trace (drawn with replacement if short)."""
    rows = _layer_rows(model)
    rng = np.random.default_rng(SEED + batch)
    take = rng.choice(rows.shape[0], batch, replace=rows.shape[0] < batch)
    return rows[take]


def _holders(num_experts: int, nodes: int) -> NDArray[np.bool_]:
    mask = np.zeros((num_experts, nodes), dtype=bool)
    for c in range(nodes):
        if num_experts >= nodes:
            mask[np.arange(c, num_experts, nodes), c] = True
        else:
            mask[c % num_experts, c] = True
    return mask


def _to_messages(src: NDArray[np.int64], dst: NDArray[np.int64], size: NDArray[np.float64],
                 ready_s: NDArray[np.float64] | None = None) -> Messages:
    keep = src != dst
    flits = np.ceil(np.asarray(size, dtype=np.float64)[keep] / FLIT_BYTES).astype(np.int64)
    ready = np.zeros(flits.size, dtype=np.int64) if ready_s is None else np.rint(
        np.asarray(ready_s)[keep] / CYCLE_S).astype(np.int64)
    return Messages(np.asarray(src)[keep].astype(np.int64), np.asarray(dst)[keep].astype(np.int64),
                    np.maximum(flits, 1), ready)


def build_messages(model: str, batch: int, kind: str, topo_kind: str,
                   grid: tuple[int, int], hop_latency_s: float) -> Messages:
    """The message list of one case (deterministic: seeded by ``SEED`` and B)."""
    spec = MODEL_PRESETS[model]
    topo = topology_for(topo_kind, grid)
    nodes = grid[0] * grid[1]
    h = spec.hidden_size
    if kind in ("dispatch", "combine"):
        rows = _token_rows(model, batch)
        holders = _holders(spec.num_experts, nodes)
        agg = choose_aggregators(rows, holders, "uniform", np.random.default_rng(SEED + batch))
        src, dst, size, _task = layer_messages(rows, float(h * B_MSG), holders, agg,
                                               np.arange(nodes), direction=kind)
        return _to_messages(src, dst, size)
    if kind == "allreduce":  # one reduce-scatter step of the ring all-reduce over D nodes
        ring = collectives.default_ring(topo)
        part = batch * h * B_MSG / nodes
        return _to_messages(ring, np.roll(ring, -1), np.full(ring.size, part))
    if kind == "broadcast":  # two experts from nodes 0 and D/2, chunk-pipelined trees
        shares = np.zeros((2, nodes))
        shares[0, 0] = shares[1, nodes // 2] = 1.0
        msgs = broadcast_messages(topo, shares, [0, 1], float(BROADCAST_BYTES), BROADCAST_CHUNKS,
                                  hop_latency_s=hop_latency_s)
        return _to_messages(msgs.src, msgs.dst, msgs.size_bytes, msgs.ready_s)
    raise ValueError(kind)


def cases(quick: bool = False, full: bool = False
          ) -> list[tuple[str, int, str, str, tuple[int, int]]]:
    """Every (model, B, kind, topology, grid) of the grid; broadcast once per setting.

    B = 512 on the 8x8 grids is left out unless ``full``: one BookSim run of Mixtral B512
    dispatch on the 4x8 mesh took 88 s, and 8x8 has about twice the messages on twice the
    routers.
    """
    out = []
    batches = (16, 128) if quick else BATCHES
    settings = SETTINGS[1:] if quick else SETTINGS
    for topo_kind, grid in settings:
        for model in MODELS:
            for batch in batches:
                if batch == 512 and grid == (8, 8) and not full:
                    continue
                for kind in ("dispatch", "combine", "allreduce"):
                    out.append((model, batch, kind, topo_kind, grid))
            out.append((model, 0, "broadcast", topo_kind, grid))
    return out


def case_id(model: str, batch: int, kind: str, topo_kind: str, grid: tuple[int, int]) -> str:
    return f"{SHORT[model]}/B{batch}/{kind}/{topo_kind}{grid[0]}x{grid[1]}"


def parse_case_id(case: str) -> tuple[str, int, str, str, tuple[int, int]]:
    """Invert ``case_id``: (model, B, kind, topology, grid)."""
    short, batch, kind, setting = case.split("/")
    model = next(k for k, v in SHORT.items() if v == short)
    topo_kind = setting.rstrip("0123456789x")
    x, y = setting[len(topo_kind):].split("x")
    return model, int(batch[1:]), kind, topo_kind, (int(x), int(y))


#: latency of a network-interface port in hop latencies: the ``faithful`` profile's
NI_HOPS = PROFILES["faithful"].ni_latency_hops

#: DES variants: (column, switching, ports: None or their latency in hop latencies); the
#: ``faithful`` model is ``ct_ni``; ``ct_ni_hop`` is it with a full hop latency per port (the
#: model before ``ni_latency_hops``)
VARIANTS = (("saf", "store_and_forward", None), ("ct", "cut_through", None),
            ("saf_ni", "store_and_forward", NI_HOPS), ("ct_ni", "cut_through", NI_HOPS),
            ("ct_ni_hop", "cut_through", 1.0))
LABELS = {"saf": "SAF", "ct": "CT", "saf_ni": "SAF+NI", "ct_ni": "CT+NI",
          "ct_ni_hop": "CT+NI₁"}


def run_des(msgs: Messages, topo_kind: str, grid: tuple[int, int], hop_latency_s: float,
            switching: str, ni: float | None = None) -> float:
    """The DES makespan of a message list.

    ``ni``: None (no ports) or 50 GB/s injection and ejection ports, each with a latency of
    ``ni`` hop latencies.
    """
    topo = topology_for(topo_kind, grid)
    return simulate_messages(topo, msgs.src, msgs.dst, msgs.size_bytes, msgs.ready_s,
                             hop_latency_s=hop_latency_s, switching=switching,
                             ni_bw_Bps=None if ni is None else LINK_BW_GBPS * 1e9,
                             ni_latency_s=None if ni is None else ni * hop_latency_s
                             ).makespan_s


# --------------------------------------------------------------------------------------------
# the analytic twin


def twin_profile() -> Conventions:
    """``faithful`` with the DES configured as in this benchmark: no start-up α (BookSim has no
    DMA start-up) and no partial-sum combine (every message is h·b_msg bytes, as here)."""
    return PROFILES["faithful"].derive(msg_alpha_s=0.0, psum_combine=False)


def _twin_simulator(model: str, topo_kind: str, grid: tuple[int, int],
                    hop_latency_s: float) -> MoESimulator:
    hw = HardwareSpec(mesh_shape=grid, link_bw_gbps=LINK_BW_GBPS,
                      hop_latency_ns=hop_latency_s * 1e9)
    return MoESimulator(model, hw, topo_kind, twin_profile())


@functools.lru_cache(maxsize=None)
def twin_gamma(model: str, batch: int, topo_kind: str, grid: tuple[int, int],
               hop_latency_s: float) -> float:
    """γ of the analytic twin for one setting: ``fit_gamma`` on the EP holders of the cases.

    The twin's own procedure (paper-model.md §5.5, ``faithful``): 64 batch sizes in [B/2, 2B]
    drawn from the layer's trace rows, y = dispatch + combine of the CT+NI DES, least squares
    through the origin; seeded by ``SEED`` and B.
    """
    sim = _twin_simulator(model, topo_kind, grid, hop_latency_s)
    nodes = grid[0] * grid[1]
    holders = _holders(sim.model.num_experts, nodes)
    shares = holders / holders.sum(axis=1, keepdims=True)
    placement = Placement(shares[None], np.arange(nodes, dtype=np.int64)[None], method="ep")
    fit = fit_gamma(sim, placement, 0, _layer_rows(model), batch,
                    np.random.default_rng(SEED + batch))
    return fit.gamma


def twin_estimate(msgs: Messages, model: str, batch: int, kind: str, topo_kind: str,
                  grid: tuple[int, int], hop_latency_s: float) -> float:
    """The analytic twin's makespan of one case, seconds (module docstring)."""
    topo = topology_for(topo_kind, grid)
    bw = LINK_BW_GBPS * 1e9
    if kind in ("dispatch", "combine"):
        conv = twin_profile()
        spec = MODEL_PRESETS[model]
        holders = _holders(spec.num_experts, grid[0] * grid[1])
        x, _volume = perf.analytic_comm_sampled(holders, _token_rows(model, batch),
                                                spec.hidden_size, conv.kappa_a, topo.bw_end_Bps)
        return twin_gamma(model, batch, topo_kind, grid, hop_latency_s) * x / 2.0
    if kind == "allreduce":  # one step of the closed-form ring: hop + S/(p·BW)
        return hop_latency_s + float(msgs.size_bytes[0]) / bw
    if kind == "broadcast":
        chunk = BROADCAST_BYTES / BROADCAST_CHUNKS
        return float(broadcast_time_chunked(chunk, 2, float(BROADCAST_BYTES),
                                            float(topo.diameter), 0.0, bw))
    raise ValueError(kind)


# --------------------------------------------------------------------------------------------
# BookSim


def tools_missing() -> list[str]:
    return [t for t in ("g++", "make", "flex", "bison") if shutil.which(t) is None]


def run_booksim(binary: Path, msgs: Messages, topo_kind: str, grid: tuple[int, int],
                work: Path, router: dict[str, float] | None = None
                ) -> tuple[int, NDArray[np.int64]]:
    """Run BookSim on a message list; return (makespan cycles, per-message arrival cycles).

    ``router`` overrides fields of ``ROUTER`` (VCs and speedups).
    """
    trace, out, conf = work / "trace.txt", work / "arrivals.txt", work / "booksim.cfg"
    nodes = booksim_node(grid, msgs.src), booksim_node(grid, msgs.dst)
    np.savetxt(trace, np.column_stack([msgs.ready_cycle, nodes[0], nodes[1], msgs.flits]),
               fmt="%d")
    conf.write_text(BOOKSIM_CONFIG.format(topology=topo_kind, trace=trace, out=out,
                                          **{**ROUTER, **(router or {})}))
    out.unlink(missing_ok=True)
    done = subprocess.run([str(binary), str(conf)], capture_output=True, cwd=work)
    if done.returncode not in (0, 255) or not out.exists():  # BookSim exits -1 on success
        raise RuntimeError(f"BookSim failed ({done.returncode}): {done.stdout[-400:]!r}")
    lines = out.read_text().split("\n")
    makespan = int(lines[-2].split()[1])
    arrival = np.array([int(x.split()[1]) for x in lines[:-2]], dtype=np.int64)
    return makespan, arrival


def zero_load_hop_cycles(binary: Path, work: Path) -> tuple[float, float]:
    """Fit arrival = a + b·hops on single 1-flit messages along a row of the 8x8 mesh."""
    hops = np.arange(1, 8)
    arrivals = []
    for h in hops:
        msgs = Messages(np.array([0]), np.array([int(h) * 8]), np.array([1]), np.array([0]))
        arrivals.append(run_booksim(binary, msgs, "mesh", (8, 8), work)[0])
    b, a = np.polyfit(hops, np.array(arrivals, dtype=np.float64), 1)
    return float(a), float(b)


# --------------------------------------------------------------------------------------------
# reporting


def _err(x: float, ref: float) -> float:
    return (x - ref) / ref * 100.0


def write_fixture(rows: list[dict[str, object]], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fields = ["case", "messages", "digest", "hop_latency_s", "booksim_s",
              *(f"{v[0]}_s" for v in VARIANTS), "twin_s"]
    with path.open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields)
        w.writeheader()
        for r in rows:
            w.writerow({k: (repr(r[k]) if isinstance(r[k], float) else r[k]) for k in fields})


def write_results(rows: list[dict[str, object]], meta: dict[str, object], path: Path) -> None:
    def fmt(x: float) -> str:
        return f"{x:+.1f}"

    lines = [
        "# NoC DES against BookSim 2.0",
        "",
        "Generated by `python benchmarks/validate_booksim.py"
        + (" --quick" if meta["quick"] else "") + "` (issue #27). BookSim 2.0 from",
        "../shared/vendor/booksim2 with the trace traffic manager of benchmarks/booksim/ (built",
        "outside the repository by benchmarks/booksim/build.sh). Errors are (DES − BookSim) /",
        "BookSim of the makespan of the same message list, in %; `SAF` store-and-forward, `CT`",
        "cut-through, `+NI` with one 50 GB/s injection and one ejection port per endpoint",
        f"(`ni_bw_Bps`, as BookSim's network interface) of {NI_HOPS:g} hop latency each (the",
        "`faithful` `ni_latency_hops`; `CT+NI₁`: a full hop latency per port, the model before",
        "it), `bound` the analytic link-load bound",
        "(`des.link_load_bound`, no per-hop term, no ports), `twin` the package's analytic twin",
        "(`fidelity=\"analytic\"`: dispatch and combine γ·t_comm of paper-model.md Eq. 2–3 with",
        "γ fitted against the CT+NI DES, half of the layer's estimate per phase; an all-reduce",
        "step the closed-form ring step hop + bytes/BW; the broadcast the α–β T_bc(c; m)).",
        "",
        "## Configuration and why",
        "",
        f"* Link: {FLIT_BYTES}-byte flits, one flit per cycle of {CYCLE_S * 1e9:.2f} ns "
        f"(0.78125 GHz) = {LINK_BW_GBPS:.0f} GB/s, the faithful link bandwidth; every message "
        "size is a whole number of flits (h·b_msg = 4096, 8192 and 7168 bytes), so both "
        "simulators move exactly the same bytes.",
        "* Topology and routing: BookSim's k-ary 2-cube (k = 8) mesh or torus, dimension-order "
        "routing (`dim_order`), row index first as in `noc/topology.py`; the torus tie "
        "(distance k/2) is patched from random to the +1 direction so both simulators use identical routes. "
        "4x8 mesh = the 4 x 8 corner of the 8x8 mesh (DOR stays inside it); a 4x8 torus is not "
        "expressible in BookSim's k-ary n-cube and is not run. B = 512 runs on the 4x8 mesh "
        "only (`--full` adds the 8x8 grids): BookSim needed 88 s for one Mixtral B512 run on "
        "the 4x8 mesh, and 8x8 doubles both messages and routers.",
        "* Routers: input-queued (`iq`), 8 VCs (the torus dateline splits them in two sets) of "
        "1024 flits — deeper than every message, so a blocked packet is buffered whole and the "
        "switching is virtual cut-through; credit stalls never throttle a link; input speedup 2 "
        "(as BookSim's own `mesh88_lat` example), output speedup 1; iSLIP VC and switch "
        "allocation, 1 iteration; routing 0 cycles, VC and switch allocation 1 cycle each, "
        "credit 1 cycle. Why 8 VCs and speedup 2: the DES's router is ideal output-queued (every "
        "link an independent FCFS queue, no head-of-line blocking); with 2 VCs and speedup 1 "
        "BookSim's input-queued routers lose 10–20 % to head-of-line blocking at B = 128 "
        "(measured: Mixtral B128 combine mesh8x8 CT+NI −16.5 %, DS-V2-Lite B128 dispatch "
        "torus8x8 −21.6 %; with 8 VCs alone −17.7 % and −12.6 %; with 8 VCs and speedup 2 "
        "−4.8 % and −2.3 %). Real routers sit between the two; the DES models the better one.",
        f"* Router delay: measured at zero load from 1-flit messages over 1–7 hops: arrival = "
        f"{meta['a']:.2f} + {meta['b']:.2f}·hops cycles. The DES runs with hop latency "
        f"{meta['b']:.2f} cycles = {meta['hop_ns']:.3f} ns, so both see the same per-hop "
        "pipeline delay. The constant is BookSim's injection plus ejection: "
        f"{meta['a'] / 2:.2f} cycles = {meta['a'] / 2 / meta['b']:.2f} hop latencies per port, "
        f"which the `+NI` columns charge as {NI_HOPS:g} hop latency per port "
        "(`ni_latency_hops`, docs/PHYSICS.md §16).",
        "* BookSim's network interface injects one flit per cycle per node and ejects one per "
        "cycle (one injection queue per node, messages in ready order). The DES of §6.3 has no "
        "such limit (the links are the only resources); the `+NI` columns add it "
        "(`simulate_messages(..., ni_bw_Bps=50e9, ni_latency_s=...)`).",
        "* Messages: layer-1 token rows of the reference traces read in place (Mixtral: real "
        "reasoning trace; DeepSeek-V2-Lite and Qwen2: the short extracts, rows drawn with "
        "replacement), expert-parallel holders, uniform aggregators (seed 27). `allreduce` = "
        "one reduce-scatter step of the ring all-reduce (B·h·2/D bytes to the ring successor); "
        f"`broadcast` = two experts from nodes 0 and D/2 down the broadcast trees, "
        f"{BROADCAST_BYTES // 1024} KiB each in {BROADCAST_CHUNKS} chunks with the pipeline "
        "release times of `noc/broadcast.py` (a slice of an expert: whole experts are MBs and "
        "too slow for BookSim; the schedule's structure is the same).",
        "* Analytic twin (`twin`): the `faithful` estimator t_comm = κ_a·max_c V_c / BW_end "
        "(κ_a = 2, V_c = h · tokens touching node c) times γ, fitted as the env's twin fits it "
        "(`sim.calibrate.fit_gamma`: 64 batch sizes in [B/2, 2B] from the same trace layer, "
        "y = dispatch + combine makespan of the CT+NI DES of the same setting, least squares "
        "through the origin, seed 27 + B; profile `faithful` with α = 0 and without partial "
        "sums, as the DES here). The twin predicts a layer's dispatch + combine, so each phase "
        "gets half; the table *MoE layer* below compares the sum, the twin's own quantity. "
        "All-reduce step: hop latency + bytes/BW (one step of `perf.tp_allreduce_time`'s ring; "
        "the env charges TP's all-reduce by the DES even under `fidelity=\"analytic\"`). "
        "Broadcast: `cost.broadcast.broadcast_time_chunked` with m = 2, c = "
        f"{BROADCAST_BYTES // BROADCAST_CHUNKS // 1024} KiB, H = the topology's diameter, α = 0 "
        "(the α–β model behind k_b).",
        "",
        "## Summary",
        "",
    ]
    lines += meta["summary"]
    lines += ["", "## MoE layer (dispatch + combine): the analytic twin's own quantity", ""]
    lines += meta["layer"]
    lines += ["", "## Per case", "",
              "| case | msgs | flits | BookSim µs | "
              + " | ".join(f"{LABELS[v[0]]} %" for v in VARIANTS)
              + " | bound % | twin % | BookSim s | DES s |",
              "|---|---:|---:|---:|" + "---:|" * len(VARIANTS) + "---:|---:|---:|---:|"]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['messages']} | {r['flits']} | {r['booksim_s'] * 1e6:.3f} | "
            + " | ".join(fmt(r[f"err_{v[0]}"]) for v in VARIANTS)
            + f" | {fmt(r['err_bound'])} | {fmt(r['err_twin'])} | {r['wall_booksim']:.2f} | "
            f"{r['wall_des']:.4f} |")
    lines += ["", "Runtimes are wall-clock seconds on a shared 2-core machine (`BookSim s` one "
              "BookSim run, `DES s` one CT+NI DES call after compilation).", ""]
    over = [r for r in rows if abs(r["err_ct_ni"]) > 5.0]
    lines += ["## Cases where CT+NI is more than 5 % off", ""]
    lines += [f"* {r['case']}: {fmt(r['err_ct_ni'])} %" for r in over] or ["* none"]
    lines.append("")
    kept = ""  # a hand-written reading below the marker survives a re-run
    if path.exists() and HAND_WRITTEN in path.read_text():
        kept = path.read_text().split(HAND_WRITTEN, 1)[1]
    lines.append(HAND_WRITTEN + kept.rstrip("\n"))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def summarise(rows: list[dict[str, object]]) -> list[str]:
    out = ["Mean / max absolute makespan error in % against BookSim 2.0.", "",
           "| subset | cases | " + " | ".join(LABELS[v[0]] for v in VARIANTS) + " | twin |",
           "|---|---:|" + "---:|" * len(VARIANTS) + "---:|"]

    def line(name: str, sel: list[dict[str, object]]) -> None:
        if not sel:
            return
        cells = []
        for col in [v[0] for v in VARIANTS] + ["twin"]:
            e = np.abs([r[f"err_{col}"] for r in sel])
            cells.append(f"{e.mean():.1f} / {e.max():.1f}")
        out.append(f"| {name} | {len(sel)} | " + " | ".join(cells) + " |")

    line("all", rows)
    for kind in KINDS:
        line(kind, [r for r in rows if r["kind"] == kind])
    line("B >= 32 (dispatch, combine, allreduce)",
         [r for r in rows if r["kind"] != "broadcast" and r["batch"] >= 32])
    line("B = 16", [r for r in rows if r["batch"] == 16])
    for topo_kind, grid in SETTINGS:
        line(f"{topo_kind} {grid[0]}x{grid[1]}",
             [r for r in rows if r["topo"] == topo_kind and r["grid"] == grid])
    return out


def layer_table(rows: list[dict[str, object]]) -> list[str]:
    """Dispatch + combine per (model, B, setting): BookSim sum vs CT+NI DES sum vs the twin."""
    by_key: dict[str, dict[str, dict[str, object]]] = {}
    for r in rows:
        if r["kind"] in ("dispatch", "combine"):
            key = str(r["case"]).replace(f"/{r['kind']}/", "/")
            by_key.setdefault(key, {})[str(r["kind"])] = r
    out = ["Sum of the dispatch and combine makespans of each layer (BookSim runs the two phases "
           "separately, as the DES does); error in % against BookSim's sum. `γ` is the twin's "
           "fitted slope.", "",
           "| layer | BookSim µs | CT+NI % | twin % | γ |", "|---|---:|---:|---:|---:|"]
    errs: dict[str, list[float]] = {"ct_ni": [], "twin": []}
    for key, pair in by_key.items():
        if set(pair) != {"dispatch", "combine"}:
            continue
        ref = sum(float(p["booksim_s"]) for p in pair.values())
        des = sum(float(p["ct_ni_s"]) for p in pair.values())
        twin = sum(float(p["twin_s"]) for p in pair.values())
        errs["ct_ni"].append(_err(des, ref))
        errs["twin"].append(_err(twin, ref))
        out.append(f"| {key} | {ref * 1e6:.3f} | {errs['ct_ni'][-1]:+.1f} | "
                   f"{errs['twin'][-1]:+.1f} | {float(pair['combine']['gamma']):.3f} |")
    if errs["twin"]:
        ct, tw = np.abs(errs["ct_ni"]), np.abs(errs["twin"])
        out += ["", f"Mean / max absolute error over {ct.size} layers: CT+NI DES "
                f"{ct.mean():.1f} / {ct.max():.1f} %, analytic twin {tw.mean():.1f} / "
                f"{tw.max():.1f} %."]
    return out


def hol_study(binary: Path, case_ids: list[str], work: Path, hop: float) -> list[str]:
    """BookSim under the routers of ``HOL_ROUTERS`` against the CT+NI DES (Markdown lines).

    The DES's routers are ideal output queues; BookSim's are input-queued. Raising VCs and
    speedups moves BookSim towards an output-queued router; the error of the DES should shrink
    if head-of-line blocking is what separates them.
    """
    head = "| case | DES CT+NI µs | " + " | ".join(
        f"{r['num_vcs']} VCs, in {r['input_speedup']}, out {r['output_speedup']}, "
        f"int {r['internal_speedup']:g}" for r in HOL_ROUTERS) + " |"
    out = ["BookSim makespan (µs) and CT+NI DES error (%) per router: VCs, input, output and "
           "internal speedup.", "", head, "|---|---:|" + "---:|" * len(HOL_ROUTERS)]
    for cid in case_ids:
        model, batch, kind, topo_kind, grid = parse_case_id(cid)
        msgs = build_messages(model, batch, kind, topo_kind, grid, hop)
        des = run_des(msgs, topo_kind, grid, hop, "cut_through", NI_HOPS)
        cells = []
        for router in HOL_ROUTERS:
            t0 = time.perf_counter()
            cycles, _arrival = run_booksim(binary, msgs, topo_kind, grid, work, router)
            ref = cycles * CYCLE_S
            cells.append(f"{ref * 1e6:.3f} ({_err(des, ref):+.1f})")
            print(f"{cid} {router}: booksim {ref * 1e6:.3f} us, DES {_err(des, ref):+.1f} % "
                  f"({time.perf_counter() - t0:.1f} s)", flush=True)
        out.append(f"| {cid} | {des * 1e6:.3f} | " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--booksim", type=Path, help="a built trace-driven BookSim binary")
    parser.add_argument("--quick", action="store_true", help="B in {16, 128}, 8x8 only")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--fixture", type=Path, default=FIXTURE)
    parser.add_argument("--full", action="store_true", help="B = 512 on 8x8 too (slow)")
    parser.add_argument("--hol", nargs="+", metavar="CASE",
                        help="only the head-of-line study: these cases under every router of "
                             "HOL_ROUTERS (prints a Markdown table, writes nothing)")
    parser.add_argument("--resume", type=Path,
                        help="JSON-lines file of finished cases: reused (same message hash) "
                             "and appended to, so an interrupted run continues")
    args = parser.parse_args(argv)
    binary = args.booksim
    if binary is None:
        missing = tools_missing()
        if missing:
            print(f"validate_booksim: skipped ({', '.join(missing)} not found)")
            return 0
        built = subprocess.run(["sh", str(ROOT / "benchmarks" / "booksim" / "build.sh")],
                               check=True, capture_output=True, text=True)
        binary = Path(built.stdout.strip().splitlines()[-1])
    if not TRACES.is_dir():
        print(f"validate_booksim: skipped (no reference traces at {TRACES})")
        return 0
    rows: list[dict[str, object]] = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        a, b = zero_load_hop_cycles(binary, work)
        hop = b * CYCLE_S
        print(f"zero load: arrival = {a:.2f} + {b:.2f} * hops cycles; DES hop latency "
              f"{hop * 1e9:.3f} ns, port latency {NI_HOPS * hop * 1e9:.3f} ns", flush=True)
        if args.hol:
            print("\n".join(hol_study(binary, args.hol, work, hop)))
            return 0
        run_des(Messages(np.array([0]), np.array([1]), np.array([1]), np.array([0])), "mesh",
                (8, 8), hop, "cut_through", NI_HOPS)  # compile outside the timings
        done: dict[tuple[str, str], dict[str, float]] = {}
        if args.resume is not None and args.resume.exists():
            for line in args.resume.read_text().splitlines():
                rec = json.loads(line)
                done[(rec["case"], rec["digest"])] = rec
        for model, batch, kind, topo_kind, grid in cases(args.quick, args.full):
            msgs = build_messages(model, batch, kind, topo_kind, grid, hop)
            cid = case_id(model, batch, kind, topo_kind, grid)
            rec = done.get((cid, msgs.digest()))
            t0 = time.perf_counter()
            if rec is None or rec["hop_latency_s"] != hop:
                cycles, _arrival = run_booksim(binary, msgs, topo_kind, grid, work)
                rec = {"case": cid, "digest": msgs.digest(), "hop_latency_s": hop,
                       "cycles": cycles, "wall": time.perf_counter() - t0}
                if args.resume is not None:
                    with args.resume.open("a") as f:
                        f.write(json.dumps(rec) + "\n")
            cycles = int(rec["cycles"])
            t1 = t0 + float(rec["wall"])
            t1_real = time.perf_counter()
            run_des(msgs, topo_kind, grid, hop, "cut_through", True)
            t2 = t1 + time.perf_counter() - t1_real
            ref = cycles * CYCLE_S
            row = {"case": case_id(model, batch, kind, topo_kind, grid), "model": model,
                   "batch": batch, "kind": kind, "topo": topo_kind, "grid": grid,
                   "messages": int(msgs.src.size), "flits": int(msgs.flits.sum()),
                   "digest": msgs.digest(), "hop_latency_s": hop, "booksim_s": ref,
                   "wall_booksim": t1 - t0, "wall_des": t2 - t1}
            for name, switching, ni in VARIANTS:
                row[f"{name}_s"] = run_des(msgs, topo_kind, grid, hop, switching, ni)
                row[f"err_{name}"] = _err(row[f"{name}_s"], ref)
            topo = topology_for(topo_kind, grid)
            row["err_bound"] = _err(link_load_bound(topo, msgs.src, msgs.dst, msgs.size_bytes),
                                    ref)
            row["twin_s"] = twin_estimate(msgs, model, batch, kind, topo_kind, grid, hop)
            row["err_twin"] = _err(row["twin_s"], ref)
            row["gamma"] = (twin_gamma(model, batch, topo_kind, grid, hop)
                            if kind in ("dispatch", "combine") else float("nan"))
            rows.append(row)
            print(f"{row['case']:34s} msgs {row['messages']:5d} booksim {ref * 1e6:9.3f} us  "
                  + "  ".join(f"{n} {row['err_' + n]:+6.1f}%" for n, _s, _n in VARIANTS)
                  + f"  bound {row['err_bound']:+6.1f}%  twin {row['err_twin']:+6.1f}%"
                  + f"  ({t1 - t0:.2f} s / {t2 - t1:.4f} s)",
                  flush=True)
    summary = summarise(rows)
    print("\n".join(summary))
    write_fixture(rows, args.fixture)
    layer = layer_table(rows)
    print("\n".join(layer))
    write_results(rows, {"quick": args.quick, "a": a, "b": b, "hop_ns": hop * 1e9,
                         "summary": summary, "layer": layer}, args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

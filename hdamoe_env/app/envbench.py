"""Env throughput benchmark (``hdamoe bench-env``): env steps per second and decision time.

Measures, in one run, ``HdMoE-v1`` steps per second on the DES and on the analytic twin against
the raw simulator layer call they wrap, and the heuristic agents' decision time per step.
Numbers are ratios against a baseline measured in the same run (the raw layer call); library
functions return numbers, only :func:`cmd_bench_env` prints.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from hdamoe_env.app.vecbench import items_per_second
from hdamoe_env.app.tables import render_table
from hdamoe_env.config.fileio import write_json
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = ["bench_env", "cmd_bench_env", "format_bench_env"]


# ------------------------------------------------------------------------------------ bench-env
#: Interleaved measurement rounds per env policy (each keeps its best round).
ROUNDS = 5


def _policy_rates(env: Any, policies: dict[str, Callable[[Any], Any]], seconds: float,
                  seed: int) -> tuple[dict[str, float], float]:
    """Return env steps/s per policy and the time when the first policy's warm-up ended.

    The policies take turns (:data:`ROUNDS` rounds of ``seconds / ROUNDS`` each) and each keeps
    its best round: load from other processes then hits all of them alike, and the ratios
    (gating on vs off) compare like with like.
    """
    runners: dict[str, Callable[[], int]] = {}
    warm = 0.0
    for suffix, policy in policies.items():
        state = {"episodes": 0}

        def env_steps(policy: Any = policy, state: dict[str, int] = state) -> int:
            obs, _ = env.reset(seed=seed + state["episodes"])
            state["episodes"] += 1
            n, done = 0, False
            while not done:
                obs, _, term, trunc, _ = env.step(policy(obs))
                n += 1
                done = term or trunc
            return n

        env_steps()                                      # warm-up: JIT, γ fit, caches
        warm = warm or time.perf_counter()
        runners[suffix] = env_steps
    best = dict.fromkeys(runners, 0.0)
    for _ in range(ROUNDS):
        for suffix, run in runners.items():
            best[suffix] = max(best[suffix], items_per_second(run, seconds / ROUNDS)[0])
    return best, warm


def bench_env(*, seconds: float = 2.0, model: str = RUN_DEFAULTS.model, mesh: str = RUN_DEFAULTS.mesh,
              setting: str = RUN_DEFAULTS.setting, batch: int = RUN_DEFAULTS.batch,
              conventions: str = RUN_DEFAULTS.conventions,
              seed: int = 0) -> dict[str, Any]:
    """Measure env steps per second and heuristic decision times (``hdamoe bench-env``).

    Env: EP placement (every layer simulated by the DES; TP would take the analytic all-reduce
    path), DES and analytic fidelity, under four policies: no-op actions (gating off), no-op
    with hardware-aware gating at level 1 (``_gating``), random actions drawn from the
    per-dimension masks (``_random_masked``, what an untrained masked policy sends) and the
    HDA-MoE agent (``_hda_moe``, pre-broadcast + dispatch + gating), measured in
    :data:`ROUNDS` interleaved rounds (best round each) of ``seconds`` in total per policy.
    Baseline, same run: the raw simulator layer call ``MoESimulator.layer_sampled`` on the same
    decode steps. Decisions: ``HDMoEAgent`` and
    ``HDAMoEAgent`` on the observations of a DES episode (typical), and with the budget forced to
    ``max_broadcast`` slots (worst case); baseline: ``NoOpAgent.predict``.

    Returns:
        Rates (steps/s), times (ms) and ratios.
    """
    import agents
    from hdamoe_env.env.environment import HdMoeEnv
    from hdamoe_env.sim.simulator import make_steps

    out: dict[str, Any] = {"model": model, "mesh": mesh, "setting": setting, "batch": batch,
                           "conventions": conventions, "seconds": seconds}
    for fidelity in ("des", "analytic"):
        t0 = time.perf_counter()
        env = HdMoeEnv(model=model, mesh=mesh, setting=setting, batch=batch,
                       conventions=conventions, placement="ep", fidelity=fidelity,
                       steps_per_episode=4, placement_seed=seed)
        layout = agents.NoOpAgent.from_env(env).layout
        noop = layout.noop()
        gated = layout.encode(gating_level=1.0)
        hda = agents.HDAMoEAgent.from_env(env)
        env.action_space.seed(seed)
        policies: dict[str, Callable[[Any], Any]] = {
            "": lambda obs, a=noop: a,                                 # no-op, gating off
            "_gating": lambda obs, a=gated: a,                         # no-op, gating level 1
            "_random_masked": lambda obs, env=env: env.action_space.sample(
                mask=env.action_mask_tuple()),
            "_hda_moe": lambda obs, agent=hda: agent.predict(obs)[0],
        }
        rates, warm_s = _policy_rates(env, policies, seconds, seed)
        out[f"{fidelity}_setup_s"] = warm_s - t0
        for suffix, rate in rates.items():
            out[f"env_{fidelity}{suffix}_steps_per_s"] = rate
        out[f"ratio_{fidelity}_gating_on_vs_off"] = (out[f"env_{fidelity}_gating_steps_per_s"]
                                                      / out[f"env_{fidelity}_steps_per_s"])
        sim, placement = env.sim, env.placement
        rows = make_steps(env.trace, batch, 8, np.random.default_rng(seed))
        sets = [np.asarray(env.trace.topk_ids[:, r, :], dtype=np.int64) for r in rows]
        rng = np.random.default_rng(seed)
        # the cost of the analytic call does not depend on the value of γ
        gammas = [1.0] * env.num_layers if fidelity == "analytic" else None

        def raw_layers(sim: Any = sim, placement: Any = placement, sets: Any = sets,
                       gammas: Any = gammas, fidelity: str = fidelity) -> int:
            n = 0
            for step_sets in sets:
                for layer in range(step_sets.shape[0]):
                    sim.layer_sampled(placement, layer, step_sets[layer], rng=rng,
                                      fidelity=fidelity,
                                      gamma=None if gammas is None else gammas[layer])
                    n += 1
            return n

        raw_layers()
        out[f"raw_{fidelity}_layers_per_s"], _ = items_per_second(raw_layers, seconds)
        out[f"ratio_{fidelity}"] = (out[f"env_{fidelity}_steps_per_s"]
                                    / out[f"raw_{fidelity}_layers_per_s"])
    env = HdMoeEnv(model=model, mesh=mesh, setting=setting, batch=batch,
                   conventions=conventions, placement="ep", steps_per_episode=4,
                   placement_seed=seed)
    noop_agent = agents.NoOpAgent.from_env(env)
    observations = []
    obs, _ = env.reset(seed=seed)
    done = False
    while not done:
        observations.append(obs)
        obs, _, term, trunc, _ = env.step(noop_agent.predict(obs)[0])
        done = term or trunc
    worst = [{**o, "budget": np.ones(1, dtype=np.float32)} for o in observations]
    out["k_b_mean"] = float(np.mean(env.k_b))
    for label, agent in (("noop", noop_agent),
                         ("hd_moe", agents.HDMoEAgent.from_env(env)),
                         ("hda_moe", agents.HDAMoEAgent.from_env(env))):
        for case, obs_list in (("typical", observations), ("worst", worst)):
            times = []
            for _ in range(3):
                for o in obs_list:
                    t0 = time.perf_counter()
                    agent.predict(o)
                    times.append(time.perf_counter() - t0)
            out[f"decide_{label}_{case}_ms"] = 1e3 * float(np.median(times))
            out[f"decide_{label}_{case}_p99_ms"] = 1e3 * float(np.percentile(times, 99))
    env_step_ms = 1e3 / out["env_des_steps_per_s"]
    out["env_des_step_ms"] = env_step_ms
    for label in ("hd_moe", "hda_moe"):
        out[f"ratio_decide_{label}_vs_noop"] = (out[f"decide_{label}_worst_ms"]
                                                / max(out["decide_noop_worst_ms"], 1e-9))
        out[f"ratio_decide_{label}_vs_env_step"] = out[f"decide_{label}_worst_ms"] / env_step_ms
    out["targets"] = {"env_des_steps_per_s": 1000, "env_analytic_steps_per_s": 10000,
                      "decide_hda_moe_ms": 3.0, "gating_on_vs_off": 0.5}
    out["pass"] = {
        "gating_on_vs_off": all(out[f"ratio_{f}_gating_on_vs_off"] >= 0.5
                                for f in ("des", "analytic")),
        "env_des_steps_per_s": out["env_des_steps_per_s"] >= 1000,
        "env_analytic_steps_per_s": out["env_analytic_steps_per_s"] >= 10000,
        "decide_hda_moe_ms": out["decide_hda_moe_worst_ms"] <= 3.0,
    }
    return out


def format_bench_env(res: dict[str, Any]) -> str:
    """Return the ``bench-env`` table: measurement, value, same-run baseline, ratio, target."""
    ok = res["pass"]
    rows = [
        ("env steps/s, DES", f"{res['env_des_steps_per_s']:,.0f}",
         f"raw layer_sampled DES {res['raw_des_layers_per_s']:,.0f}/s",
         f"{res['ratio_des']:.2f}", ">= 1,000 " + ("ok" if ok["env_des_steps_per_s"] else "MISS")),
        ("env steps/s, analytic", f"{res['env_analytic_steps_per_s']:,.0f}",
         f"raw layer_sampled analytic {res['raw_analytic_layers_per_s']:,.0f}/s",
         f"{res['ratio_analytic']:.2f}",
         ">= 10,000 " + ("ok" if ok["env_analytic_steps_per_s"] else "MISS")),
    ]
    for fid in ("des", "analytic"):
        off = res[f"env_{fid}_steps_per_s"]
        for suffix, what in (("_gating", "gating on (level 1)"),
                             ("_random_masked", "random masked actions"),
                             ("_hda_moe", "HDA-MoE agent")):
            value = res[f"env_{fid}{suffix}_steps_per_s"]
            target = ""
            if suffix == "_gating":
                target = ">= 0.5 x off " + ("ok" if value >= 0.5 * off else "MISS")
            rows.append((f"env steps/s, {fid}, {what}", f"{value:,.0f}",
                         f"no-op, gating off {off:,.0f}/s", f"{value / off:.2f}", target))
    for label, name in (("hd_moe", "HD-MoE"), ("hda_moe", "HDA-MoE")):
        target = ("<= 3 ms " + ("ok" if ok["decide_hda_moe_ms"] else "MISS")
                  if label == "hda_moe" else "")
        rows.append((f"{name} decision ms (typical)",
                     f"{res[f'decide_{label}_typical_ms']:.3f}",
                     f"NoOp {res['decide_noop_typical_ms']:.4f} ms", "", ""))
        rows.append((f"{name} decision ms (k_b = max)", f"{res[f'decide_{label}_worst_ms']:.3f}",
                     f"env DES step {res['env_des_step_ms']:.3f} ms",
                     f"{res[f'ratio_decide_{label}_vs_env_step']:.2f}", target))
    head = ("measurement", "value", "baseline (same run)", "ratio", "target")
    return render_table(head, rows, align="l" * len(head))


def cmd_bench_env(args: argparse.Namespace) -> int:
    """Run ``hdamoe bench-env``; print the table; return the exit code."""
    if getattr(args, "num_envs", 0):
        return _cmd_bench_vector(args)
    res = bench_env(seconds=args.seconds, model=args.model, mesh=args.mesh,
                    setting=args.setting, batch=args.batch, conventions=args.conventions,
                    seed=args.seed)
    print(f"env benchmark: {res['model']} {res['mesh']} {res['setting']} B={res['batch']} "
          f"({res['conventions']}), EP placement; mean k_b "
          f"{res['k_b_mean']:.2f}")
    print(format_bench_env(res))
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    return 0


def _cmd_bench_vector(args: argparse.Namespace) -> int:
    """Run ``hdamoe bench-env --num-envs N`` (``hdamoe_env.app.vecbench``)."""
    from hdamoe_env.app import vecbench

    fidelities = ("analytic", "des") if args.fidelity == "both" else (args.fidelity,)
    res = vecbench.bench_vector(args.num_envs, seconds=args.seconds, model=args.model,
                                mesh=args.mesh, setting=args.setting, batch=args.batch,
                                conventions=args.conventions, fidelities=fidelities,
                                seed=args.seed, des_threads=tuple(args.des_threads),
                                k_b=getattr(args, "k_b", None))
    print(f"vector env benchmark: {res['model']} {res['mesh']} {res['setting']} "
          f"B={res['batch']} ({res['conventions']}), EP placement, {res['steps_per_episode']} "
          f"decode steps per episode" + ("" if res.get("k_b") is None
                                          else f", k_b = {res['k_b']}"))
    print(vecbench.format_vector_bench(res, fidelities))
    if args.json:
        write_json(args.json, res)
        print(f"wrote {args.json}")
    return 0

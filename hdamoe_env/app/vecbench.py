"""Batched vector env throughput (``hdamoe bench-env --num-envs N``): single vs batched steps/s.

Measures, in one run and on the same configuration, env steps per second of one ``HdMoeEnv``
and of ``HdMoeVectorEnv`` with N copies (steps/s counts every copy's step), for both fidelities
and two policies: no-op actions (no pre-broadcast, gating off: the batched path) and random
actions drawn from the per-dimension masks (what an untrained masked policy sends: a share of
the copies takes the per-copy path). The two take turns in :data:`ROUNDS` rounds and each keeps
its best round, so load from other processes hits both alike; the ratio is batched ÷ single.
Library functions return numbers; :func:`format_vector_bench` renders them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import NDArray

from hdamoe_env.config.errors import ConfigError
from hdamoe_env.config.run import RUN_DEFAULTS

__all__ = ["ROUNDS", "bench_vector", "format_vector_bench", "items_per_second", "masked_sample"]

#: Interleaved measurement rounds (each side keeps its best round).
ROUNDS = 3


def items_per_second(fn: Callable[[], int], seconds: float) -> tuple[float, int]:
    """Call ``fn`` (returns the number of items it did) until ``seconds`` pass; items/s."""
    count = 0
    t0 = time.perf_counter()
    while True:
        count += fn()
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return count / elapsed, count


def masked_sample(masks: NDArray[np.bool_], nvec: NDArray[np.int64],
                  rng: np.random.Generator) -> NDArray[np.int64]:
    """Draw one action per row uniformly among the allowed values of every dimension.

    Args:
        masks: bool [N, sum(nvec)] flat masks (``action_masks()``).
        nvec: int [n] values per action dimension.
        rng: Generator of the draws.

    Returns:
        int64 [N, n].
    """
    out = np.empty((masks.shape[0], nvec.size), dtype=np.int64)
    start = 0
    for d, size in enumerate(nvec.tolist()):
        part = masks[:, start:start + size]
        out[:, d] = np.argmax(rng.random(part.shape) * part, axis=1)
        start += size
    return out


def bench_vector(num_envs: int, *, seconds: float = 2.0, model: str = RUN_DEFAULTS.model,
                 mesh: str = RUN_DEFAULTS.mesh, setting: str = RUN_DEFAULTS.setting,
                 batch: int = RUN_DEFAULTS.batch, conventions: str = RUN_DEFAULTS.conventions,
                 fidelities: tuple[str, ...] = ("analytic", "des"), seed: int = 0,
                 des_threads: tuple[int, ...] = (1,), k_b: int | None = None
                 ) -> dict[str, Any]:
    """Measure single-env and batched steps/s (module docstring) on the EP placement.

    Args:
        num_envs: Copies N of the batched env.
        seconds: Time per measurement (split over :data:`ROUNDS` rounds).
        model, mesh, setting, batch, conventions: The run.
        fidelities: ``"analytic"`` and/or ``"des"``.
        seed: Seed of the envs and of the random actions.
        des_threads: ``des_threads`` of the batched env (DES layer runs and decode-step
            formation), one batched env per value and fidelity, all measured in the same
            rounds as the single env (which always uses one thread). The first value gives
            the ``..._batched_...`` keys; each further value t gives
            ``{fidelity}_{policy}_batched_{t}t_steps_per_s`` and ``..._ratio_{t}t``.
        k_b: Manual pre-broadcast slots of the envs (``EnvConfig.k_b``), or None: the budget
            rule (k_b = 0 at every layer of the default run, so no action pre-broadcasts).

    Returns:
        ``{fidelity}_{policy}_single_steps_per_s``, ``..._batched_steps_per_s`` and
        ``..._ratio`` for policy ``noop`` and ``random_masked``, plus the configuration.

    Raises:
        ConfigError: A bad ``des_threads`` value (``linksim.check_threads``).
    """
    from hdamoe_env.env.environment import HdMoeEnv
    from hdamoe_env.env.vector import HdMoeVectorEnv
    from hdamoe_env.noc.linksim import check_threads

    threads = tuple(check_threads(t, "des_threads") for t in des_threads) or (1,)
    if len(set(threads)) != len(threads):
        raise ConfigError(f"des_threads must not repeat a value, got {list(des_threads)}; "
                          "list each thread count once")
    out: dict[str, Any] = {"model": model, "mesh": mesh, "setting": setting, "batch": batch,
                           "conventions": conventions, "num_envs": num_envs,
                           "seconds": seconds, "placement": "ep", "steps_per_episode": 4,
                           "des_threads": list(threads), "k_b": k_b}
    for fidelity in fidelities:
        kwargs = dict(model=model, mesh=mesh, setting=setting, batch=batch,
                      conventions=conventions, placement="ep", fidelity=fidelity,
                      steps_per_episode=4, placement_seed=seed,
                      **({} if k_b is None else {"k_b": k_b}))
        t0 = time.perf_counter()
        venv = HdMoeVectorEnv(num_envs, des_threads=threads[0], **kwargs)
        out[f"{fidelity}_setup_s"] = time.perf_counter() - t0
        # further thread counts: one more batched env each ("" = the first)
        venvs = {"": venv}
        venvs.update({f"_{t}t": HdMoeVectorEnv(num_envs, des_threads=t, **kwargs)
                      for t in threads[1:]})
        gammas = venv.envs[0]._gammas if fidelity == "analytic" else None
        single = HdMoeEnv(**kwargs, **({} if gammas is None else {"gammas": list(gammas)}))
        nvec = single.action_space.nvec
        noop = np.array([single.num_experts] * single.max_broadcast + [0, 0], dtype=np.int64)
        rng = np.random.default_rng(seed)
        runners: dict[str, Callable[[], int]] = {}
        for policy in ("noop", "random_masked"):
            state = {"episodes": 0}

            def single_run(policy: str = policy, state: dict[str, int] = state) -> int:
                single.reset(seed=seed + state["episodes"])
                state["episodes"] += 1
                n, done = 0, False
                while not done:
                    act = noop if policy == "noop" else masked_sample(
                        single.action_masks()[None], nvec, rng)[0]
                    _, _, term, trunc, _ = single.step(act)
                    n += 1
                    done = term or trunc
                return n

            steps_per_episode = single.steps_per_episode * single.num_layers

            single_run()                                 # warm-up: JIT, caches
            runners[f"{fidelity}_{policy}_single"] = single_run
            for suffix, env in venvs.items():

                def batched_run(policy: str = policy, env: HdMoeVectorEnv = env) -> int:
                    env.reset(seed=seed)
                    acts = np.tile(noop, (num_envs, 1))
                    for _ in range(steps_per_episode):
                        if policy != "noop":
                            acts = masked_sample(env.action_masks(), nvec, rng)
                        env.step(acts)
                    return steps_per_episode * num_envs

                batched_run()
                runners[f"{fidelity}_{policy}_batched{suffix}"] = batched_run
        best = dict.fromkeys(runners, 0.0)
        for _ in range(ROUNDS):
            for key, run in runners.items():
                best[key] = max(best[key], items_per_second(run, seconds / ROUNDS)[0])
        for policy in ("noop", "random_masked"):
            s = best[f"{fidelity}_{policy}_single"]
            out[f"{fidelity}_{policy}_single_steps_per_s"] = s
            for suffix in venvs:
                b = best[f"{fidelity}_{policy}_batched{suffix}"]
                out[f"{fidelity}_{policy}_batched{suffix}_steps_per_s"] = b
                out[f"{fidelity}_{policy}_ratio{suffix}"] = b / s if s > 0 else float("nan")
        for env in venvs.values():
            env.close()
    return out


def format_vector_bench(res: dict[str, Any], fidelities: tuple[str, ...] = ("analytic", "des")
                        ) -> str:
    """Return the table: fidelity, policy, single steps/s, batched steps/s, ratio."""
    head = ("fidelity", "policy", "single steps/s", f"batched N={res['num_envs']} steps/s",
            "ratio")
    rows = []
    threads = res.get("des_threads", [1])
    for fidelity in fidelities:
        if f"{fidelity}_noop_ratio" not in res:
            continue
        for policy in ("noop", "random_masked"):
            for i, t in enumerate(threads):
                suffix = "" if i == 0 else f"_{t}t"
                label = policy.replace("_", " ")
                if threads != [1]:
                    label += f", batched {t} thread{'s' if t > 1 else ''}"
                rows.append((fidelity, label,
                             f"{res[f'{fidelity}_{policy}_single_steps_per_s']:,.0f}",
                             f"{res[f'{fidelity}_{policy}_batched{suffix}_steps_per_s']:,.0f}",
                             f"{res[f'{fidelity}_{policy}_ratio{suffix}']:.2f}"))
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)

"""The methods of ``hdamoe bench``: a placement plus an online agent, parsed from a name.

Methods (paper-model.md §9, §13 Fig. 10):

| method | placement | online agent |
|---|---|---|
| ``tp`` | TP (§9.1) | NoOp |
| ``tp-tiled`` | tile-aligned TP: expert column tiles dealt over all nodes, TP all-reduce | NoOp |
| ``ep`` | EP (§9.2, seeded) | NoOp |
| ``hybrid`` | compute-balanced hybrid TP-EP (§9.3) | NoOp |
| ``node-balance`` | Node Balance with the random mapping π0 (§7) | NoOp |
| ``node-link`` | Node + Link Balance (§7–8), static | NoOp |
| ``node-link-raw`` | the same without the TP guard (ablations; not in the default set) | NoOp |
| ``hd-moe`` | Node + Link Balance | ``HDMoEAgent``: pre-broadcast + dispatch (§10) |
| ``hda-moe`` | Node + Link Balance | ``HDAMoEAgent``: + hardware-aware gating (§11) |
| ``hda-moe@qNN`` | Node + Link Balance | ``HDAMoEAgent`` at the matched-quality gating scale |
| ``hda-moe@sX`` | Node + Link Balance | ``HDAMoEAgent`` at gating scale X (Pareto curves) |
| ``agent:NAME[@placement]`` | node-link unless ``@placement`` | a registered or learned agent |
| ``tuned:PATH[@placement]`` | node-link unless ``@placement`` | the tuned heuristic of ``hdamoe tune`` (its ``tuned.json``: knobs of the agent and the env) |

``hda-moe@q99`` gates at the strongest scale s <= 1 of the default coefficients (§11.7) whose
top-1 routing retention on training decode steps is >= 99 % (``hdamoe_env.app.matched``: a grid
over s refined by bisection); the bench then measures that scale on its own episodes. Its records
carry ``quality_target`` and the search (``gating_search``); every record carries the applied
``gating_scale`` (mean over env steps) and the routing quality in ``gating``.

(A learned agent is a saved file, loaded by ``agents.learned.policy.load_agent``.)
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from baselines.store import PLACEMENT_ARTIFACTS
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled, unknown_name

__all__ = ["BUILTIN_METHODS", "DEFAULT_METHODS", "MethodSpec", "parse_method", "resolve_agent"]


@dataclass(frozen=True)
class MethodSpec:
    """A benchmark method: a placement plus an online agent.

    Attributes:
        name: Method name used in tables, records and run directories.
        placement: One of ``PLACEMENT_ARTIFACTS`` (``tp``, ``ep``, ``hybrid``, ``node_balance``,
            ``node_link``).
        agent: A registered agent name (``agents.AGENTS``), a path to a saved learned agent, or
            None (``NoOpAgent``: the static placement).
        description: One line.
        quality_target: Top-1 retention target of a matched-quality method (``hda-moe@q99``:
            0.99), or None.
        gating_scale: Fixed gating scale of ``hda-moe@sX``, or None (the agent's default).
        rebalance_period: Decode steps between EPLB rebalances
            (``baselines.rebalance.EplbRebalanceWrapper``), or None (a static placement).
        env_kwargs: ``HdMoeEnv`` keyword arguments of this method only, as (name, value)
            pairs (the tuned heuristic's protect-top, k_b and gating levels).
    """

    name: str
    placement: str
    agent: str | None = None
    description: str = ""
    quality_target: float | None = None
    gating_scale: float | None = None
    rebalance_period: int | None = None
    env_kwargs: tuple[tuple[str, Any], ...] = ()


BUILTIN_METHODS: dict[str, MethodSpec] = {
    "tp": MethodSpec("tp", "tp", None, "tensor parallelism (§9.1)"),
    "tp-tiled": MethodSpec("tp-tiled", "tp_tiled", None,
                           "tile-aligned TP: column tiles dealt over all nodes, TP all-reduce"),
    "ep": MethodSpec("ep", "ep", None, "expert parallelism (§9.2)"),
    "hybrid": MethodSpec("hybrid", "hybrid", None, "compute-balanced hybrid TP-EP (§9.3)"),
    "node-balance": MethodSpec("node-balance", "node_balance", None,
                               "Node Balance with the random mapping (§7)"),
    "node-link": MethodSpec("node-link", "node_link", None,
                            "Node + Link Balance, static (§7–8)"),
    "node-link-raw": MethodSpec("node-link-raw", "node_link_raw", None,
                                "Node + Link Balance without the TP guard (ablations)"),
    "hd-moe": MethodSpec("hd-moe", "node_link", "hd-moe",
                         "Node + Link Balance + pre-broadcast + dispatch (§9.4, §10)"),
    "hda-moe": MethodSpec("hda-moe", "node_link", "hda-moe",
                          "HD-MoE + hardware-aware gating (§9.4, §11)"),
    "eplb": MethodSpec("eplb", "eplb", None,
                       "EPLB redundant experts + least-loaded replica dispatch (not in the paper)"),
    "eplb-dynamic": MethodSpec("eplb-dynamic", "eplb", None,
                               "EPLB re-placed every 4 decode steps from the executed loads, "
                               "weight moves charged (DES)", rebalance_period=4),
}


DEFAULT_METHODS: tuple[str, ...] = tuple(m for m in BUILTIN_METHODS if m != "node-link-raw")


def _split_placement(body: str) -> tuple[str, str]:
    """Split ``NAME_OR_PATH[@placement]`` of an ``agent:``/``tuned:`` method (default node_link).

    Raises:
        ConfigError: Unknown placement name.
    """
    if "@" not in body:
        return body, "node_link"
    body, placement = body.rsplit("@", 1)
    placement = placement.replace("-", "_")
    if placement not in PLACEMENT_ARTIFACTS:
        raise unknown_name("placement", placement, PLACEMENT_ARTIFACTS)
    return body, placement


def parse_method(text: str) -> MethodSpec:
    """Parse a method name (built-in, matched-quality, fixed-scale, ``agent:...``, ``tuned:...``).

    Forms: a key of :data:`BUILTIN_METHODS`; ``hda-moe@qNN`` (matched quality: top-1 retention
    >= NN %, 0 < NN <= 100); ``hda-moe@sX`` (gating scale X >= 0); ``eplb-dynamic@N``
    (rebalance every N decode steps); ``agent:NAME_OR_PATH[@placement]``;
    ``tuned:PATH[@placement]`` (a ``tuned.json`` of ``hdamoe tune``, or its directory).

    Raises:
        ConfigError: Unknown built-in method or placement name, a malformed ``@q`` / ``@s`` /
            ``@N`` suffix, or an unreadable tuned file.
    """
    name = text.strip()
    key = name.replace("_", "-")
    if key in BUILTIN_METHODS:
        return BUILTIN_METHODS[key]
    if key.startswith("eplb-dynamic@"):
        period = key.split("@", 1)[1]
        if not period.isdigit() or int(period) < 1:
            raise ConfigError(f"method {text!r}: expected eplb-dynamic@N with N >= 1 decode "
                              "steps between rebalances, e.g. eplb-dynamic@16")
        return MethodSpec(key, "eplb", None, f"EPLB re-placed every {int(period)} decode steps",
                          rebalance_period=int(period))
    if key.startswith("hda-moe@"):
        return _parse_hda_variant(text.strip(), key[len("hda-moe@"):])
    if name.startswith("tuned:"):
        from agents.tuned.search import load_tuned

        body, placement = _split_placement(name[len("tuned:"):])
        if not body:
            raise ConfigError(f"method {text!r}: expected tuned:PATH/tuned.json")
        knobs, _ = load_tuned(body)
        return MethodSpec(name, placement, name, f"tuned heuristic {knobs.label()} on {placement}",
                          env_kwargs=tuple(sorted(knobs.env_kwargs().items())))
    if name.startswith("agent:"):
        body, placement = _split_placement(name[len("agent:"):])
        if not body:
            raise ConfigError(f"method {text!r}: expected agent:NAME or agent:PATH.zip")
        return MethodSpec(name, placement, body, f"agent {body} on {placement}")
    raise ConfigError(f"unknown method {text!r}; expected one of {list(BUILTIN_METHODS)} or "
                      "agent:NAME[@placement] / agent:PATH.zip"
                      + _hint(key, BUILTIN_METHODS))


def _parse_hda_variant(text: str, suffix: str) -> MethodSpec:
    """Parse the ``qNN`` / ``sX`` suffix of ``hda-moe@...``."""
    base = BUILTIN_METHODS["hda-moe"]
    kind, number = suffix[:1], suffix[1:]
    try:
        value = float(number) if kind in ("q", "s") and number else float("nan")
    except ValueError:
        value = float("nan")
    if kind == "q" and 0 < value <= 100:
        return MethodSpec(f"hda-moe@q{number}", base.placement, base.agent,
                          f"HDA-MoE at the strongest gating scale <= 1 keeping top-1 retention "
                          f">= {value:g} %", quality_target=value / 100.0)
    if kind == "s" and math.isfinite(value) and value >= 0:
        return MethodSpec(f"hda-moe@s{number}", base.placement, base.agent,
                          f"HDA-MoE at gating scale {value:g}", gating_scale=value)
    raise ConfigError(f"method {text!r}: expected hda-moe@qNN with 0 < NN <= 100 (top-1 "
                      "retention target in %, e.g. hda-moe@q99) or hda-moe@sX with X >= 0 "
                      "(gating scale, e.g. hda-moe@s0.5)")


def _hint(name: str, choices: Iterable[str]) -> str:
    import difflib

    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def resolve_agent(spec: str | None, env: Any, *, seed: int = 0, **kwargs: Any) -> Any:
    """Return the agent of a method: NoOp (None), a registered agent, or a learned one.

    Learned agents are loaded with ``agents.learned.policy.load_agent(path)`` (the hook for trained
    SB3 / sb3-contrib policies; ``env=`` is passed when the loader accepts it). ``kwargs`` go to
    a registered agent's constructor (e.g. ``gating_level=``).

    Raises:
        ConfigError: Unknown agent name and no such file.
        DependencyNotInstalled: A learned agent without ``agents.learned.policy`` or its extras.
    """
    import agents

    if spec is None:
        return agents.NoOpAgent.from_env(env)
    if spec.startswith("tuned:"):
        from agents.tuned.search import load_tuned

        knobs, _ = load_tuned(_split_placement(spec[len("tuned:"):])[0])
        return knobs.make_agent(env)
    key = spec.replace("_", "-")
    if key in agents.AGENTS:
        return agents.make_agent(key, env=env, seed=seed, **kwargs)
    path = Path(spec)
    if path.suffix == ".zip" or path.exists():
        if not path.exists():
            raise ConfigError(f"learned agent file {spec!r} does not exist")
        try:
            from agents.learned import policy as learned
        except ImportError as exc:
            raise DependencyNotInstalled(
                f"loading the learned agent {spec!r} needs agents.learned.policy and the rl extra "
                '(`pip install "hdamoe-env[rl]"`)') from exc
        loader = learned.load_agent
        if "env" in inspect.signature(loader).parameters:
            return loader(path, env=env)
        return loader(path)
    raise unknown_name("agent", spec, agents.AGENTS)

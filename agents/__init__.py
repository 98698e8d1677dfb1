"""Online policies: pre-broadcast, dispatch and hardware-aware gating (paper-model.md §10–11).

Every agent implements SB3's ``predict(observation, state=None, episode_start=None,
deterministic=True) -> (action, state)`` (style.md R11) for the ``HdMoE-v1`` action layout
(``agents.base.ActionLayout``). Heuristics take specs in ``__init__`` and read only the
observation; ``Agent.from_env(env)`` reads those specs from an env.

``AGENTS`` maps registry names to classes; :func:`make_agent` builds one by name, from an env or
from explicit specs. Learned agents (``agents.learned.policy``, torch) are not imported here.

May import: hdamoe_env, hdamoe_env.config, hdamoe_env.noc, hdamoe_env.cost,
hdamoe_env.decisions, hdamoe_env.sim, hdamoe_env.env, traces
"""

from __future__ import annotations

from typing import Any

from agents.base import ActionLayout, Agent, BaseAgent, NoOpAgent, RandomAgent, env_specs
from agents.composite import CompositeAgent, HDAMoEAgent, HDMoEAgent
from agents.dispatch import LeastLoadedDispatchAgent
from agents.gating import HardwareAwareGatingAgent
from agents.prebroadcast import GreedyPreBroadcastAgent, PriorityPreBroadcastAgent
from hdamoe_env.config.errors import unknown_name

__all__ = [
    "AGENTS",
    "ActionLayout",
    "Agent",
    "BaseAgent",
    "CompositeAgent",
    "GreedyPreBroadcastAgent",
    "HDAMoEAgent",
    "HDMoEAgent",
    "HardwareAwareGatingAgent",
    "LeastLoadedDispatchAgent",
    "NoOpAgent",
    "PriorityPreBroadcastAgent",
    "RandomAgent",
    "env_specs",
    "make_agent",
]

AGENTS: dict[str, type[BaseAgent]] = {
    "noop": NoOpAgent,
    "random": RandomAgent,
    "greedy-prebroadcast": GreedyPreBroadcastAgent,
    "least-loaded-dispatch": LeastLoadedDispatchAgent,
    "hardware-aware-gating": HardwareAwareGatingAgent,
    "hd-moe": HDMoEAgent,
    "hda-moe": HDAMoEAgent,
}


def make_agent(name: str, env: Any = None, **kwargs: Any) -> BaseAgent:
    """Build a registered agent.

    Args:
        name: A key of ``AGENTS`` (underscores are accepted for dashes).
        env: Optional ``HdMoeEnv``: its specs and action layout are passed to the agent
            (``kwargs`` override them).
        **kwargs: Constructor arguments (e.g. ``model=``, ``hw=``, ``seed=``).

    Raises:
        ConfigError: Unknown name (with a near-miss suggestion).
    """
    key = name.replace("_", "-")
    if key not in AGENTS:
        raise unknown_name("agent", name, AGENTS)
    cls = AGENTS[key]
    if env is not None:
        return cls.from_env(env, **kwargs)
    return cls(**kwargs)

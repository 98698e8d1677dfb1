"""Env versions: what bumps an id's version, and the entry point of retired ids.

Gymnasium's convention (and style.md R5): an id's version is bumped whenever the same seed and
actions could give different observations, rewards or episode ends — a changed observation or
action space, reward, episode length or physics (the cost model behind the reward). The retired
ids stay registered so that ``gymnasium.make`` of an old id raises a ``ConfigError`` naming its
successor instead of silently running new dynamics (the policy and the history are in
docs/ENV.md).

May import: hdamoe_env.config
"""

from __future__ import annotations

from typing import Any, NoReturn

from hdamoe_env.config.errors import ConfigError

__all__ = ["RETIRED_ENVS", "retired_env"]

#: Retired id -> (successor id, why it was retired).
RETIRED_ENVS: dict[str, tuple[str, str]] = {
    f"hdamoe_env/HdMoE{variant}-v0": (
        f"hdamoe_env/HdMoE{variant}-v1",
        "the cost model changed (faithful profile: tile model, weight streaming, the NoC "
        "all-reduce), so rewards of the same seed and actions differ")
    for variant in ("", "-analytic", "-Mixtral")
}


def retired_env(*args: Any, retired_id: str = "", **kwargs: Any) -> NoReturn:
    """Raise ``ConfigError`` naming the successor of a retired id (its registered entry point).

    Args:
        *args: Ignored (``num_envs`` of ``make_vec``).
        retired_id: The retired id (set by the registration).
        **kwargs: Ignored (the env's arguments).

    Raises:
        ConfigError: Always.
    """
    successor, why = RETIRED_ENVS.get(retired_id, ("hdamoe_env/HdMoE-v1", "it was retired"))
    raise ConfigError(f"{retired_id or 'this env id'} is retired: {why}; use "
                      f"gymnasium.make({successor!r}) (docs/ENV.md, 'Versions')")

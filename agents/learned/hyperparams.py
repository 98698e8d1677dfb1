"""Hyperparameters of the learned policies: RL-Zoo style dataclasses and their YAML files.

:class:`PPOHyperparams`, :class:`MaskablePPOHyperparams` and :class:`A2CHyperparams`
(``HYPERPARAMS[algo]``) hold every field of an algorithm, sized for ~10⁴–10⁵ steps on the
analytic twin; :func:`load_hyperparams` reads a section of an RL Zoo style hyperparameter file
(``hyperparams/<algo>.yml`` of rl-zoo3; PyYAML imported lazily, the ``rl`` extra) into validated
overrides and run settings (:class:`HyperparamsFile`). ``agents.learned.train.train`` builds the
SB3 model from them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from agents.learned.policy import ALGORITHMS, algo_key
from hdamoe_env.config.errors import ConfigError, DependencyNotInstalled

__all__ = [
    "HYPERPARAMS",
    "HYPERPARAM_FILE_KEYS",
    "A2CHyperparams",
    "HyperparamsFile",
    "MaskablePPOHyperparams",
    "PPOHyperparams",
    "load_hyperparams",
]


# ------------------------------------------------------------------------- hyperparameters
@dataclass(frozen=True)
class PPOHyperparams:
    """PPO hyperparameters (RL-Zoo style; sized for ~10⁴–10⁵ steps on the analytic twin).

    The defaults are sized for the batched vector env (``hdamoe train``'s default 32 copies,
    docs/results/throughput.md): 4 epochs of minibatches of 256 over 1,024-step rollouts. The
    earlier defaults (one env, n_steps 256, batch 64, 10 epochs, ``policy_input="full"``) are
    the section ``maskable-ppo-earlier`` of ``hyperparams/maskable-ppo.yml``.

    Attributes:
        n_steps: Rollout steps per env before an update (n_steps · n_envs per update: 1,024
            with ``hdamoe train``'s default 32 batched copies, about 10 episodes of
            DeepSeek-V2-Lite at 4 decode steps × 26 layers). Earlier default: 256 with one env.
        batch_size: Minibatch size of the SGD epochs (earlier default 64; a rollout smaller
            than it is one minibatch).
        n_epochs: SGD passes over each rollout (earlier default 10).
        learning_rate: Adam step size.
        gamma: Discount per env step (one MoE layer); 0.99 ≈ a 100-layer horizon, about one
            decode step of a 26-layer model × 4.
        gae_lambda: GAE λ.
        clip_range: PPO ratio clip.
        ent_coef: Entropy bonus (keeps the many slot heads exploring).
        vf_coef: Value-loss weight.
        max_grad_norm: Gradient clip.
        net_arch: Hidden layers of the policy and value MLPs (shared extractor flattens the Dict).
        policy_input: ``"compact"`` (the ``replicas`` map summarised as E + D values,
            ``agents.learned.nets``) or ``"full"`` (every observation value, SB3's flattening).
    """

    n_steps: int = 32
    batch_size: int = 256
    n_epochs: int = 4
    learning_rate: float = 3e-4
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_range: float = 0.2
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    net_arch: tuple[int, ...] = (64, 64)
    policy_input: str = "compact"


@dataclass(frozen=True)
class MaskablePPOHyperparams(PPOHyperparams):
    """MaskablePPO hyperparameters: PPO's, with a smaller entropy bonus (masks already prune)."""

    ent_coef: float = 0.005


@dataclass(frozen=True)
class A2CHyperparams:
    """A2C hyperparameters (RL-Zoo defaults for small discrete tasks).

    Attributes:
        n_steps: Rollout steps per env before an update.
        learning_rate: RMSprop step size.
        gamma: Discount per env step.
        gae_lambda: GAE λ (1.0 = plain n-step returns).
        ent_coef: Entropy bonus.
        vf_coef: Value-loss weight.
        max_grad_norm: Gradient clip.
        net_arch: Hidden layers of the policy and value MLPs.
        policy_input: ``"compact"`` or ``"full"`` (as :class:`PPOHyperparams`).
    """

    n_steps: int = 8
    learning_rate: float = 7e-4
    gamma: float = 0.99
    gae_lambda: float = 1.0
    ent_coef: float = 0.01
    vf_coef: float = 0.5
    max_grad_norm: float = 0.5
    net_arch: tuple[int, ...] = (64, 64)
    policy_input: str = "compact"


HYPERPARAMS: dict[str, type[Any]] = {"ppo": PPOHyperparams,
                                     "maskable-ppo": MaskablePPOHyperparams,
                                     "a2c": A2CHyperparams}
assert tuple(HYPERPARAMS) == ALGORITHMS, "agents.learned.policy.ALGORITHMS names the same algorithms"


#: Keys of an RL Zoo style hyperparameter file that are not dataclass fields: the run settings
#: they map onto (``n_envs``, ``n_timesteps``), the policy class (only ``MultiInputPolicy``),
#: observation normalisation (a bool or the zoo's ``"{'norm_obs': True, ...}"`` string; reward
#: normalisation is not supported), ``policy_kwargs`` (only ``net_arch``) and ``env_wrapper``
#: (the zoo's list of wrapper classes; see :data:`ENV_WRAPPERS`).
HYPERPARAM_FILE_KEYS: tuple[str, ...] = ("n_envs", "n_timesteps", "policy", "normalize",
                                         "policy_kwargs", "env_wrapper")
#: ``env_wrapper`` entries understood by ``hdamoe train`` -> the training setting each one is.
#: The training env always flattens the replica map (``FlattenReplicasWrapper`` is accepted and
#: changes nothing); ``RankedBroadcastWrapper`` (keyword ``num_candidates``) is
#: ``--action-mode ranked --candidates K``; ``ResidualHDAWrapper`` is ``--action-mode
#: residual``; no action wrapper is ``--action-mode full``.
ENV_WRAPPERS: dict[str, str | None] = {
    "hdamoe_env.env.wrappers.FlattenReplicasWrapper": None,
    "hdamoe_env.env.wrappers.RankedBroadcastWrapper": "ranked",
    "agents.wrappers.ResidualHDAWrapper": "residual",
}
#: Section names accepted for an algorithm (ours and rl-zoo3's ``--algo`` names).
_ALGO_SECTIONS: dict[str, tuple[str, ...]] = {"ppo": ("ppo",),
                                              "maskable-ppo": ("maskable-ppo", "ppo_mask"),
                                              "a2c": ("a2c",)}


@dataclass(frozen=True)
class HyperparamsFile:
    """The settings of one section of an RL Zoo style hyperparameter file.

    Attributes:
        path: The file read.
        section: The top-level key the settings came from (an algorithm or env id).
        hyperparams: Overrides of the algorithm's dataclass (``HYPERPARAMS[algo]``), validated.
        n_envs: Env copies (``n_envs`` of the file), None if absent.
        n_timesteps: Total env steps (``n_timesteps``), None if absent.
        normalize_obs: Observation normalisation (``normalize``), None if absent.
        action_mode: The action design of ``env_wrapper`` (``"ranked"``, ``"residual"`` or
            ``"full"``), None if the section has no ``env_wrapper``.
        num_candidates: K of a ``RankedBroadcastWrapper`` entry, None if not given.
    """

    path: str
    section: str
    hyperparams: dict[str, Any]
    n_envs: int | None = None
    n_timesteps: int | None = None
    normalize_obs: bool | None = None
    action_mode: str | None = None
    num_candidates: int | None = None


def _env_sections() -> tuple[str, ...]:
    """Every registered env id, with and without the ``hdamoe_env/`` prefix (zoo sections)."""
    import hdamoe_env

    ids = list(hdamoe_env.REGISTERED_ENVS)
    return tuple(dict.fromkeys([name for i in ids for name in (i, i.split("/", 1)[-1])]))


def _env_wrappers(value: Any, src: str, run: dict[str, Any]) -> None:
    """Map the zoo's ``env_wrapper`` list onto ``run["action_mode"]`` / ``num_candidates``."""
    entries = value if isinstance(value, list) else [value]
    mode = "full"
    for entry in entries:
        if isinstance(entry, dict) and len(entry) == 1:
            name, kwargs = next(iter(entry.items()))
        elif isinstance(entry, str):
            name, kwargs = entry, None
        else:
            raise ConfigError(f"{src}: env_wrapper entry {entry!r}: expected \"module.Class\" "
                              "or {\"module.Class\": {keyword: value}}")
        if name not in ENV_WRAPPERS:
            raise ConfigError(f"{src}: env_wrapper {name!r} is not a training setting of "
                              f"hdamoe train; expected one of {sorted(ENV_WRAPPERS)}")
        kwargs = dict(kwargs or {})
        role = ENV_WRAPPERS[name]
        if role == "ranked":
            k = kwargs.pop("num_candidates", None)
            if k is not None:
                if not isinstance(k, int) or isinstance(k, bool) or k < 1:
                    raise ConfigError(f"{src}: {name} num_candidates={k!r}: expected a "
                                      "positive integer")
                run["num_candidates"] = k
        if kwargs:
            raise ConfigError(f"{src}: env_wrapper {name}: unsupported keywords "
                              f"{sorted(kwargs)}")
        if role is not None:
            if mode != "full":
                raise ConfigError(f"{src}: env_wrapper has two action designs ({mode} and "
                                  f"{role}); expected at most one")
            mode = role
    run["action_mode"] = mode


def _literal(text: str, key: str, path: str) -> Any:
    """Evaluate a zoo-style Python literal such as ``dict(net_arch=[64, 64])`` without ``eval``."""
    import ast

    try:
        node = ast.parse(text.strip(), mode="eval").body
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id == "dict" and not node.args:
            return {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
        return ast.literal_eval(node)
    except (SyntaxError, ValueError) as exc:
        raise ConfigError(f"{path}: {key}={text!r} is not a literal ({exc}); expected e.g. "
                          f"{key}: \"dict(net_arch=[64, 64])\" or a YAML mapping") from None


def _file_setting(name: str, value: Any, src: str, hp: dict[str, Any],
                  run: dict[str, Any]) -> None:
    """Map one :data:`HYPERPARAM_FILE_KEYS` entry onto ``hp`` (net_arch) or ``run``."""
    if name == "env_wrapper":
        _env_wrappers(value, src, run)
    elif name in ("n_envs", "n_timesteps"):
        if isinstance(value, float) and value.is_integer():
            value = int(value)                           # the zoo writes !!float 2e5
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ConfigError(f"{src}: {name}={value!r}: expected a positive integer")
        run[name] = value
    elif name == "policy":
        if value != "MultiInputPolicy":
            raise ConfigError(f"{src}: policy={value!r}: expected 'MultiInputPolicy' (the "
                              "observation is a Dict)")
    elif name == "normalize":
        norm = _literal(value, name, src) if isinstance(value, str) else value
        if isinstance(norm, dict):
            if norm.get("norm_reward", False):
                raise ConfigError(f"{src}: normalize={value!r}: reward normalisation is not "
                                  "supported; expected norm_reward False")
            norm = bool(norm.get("norm_obs", True))
        if not isinstance(norm, bool):
            raise ConfigError(f"{src}: normalize={value!r}: expected true/false or "
                              "\"{'norm_obs': True, 'norm_reward': False}\"")
        run["normalize_obs"] = norm
    else:                                                # policy_kwargs
        kw = _literal(value, name, src) if isinstance(value, str) else value
        if not isinstance(kw, dict) or set(kw) - {"net_arch"}:
            raise ConfigError(f"{src}: policy_kwargs={value!r}: only net_arch is supported, "
                              "e.g. \"dict(net_arch=[64, 64])\"")
        if "net_arch" in kw:
            arch = kw["net_arch"]
            if not isinstance(arch, list | tuple) or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in arch):
                raise ConfigError(f"{src}: net_arch={arch!r}: expected a list of positive "
                                  "layer widths, e.g. [64, 64]")
            hp["net_arch"] = tuple(arch)


def load_hyperparams(path: str | os.PathLike[str], algo: str = "maskable-ppo",
                     section: str | None = None, env_id: str | None = None) -> HyperparamsFile:
    """Read an RL Zoo style hyperparameter file (``hyperparams/<algo>.yml`` of rl-zoo3).

    The file is a YAML mapping of sections; the section used is the first present of the
    algorithm's name (``maskable-ppo`` or rl-zoo3's ``ppo_mask``, ``ppo``, ``a2c``), then the
    run's env id (``env_id``), then any registered env id (with or without ``hdamoe_env/``) —
    RL Zoo's own layout: one file per algorithm, one section per env id. Its keys are fields of the algorithm's
    hyperparameter dataclass (``n_steps``, ``batch_size``, ``learning_rate``, ``gamma``,
    ``ent_coef``, ...) or one of :data:`HYPERPARAM_FILE_KEYS`; ``policy_kwargs`` (a mapping or
    the zoo's ``"dict(net_arch=[64, 64])"`` string) may hold only ``net_arch``. PyYAML is
    imported lazily (the ``rl`` extra).

    Args:
        path: The YAML file.
        algo: Algorithm the settings are for (selects the section and the dataclass).
        section: Use this top-level key instead of the default lookup (a file may hold several
            variants, e.g. ``maskable-ppo-residual``).
        env_id: The registered id the run corresponds to (its section comes first among the
            env sections).

    Returns:
        The section's settings, hyperparameters validated against the dataclass.

    Raises:
        ConfigError: Missing or unparsable file, no matching section, an unknown key (naming
            the allowed ones), a value of the wrong type.
        DependencyNotInstalled: PyYAML missing.
    """
    key = algo_key(algo)
    try:
        import yaml
    except ImportError as exc:
        raise DependencyNotInstalled(f"reading {path} needs PyYAML: "
                                     'pip install "hdamoe-env[rl]"') from exc
    src = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"hyperparameter file {src!r} cannot be read ({exc.strerror}); "
                          "expected an RL Zoo style YAML file, e.g. hyperparams/maskable-ppo.yml"
                          ) from None
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{src}: not valid YAML ({first})") from None
    if not isinstance(doc, dict) or not doc:
        raise ConfigError(f"{src}: expected a mapping of sections (algorithm or env id -> "
                          f"settings), got {type(doc).__name__}")
    envs = _env_sections()
    if env_id is not None:
        envs = tuple(dict.fromkeys([env_id, env_id.split("/", 1)[-1], *envs]))
    names = (section,) if section is not None else (*_ALGO_SECTIONS[key], *envs)
    section = next((n for n in names if n in doc), None)
    if section is None:
        raise ConfigError(f"{src}: no section for {key}; expected one of {list(names)}, "
                          f"found {[str(k) for k in doc]}")
    body = doc[section] or {}
    if not isinstance(body, dict):
        raise ConfigError(f"{src}: section {section!r} must be a mapping of settings, got "
                          f"{type(body).__name__}")
    cls = HYPERPARAMS[key]
    fields = [f.name for f in dataclasses.fields(cls)]
    allowed = sorted(set(fields) - {"net_arch"}) + list(HYPERPARAM_FILE_KEYS)
    hp: dict[str, Any] = {}
    run: dict[str, Any] = {}
    for name, value in body.items():
        name = str(name)
        if name in fields and name != "net_arch":
            hp[name] = value
        elif name in HYPERPARAM_FILE_KEYS:
            _file_setting(name, value, src, hp, run)
        else:
            raise ConfigError(f"{src}: unknown key {name!r} in section {section!r}; allowed: "
                              f"{', '.join(allowed)}")
    for name in ("learning_rate", "gamma", "gae_lambda", "clip_range", "ent_coef", "vf_coef",
                 "max_grad_norm"):
        if isinstance(hp.get(name), str):                # YAML 1.1 reads 3e-4 as a string
            try:
                hp[name] = float(hp[name])
            except ValueError:
                pass                                     # refused with its name just below
    check_hyperparam_types(cls(), hp)
    return HyperparamsFile(src, str(section), hp, n_envs=run.get("n_envs"),
                           n_timesteps=run.get("n_timesteps"),
                           normalize_obs=run.get("normalize_obs"),
                           action_mode=run.get("action_mode"),
                           num_candidates=run.get("num_candidates"))


def model_kwargs(hp: Any) -> dict[str, Any]:
    """Return the SB3 constructor keywords of ``hp`` (``policy_kwargs`` from ``net_arch`` and
    ``policy_input``).

    Raises:
        ConfigError: ``policy_input`` is not one of ``agents.learned.nets.POLICY_INPUTS``.
    """
    kwargs = dataclasses.asdict(hp)
    net_arch = list(kwargs.pop("net_arch"))
    policy_input = kwargs.pop("policy_input", "full")
    kwargs["policy_kwargs"] = {"net_arch": {"pi": net_arch, "vf": list(net_arch)}}
    from agents.learned.nets import POLICY_INPUTS, compact_extractor

    if policy_input not in POLICY_INPUTS:
        raise ConfigError(f"hyperparameter policy_input={policy_input!r}: expected one of "
                          f"{list(POLICY_INPUTS)}, e.g. --hp policy_input=full")
    if policy_input == "compact":
        kwargs["policy_kwargs"]["features_extractor_class"] = compact_extractor()
    return kwargs


def check_hyperparam_types(hp: Any, overrides: dict[str, Any]) -> None:
    """Refuse an override whose type differs from the field's default (``n_steps="abc"``).

    Raises:
        ConfigError: Naming the field, the value, the expected type and an example.
    """
    defaults = {f.name: getattr(type(hp)(), f.name) for f in dataclasses.fields(hp)}
    for name, value in overrides.items():
        default = defaults.get(name)
        if default is None:
            continue
        ok = True
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
            ok = ok and value > 0 if name in ("n_steps", "batch_size", "n_epochs") else ok
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool) \
                and bool(np.isfinite(value))
        elif isinstance(default, str):
            ok = isinstance(value, str)
        elif isinstance(default, tuple | list):
            ok = isinstance(value, tuple | list)
        if not ok:
            raise ConfigError(f"hyperparameter {name}={value!r}: expected a "
                              f"{'positive ' if name in ('n_steps', 'batch_size', 'n_epochs') else ''}"
                              f"{type(default).__name__} like the default {default!r}, e.g. "
                              f"--hp {name}={json.dumps(default)}")

"""``argparse`` value types of the ``hdamoe`` options: every value is checked at parse time.

Also :func:`add_run_arguments`, which generates the options of a run (model, setting, mesh,
topology, profile, batch, trace) from their one declaration, ``hdamoe_env.config.run.RUN_OPTIONS``,
and :func:`run_from_args`, which resolves them once into a ``RunSpec``; and
:func:`add_decision_arguments`, the options of the online decisions that ``hdamoe bench`` and
``hdamoe tune`` share.

Each function takes the option text and returns the parsed value or raises
``argparse.ArgumentTypeError`` with the value received, what was expected and an example, which
argparse prints as one ``hdamoe <cmd>: error: argument --x: ...`` line (exit code 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
from pathlib import Path
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hdamoe_env.config.errors import ConfigError, HdMoeError, OutputPathError
from hdamoe_env.config.limits import SEED_MAX
from hdamoe_env.config.run import RUN_OPTIONS, RunSpec, check_hardware, check_run_memory

__all__ = ["HYPERPARAM_RANGES", "add_decision_arguments", "add_run_arguments", "bounded_float",
           "bounded_int", "check_hyperparams", "check_output_options", "finite_float",
           "batch_list", "float_list", "hp_item", "int_list", "model_list", "name_list", "output_targets", "nonneg_float", "nonneg_int",
           "positive_float", "positive_int", "run_from_args", "seed_list", "setting_list"]

def _int(text: str) -> int:
    try:
        return int(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer; expected e.g. 16") from None


def _float(text: str) -> float:
    try:
        value = float(str(text).strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number; expected e.g. 2.5") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text!r} is not finite; expected a finite number")
    return value


def bounded_int(lo: int, hi: int | None = None) -> Callable[[str], int]:
    """Return a type accepting integers in ``[lo, hi]`` (``hi`` None: no upper bound)."""

    def parse(text: str) -> int:
        value = _int(text)
        if value < lo or (hi is not None and value > hi):
            bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise argparse.ArgumentTypeError(f"{value} is out of range; expected an integer "
                                             f"{bound}")
        return value

    parse.__name__ = "integer"
    return parse


positive_int = bounded_int(1)
nonneg_int = bounded_int(0)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be > 0; e.g. 10")
    return value


def nonneg_float(text: str) -> float:
    """A finite number >= 0."""
    value = _float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 0; e.g. 0 or 2.5")
    return value


def finite_float(text: str) -> float:
    """Any finite number (no ``nan``, ``inf`` or overflow such as ``1e999``)."""
    return _float(text)


def bounded_float(lo: float, hi: float, *, lo_open: bool = False,
                  hi_open: bool = False) -> Callable[[str], float]:
    """Return a type accepting finite numbers in the interval from ``lo`` to ``hi``.

    Args:
        lo: Lower end.
        hi: Upper end.
        lo_open: Exclude ``lo`` itself.
        hi_open: Exclude ``hi`` itself.
    """
    where = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"

    def parse(text: str) -> float:
        value = _float(text)
        if value < lo or value > hi or (lo_open and value == lo) or (hi_open and value == hi):
            raise argparse.ArgumentTypeError(f"{text!r} is out of range; expected a number in "
                                             f"{where}")
        return value

    parse.__name__ = "number"
    return parse


def seed_list(text: str) -> str:
    """A comma list of distinct seeds (integers in [0, 2³²−1]); kept as text."""
    int_list(text)
    items = [int(p.strip()) for p in str(text).split(",") if p.strip()]
    if any(not str(p).strip() for p in str(text).split(",")):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item; expected seeds like 0,1,2")
    for seed in items:
        if not 0 <= seed <= SEED_MAX:
            raise argparse.ArgumentTypeError(f"seed {seed} in {text!r} is outside [0, "
                                             f"{SEED_MAX}]; expected seeds like 0,1,2")
    repeated = sorted({s for s in items if items.count(s) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} repeats seed(s) {repeated}; each seed would "
                                         "run twice; give each once")
    return str(text)


def name_list(text: str) -> str:
    """A comma list of distinct non-empty names (methods, placements, models); kept as text."""
    items = [p.strip() for p in str(text).split(",")]
    if not str(text).strip() or any(not p for p in items):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty name; expected names like "
                                         "tp,ep")
    repeated = sorted({p for p in items if items.count(p) > 1})
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r} repeats {repeated}; give each name once")
    return str(text)


def _list_of(kind: str, check: Callable[[str], Any], example: str) -> Callable[[str], list[Any]]:
    """Return a type parsing a comma list, each item checked by ``check`` (a ``ConfigError``)."""

    def parse(text: str) -> list[Any]:
        name_list(text)
        out = []
        for item in (p.strip() for p in str(text).split(",")):
            try:
                out.append(check(item))
            except (HdMoeError, ValueError) as exc:
                raise argparse.ArgumentTypeError(f"{kind} {item!r} in {text!r}: {exc}; "
                                                 f"expected e.g. {example}") from None
        return out

    parse.__name__ = f"{kind} list"
    return parse


def _model(text: str) -> str:
    from hdamoe_env.config.specs import get_model

    get_model(text)
    return text


def _setting(text: str) -> str:
    from hdamoe_env.config.run import check_hardware
    from hdamoe_env.config.specs import hardware_from_setting

    check_hardware(hardware_from_setting(text, (1, 1)))
    return text


def _batch(text: str) -> int:
    from hdamoe_env.config.run import check_batch

    return check_batch(_int(text))


#: ``--models``, ``--settings``, ``--batches``: comma lists whose every item is checked.
model_list = _list_of("model", _model, "deepseek-v2-lite,mixtral-8x7b")
setting_list = _list_of("setting", _setting, "5/50,10/25")
batch_list = _list_of("batch", _batch, "32,128")


def int_list(text: str) -> str:
    """A comma list of integers (kept as text; the command splits it again)."""
    items = [p.strip() for p in str(text).split(",") if p.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r} is empty; expected integers like 0,1,2")
    for item in items:
        try:
            int(item)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{item!r} in {text!r} is not an integer; expected "
                                             "integers like 0,1,2") from None
    return str(text)


def float_list(allow_none: bool = False, positive: bool = True) -> Callable[[str], str]:
    """Return a type accepting a comma list of finite numbers (and ``none`` if allowed)."""

    def parse(text: str) -> str:
        items = [p.strip() for p in str(text).split(",") if p.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{text!r} is empty; expected numbers like 1,1.5")
        for item in items:
            if allow_none and item.lower() == "none":
                continue
            try:
                value = _float(item)
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(
                    f"{item!r} in {text!r} is not a number; expected numbers"
                    + (" or 'none'" if allow_none else "") + " like none,2,1.5") from None
            if positive and value <= 0:
                raise argparse.ArgumentTypeError(f"{item!r} in {text!r} must be > 0")
        return str(text)

    parse.__name__ = "number list"
    return parse


#: Accepted ranges of the SB3 hyperparameters a user sets (``--hp``, ``--hyperparams``):
#: name -> (low, high, low open, high open, integer). Outside them SB3 trains without error but
#: the run means nothing (gamma = 2 diverges, a negative clip range inverts the PPO ratio).
HYPERPARAM_RANGES: dict[str, tuple[float, float, bool, bool, bool]] = {
    "learning_rate": (0.0, 1.0, True, False, False),
    "gamma": (0.0, 1.0, False, False, False),
    "gae_lambda": (0.0, 1.0, False, False, False),
    "clip_range": (0.0, 10.0, True, False, False),
    "clip_range_vf": (0.0, 10.0, True, False, False),
    "ent_coef": (0.0, 10.0, False, False, False),
    "vf_coef": (0.0, 10.0, False, False, False),
    "max_grad_norm": (0.0, 1e6, True, False, False),
    "target_kl": (0.0, 10.0, True, False, False),
    "tau": (0.0, 1.0, True, False, False),
    "exploration_fraction": (0.0, 1.0, False, False, False),
    "exploration_initial_eps": (0.0, 1.0, False, False, False),
    "exploration_final_eps": (0.0, 1.0, False, False, False),
    "n_steps": (1, 2**20, False, False, True),
    "batch_size": (1, 2**20, False, False, True),
    "n_epochs": (1, 10_000, False, False, True),
    "buffer_size": (1, 2**26, False, False, True),
    "learning_starts": (0, 2**31, False, False, True),
    "train_freq": (1, 2**20, False, False, True),
    "gradient_steps": (-1, 2**20, False, False, True),
    "target_update_interval": (1, 2**31, False, False, True),
}


def _check_hp(name: str, value: Any) -> str | None:
    """Return what is wrong with hyperparameter ``name=value`` (None: fine or not ranged)."""
    if name not in HYPERPARAM_RANGES or value is None or isinstance(value, str):
        return None                            # schedules ("lin_3e-4") and unranged names
    lo, hi, lo_open, hi_open, integer = HYPERPARAM_RANGES[name]
    where = f"{'(' if lo_open else '['}{lo:g}, {hi:g}{')' if hi_open else ']'}"
    kind = "an integer" if integer else "a number"
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            integer and not isinstance(value, int)):
        return f"{name}={value!r} must be {kind} in {where}"
    if not math.isfinite(value) or value < lo or value > hi or (lo_open and value == lo) or (
            hi_open and value == hi):
        return f"{name}={value!r} is outside {where}"
    return None


def check_hyperparams(hyperparams: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``hyperparams`` when every ranged value lies in ``HYPERPARAM_RANGES``.

    Raises:
        ConfigError: A value of the wrong type or outside its range (names it and the range).
    """
    for name, value in hyperparams.items():
        problem = _check_hp(str(name), value)
        if problem:
            raise ConfigError(f"hyperparameter {problem}; e.g. gamma=0.99, clip_range=0.2, "
                              "learning_rate=3e-4")
    return dict(hyperparams)


def hp_item(text: str) -> str:
    """``NAME=VALUE`` with a JSON value (a bare word is a string); kept as text.

    Values of the names in :data:`HYPERPARAM_RANGES` must lie in their range.
    """
    name, sep, value = str(text).partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. n_steps=128")
    try:
        parsed = json.loads(value)
    except (json.JSONDecodeError, RecursionError):
        return str(text)                       # a string value (e.g. a schedule name)
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise argparse.ArgumentTypeError(f"{text!r}: value must be finite")
    problem = _check_hp(name.strip(), parsed)
    if problem:
        raise argparse.ArgumentTypeError(f"{problem}; e.g. gamma=0.99, clip_range=0.2")
    return str(text)


#: Names an ``--out`` directory's own command writes: ``--json``/``--csv`` may not land there.
_OWN_FILES = re.compile(r"^(layer_\d+\.(json|npz)|run\.json|placement.*\.npz|suite\.json|"
                        r"results\.jsonl|report\.md|learned\.json|model\.zip|"
                        r"vecnormalize\.npz|eval\.(json|md)|seeds\.(json|md)|crossover\.json|"
                        r"tuned\.json)$")


def output_targets(args: argparse.Namespace, out_kind: str | None) -> list[tuple[str, str]]:
    """Return the outputs a command writes, as ``(path, kind)`` for ``fileio.output_lock``.

    ``--json``/``--csv`` files (not ``-``), and ``--out`` as a directory or a file. A file
    inside a locked ``--out`` directory is covered by the directory's lock (a lock file of its
    own would be a stranger in the directory).
    """
    out = getattr(args, "out", None)
    root = (Path(os.path.abspath(out)) if isinstance(out, str) and out and out_kind == "dir"
            else None)
    targets = [(str(v), "file") for v in (getattr(args, o, None) for o in ("json", "csv"))
               if isinstance(v, str) and v and v != "-"
               and not (root is not None and root in Path(os.path.abspath(v)).parents)]
    if isinstance(out, str) and out and out_kind in ("dir", "file"):
        targets.append((out, out_kind))
    return targets


def check_output_options(args: argparse.Namespace, out_kind: str | None) -> None:
    """Cross-field checks of a command's output options, before any work starts.

    Refuses an empty path, ``--csv`` and ``--json`` naming the same file (one would be lost),
    and a ``--json``/``--csv`` file inside the command's own ``--out`` directory where the
    command writes its own files (a checkpoint such as ``layer_000.json`` would be
    overwritten).

    Args:
        args: Parsed arguments.
        out_kind: ``"dir"`` when ``--out`` is the command's output directory, else anything.

    Raises:
        OutputPathError: Naming the option, the path and a fix.
    """
    opts = ("json", "csv", "out", "tensorboard", "plots", "placement_dir", "cache_dir")
    for opt in opts:
        value = getattr(args, opt, None)
        if isinstance(value, str) and not value.strip():
            flag = "--" + opt.replace("_", "-")
            raise OutputPathError(f"{flag} is empty ({value!r}); give a path, e.g. {flag} "
                                  f"{'runs/out.json' if opt in ('json', 'csv') else 'runs/x'}")
    files = {opt: getattr(args, opt, None) for opt in ("json", "csv")}
    files = {k: Path(os.path.abspath(v)) for k, v in files.items() if v and v != "-"}
    if len(files) == 2 and files["json"] == files["csv"]:
        raise OutputPathError(f"--json and --csv are the same file {str(files['json'])!r}; one "
                              "would overwrite the other; give two paths")
    out = getattr(args, "out", None)
    if out_kind != "dir" or not out:
        return
    root = Path(os.path.abspath(out))
    for opt, path in files.items():
        if root in path.parents:
            rel = path.relative_to(root)
            if len(rel.parts) > 1 or _OWN_FILES.match(rel.name):
                raise OutputPathError(f"--{opt} {str(path)!r} is inside --out {out!r} where the "
                                      f"command writes its own files ({rel} would be "
                                      "overwritten or mixed with them); write it elsewhere")


def add_decision_arguments(p: argparse.ArgumentParser) -> None:
    """Add ``--fidelity``, ``--predictor`` and ``--max-broadcast`` (``hdamoe bench`` / ``tune``)."""
    from hdamoe_env.env.config import PREDICTORS

    p.add_argument("--fidelity", default="des", choices=("des", "analytic"),
                   help="latency model: des (discrete-event NoC) or analytic (calibrated twin)")
    p.add_argument("--predictor", default="noisy_oracle", choices=PREDICTORS,
                   help="next-layer expert-load predictor")
    p.add_argument("--max-broadcast", type=nonneg_int, default=8, help="pre-broadcast slots")


def _argparse_type(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """Wrap a ``ConfigError``-raising parser as an argparse type (one ``error:`` line, exit 2)."""

    def convert(text: str) -> Any:
        try:
            return parse(text)
        except HdMoeError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value").lstrip("_")
    return convert


def add_run_arguments(parser: argparse.ArgumentParser, names: Iterable[str] | None = None, *,
                      defaults: Mapping[str, Any] | None = None,
                      helps: Mapping[str, str] | None = None,
                      required: Iterable[str] = ()) -> None:
    """Add the options of a run, generated from ``RUN_OPTIONS`` (one default, one help each).

    Args:
        parser: The command's parser.
        names: Which run options (``RUN_OPTIONS`` keys), in that order (None: all).
        defaults: Per-command defaults that differ on purpose (e.g. ``None`` = "take the base
            configuration's value" in ``hdamoe train``).
        helps: Text appended to an option's help for this command.
        required: Options this command requires (no default).
    """
    required = set(required)
    for name in RUN_OPTIONS if names is None else names:
        opt = RUN_OPTIONS[name]
        kwargs: dict[str, Any] = {"dest": name, "help": opt.help + (helps or {}).get(name, "")}
        if name in required:
            kwargs["required"] = True
        else:
            kwargs["default"] = (defaults or {}).get(name, opt.default)
        if opt.parse is not None:
            kwargs["type"] = _argparse_type(opt.parse)
        if opt.choices is not None:
            kwargs["choices"] = opt.choices
        if opt.metavar is not None:
            kwargs["metavar"] = opt.metavar
        parser.add_argument(opt.flag, **kwargs)


def run_from_args(args: argparse.Namespace, *, cache: bool = False,
                  hardware_overrides: Mapping[str, Any] | None = None) -> RunSpec:
    """Resolve the run options of parsed arguments into a ``RunSpec``, once per command.

    The first call with ``cache=True`` (``hdamoe``'s memory pre-flight) keeps the run on
    ``args``; later calls return it instead of looking the names up again.

    Args:
        args: Parsed arguments (options added by :func:`add_run_arguments`; absent ones take
            their ``RUN_OPTIONS`` default).
        cache: Keep the resolved run on ``args`` for the command.
        hardware_overrides: Further ``HardwareSpec`` fields (e.g. ``hop_latency_ns``).

    Raises:
        ConfigError: An unknown name or an invalid value.
    """
    run: RunSpec | None = getattr(args, "_resolved_run", None)
    if run is None:
        names = {name: getattr(args, name) for name in RUN_OPTIONS if hasattr(args, name)}
        run = RunSpec.resolve(**names)
        if cache:
            args._resolved_run = run
    if hardware_overrides:
        hardware = check_hardware(dataclasses.replace(run.hardware, **hardware_overrides))
        run = dataclasses.replace(run, hardware=hardware)
        check_run_memory(run.model, run.hardware, run.batch)
    return run

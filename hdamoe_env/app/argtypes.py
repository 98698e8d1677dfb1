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
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from hdamoe_env.config.errors import HdMoeError
from hdamoe_env.config.run import RUN_OPTIONS, RunSpec, check_hardware, check_run_memory

__all__ = ["add_decision_arguments", "add_run_arguments", "bounded_int", "float_list", "hp_item", "int_list",
           "nonneg_float", "nonneg_int", "positive_float", "positive_int", "run_from_args"]

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


def hp_item(text: str) -> str:
    """``NAME=VALUE`` with a JSON value (a bare word is a string); kept as text."""
    name, sep, value = str(text).partition("=")
    if not sep or not name.strip().isidentifier():
        raise argparse.ArgumentTypeError(f"{text!r}: expected NAME=VALUE, e.g. n_steps=128")
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError:
        return str(text)                       # a string value (e.g. a schedule name)
    if isinstance(parsed, float) and not math.isfinite(parsed):
        raise argparse.ArgumentTypeError(f"{text!r}: value must be finite")
    return str(text)


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

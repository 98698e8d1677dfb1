"""Command-line flags shared by the subcommands: one name for one thing, old spellings for a release.

The same thing has the same flag in every ``hdamoe`` subcommand:

| flag | meaning |
|---|---|
| ``--json PATH`` | the command's machine-readable result as JSON (``-`` = stdout) |
| ``--out PATH`` | the command's output directory (or output file of ``traces gen/convert/record``) |
| ``--progress`` / ``--no-progress`` | progress bars on stderr on / off |

An older spelling that a command used to accept stays accepted for one release
(:data:`DEPRECATED_SINCE`): it does what the new flag does and prints one line
``hdamoe <sub>: note: --old is deprecated, use --new (removed after 0.2)`` on stderr
(:class:`DeprecatedAlias`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["DEPRECATED_SINCE", "REMOVED_AFTER", "DeprecatedAlias", "add_deprecated_alias",
           "add_progress_flag"]

#: Release that renamed the flags, and the release after which the old spellings go.
DEPRECATED_SINCE, REMOVED_AFTER = "0.1", "0.2"


class DeprecatedAlias(argparse.Action):
    """An old spelling of a flag: stores into the new flag's ``dest`` and prints one note.

    ``const`` (if given) is stored for a flag without a value (``nargs=0``), else the value.
    """

    def __init__(self, option_strings: Sequence[str], dest: str, *, new: str,
                 nargs: int | str | None = None, const: Any = None, **kwargs: Any) -> None:
        """Build the alias; ``new`` is the current spelling named in the note."""
        self.new = new
        super().__init__(option_strings, dest, nargs=nargs, const=const,
                         help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        """Store the value and print the deprecation note (once per parse)."""
        setattr(namespace, self.dest, self.const if self.nargs == 0 else values)
        print(f"{parser.prog}: note: {option_string} is deprecated, use {self.new} (removed "
              f"after {REMOVED_AFTER})", file=sys.stderr)


def add_deprecated_alias(p: argparse.ArgumentParser, old: str, new: str, dest: str, *,
                         const: Any = None, takes_value: bool = False) -> None:
    """Accept ``old`` as a hidden alias of ``new`` (same ``dest``) with a one-line note.

    Args:
        p: The subcommand's parser.
        old: The old spelling (``--no-held-out-...``).
        new: The new spelling shown in the note.
        dest: The ``dest`` of the new flag.
        const: Value stored by a flag without a value (``takes_value=False``).
        takes_value: The old flag takes a value (``--old VALUE``).
    """
    p.add_argument(old, action=DeprecatedAlias, dest=dest, new=new,
                   nargs=None if takes_value else 0, const=const)


def add_progress_flag(p: argparse.ArgumentParser, *, default: bool) -> None:
    """Add ``--progress`` / ``--no-progress`` (``dest="progress"``)."""
    p.add_argument("--progress", action=argparse.BooleanOptionalAction, default=default,
                   help="progress bars on stderr" + (" (default: on)" if default else
                                                     " (default: off)"))

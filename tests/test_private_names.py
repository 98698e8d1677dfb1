"""No project module uses another module's private (underscore) names.

A helper one module shares with another is part of its owner's interface: it gets a public name
and a docstring in the module that owns it (style.md R13). The scan reads every module of the
four packages with ``ast`` and fails on

* ``from X import _name`` where X is a project module (relative imports included), and
* ``m._name`` where ``m`` is a name bound to a project module by an import (``import a.b as m``,
  ``from a import b``),

in either case for single-underscore names (dunders such as ``__version__`` are fine). Tests are
not scanned: they may reach into the code they check.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("hdamoe_env", "agents", "baselines", "traces")


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _absolute(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    if not node.level:
        return node.module or ""
    base = module.split(".")
    base = base if is_package else base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def private_uses(module: str, source: str, is_package: bool = False) -> list[str]:
    """Return one line per use of another project module's private name in ``source``."""
    tree = ast.parse(source)
    problems: list[str] = []
    bound: dict[str, str] = {}                      # local name -> project module
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PACKAGES:
                    if alias.asname:
                        bound[alias.asname] = alias.name
                    else:
                        top = alias.name.split(".")[0]
                        bound[top] = top
        elif isinstance(node, ast.ImportFrom):
            source_module = _absolute(node, module, is_package)
            if source_module.split(".")[0] not in PACKAGES:
                continue
            for alias in node.names:
                full = f"{source_module}.{alias.name}"
                if _is_module(full):
                    bound[alias.asname or alias.name] = full
                elif _is_private(alias.name) and source_module != module:
                    problems.append(f"{module}:{node.lineno} imports {alias.name} from "
                                    f"{source_module}")
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and _is_private(node.attr)
                and isinstance(node.value, ast.Name) and node.value.id in bound
                and bound[node.value.id] != module):
            problems.append(f"{module}:{node.lineno} uses {bound[node.value.id]}.{node.attr}")
    return problems


def test_no_module_uses_another_modules_private_names():
    problems = []
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            problems += private_uses(_module_name(path), path.read_text(),
                                     path.name == "__init__.py")
    assert not problems, ("give shared helpers a public name (and a docstring) in the module "
                          "that owns them:\n" + "\n".join(problems))


def test_the_scan_reports_private_imports_and_attributes():
    source = ("from hdamoe_env.noc.des import simulate_messages, _hidden\n"
              "from .perf import _batch\n"
              "from hdamoe_env.decisions import gating\n"
              "import hdamoe_env.noc.linksim as ls\n"
              "import numpy as np\n"
              "x = gating._prepared_arrays, ls._phase_codes, np._NoValue, gating.__doc__\n")
    found = private_uses("hdamoe_env.cost.nonmoe", source)
    assert len(found) == 4, found
    assert any("_hidden from hdamoe_env.noc.des" in p for p in found)
    assert any("_batch from hdamoe_env.cost.perf" in p for p in found)
    assert any("hdamoe_env.decisions.gating._prepared_arrays" in p for p in found)
    assert any("hdamoe_env.noc.linksim._phase_codes" in p for p in found)


def test_a_module_may_use_its_own_private_names():
    source = "from hdamoe_env.cost import perf\nfrom hdamoe_env.cost.perf import _nodes\n"
    assert private_uses("hdamoe_env.cost.perf", source) == []

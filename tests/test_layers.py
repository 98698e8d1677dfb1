"""One-way imports between the sub-packages, read from their own ``__init__`` docstrings.

Every package of the project (``traces``, ``hdamoe_env`` and each of their sub-packages, ``agents``,
``baselines`` …) is a *room*. Its ``__init__`` docstring ends with a line ``May import: …`` naming
the rooms its modules may import (``nothing`` or ``everything`` are allowed words). A module
belongs to the innermost room that contains it. The tests below read those tables and fail on:

* an import of a room that is not in the importer's table (an upward or sideways arrow);
* a circle between rooms, in the tables or in the code, and a circle between modules;
* any import of the application layer (``hdamoe_env.app``) from outside it;
* a heavy third-party import at module level below the env.

Every import counts, those inside functions included: a lazy import saves load time, it does
not excuse an upward arrow.
"""

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("traces", "hdamoe_env", "agents", "baselines")
HEAVY = ("gymnasium", "torch", "stable_baselines3", "sb3_contrib", "pulp", "skopt", "highspy",
         "scipy", "tensorboard", "tensorboardX", "matplotlib", "transformers", "ray", "tqdm")
#: Rooms whose modules may not import a heavy package at module level (the simulator core).
LIGHT_ROOMS = ("traces", "hdamoe_env.config", "hdamoe_env.noc", "hdamoe_env.cost",
               "hdamoe_env.decisions", "hdamoe_env.sim")
_TABLE = re.compile(r"^May import:(?P<names>.*?)(?:\n\s*\n|\Z)", re.M | re.S)


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def _all_imports(tree: ast.Module, module: str, is_package: bool):
    """Yield (absolute module name, is_module_level) for every import in the tree."""
    top_level = {id(node) for node in tree.body}
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                prefix = ".".join(base)
                mod = f"{prefix}.{node.module}" if node.module else prefix
            else:
                mod = node.module or ""
            # `from pkg import sub` imports the submodule pkg.sub when it is one; the package
            # itself counts only when a name is taken from it
            subs = [f"{mod}.{alias.name}" for alias in node.names
                    if _is_module(f"{mod}.{alias.name}")]
            names = subs + ([mod] if len(subs) < len(node.names) else [])
        for name in names:
            yield name, id(node) in top_level


# ------------------------------------------------------------------------------------ the tables
def room_tables() -> dict[str, set[str] | None]:
    """Return room -> the rooms it may import (None = everything), read from the docstrings.

    Raises:
        AssertionError: A package whose docstring has no ``May import:`` line.
    """
    tables: dict[str, set[str] | None] = {}
    for init in sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("__init__.py")):
        room = _module_name(init)
        doc = ast.get_docstring(ast.parse(init.read_text())) or ""
        match = _TABLE.search(doc)
        assert match, f"{init.relative_to(ROOT)}: the docstring needs a 'May import: ...' line"
        text = re.sub(r"\([^)]*\)", "", match.group("names")).replace("\n", " ").strip()
        if text.startswith("everything"):
            tables[room] = None
        elif text.startswith("nothing"):
            tables[room] = set()
        else:
            tables[room] = {name.strip() for name in text.split(",") if name.strip()}
    return tables


def room_of(module: str, rooms) -> str:
    """Return the innermost room that contains ``module``."""
    best = ""
    for room in rooms:
        if (module == room or module.startswith(room + ".")) and len(room) > len(best):
            best = room
    return best


def import_problems(module: str, source: str, is_package: bool, tables) -> list[str]:
    """Return one line per import of ``module``'s source that its room's table forbids."""
    own = room_of(module, tables)
    allowed = tables[own]
    problems = []
    for imported, _ in _all_imports(ast.parse(source), module, is_package):
        if imported.split(".")[0] not in PACKAGES:
            continue
        other = room_of(imported, tables)
        if other == own or allowed is None or other in allowed:
            continue
        problems.append(f"{module} (room {own}) imports {imported} (room {other}); "
                        f"{own} may import only {sorted(allowed) or 'nothing'}")
    return problems


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return cycles


# ------------------------------------------------------------------------------------ the tests
def test_every_room_declares_its_imports_and_names_real_rooms():
    tables = room_tables()
    assert {"hdamoe_env.config", "hdamoe_env.noc", "hdamoe_env.cost", "hdamoe_env.decisions",
            "hdamoe_env.sim", "hdamoe_env.env", "hdamoe_env.app"} <= set(tables)
    unknown = {f"{room}: {name}" for room, names in tables.items() for name in names or ()
               if name not in tables}
    assert not unknown, f"tables name rooms that do not exist: {sorted(unknown)}"


def test_no_import_against_the_tables():
    tables = room_tables()
    problems = []
    for path in _sources():
        problems += import_problems(_module_name(path), path.read_text(),
                                    path.name == "__init__.py", tables)
    assert not problems, "\n".join(problems)


def test_tables_and_code_have_no_circle_between_rooms():
    tables = room_tables()
    declared = {room: set(names) for room, names in tables.items() if names is not None}
    assert not _cycles(declared), _cycles(declared)
    actual: dict[str, set[str]] = {}
    for path in _sources():
        mod = _module_name(path)
        for imported, _ in _all_imports(ast.parse(path.read_text()), mod,
                                        path.name == "__init__.py"):
            if imported.split(".")[0] in PACKAGES:
                a, b = room_of(mod, tables), room_of(imported, tables)
                if a != b:
                    actual.setdefault(a, set()).add(b)
    assert not _cycles(actual), _cycles(actual)


def test_an_added_upward_import_is_reported():
    """A lazy import of the simulator from the NoC, added to a real module, fails the check."""
    tables = room_tables()
    victim = ROOT / "hdamoe_env" / "noc" / "des.py"
    source = victim.read_text()
    assert not import_problems("hdamoe_env.noc.des", source, False, tables)
    source += ("\n\ndef _upward():  # added by the test\n"
               "    from hdamoe_env.sim import simulator  # noqa: F401\n")
    problems = import_problems("hdamoe_env.noc.des", source, False, tables)
    assert len(problems) == 1 and "hdamoe_env.sim.simulator" in problems[0]


def test_an_added_circle_between_rooms_is_reported():
    tables = room_tables()
    declared = {room: set(names) for room, names in tables.items() if names is not None}
    declared["hdamoe_env.config"] = declared["hdamoe_env.config"] | {"hdamoe_env.env"}
    assert any("hdamoe_env.config" in cycle for cycle in _cycles(declared))


def test_siblings_agents_and_baselines_do_not_import_each_other():
    tables = room_tables()
    for a, b in (("agents", "baselines"), ("baselines", "agents")):
        for room, names in tables.items():
            if room.split(".")[0] == a:
                assert names is not None and not any(n.split(".")[0] == b for n in names), room


def test_scan_resolves_relative_imports():
    tree = ast.parse("from .bench import run_bench\nfrom . import records\n")
    names = [n for n, _ in _all_imports(tree, "hdamoe_env.app.cli", False)]
    assert "hdamoe_env.app.bench" in names and "hdamoe_env.app.records" in names


def test_nothing_imports_the_application_layer():
    problems = []
    for path in _sources():
        mod = _module_name(path)
        if mod.startswith("hdamoe_env.app"):
            continue
        for imported, _ in _all_imports(ast.parse(path.read_text()), mod,
                                        path.name == "__init__.py"):
            if imported == "hdamoe_env.app" or imported.startswith("hdamoe_env.app."):
                problems.append(f"{mod} imports {imported}")
    assert not problems, "\n".join(problems)


def test_no_import_circles_between_modules():
    """No two project modules import each other, directly or through a longer path."""
    graph: dict[str, set[str]] = {}
    for path in _sources():
        mod = _module_name(path)
        deps = graph.setdefault(mod, set())
        for imported, _ in _all_imports(ast.parse(path.read_text()), mod,
                                        path.name == "__init__.py"):
            # a package __init__ re-exporting its own submodules is not a circle of logic
            if (imported.split(".")[0] in PACKAGES and _is_module(imported) and imported != mod
                    and not mod.startswith(imported + ".")):
                deps.add(imported)
    cycles = _cycles(graph)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_core_has_no_heavy_module_level_imports():
    tables = room_tables()
    problems = []
    for path in _sources():
        mod = _module_name(path)
        if room_of(mod, tables) not in LIGHT_ROOMS:
            continue
        for imported, top in _all_imports(ast.parse(path.read_text()), mod,
                                          path.name == "__init__.py"):
            if top and imported.split(".")[0] in HEAVY:
                problems.append(f"{mod} imports {imported} at module level")
    assert not problems, "\n".join(problems)


def test_architecture_doc_table_matches_the_rooms():
    """docs/ARCHITECTURE.md's "Who may import whom" table says what the docstrings say."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    rows = re.findall(r"^\| `([\w.]+)` \| (.+?) \|$", text, flags=re.M)
    doc = {room: (None if cell.strip() == "everything" else
                  set() if cell.strip() == "nothing" else set(re.findall(r"`([\w.]+)`", cell)))
           for room, cell in rows}
    assert doc == room_tables()

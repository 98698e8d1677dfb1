"""One-way imports between the package layers (style.md §2), checked by an ast scan.

Every import of every module counts, those inside functions included: a lazy import saves load
time, it does not excuse an upward arrow. The layers, bottom up::

    traces  <-  simulator core (hdamoe_env, below env)  <-  env, wrappers
            <-  {agents, baselines} (siblings)  <-  hdamoe_env.app (imported by nothing)
"""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("traces", "hdamoe_env", "agents", "baselines")

# Longest prefix wins. ``hdamoe_env`` itself is the public facade of the core (re-exports).
LAYER = {"traces": 0,
         "hdamoe_env": 6, "hdamoe_env.errors": 1, "hdamoe_env.specs": 1,
         "hdamoe_env.fileio": 2, "hdamoe_env.profiles": 2,
         "hdamoe_env.topology": 3, "hdamoe_env.placement": 3,
         "hdamoe_env.des": 4, "hdamoe_env.perf": 4, "hdamoe_env.linksim": 4,
         "hdamoe_env.collectives": 4, "hdamoe_env.nonmoe": 4, "hdamoe_env.prebroadcast": 4,
         "hdamoe_env.sources": 2, "hdamoe_env.quality": 2, "hdamoe_env.gating": 5,
         "hdamoe_env.evaluator": 5, "hdamoe_env.scheduling": 5,
         "hdamoe_env.calibrate": 6, "hdamoe_env.simulator": 6,
         "hdamoe_env.env_config": 6, "hdamoe_env.actions": 6,
         "hdamoe_env.env": 7, "hdamoe_env.wrappers": 7,
         "baselines": 8, "agents": 8, "agents.tuned": 8,
         "hdamoe_env.app": 9, "hdamoe_env.app.tune": 9}
HEAVY = ("gymnasium", "torch", "stable_baselines3", "sb3_contrib", "pulp", "skopt", "highspy",
         "scipy", "tensorboard", "tensorboardX", "matplotlib", "transformers", "ray", "tqdm")


def _layer_of(module: str) -> int | None:
    best = None
    for name, layer in LAYER.items():
        if module == name or module.startswith(name + "."):
            if best is None or len(name) > len(best[0]):
                best = (name, layer)
    return None if best is None else best[1]


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


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


def _is_module(name: str) -> bool:
    path = ROOT.joinpath(*name.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _sources():
    for pkg in PACKAGES:
        yield from sorted((ROOT / pkg).rglob("*.py"))


def upward_imports(root: Path = ROOT) -> list[str]:
    """Return one line per import that points up the layer order or across the siblings."""
    problems = []
    for path in _sources() if root == ROOT else sorted(root.rglob("*.py")):
        mod = _module_name(path)
        own = _layer_of(mod)
        if own is None:
            continue
        tree = ast.parse(path.read_text())
        for imported, _ in _all_imports(tree, mod, path.name == "__init__.py"):
            if imported.split(".")[0] not in PACKAGES:
                continue
            other = _layer_of(imported)
            if other is not None and other > own:
                problems.append(f"{mod} (layer {own}) imports {imported} (layer {other})")
            for a, b in (("agents", "baselines"), ("baselines", "agents")):
                if mod.split(".")[0] == a and imported.split(".")[0] == b:
                    problems.append(f"{mod} imports {imported}: agents and baselines are "
                                    "siblings")
    return problems


def test_no_upward_imports():
    problems = upward_imports()
    assert not problems, "\n".join(problems)


def test_every_module_has_a_layer():
    missing = [_module_name(p) for p in _sources() if _layer_of(_module_name(p)) is None]
    assert not missing, f"modules without a layer in LAYER: {missing}"


def test_scan_sees_function_level_upward_import(tmp_path, monkeypatch):
    """A deliberately added upward import inside a function is reported (the scan is not blind)."""
    victim = ROOT / "hdamoe_env" / "placement.py"
    src = victim.read_text() + ("\n\ndef _upward():  # added by the test\n"
                                "    from hdamoe_env.app import bench  # noqa: F401\n")
    tree = ast.parse(src)
    found = [(name, top) for name, top in _all_imports(tree, "hdamoe_env.placement", False)
             if name.startswith("hdamoe_env.app")]
    assert found and not any(top for _, top in found)
    assert _layer_of(found[0][0]) > _layer_of("hdamoe_env.placement")


def test_scan_resolves_relative_imports():
    tree = ast.parse("from .bench import run_bench\nfrom . import records\n")
    names = [n for n, _ in _all_imports(tree, "hdamoe_env.app.cli", False)]
    assert "hdamoe_env.app.bench" in names


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
            if imported.split(".")[0] in PACKAGES and _is_module(imported) and imported != mod:
                deps.add(imported)
    # a package __init__ re-exporting its own submodules is not a circle of logic
    def edges(mod: str) -> set[str]:
        return {d for d in graph.get(mod, ()) if not mod.startswith(d + ".")}

    state: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(node: str) -> None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(edges(node)):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


@pytest.mark.parametrize("pkg", ["traces", "hdamoe_env"])
def test_core_has_no_heavy_module_level_imports(pkg):
    problems = []
    for path in (ROOT / pkg).rglob("*.py"):
        mod = _module_name(path)
        own = _layer_of(mod)
        if own is None or own >= 7:       # env may import gymnasium; app layer imports lazily
            continue
        if mod == "hdamoe_env":           # registers the env id with gymnasium (string entry)
            continue
        for imported, top in _all_imports(ast.parse(path.read_text()), mod,
                                          path.name == "__init__.py"):
            if top and imported.split(".")[0] in HEAVY:
                problems.append(f"{mod} imports {imported} at module level")
    assert not problems, "\n".join(problems)

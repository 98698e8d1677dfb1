"""One-way imports between the package layers (style.md §2), checked by an ast scan."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LAYER = {"traces": 0, "hdamoe_env.errors": 1, "hdamoe_env.specs": 1, "hdamoe_env.fileio": 2,
         "hdamoe_env.sources": 2, "hdamoe_env.profiles": 2,
         "hdamoe_env.topology": 3, "hdamoe_env.placement": 3, "hdamoe_env.perf": 4,
         "hdamoe_env.des": 4, "hdamoe_env.linksim": 4,
         "hdamoe_env.collectives": 4, "hdamoe_env.calibrate": 5, "hdamoe_env.gating": 5,
         "hdamoe_env.scheduling": 5, "hdamoe_env.evaluator": 5,
         "hdamoe_env.simulator": 6, "hdamoe_env.env_config": 6,
         "hdamoe_env.env": 7, "baselines": 8, "agents": 8, "hdamoe_env.bench": 9,
         "hdamoe_env.tb": 9, "hdamoe_env.cli": 9, "hdamoe_env.simbench": 9,
         "hdamoe_env.record_cli": 9,
         "hdamoe_env.plots": 9}
HEAVY = ("gymnasium", "torch", "stable_baselines3", "sb3_contrib", "pulp", "skopt", "highspy",
         "scipy", "tensorboard", "tensorboardX", "matplotlib", "transformers")


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


def _top_level_imports(tree: ast.Module):
    for node in tree.body:
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            yield node.module


def _sources():
    for pkg in ("traces", "hdamoe_env", "agents", "baselines"):
        yield from (ROOT / pkg).rglob("*.py")


def test_no_upward_imports():
    problems = []
    for path in _sources():
        mod = _module_name(path)
        own = _layer_of(mod)
        if own is None:
            continue
        for imported in _top_level_imports(ast.parse(path.read_text())):
            other = _layer_of(imported)
            if other is not None and other > own:
                problems.append(f"{mod} (layer {own}) imports {imported} (layer {other})")
            if mod.startswith("agents") and imported.startswith("baselines"):
                problems.append(f"{mod} imports {imported}: agents and baselines are siblings")
            if mod.startswith("baselines") and imported.startswith("agents"):
                problems.append(f"{mod} imports {imported}: agents and baselines are siblings")
    assert not problems, "\n".join(problems)


def test_core_has_no_heavy_module_level_imports():
    problems = []
    for path in _sources():
        mod = _module_name(path)
        own = _layer_of(mod)
        if own is None or own >= 7:       # env may import gymnasium; app layer imports lazily
            continue
        for imported in _top_level_imports(ast.parse(path.read_text())):
            if imported.split(".")[0] in HEAVY:
                problems.append(f"{mod} imports {imported} at module level")
    assert not problems, "\n".join(problems)

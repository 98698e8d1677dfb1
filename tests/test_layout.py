"""The repository layout: the four top-level packages resolve to this checkout (style.md §1, name
clash), and tests/ mirrors the package tree — ``tests/<package>/<sub-package>/test_<module>.py``
tests ``<package>/<sub-package>/<module>.py``, with a short list of files named after a behaviour
that spans modules instead."""

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the top-level directories tests/ mirrors (benchmarks/ holds scripts, tested by module name too)
MIRRORED = ("hdamoe_env", "agents", "baselines", "traces", "benchmarks")
# test files named after a behaviour across modules rather than after one module (paths relative
# to tests/); keep this list short: a test of one module belongs in that module's file
BEHAVIOUR_NAMED = {
    "hdamoe_env/app/test_cli_errors.py": "one-line CLI errors, exit codes, pre-flight checks",
    "baselines/test_pipeline_safety.py": "`hdamoe place` never deletes or overwrites foreign files",
    "baselines/test_tile_grid.py": "Node Balance and the hybrid produce shares on the tile grid",
}


@pytest.mark.parametrize("name", ["hdamoe_env", "agents", "baselines", "traces"])
def test_package_resolves_inside_repo(name):
    module = importlib.import_module(name)
    location = Path(module.__file__).resolve()
    assert ROOT in location.parents, (
        f"import {name!r} resolved to {location}, outside {ROOT}. 'agents', 'baselines' and "
        "'traces' are also names of unrelated PyPI distributions: use a dedicated venv and do "
        "not install those distributions next to hdamoe-env.")


def misplaced_tests(root: Path, allowed: dict[str, str]) -> list[str]:
    """Test files under ``root/tests/<dir>/`` that name no module of ``root/<dir>/``.

    Files directly in ``tests/`` are repository-level tests and are not checked.
    """
    tests = root / "tests"
    problems = []
    for path in sorted(tests.rglob("test_*.py")):
        rel = path.relative_to(tests)
        if len(rel.parts) == 1 or rel.as_posix() in allowed:
            continue
        if rel.parts[0] not in MIRRORED:
            problems.append(f"tests/{rel.as_posix()}: tests/{rel.parts[0]}/ mirrors no "
                            f"top-level directory (expected one of {', '.join(MIRRORED)})")
            continue
        module = root.joinpath(*rel.parts[:-1], path.name.removeprefix("test_"))
        if not module.is_file():
            problems.append(f"tests/{rel.as_posix()}: there is no {module.relative_to(root)}; "
                            "name the file after the module it tests (or, for a behaviour "
                            "across modules, add it to BEHAVIOUR_NAMED)")
    return problems


def test_every_test_file_names_the_module_it_tests():
    assert misplaced_tests(ROOT, BEHAVIOUR_NAMED) == []


def test_behaviour_named_files_exist_and_name_no_module():
    for rel in BEHAVIOUR_NAMED:
        path = ROOT / "tests" / rel
        assert path.is_file(), f"tests/{rel} is listed in BEHAVIOUR_NAMED but does not exist"
        module = ROOT.joinpath(*Path(rel).parts[:-1], path.name.removeprefix("test_"))
        assert not module.is_file(), f"tests/{rel} names {module.relative_to(ROOT)}: not a " \
                                     "behaviour name, drop it from BEHAVIOUR_NAMED"


def test_a_misnamed_test_file_is_reported(tmp_path):
    for name in ("hdamoe_env/noc/des.py", "traces/io.py", "tests/test_repository.py",
                 "tests/hdamoe_env/noc/test_des.py", "tests/hdamoe_env/noc/test_linksim.py",
                 "tests/hdamoe_env/test_env.py", "tests/traces/test_io.py",
                 "tests/traces/test_trace_io.py", "tests/misc/test_io.py",
                 "tests/hdamoe_env/noc/test_behaviour.py", "tests/traces/trace_helpers.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text("")
    problems = misplaced_tests(tmp_path, {"hdamoe_env/noc/test_behaviour.py": "a behaviour"})
    assert [p.split(":")[0] for p in problems] == [
        "tests/hdamoe_env/noc/test_linksim.py", "tests/hdamoe_env/test_env.py",
        "tests/misc/test_io.py", "tests/traces/test_trace_io.py"]
    assert "there is no hdamoe_env/noc/linksim.py" in problems[0]
    assert "mirrors no top-level directory" in problems[2]

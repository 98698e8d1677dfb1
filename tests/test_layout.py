"""The four top-level packages must resolve to this repository (style.md §1, name clash)."""

import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("name", ["hdamoe_env", "agents", "baselines", "traces"])
def test_package_resolves_inside_repo(name):
    module = importlib.import_module(name)
    location = Path(module.__file__).resolve()
    assert ROOT in location.parents, (
        f"import {name!r} resolved to {location}, outside {ROOT}. 'agents', 'baselines' and "
        "'traces' are also names of unrelated PyPI distributions: use a dedicated venv and do "
        "not install those distributions next to hdamoe-env.")

"""Packaging metadata: SPDX license with its file, classifiers, authors."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_license_is_spdx_with_a_license_file():
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["license"] == "MIT"                     # PEP 639 string, not {text=...}
    assert project["license-files"] == ["LICENSE"]
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
    # setuptools reads SPDX strings from 77 on; license classifiers are then an error
    req = next(r for r in meta["build-system"]["requires"] if r.startswith("setuptools"))
    assert tuple(int(x) for x in re.search(r">=\s*([\d.]+)", req).group(1).split(".")) >= (77,)
    assert not any(c.startswith("License ::") for c in project["classifiers"])


def test_descriptive_metadata():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["authors"] and project["authors"][0]["name"]
    assert "Programming Language :: Python :: 3.11" in project["classifiers"]
    assert "Typing :: Typed" in project["classifiers"]
    assert (ROOT / "hdamoe_env" / "py.typed").exists()

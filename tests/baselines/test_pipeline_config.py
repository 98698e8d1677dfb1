"""Tests of baselines.pipeline_config: layer ranges and the place configuration."""

from __future__ import annotations

import pytest

pytest.importorskip("pulp")

from baselines.pipeline_config import PlaceConfig, parse_layers
from hdamoe_env.config.errors import ConfigError


def test_parse_layers():
    assert parse_layers("0-3", 26) == (0, 1, 2, 3)
    assert parse_layers("0,2,5", 26) == (0, 2, 5)
    assert parse_layers("5,0-1", 26) == (0, 1, 5)
    assert parse_layers(None, 3) == (0, 1, 2)
    for bad in ("3-1", "x", "26", "0-30"):
        with pytest.raises(ConfigError):
            parse_layers(bad, 26)


def test_place_config_accepts_profile_objects():  # paper-model.md §4 (derived profiles)
    from hdamoe_env.config.profiles import PROFILES, get_profile

    by_name = PlaceConfig.create(model="mixtral-8x7b", conventions="paper")
    by_object = PlaceConfig.create(model="mixtral-8x7b", conventions=PROFILES["paper"])
    assert by_name.conv is PROFILES["paper"] and by_object.conv is PROFILES["paper"]
    assert by_name.to_dict() == by_object.to_dict()
    assert by_name.to_dict()["conventions"] == "paper"
    assert by_name.config_hash("t") == by_object.config_hash("t")
    derived = get_profile("paper", chunks=2)
    cfg = PlaceConfig.create(model="mixtral-8x7b", conventions=derived)
    assert cfg.conv is derived
    back = PlaceConfig.from_dict(cfg.to_dict())
    assert back.conv == derived and back.config_hash("t") == cfg.config_hash("t")
    assert cfg.config_hash("t") != by_name.config_hash("t")


def test_objective_enters_the_hash_only_when_not_latency():
    """Latency placements keep their hash (cache key); energy/EDP ones get their own."""
    base = PlaceConfig.create(model="mixtral-8x7b")
    lat = PlaceConfig.create(model="mixtral-8x7b", objective="latency")
    assert "objective" not in lat.to_dict() and lat.config_hash("t") == base.config_hash("t")
    hashes = {base.config_hash("t")}
    for obj in ("energy", "edp"):
        cfg = PlaceConfig.create(model="mixtral-8x7b", objective=obj)
        assert cfg.to_dict()["objective"] == obj
        assert PlaceConfig.from_dict(cfg.to_dict()).objective == obj
        hashes.add(cfg.config_hash("t"))
    assert len(hashes) == 3
    with pytest.raises(ConfigError, match="objective='power'"):
        PlaceConfig.create(model="mixtral-8x7b", objective="power")
    with pytest.raises(ConfigError, match="needs a simulated Link-Balance objective"):
        PlaceConfig.create(model="mixtral-8x7b", objective="energy", lb_objective="mst")

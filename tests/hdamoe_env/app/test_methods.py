"""Tests of hdamoe_env.app.methods: parsing the bench method names (placements, agents, the
matched-quality ``@qNN`` and gating-scale ``@sX`` suffixes).
"""

from __future__ import annotations

import pytest

from hdamoe_env.app.methods import parse_method
from hdamoe_env.config.errors import ConfigError


def test_parse_method():
    assert parse_method("hd-moe").placement == "node_link"
    assert (parse_method("tp-tiled").placement, parse_method("tp_tiled").agent) == (
        "tp_tiled", None)
    assert parse_method("hda_moe").agent == "hda-moe"
    spec = parse_method("agent:greedy-prebroadcast@ep")
    assert (spec.placement, spec.agent) == ("ep", "greedy-prebroadcast")
    assert parse_method("agent:runs/ppo.zip").agent == "runs/ppo.zip"
    with pytest.raises(ConfigError, match="did you mean 'hybrid'"):
        parse_method("hybird")
    with pytest.raises(ConfigError):
        parse_method("agent:noop@ring")


def test_parse_matched_and_scaled_methods():
    q = parse_method("hda-moe@q99")
    assert (q.name, q.placement, q.agent, q.quality_target) == (
        "hda-moe@q99", "node_link", "hda-moe", 0.99)
    assert parse_method("hda_moe@q95").quality_target == 0.95
    assert parse_method("hda-moe@q99.5").quality_target == pytest.approx(0.995)
    s = parse_method("hda-moe@s0.25")
    assert s.gating_scale == 0.25 and s.quality_target is None


@pytest.mark.parametrize("text", ["hda-moe@q150", "hda-moe@qx", "hda-moe@q0", "hda-moe@q",
                                  "hda-moe@s-1", "hda-moe@z9"])
def test_parse_rejects_bad_suffixes_in_one_line(text):
    with pytest.raises(ConfigError) as info:
        parse_method(text)
    msg = str(info.value)
    assert "\n" not in msg and repr(text) in msg and "hda-moe@qNN" in msg

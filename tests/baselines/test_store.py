"""Tests of baselines.store: the placement store resolves a method name (here EPLB) to a placement
that fits memory and keeps it in memory.
"""

from __future__ import annotations

from baselines.store import PlacementStore, StoreConfig
from hdamoe_env.config.profiles import get_profile
from hdamoe_env.sim.placement import check_memory


def test_store_resolves_eplb(nb_model, hw22, make_trace):
    trace = make_trace(2, 4, 2, 200)
    store = PlacementStore(StoreConfig.create(model=nb_model, mesh="2x2", setting="1/1",
                                       eplb_rho_mem=2.0), trace)
    pl, artifact = store.get("eplb")
    assert artifact is None and pl.method == "eplb"
    assert (pl.copies().sum(axis=1) == 8).all()               # D·S = 4·2 physical experts
    check_memory(pl, nb_model, hw22, get_profile("faithful"), rho_mem=2.0)
    assert store.get("eplb")[0] is pl                         # kept in memory

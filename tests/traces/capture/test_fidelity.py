"""Tests of traces.capture.fidelity: expert outputs rebuild the MoE block, zero gating is the
identity and real gating changes routing (KL, perplexity, top-1), substitutability shapes.

Uses a randomly initialised tiny Mixtral-config model (no download, no training).
"""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="the [record] extra (torch) is not installed")
transformers = pytest.importorskip(
    "transformers", reason="the [record] extra (transformers) is not installed")

from traces.capture import fidelity
from traces.capture import record
from tests.traces.capture.random_model import PROMPTS  # noqa: E402

torch.set_num_threads(1)


def test_expert_output_reconstructs_block(model, tok):
    ids = torch.tensor([tok.encode(PROMPTS[1])])
    block = model.model.layers[1].mlp
    seen = {}
    h1 = block.gate.register_forward_hook(lambda m, a, o: seen.update(x=a[0], o=o))
    h2 = block.register_forward_hook(lambda m, a, o: seen.update(y=o))
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
        _, w, idx = seen["o"]
        x = seen["x"].reshape(-1, 32)
        y = torch.zeros_like(x)
        for slot in range(idx.shape[1]):
            for e in range(8):
                rows = idx[:, slot] == e
                if rows.any():
                    y[rows] += w[rows, slot, None] * fidelity.expert_output(block.experts, e,
                                                                            x[rows])
    h1.remove()
    h2.remove()
    torch.testing.assert_close(y, seen["y"].reshape(-1, 32), rtol=1e-5, atol=1e-6)


def test_zero_gating_is_identity_and_gating_changes(model, tok):
    from hdamoe_env.app.model_gating import GatingSetup

    seqs = [tok.encode(p * 3)[:64] for p in PROMPTS]
    adapter = record.resolve_adapter(model)
    setup = GatingSetup.for_model(8, 2, 3, placement="ep", seed=0)
    base = fidelity.run_reference(model, adapter, seqs)
    zero = fidelity.routing_impact(model, adapter, seqs, setup.policy(0.0, batch=16),
                                   reference=base)
    assert zero.kl == 0.0 and zero.ppl_ratio == 1.0 and zero.top1_retention == 1.0
    assert zero.top1_agreement == 100.0 and zero.rms_shift_pp == 0.0
    np.testing.assert_array_equal(zero.gated_ids, base.orig_ids)
    strong = fidelity.routing_impact(model, adapter, seqs, setup.policy(1.0, batch=16),
                                     reference=base)
    assert strong.changed_token_ratio > 0 and strong.kl > 0
    lat = setup.simulate(base.orig_ids, strong.gated_ids, batch=16)
    assert lat["sim_steps"] == 8 and lat["tbt_gated_us"] > 0
    cache = fidelity.cache_prior_policy(base.orig_ids, base.scores, lam=0.5)
    cp = fidelity.routing_impact(model, adapter, seqs, cache, reference=base)
    assert cp.top1_retention == 1.0


def test_substitutability_shapes(model, tok):
    seqs = [tok.encode(p) for p in PROMPTS]
    sub = fidelity.substitutability(model, record.resolve_adapter(model), seqs, num_tokens=8)
    assert sub.matrix.shape == (2, 2) and sub.per_layer.shape == (3, 2, 2)
    assert np.all(np.abs(sub.matrix) <= 1 + 1e-9)
    assert -1 <= sub.control_random_sum <= 1 and -1 <= sub.control_replace_random <= 1

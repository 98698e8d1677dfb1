"""A randomly initialised tiny Mixtral-config model for the capture tests (no download, no training)."""

from __future__ import annotations

from typing import Any

#: Two short Python prompts the capture tests record, gate and score.
PROMPTS = ["def add(a, b):\n    return a + b\n", "import os\nprint(os.getcwd())"]


def random_model(layers: int = 3, seed: int = 0) -> Any:
    """Return a tiny ``MixtralForCausalLM`` with seeded weights and well-spread router scores."""
    import torch
    import transformers

    from traces.capture.tiny_model import TinyModelSpec, tiny_config

    spec = TinyModelSpec(hidden_size=32, intermediate_size=48, num_layers=layers, num_heads=2,
                         num_kv_heads=1, max_positions=256)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = transformers.MixtralForCausalLM(tiny_config(spec))
        gen = torch.Generator().manual_seed(seed)
        for module in model.modules():   # spread the router scores: no near-ties
            if type(module).__name__ == "MixtralTopKRouter":
                module.weight.data = torch.randn(module.weight.shape, generator=gen)
    model.eval()
    return model

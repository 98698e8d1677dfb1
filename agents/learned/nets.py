"""Policy networks of the learned agents: a compact policy input and a fast masked head.

Two pieces that make a MaskablePPO update and a rollout forward pass cheap without changing
what the policy can express (docs/results/throughput.md, "Training"):

* :func:`compact_extractor` (``policy_input="compact"``): the ``replicas`` observation
  ([E·D] shares of every expert's weights per node, 2,048 of the 2,250 values on
  DeepSeek-V2-Lite 4×8) enters the MLPs as E + D values — per expert its largest share on
  one node, per node the sum of the shares it holds — and every other key as is. The layer's
  placement is fixed during training (the ``layer`` feature names it), so the full map only
  multiplied the first layer's width by ~8.5 (``policy_input="full"``: SB3's flattening, the
  earlier behaviour).
* :func:`fast_maskable_policy`: sb3-contrib's ``MaskableMultiInputActorCriticPolicy`` with
  :func:`fast_multi_categorical` as its action distribution: every action dimension in one
  padded [B, dims, max n] tensor (one log-softmax, one gather, one multinomial draw) instead of
  one ``torch.distributions.Categorical`` per dimension, each built and re-validated again
  when the mask is applied. The same distribution (masked entries get logit −10⁸, as
  sb3-contrib's ``MaskableCategorical``); the numbers differ from sb3-contrib's only in float
  rounding and in the order the sampler consumes torch's random stream.

torch, stable-baselines3 and sb3-contrib are imported when a function here is first called
(style.md R12); the classes are built once and cached, so models saved with them load again
(SB3 pickles the class by its qualified name, which :func:`__getattr__` resolves).
"""

from __future__ import annotations

import functools
import math
from typing import Any

__all__ = ["POLICY_INPUTS", "compact_extractor", "fast_maskable_policy",
           "fast_multi_categorical"]

#: Policy inputs of the hyperparameter ``policy_input`` (module docstring).
POLICY_INPUTS: tuple[str, ...] = ("compact", "full")

#: Logit of a masked action (sb3-contrib's ``MaskableCategorical`` uses the same value).
_MASKED_LOGIT = -1e8


@functools.cache
def compact_extractor() -> type[Any]:
    """Return the features extractor of ``policy_input="compact"`` (module docstring)."""
    import torch as th
    from gymnasium import spaces
    from stable_baselines3.common.torch_layers import BaseFeaturesExtractor

    class CompactExtractor(BaseFeaturesExtractor):  # type: ignore[misc]
        """Flatten a Dict observation, ``replicas`` [E·D] summarised as E + D values."""

        def __init__(self, observation_space: spaces.Dict) -> None:
            sizes = {k: math.prod(sp.shape) for k, sp in observation_space.spaces.items()}
            self.keys = list(observation_space.spaces)
            self.num_experts = sizes.get("pred_load", 0)
            size = sum(sizes.values())
            if "replicas" in sizes and self.num_experts > 0:
                self.num_nodes = sizes["replicas"] // self.num_experts
                size += self.num_experts + self.num_nodes - sizes["replicas"]
            super().__init__(observation_space, features_dim=size)

        def forward(self, observations: dict[str, th.Tensor]) -> th.Tensor:
            parts = []
            for key in self.keys:
                x = observations[key]
                if key == "replicas" and self.num_experts > 0:
                    shares = x.reshape(x.shape[0], self.num_experts, self.num_nodes)
                    parts.append(shares.amax(dim=2))           # [B, E] largest share
                    parts.append(shares.sum(dim=1))            # [B, D] held per node
                else:
                    parts.append(x.reshape(x.shape[0], -1))
            return th.cat(parts, dim=1)

    CompactExtractor.__qualname__ = "CompactExtractor"
    CompactExtractor.__module__ = __name__
    return CompactExtractor


@functools.cache
def fast_multi_categorical() -> type[Any]:
    """Return the padded masked multi-categorical distribution (module docstring)."""
    import torch as th
    from sb3_contrib.common.maskable.distributions import MaskableMultiCategoricalDistribution

    class FastMaskableMultiCategorical(MaskableMultiCategoricalDistribution):  # type: ignore[misc]
        """Every dimension of a MultiDiscrete action in one padded tensor [B, dims, max n]."""

        def __init__(self, action_dims: list[int]) -> None:
            super().__init__(action_dims)
            dims = [int(n) for n in action_dims]
            width = max(dims)
            offsets = [sum(dims[:d]) for d in range(len(dims))]
            self._index = th.tensor([[offsets[d] + min(j, n - 1) for j in range(width)]
                                     for d, n in enumerate(dims)], dtype=th.long)
            self._valid = th.tensor([[j < n for j in range(width)] for n in dims])
            self._raw: th.Tensor | None = None
            self._mask: th.Tensor | None = None
            self._logits: th.Tensor | None = None

        def proba_distribution(self, action_logits: th.Tensor) -> Any:
            flat = action_logits.view(-1, sum(self.action_dims))
            self._raw = flat[:, self._index]                        # [B, dims, width]
            self._set(self._valid.expand_as(self._raw))
            return self

        def apply_masking(self, masks: Any) -> None:
            assert self._raw is not None, "Must set distribution parameters"
            if masks is None:
                self._set(self._valid.expand_as(self._raw))
                return
            flat = th.as_tensor(masks, dtype=th.bool).view(-1, sum(self.action_dims))
            self._set(flat[:, self._index] & self._valid)

        def _set(self, mask: th.Tensor) -> None:
            assert self._raw is not None
            logits = th.where(mask, self._raw, th.tensor(_MASKED_LOGIT, dtype=self._raw.dtype))
            self._logits = logits - logits.logsumexp(dim=-1, keepdim=True)
            self._mask = mask

        def log_prob(self, actions: th.Tensor) -> th.Tensor:
            assert self._logits is not None, "Must set distribution parameters"
            a = actions.view(-1, len(self.action_dims)).long().unsqueeze(-1)
            return self._logits.gather(2, a).squeeze(-1).sum(dim=1)

        def entropy(self) -> th.Tensor:
            assert self._logits is not None and self._mask is not None
            p_log_p = self._logits * self._logits.exp()
            return -th.where(self._mask, p_log_p, th.zeros((), dtype=p_log_p.dtype)).sum(
                dim=(1, 2))

        def sample(self) -> th.Tensor:
            assert self._logits is not None, "Must set distribution parameters"
            b, d, w = self._logits.shape
            probs = self._logits.exp().reshape(b * d, w)
            return th.multinomial(probs, 1).view(b, d)

        def mode(self) -> th.Tensor:
            assert self._logits is not None, "Must set distribution parameters"
            return self._logits.argmax(dim=2)

    FastMaskableMultiCategorical.__qualname__ = "FastMaskableMultiCategorical"
    FastMaskableMultiCategorical.__module__ = __name__
    return FastMaskableMultiCategorical


@functools.cache
def fast_maskable_policy() -> type[Any]:
    """Return ``MaskableMultiInputActorCriticPolicy`` with the fast head for MultiDiscrete."""
    from gymnasium import spaces
    from sb3_contrib.common.maskable.policies import MaskableMultiInputActorCriticPolicy

    dist_cls = fast_multi_categorical()

    class FastMaskablePolicy(MaskableMultiInputActorCriticPolicy):  # type: ignore[misc]
        """sb3-contrib's Dict-observation masked policy; MultiDiscrete actions use the padded
        distribution (other action spaces keep sb3-contrib's)."""

        def _build(self, lr_schedule: Any) -> None:
            if isinstance(self.action_space, spaces.MultiDiscrete):
                self.action_dist = dist_cls([int(n) for n in self.action_space.nvec])
            super()._build(lr_schedule)

    FastMaskablePolicy.__qualname__ = "FastMaskablePolicy"
    FastMaskablePolicy.__module__ = __name__
    return FastMaskablePolicy


_CLASSES = {"CompactExtractor": compact_extractor,
            "FastMaskableMultiCategorical": fast_multi_categorical,
            "FastMaskablePolicy": fast_maskable_policy}


def __getattr__(name: str) -> Any:
    """Resolve the lazily built classes by name (unpickling a saved model needs this)."""
    if name in _CLASSES:
        return _CLASSES[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

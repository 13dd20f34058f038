"""Random weights for the HF reference models the tests write GGUFs from: every parameter drawn
away from its init's special values, so a weight dropped or misplaced by a loader shows."""

from __future__ import annotations

from collections.abc import Callable

import torch
import transformers

# a family's own draw for a parameter: (name, parameter, z ~ N(0, 1) of its shape, the
# generator) -> its values, or None for the shared rules
Rule = Callable[[str, torch.Tensor, torch.Tensor, torch.Generator], torch.Tensor | None]


def randomize(model: transformers.PreTrainedModel, seed: int, embed_std: float,
              rule: Rule | None = None) -> transformers.PreTrainedModel:
    """`model` in float32 eval mode, each parameter in order from one generator seeded with
    `seed`: the family's `rule` first, else norm weights 1 + N(0, 0.1), the embedding
    N(0, embed_std), matrices (and any other tensor) N(0, 1/sqrt(fan_in))."""
    model = model.to(torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            z = torch.randn(p.shape, generator=g)
            own = rule(name, p, z, g) if rule is not None else None
            if own is not None:
                p.copy_(own)
            elif name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * z)
            elif name.endswith("embed_tokens.weight"):
                p.copy_(embed_std * z)
            else:
                p.copy_(z / p.shape[-1] ** 0.5)
    return model.eval()

"""The HF reference models the tests write GGUFs from: random weights, every parameter drawn
away from its init's special values, so a weight dropped or misplaced by a loader shows; and
their tensors walked layer by layer for a GGUF writer."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

import numpy as np
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


def layer_arrays(model: transformers.PreTrainedModel, global_names: dict[str, str],
                 out: dict[str, tuple[str, np.ndarray]]
                 ) -> Iterator[tuple[str, np.ndarray, str, str]]:
    """The model's tensors as contiguous f32 arrays: those `global_names` maps put in `out`
    under their GGUF names, each layer's yielded as (HF name, array, "blk.N.", its name within
    the layer); the head left out when tied; ValueError for any other name."""
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and model.config.tie_word_embeddings:
            continue
        a = np.ascontiguousarray(t.detach().float().numpy())
        if name in global_names:
            out[global_names[name]] = (name, a)
            continue
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)", name)
        if m is None:
            raise ValueError(f"{name!r} has no GGUF counterpart")
        yield name, a, f"blk.{m[1]}.", m[2]

"""The DualAR's starting weights: used by its trainer (training/dual_ar_train.py) and by the size probe that runs
random weights through the engine (training/configs.py), which must not import the trainer (it imports configs)."""

from __future__ import annotations

import math

import torch

from model.dual_ar import DualARTransformer


def init_dual_ar(model: DualARTransformer, std: float) -> None:
    """Normal(0, std) weights, residual output projections scaled by 1/√(2·layers), norms 1, biases 0."""
    depth = model.config.n_layer + model.config.n_fast_layer
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in name else 0.0)
            elif name.endswith(("attention.wo.weight", "feed_forward.w2.weight")):
                p.normal_(0.0, std / math.sqrt(2 * depth))
            else:
                p.normal_(0.0, std)

"""The optimizer part: AdamW (or SGD) over the trainable parameters and its learning-rate schedule."""

from __future__ import annotations

from typing import Any

import torch

from scale.config.schema import Config
from scale.training.schedule import lr_factor


def make_optimizer(cfg: Config, model: torch.nn.Module, max_steps: int | None = None
                   ) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (or SGD) over the trainable parameters, and the LR schedule of :mod:`scale.training.schedule` over
    ``max_steps`` optimizer steps (default ``train.max_steps``).

    The scheduler is NOT prepared: a prepared one steps ``num_processes`` times per optimizer step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    if o.name == "sgd":
        optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    steps = max_steps or cfg.train.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, o, steps))
    return optimizer, scheduler

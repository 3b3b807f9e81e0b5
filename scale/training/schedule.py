"""Learning-rate schedule as a pure function of the optimizer step. No torch.distributed.

``lr_factor(step)`` is the multiplier of ``optim.lr`` used by optimizer step ``step`` (0-based):
linear warmup ``(step + 1) / W`` for ``step < W`` (``W`` = :func:`warmup_steps`), then cosine or linear decay
from 1 to ``min_lr_ratio``, reaching ``min_lr_ratio`` at the last step ``max_steps - 1``.
"""

from __future__ import annotations

import math

from scale.config.schema import OptimConfig


def warmup_steps(optim: OptimConfig, max_steps: int) -> int:
    """Warmup length in optimizer steps: ``ceil(optim.warmup_ratio * max_steps)`` when the ratio is set (as
    transformers' ``TrainingArguments.get_warmup_steps`` computes ``warmup_ratio``), else ``optim.warmup_steps``."""
    if optim.warmup_ratio is not None:
        return math.ceil(optim.warmup_ratio * max_steps)
    return optim.warmup_steps


def lr_factor(step: int, optim: OptimConfig, max_steps: int) -> float:
    """Multiplier of the peak LR at optimizer step ``step`` (0-based; unitless, in (0, 1])."""
    warmup = min(warmup_steps(optim, max_steps), max_steps - 1)
    if step < warmup:
        return (step + 1) / warmup
    if optim.schedule == "constant":
        return 1.0
    span = max(max_steps - 1 - warmup, 1)
    progress = min((step - warmup) / span, 1.0)
    shape = 0.5 * (1.0 + math.cos(math.pi * progress)) if optim.schedule == "cosine" else 1.0 - progress
    return optim.min_lr_ratio + (1.0 - optim.min_lr_ratio) * shape


def steps_for_epochs(train_rows: int, global_batch_size: int, num_epochs: int) -> int:
    """Optimizer steps in ``num_epochs`` passes over ``train_rows`` rows (``train.num_epochs``); with ``data.packing``
    the loader deals in bins, and ``train_rows`` is the number of bins.

    An epoch is ``ceil(train_rows / global_batch_size)`` windows, the last one partial when the rows do not
    divide: the number the loop runs in every launch mode, since ``ceil(ceil(ceil(n / mb) / world) / ga)`` equals
    ``ceil(n / (mb * world * ga))`` for the micro-batches a rank's shard holds and the windows they fill.
    """
    return num_epochs * math.ceil(train_rows / global_batch_size)

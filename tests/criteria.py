"""User criteria for tests (imported by ``loss.criterion='tests.criteria:...'``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

POISON_TYPE = 7


def poison(logits: torch.Tensor, labels: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
    """Per-token CE ``[M]``; rows of type :data:`POISON_TYPE` get a NaN loss AND NaN gradients (an overflow)."""
    loss = F.cross_entropy(logits, labels, reduction="none")
    return loss * torch.where(types == POISON_TYPE, float("nan"), 1.0)


def poison_value(logits: torch.Tensor, labels: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
    """Per-token CE ``[M]``; rows of type :data:`POISON_TYPE` get a NaN loss but finite gradients."""
    loss = F.cross_entropy(logits, labels, reduction="none")
    return loss + torch.where(types == POISON_TYPE, float("nan"), 0.0)


def mean_ce(logits: torch.Tensor, labels: torch.Tensor, types: torch.Tensor | None = None) -> torch.Tensor:
    """The mean CE over the ``M`` tail tokens (a scalar): a criterion returning a mean, whose mean of no token would
    be NaN (a sequence-parallel shard without tail tokens; the harness then never calls it)."""
    return F.cross_entropy(logits, labels)

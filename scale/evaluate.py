"""Evaluation over the held-out split: tail loss, target NLL and label accuracy, exact across ranks.

Per-example figures are gathered with ``gather_for_metrics`` (which drops the samples accelerate repeats to
even out the last batch across ranks) and reduced once, in float64, on the host.
"""

from __future__ import annotations

import warnings

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from scale.loss import LossSpec, forward_tail, tail_loss, target_stats


@torch.no_grad()
def evaluate(acc: Accelerator, model: torch.nn.Module, eval_dl: DataLoader, spec: LossSpec) -> dict[str, float]:
    """Tail loss (ratio of sums), target NLL (nats) and label accuracy over the whole eval split.

    Per-example figures go through ``gather_for_metrics``, which drops the samples accelerate repeats to
    even out the last batch across ranks. Collective: every rank must call it.
    """
    was_training = model.training
    model.eval()
    label_ids = spec.label_token_ids.to(acc.device)
    rows = []
    for batch in eval_dl:
        tail_logits, targets = forward_tail(model, batch, spec.threshold, spec.padding_side)
        weights = spec.weights(batch)
        # One tail_loss per row (also for a user criterion that returns a mean), so that gathered rows
        # keep their own numerator and denominator.
        per_row = [tail_loss(tail_logits[b:b + 1], targets[b:b + 1], weights[b:b + 1],
                             batch["type_indicator"][b:b + 1], spec.criterion, spec.criterion_mode)
                   for b in range(tail_logits.shape[0])]
        num, den = (torch.stack(column) for column in zip(*per_row))                # [B], [B]
        stats = target_stats(tail_logits, batch["target_token"], label_ids, spec.target_position)
        rows.append(acc.gather_for_metrics(torch.stack([num, den, stats.logprob, stats.correct], dim=1)))
    table = torch.cat(rows).double()                                                # [n_eval, 4]
    num, den, logprob, correct = table.sum(0).tolist()  # host sync (eval only)
    n = table.shape[0]
    if was_training:
        model.train()
    metrics = {"eval/loss": num / den if den > 0 else None, "eval/target_nll": -logprob / n,
               "eval/accuracy": correct / n, "eval/examples": n}
    if den == 0:  # loss.type_weights weighs every eval row 0: no eval loss (missing, as train/loss then)
        del metrics["eval/loss"]
        warnings.warn("eval/loss is missing: loss.type_weights gives every eval row weight 0", stacklevel=2)
    return metrics

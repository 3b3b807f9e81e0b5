"""Evaluation over the held-out split, per data format, exact across ranks.

| format | metrics |
|---|---|
| every format | ``eval/loss``: tail NLL per weighted token (nats; ratio of sums), ``eval/examples`` |
| ``classification`` | ``eval/target_nll``: NLL of the row's label (nats per example, the sum over its tokens), ``eval/accuracy``: the label with the highest log-likelihood after the prompt is the row's |
| ``text`` with a ``target`` column | ``eval/target_nll``: NLL of the target token at ``loss.target_position`` |
| ``prompt_completion``, ``messages`` | ``eval/loss`` is the completion NLL per token; ``eval/exact_match``: every completion token is the argmax (teacher forced) |

Accuracy with single-token labels compares the label tokens' logits at the label position (one forward);
with multi-token labels every label is scored as ``sum_k log p(label_k | prompt, label_<k)``, one forward
per label (log-likelihood ranking, as evaluation harnesses rank choices). Per-example figures are gathered
with ``gather_for_metrics`` (which drops the samples accelerate repeats to even out the last batch across
ranks) and reduced once, in float64, on the host.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from torch import Tensor
from torch.utils.data import DataLoader

from scale.data import Collator, label_candidates
from scale.loss import LossSpec, forward_tail, tail_loss



@dataclass
class TargetStats:
    """Per-example classification figures at the target position.

    Attributes:
        logprob: ``[B]`` log-probability (nats) of ``target_token``.
        correct: ``[B]`` 1.0 where the target is the argmax over the label tokens, else 0.0.
    """

    logprob: Tensor
    correct: Tensor


@torch.no_grad()
def target_stats(tail_logits: Tensor, target_token: Tensor, label_token_ids: Tensor | None,
                 position: int) -> TargetStats:
    """Log-probability of each row's target token and label-set accuracy (single-token labels).

    Args:
        tail_logits: ``[B, N, V]`` predictions of the tail tokens.
        target_token: ``[B]`` token id of each row's label word.
        label_token_ids: ``[L]`` token ids of the label set; ``None``: no accuracy (``correct`` is 0).
        position: which tail token is the target, counted from the end (``-1`` = last real token); its
            prediction is ``tail_logits[:, N + position]``.

    Returns:
        :class:`TargetStats`.
    """
    logits = tail_logits[:, tail_logits.shape[1] + position].float()        # [B, V]
    logprob = logits.log_softmax(-1).gather(1, target_token[:, None]).squeeze(1)
    if label_token_ids is None:
        return TargetStats(logprob=logprob, correct=torch.zeros_like(logprob))
    pred = label_token_ids[logits[:, label_token_ids].argmax(-1)]
    return TargetStats(logprob=logprob, correct=(pred == target_token).float())


@torch.no_grad()
def sequence_logprob(tail_logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` sum of the log-probabilities (nats) of the tokens where ``mask [B, N]`` is 1."""
    token = tail_logits.float().log_softmax(-1).gather(2, targets[:, :, None]).squeeze(2)   # [B, N]
    return token.masked_fill(mask == 0, 0.0).sum(1)


@torch.no_grad()
def exact_match(tail_logits: Tensor, targets: Tensor, mask: Tensor) -> Tensor:
    """``[B]`` 1.0 where every tail token (``mask [B, N]``) is the argmax of its prediction (teacher forced)."""
    hit = (tail_logits.argmax(-1) == targets) | (mask == 0)
    return hit.all(1).float()


def _per_row_loss(tail_logits: Tensor, targets: Tensor, weights: Tensor, batch: dict[str, Tensor],
                  spec: LossSpec) -> tuple[Tensor, Tensor]:
    """``[B]`` numerators and denominators: one :func:`tail_loss` per row (also for a criterion's mean)."""
    per_row = [tail_loss(tail_logits[b:b + 1], targets[b:b + 1], weights[b:b + 1],
                         batch["type_indicator"][b:b + 1], spec.criterion, spec.criterion_mode)
               for b in range(tail_logits.shape[0])]
    num, den = (torch.stack(column) for column in zip(*per_row))
    return num, den


@torch.no_grad()
def label_scores(model: torch.nn.Module, batch: dict[str, Tensor], spec: LossSpec) -> Tensor:
    """``[B, L]`` log-likelihood (nats) of every label after each row's prompt: one forward per label."""
    collate = Collator(spec.pad_token_id, spec.padding_side)
    scores = []
    for cand in label_candidates(batch, spec.label_seqs, collate):
        logits, targets = forward_tail(model, cand, padding_side=spec.padding_side)
        scores.append(sequence_logprob(logits, targets, cand["tail_mask"]))
    return torch.stack(scores, dim=1)


@torch.no_grad()
def evaluate(acc: Accelerator, model: torch.nn.Module, eval_dl: DataLoader, spec: LossSpec) -> dict[str, float]:
    """The format's metrics (module docstring) over the whole eval split.

    Collective: every rank must call it (``gather_for_metrics``; under ZeRO-3 the forwards too).
    """
    was_training = model.training
    model.eval()
    label_ids = spec.label_token_ids.to(acc.device) if spec.label_token_ids is not None else None
    rows = []
    for batch in eval_dl:
        tail_logits, targets = forward_tail(model, batch, padding_side=spec.padding_side)
        mask = batch["tail_mask"]
        num, den = _per_row_loss(tail_logits, targets, spec.weights(batch), batch, spec)
        cols = [num, den]
        if spec.format == "classification" and label_ids is not None:   # the fast path: one forward
            stats = target_stats(tail_logits, batch["target_token"], label_ids, -2)   # label, then EOS
            cols += [stats.logprob, stats.correct]
        elif spec.format == "classification":
            label_mask = mask.clone()
            label_mask[:, -1] = 0                                        # every tail ends with EOS
            scores = label_scores(model, batch, spec)                    # [B, L]
            cols += [sequence_logprob(tail_logits, targets, label_mask),
                     (scores.argmax(1) == batch["label"]).float()]
        elif spec.format == "text" and spec.has_target:
            cols += [target_stats(tail_logits, batch["target_token"], None, spec.target_position).logprob]
        elif spec.format in ("prompt_completion", "messages"):
            cols += [exact_match(tail_logits, targets, mask)]
        rows.append(acc.gather_for_metrics(torch.stack(cols, dim=1).float()))
    table = torch.cat(rows).double()                                    # [n_eval, columns]
    sums = table.sum(0).tolist()  # host sync (eval only)
    n = table.shape[0]
    if was_training:
        model.train()
    out = {"eval/loss": sums[0] / sums[1]} if sums[1] > 0 else {}
    if sums[1] == 0:  # loss.type_weights weighs every eval row 0: no eval loss (missing, as train/loss then)
        warnings.warn("eval/loss is missing: loss.type_weights gives every eval row weight 0", stacklevel=2)
    if spec.format == "classification":
        out |= {"eval/target_nll": -sums[2] / n, "eval/accuracy": sums[3] / n}
    elif spec.format == "text" and spec.has_target:
        out["eval/target_nll"] = -sums[2] / n
    elif spec.format in ("prompt_completion", "messages"):
        out["eval/exact_match"] = sums[2] / n
    return out | {"eval/examples": n}

"""Evaluation over the held-out split, exact across ranks; each format adds its own metrics: the split's task
(:mod:`scale.data.tasks`), prepared by the data pipeline, rides with the split to here.

| format | metrics |
|---|---|
| every format | ``eval/loss``: tail NLL per weighted trained token (nats; ratio of sums), ``eval/examples`` |
| ``classification`` | ``eval/target_nll``: NLL of the row's label (nats per example, the sum over its tokens),
``eval/accuracy``: the label (+ EOS) with the highest log-likelihood after the prompt is the row's |
| ``text`` with a ``target`` column | ``eval/target_nll``: NLL of the target token at ``loss.target_position`` |
| ``prompt_completion``, ``messages`` | ``eval/loss`` is the completion NLL per trained token; ``eval/exact_match``:
every trained token is the argmax (teacher forced) |

Accuracy with single-token labels compares the label tokens' logits at the label position (one forward);
with multi-token labels every label is scored as ``sum_k log p(label_k | prompt, label_<k) + log p(EOS | prompt,
label)``, one forward per label (log-likelihood ranking, as evaluation harnesses rank choices; the EOS ranks a
label that is a prefix of another right). Per-example figures are gathered with ``gather_for_metrics`` (which
drops the samples accelerate repeats to even out the last batch across ranks) and reduced once, in float64, on
the host.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch
from accelerate import Accelerator
from torch import Tensor
from torch.utils.data import DataLoader

from scale.data.tasks.base import Task
from scale.loss.tail import forward_tail
from scale.objectives.tail import LossSpec
from scale.utils.signals import EvalInterrupted


def _per_row_loss(tail_logits: Tensor, targets: Tensor, weights: Tensor, batch: dict[str, Tensor],
                  spec: LossSpec) -> tuple[Tensor, Tensor]:
    """``[B]`` numerators and denominators: one :meth:`LossSpec.tail_loss` per row (also for a criterion's mean)."""
    per_row = [spec.tail_loss(tail_logits[b:b + 1], targets[b:b + 1], weights[b:b + 1],
                              batch["type_indicator"][b:b + 1]) for b in range(tail_logits.shape[0])]
    num, den = (torch.stack(column) for column in zip(*per_row))
    return num, den


def _evaluate_pairs(net: torch.nn.Module, eval_dl: DataLoader, objective: Any, stop: Callable[[], bool] | None,
                    gather: Callable[[Tensor], Tensor]) -> dict[str, float]:
    """:func:`evaluate` for a pair objective: the table has one row per held-out pair (its loss and metrics,
    :meth:`scale.objectives.preference.PreferenceObjective.eval_columns`), summed once on the host."""
    rows = []
    for batch in eval_dl:
        cols = objective.eval_columns(net, batch).double()                      # [P, k]
        flag = torch.full_like(cols[:, :1], float(stop is not None and stop()))
        rows.append(gather(torch.cat([cols, flag], dim=1)))
        if stop is not None and bool(rows[-1][:, -1].any()):  # host sync, only when a stop can be asked
            raise EvalInterrupted("a stop was requested during evaluation")
    table = torch.cat(rows).double()[:, :-1]
    return objective.eval_summary(table.sum(0).tolist(), table.shape[0])  # host sync (eval only)


def metric_names(task: Task, spec: LossSpec) -> set[str]:
    """The ``eval/*`` keys :func:`evaluate` returns with ``task`` (the split's prepared task), known before any
    evaluation (a ``train.keep_best`` metric is checked against them at start-up). A task's ``summary`` is
    arithmetic on the sums of its columns, so any sums give its keys."""
    if hasattr(spec, "eval_summary"):
        return set(spec.eval_summary([1.0] * 64, 1))
    return {"eval/loss", "eval/examples"} | set(task.summary([1.0] * 64, 1, spec))


@torch.no_grad()
def evaluate(acc: Accelerator, model: torch.nn.Module, eval_dl: DataLoader, spec: LossSpec,
             stop: Callable[[], bool] | None = None, task: Task | None = None,
             sequence: Any = None) -> dict[str, float]:
    """``eval/loss`` and the format's metrics (module docstring) over the whole eval split.

    Collective: every rank must call it (``gather_for_metrics``; under ZeRO-3 the forwards too).

    Args:
        stop: checked after every eval batch on every rank (a pre-emption request); its value rides in the
            gathered table as one more column, so the ranks agree at the same batch without another collective.
        task: the split's prepared task (``Splits.task``); ``None``: the one the loader's examples carry
            (``eval_dl.dataset.task``, a loader over ``Splits.eval``).
        sequence: under sequence parallelism (:class:`scale.distributed.ulysses.SequenceParallel`) every forward runs on
            the rank's shard of the rows and returns what one device's would
            (:class:`scale.distributed.ulysses.ShardedForward`), and the figures are gathered over the data-parallel
            ranks; never the plain attention on a shard.

    Raises:
        EvalInterrupted: ``stop()`` was true on some rank after some batch; nothing is returned.
        ValueError: no task given and the loader's examples carry none.
    """
    task = task if task is not None else getattr(eval_dl.dataset, "task", None)
    if task is None:
        raise ValueError("evaluate needs the split's task: pass task=splits.task, or a loader over splits.eval")
    was_training = model.training
    model.eval()
    net = sequence.forward(model) if sequence is not None else model
    gather = (lambda t: sequence.gather_for_metrics(acc, t)) if sequence is not None else acc.gather_for_metrics
    if hasattr(spec, "eval_columns"):  # a pair objective: one row per pair (what gather_for_metrics counts)
        try:
            return _evaluate_pairs(net, eval_dl, spec, stop, gather)
        finally:
            if was_training:
                model.train()
    rows = []
    try:
        for batch in eval_dl:
            tail_logits, targets = forward_tail(net, batch, padding_side=spec.padding_side)
            num, den = _per_row_loss(tail_logits, targets, spec.weights(batch), batch, spec)
            flag = torch.full_like(num, float(stop is not None and stop()))
            cols = [num, den, *task.eval_columns(net, batch, tail_logits, targets, spec), flag]
            rows.append(gather(torch.stack(cols, dim=1).float()))
            if stop is not None and bool(rows[-1][:, -1].any()):  # host sync, only when a stop can be asked
                raise EvalInterrupted("a stop was requested during evaluation")
    finally:
        if was_training:
            model.train()
    table = torch.cat(rows).double()[:, :-1]                            # [n_eval, columns]
    sums = table.sum(0).tolist()  # host sync (eval only)
    n = table.shape[0]
    out = {"eval/loss": sums[0] / sums[1]} if sums[1] > 0 else {}
    if sums[1] == 0:  # loss.type_weights weighs every eval row 0: no eval loss (missing, as train/loss then)
        warnings.warn("eval/loss is missing: loss.type_weights gives every eval row weight 0", stacklevel=2)
    return out | task.summary(sums[2:], n, spec) | {"eval/examples": n}

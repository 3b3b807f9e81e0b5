"""Accumulation windows: the micro-batches of one optimizer step, the same number on every rank, with the window's
loss denominator, agreed on by one small all-gather per window (:func:`windows`) that also carries the stop flag,
the checkpoint timer, the rows the tail loss cannot score and the previous window's non-finite flag (the loop's
held optimizer step, :class:`HeldStep`). A resumed epoch starts after the micro-batches already trained
(:func:`skip_trained`), with the last of them kept as a stand-in, so its windows are an uninterrupted run's.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import NamedTuple, Protocol

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from scale.loss.tail import batch_bad_rows, describe_batch_row
from scale.objectives.base import Objective
from scale.training.state import SaveTimer
from scale.utils.signals import Preemption


@dataclass
class MicroBatch:
    """One micro-batch of an accumulation window on this rank.

    Attributes:
        batch: the collated tensors (:class:`scale.data.Collator`), on the device.
        weights: ``[B, N]`` tail-token weights; all zero for a stand-in.
        real: ``False`` for a stand-in: a rank whose shard ran out at the end of an epoch repeats its last
            batch so that every rank runs the same number of forward/backward passes (no collective hangs);
            a stand-in backpropagates an exact zero and is not counted.
    """

    batch: dict[str, torch.Tensor]
    weights: torch.Tensor
    real: bool = True


@dataclass
class Window:
    """The micro-batches of one optimizer step on this rank.

    Attributes:
        micro: at most ``gradient_accumulation_steps`` micro-batches, the same number on every rank.
        den: the loss denominator: the sum of token weights over the window on every rank (host float).
        stop: some rank was asked to stop (SIGTERM/SIGINT) before this window; ``micro`` is then empty.
        save_due: some rank's checkpoint timer (``train.save_every_minutes``) ran out before this window: every
            rank checkpoints after it.
    """

    micro: list[MicroBatch]
    den: float = 0.0
    stop: bool = False
    save_due: bool = False


class Vote(NamedTuple):
    """One rank's entry of the all-gather of :func:`windows`, float64 scalars on its device. The gathered
    ``[world, 6]`` table is copied to the host once and read as Python numbers: each field's largest entry over the
    ranks, and the sum of ``weight_sum``."""

    micro_batches: torch.Tensor  # real micro-batches this rank holds for the window
    stop: torch.Tensor  # 1: a pre-emption signal arrived on this rank
    weight_sum: torch.Tensor  # the sum of its micro-batches' loss weights: summed over ranks, the denominator
    save_due: torch.Tensor  # 1: this rank's save_every_minutes timer is due
    bad_rows: torch.Tensor  # rows the tail loss cannot score (scale.loss.tail.batch_bad_rows)
    nonfinite: torch.Tensor  # 1: the held optimizer step's gradient norm or window loss is non-finite on this rank


class HeldStep(Protocol):
    """The previous window's optimizer step, computed but not applied (:class:`scale.training.commit.StepCommit`): its
    non-finite flag travels in the next vote, whose gathered table then decides it without a host read of its own."""

    def flag(self) -> torch.Tensor | None:
        """``[]`` float64 on the device: 1 when this rank's held step is non-finite; ``None`` when none is held."""

    def apply(self, nonfinite: bool) -> None:
        """Apply the held step (``nonfinite`` on no rank) or drop it (on some rank); a no-op when none is held."""


def skip_trained(acc: Accelerator, dl: DataLoader, epoch: int,
                 trained: int) -> tuple[Iterable[dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]:
    """This rank's micro-batches of epoch ``epoch`` after its first ``trained`` (a resumed run's, already trained),
    and the last of those: ``(batches, last)`` for :func:`windows`.

    ``last`` is the batch an uninterrupted run repeats as a stand-in when this rank's shard holds no batch for the
    next window (the last partial window of an epoch, on a rank whose shard is one micro-batch shorter: accelerate
    deals whole micro-batches round-robin, so shards differ by at most one). Skipping all ``trained`` micro-batches
    would lose it, and that rank would have nothing to run beside the others' forward/backward. ``None`` when
    ``trained`` is 0 or this rank's shard holds fewer (the epoch is then over on every rank). The skip itself is
    accelerate's ``skip_first_batches`` (indices only; ``last`` is the one skipped batch collated).
    """
    dl.set_epoch(epoch)
    if not trained:
        return dl, None
    rest = acc.skip_first_batches(dl, trained - 1)
    rest.set_epoch(epoch)  # the copy must be told the epoch too (accelerate#2016)
    batches = iter(rest)
    return batches, next(batches, None)


def windows(acc: Accelerator, dl: Iterable[dict[str, torch.Tensor]], ga: int, objective: Objective,
            preemption: Preemption | None = None, timer: SaveTimer | None = None,
            held: HeldStep | None = None, last: dict[str, torch.Tensor] | None = None) -> Iterator[Window]:
    """Yield accumulation windows of at most ``ga`` micro-batches, the same length on every rank.

    With ``even_batches=False`` a rank can run out of batches before the others at the end of an epoch; it
    then repeats its last batch as a stand-in (``real=False``): the last of its batches in this window, else of the
    previous one, else ``last`` (the batch trained just before ``dl``'s first: a resumed epoch's, from
    :func:`skip_trained`). The epoch ends when no rank has a batch left.

    Collective: one tiny all-gather per window (a :class:`Vote` of every rank), which also carries the stop flag
    (pre-emption costs no extra collective), the loss denominator, the checkpoint timer (ranks agree on a time-based
    save), the count of rows the tail loss cannot score (so every rank stops together on such a batch) and the
    non-finite flag of the optimizer step ``held`` holds (applied or dropped on every rank alike, before the next
    window, the stop or the epoch's end is yielded), and is the loop's one host sync per optimizer step.

    Raises:
        NonFiniteError: from ``held.apply`` (:class:`scale.training.commit.StepCommit`), under
        ``train.on_nonfinite=error``.
        ValueError: a micro-batch on some rank holds a row with a gap in its mask or fewer than its tail + 1
            tokens (:func:`scale.loss.tail.check_rows`).
        RuntimeError: a rank has no batch to repeat for a window the others train (its shard is empty).
    """
    it = iter(dl)
    while True:
        batches = list(itertools.islice(it, ga))
        last = batches[-1] if batches else last
        micro = [MicroBatch(b, objective.weights(b)) for b in batches]
        zero = torch.zeros((), dtype=torch.float64, device=acc.device)
        flag = held.flag() if held is not None else None
        mine = Vote(micro_batches=zero + len(micro), stop=zero + (preemption is not None and preemption.requested),
                    weight_sum=torch.stack([mb.weights.sum() for mb in micro]).double().sum() if micro else zero,
                    save_due=zero + (timer is not None and timer.due),
                    bad_rows=torch.stack([batch_bad_rows(b).sum() for b in batches]).sum().double() if micro else zero,
                    nonfinite=zero if flag is None else flag)
        table = acc.gather(torch.stack(mine)[None]).cpu()  # [world, 6]: collective + host sync, once per window
        # Python numbers by two .tolist() of the host copy: no further read (none per field by int() or bool())
        top = Vote(*table.amax(0).tolist())  # each field's largest entry over the ranks
        den = table[:, Vote._fields.index("weight_sum")].sum().tolist()  # summed over the ranks, in float64
        if held is not None:
            held.apply(top.nonfinite > 0)  # the previous window's optimizer step, before anything else
        n_max, stop = int(top.micro_batches), top.stop > 0
        if top.bad_rows > 0:
            bad = next((b for b in batches if batch_bad_rows(b).any()), None)
            raise ValueError(describe_batch_row(bad) if bad
                             else "a micro-batch on another rank holds a row the tail loss cannot score (its "
                                  "message names it)")
        if stop:
            yield Window([], stop=True)
            return
        if n_max == 0:
            return
        if last is None:
            raise RuntimeError("a rank got no batch in an epoch: lower train.micro_batch_size or num_processes")
        stand_ins = [MicroBatch(last, torch.zeros_like(objective.weights(last)), real=False)] * (n_max - len(micro))
        yield Window(micro + stand_ins, den=den, save_due=top.save_due > 0)

"""When an optimizer step is applied: :class:`StepCommit` holds a trained window's step until the next host read
(the next window vote, or a flush before anything reads the weights) tells every rank's non-finite verdict, then
applies it or skips it on every rank alike.

    commit = StepCommit(job, meter)
    train_window(job, window, meter, commit)   # backward + clip, then commit.hold(HeldWindow(...))
    ... the next window vote: commit.flag() in its gathered table, then commit.apply(nonfinite)
    commit.flush()                             # before logging, evaluation, a checkpoint, the end
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from scale.training.windows import Window

if TYPE_CHECKING:
    from scale.training.job import Job
    from scale.training.metrics import StepMeter

logger = get_logger(__name__)


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient norm (``train.on_nonfinite=error``); the message names the step and rows."""


@dataclass
class HeldWindow:
    """A trained window whose optimizer step waits for :class:`StepCommit`.

    Attributes:
        window: its micro-batches.
        nums: ``[]`` each: every micro-batch's weighted tail-CE sum (detached), on the device.
        kept: every micro-batch's objective metrics (``None`` for an objective without any).
        grad_norm: the clipped gradients' norm before clipping (``acc.clip_grad_norm_``), on the device.
        flag: ``[]`` float64 on the device: 1 when this rank's gradient norm or window loss is non-finite.
        where: the step, epoch and window, as :func:`report_nonfinite` names them.
    """

    window: Window
    nums: list[torch.Tensor]
    kept: list[Any]
    grad_norm: Any
    flag: torch.Tensor
    where: str


@dataclass
class StepCommit:
    """The optimizer step of the last window, held from its backward until a host read decides it.

    A non-finite step must be skipped on every rank alike (a NaN loss usually brings NaN gradients, but not always:
    a criterion can add a constant NaN; a rank that skipped alone would fork the replicas), so its verdict needs a
    host read of every rank's flag. Read where the step ends, that is a second host read per step beside the window
    vote's gather; instead the step waits, its flag travels in the next window's vote
    (:func:`scale.training.windows.windows` calls :meth:`flag` and :meth:`apply`), and the step is applied
    (``optimizer.step``, ``zero_grad``, the meter's sums) or skipped before the next window's first forward: the same
    updates in the same order as applying it at once, for one host read per step. GradScaler's ``found_inf`` skips on
    the device instead, but only fused optimizers take it (``torch.amp.GradScaler.step`` reads it on the host
    otherwise). Anything that reads the weights, the optimizer, the schedule or the meter between (logging, evaluation,
    a checkpoint, the end) calls :meth:`flush` first, which decides with one all-reduce and a host read of its own.

    The schedule steps here too, after the optimizer (every step, skipped or trained or of zero weight), so that the
    step runs at its own learning rate. ``acc.sync_gradients`` is still true when the step is applied: nothing
    enters ``accumulate()`` between a window's last micro-batch and the next vote.

    Attributes:
        job, meter: the run's.
        held: the window waiting (``None``: none, or a window of zero weight, which only steps the schedule).
        pending: a step is held.
        spent: host seconds the window vote spent applying steps since :meth:`take_spent` (not data-loading time;
            a step :meth:`flush` applies at an evaluation or a checkpoint counts as paused time, as they do).
    """

    job: Job
    meter: StepMeter
    held: HeldWindow | None = None
    pending: bool = False
    spent: float = 0.0

    def hold(self, held: HeldWindow | None) -> None:
        """Hold a trained window's step (``None``: a window of zero weight, nothing to apply but the schedule)."""
        if self.pending:
            raise RuntimeError("an optimizer step is held already: a window vote did not decide it")
        self.held, self.pending = held, True

    def flag(self) -> torch.Tensor | None:
        """The held step's non-finite flag (``[]`` float64 on the device), or ``None`` when none needs a verdict."""
        return self.held.flag if self.pending and self.held is not None else None

    def apply(self, nonfinite: bool) -> None:
        """Apply the held step, or skip it when ``nonfinite`` (some rank's flag is 1); then step the schedule. Called
        by the window vote; its time is kept for :meth:`take_spent` (the loop counts it as compute, not data time).

        Raises:
            NonFiniteError: ``nonfinite`` and ``train.on_nonfinite=error`` (from :func:`report_nonfinite`).
        """
        started = time.perf_counter()
        self.settle(nonfinite)
        self.spent += time.perf_counter() - started

    def settle(self, nonfinite: bool) -> None:
        """:meth:`apply` without the timing; a no-op when no step is held.

        Raises:
            NonFiniteError: ``nonfinite`` and ``train.on_nonfinite=error``.
        """
        if not self.pending:
            return
        job, held = self.job, self.held
        self.held, self.pending = None, False
        if held is not None:
            if nonfinite:
                report_nonfinite(job, held)  # raises unless on_nonfinite=skip
                job.state.skipped_steps += 1
            else:
                job.optimizer.step()
                for mb, num, terms in zip(held.window.micro, held.nums, held.kept):
                    if mb.real:
                        self.meter.add_micro(num, mb.weights.sum(), mb.batch, terms)
            job.optimizer.zero_grad(set_to_none=True)
        job.scheduler.step()  # unprepared: exactly once per optimizer step, whatever num_processes is

    def flush(self) -> None:
        """Decide and apply the held step now: an all-reduce of the flag (world size > 1) and a host read. Collective:
        every rank calls it at the same step."""
        if not self.pending:
            return
        flag = self.flag()
        if flag is not None and self.job.acc.num_processes > 1:
            flag = self.job.acc.reduce(flag, reduction="sum")  # collective
        self.settle(flag is not None and bool(flag))  # host sync

    def take_spent(self) -> float:
        """Seconds spent in :meth:`apply` since the last call (and reset to 0)."""
        spent, self.spent = self.spent, 0.0
        return spent


def nonfinite_flag(acc: Accelerator, grad_norm: Any, nums: list[torch.Tensor]) -> torch.Tensor:
    """``[]`` float64 on the device: 1 when the gradient norm or this rank's window loss is non-finite, else 0. No
    host read: :class:`StepCommit` carries it to the host with the next window vote."""
    local = torch.stack([torch.as_tensor(grad_norm, dtype=torch.float32, device=acc.device).reshape(()),
                         torch.stack(nums).sum().float().to(acc.device)])
    return (~torch.isfinite(local)).any().double()


def where_text(job: Job) -> str:
    """The optimizer step being trained, as a non-finite step's message names it: ``optimizer step 3 (epoch 0, window
    2 of the epoch)`` (1-based step, 0-based window)."""
    state = job.state
    return f"optimizer step {state.step + 1} (epoch {state.epoch}, window {state.windows_in_epoch} of the epoch)"


def report_nonfinite(job: Job, held: HeldWindow) -> None:
    """Name the step and the data-file rows of a non-finite optimizer step; raise unless ``on_nonfinite=skip``.

    Raises:
        NonFiniteError: ``train.on_nonfinite=error``.
    """
    bad_rows = [int(r) for mb, num in zip(held.window.micro, held.nums) if mb.real and not torch.isfinite(num)
                for r in mb.batch["row"].tolist()]
    where = f"{held.where}: gradient norm {float(torch.as_tensor(held.grad_norm)):.4g}; "
    where += (f"micro-batches with a non-finite loss on this rank hold data-file rows {bad_rows}" if bad_rows
              else "the losses on this rank are finite (the bad rows are on another rank, or the weights are)")
    if job.cfg.train.on_nonfinite == "skip":
        logger.warning("skipping %s", where)
        return
    raise NonFiniteError(f"non-finite loss at {where}. Nothing was saved after the last good step; fix the data "
                         f"or lower optim.lr, or set train.on_nonfinite=skip to drop such steps.")

"""The counters a checkpoint carries besides accelerate's state (:class:`TrainerState`) and the wall-clock
checkpoint interval (:class:`SaveTimer`). No torch, no accelerate.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainerState:
    """Our own counters, saved next to accelerate's state.

    ``windows_in_epoch`` accumulation windows of epoch ``epoch`` are done; each rank skips
    ``windows_in_epoch * gradient_accumulation_steps`` micro-batches of its shard to continue mid-epoch.
    """

    step: int
    epoch: int
    windows_in_epoch: int
    world_size: int
    skipped_steps: int = 0      # optimizer steps dropped for a non-finite loss (train.on_nonfinite=skip)
    zero_weight_steps: int = 0  # windows whose loss weights summed to zero: no update, the step still counts
    reason: str = "interval"  # interval | end | preempted | best | early_stopped
    data_sha256: str = ""     # of the data file: an edited file would silently change the split
    template_sha256: str = ""  # of the chat template's text and variables (issue 17)
    rows_sha256: str = ""     # of every tokenized row and its trained flags: what the run trains (issue 17)
    config: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    wandb_run_id: str = ""    # the job's W&B run, continued by every attempt (scale.tracking)
    mixed_precision: str = ""  # the autocast the run trains in (train.mixed_precision resolved): a resume keeps it
    # train.keep_best (scale.best): the best evaluation so far, its step (checkpoint kept out of rotation), and
    # the evaluations since it improved (train.early_stopping_patience)
    best_metric: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0

    def with_reason(self, reason: str) -> TrainerState:
        """Set why the next checkpoint is written (``interval``, ``end``, ``preempted``, ``best``,
        ``early_stopped``); return ``self``."""
        self.reason = reason
        return self


class SaveTimer:
    """The wall-clock checkpoint interval (``train.save_every_minutes``): due once that many minutes passed since
    the last checkpoint (or the start). Each rank reads its own clock; the loop's per-window all-gather makes
    every rank save when any is due (:func:`scale.train.windows`), so no collective is added.

    Args:
        minutes: the interval; ``None`` is never due.
    """

    def __init__(self, minutes: float | None) -> None:
        self.seconds = None if minutes is None else 60.0 * minutes
        self.reset()

    def reset(self) -> None:
        """Start the interval again (after a checkpoint)."""
        self.start = time.monotonic()

    @property
    def due(self) -> bool:
        """Whether the interval has passed on this rank."""
        return self.seconds is not None and time.monotonic() - self.start >= self.seconds

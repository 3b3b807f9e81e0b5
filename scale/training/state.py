"""The counters a checkpoint carries besides its tensors (:class:`TrainerState`), the global batch a resume keeps
(:func:`resume_accumulation`) and the wall-clock checkpoint interval (:class:`SaveTimer`). No torch, no accelerate.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from scale.config.validation import ConfigError


@dataclass
class TrainerState:
    """Our own counters, saved as ``trainer_state.json`` next to the checkpoint's tensors.

    ``windows_in_epoch`` accumulation windows of epoch ``epoch`` are done; each rank skips
    ``windows_in_epoch * gradient_accumulation_steps`` micro-batches of its shard to continue mid-epoch. Optimizer
    step ``s`` trains rows ``[s * G, (s + 1) * G)`` of the epoch's order whatever the number of processes
    (:mod:`scale.data.order`), so a run resumed on another number of processes with the same ``global_batch_size``
    ``G`` continues where this one stopped.
    """

    step: int
    epoch: int
    windows_in_epoch: int
    world_size: int           # processes that wrote the checkpoint
    skipped_steps: int = 0      # optimizer steps dropped for a non-finite loss (train.on_nonfinite=skip)
    zero_weight_steps: int = 0  # windows whose loss weights summed to zero: no update, the step still counts
    reason: str = "interval"  # interval | end | preempted | best | early_stopped
    data_sha256: str = ""     # of the data file: an edited file would silently change the split
    template_sha256: str = ""  # of the chat template's text and variables
    rows_sha256: str = ""     # of every tokenized row and its trained flags: what the run trains
    config: dict[str, Any] = field(default_factory=dict)
    saved_at: float = 0.0
    wandb_run_id: str = ""    # the job's W&B run, continued by every attempt (scale.training.tracking)
    mixed_precision: str = ""  # the autocast the run trains in (train.mixed_precision resolved): a resume keeps it
    # train.keep_best (scale.training.best): the best evaluation so far, its step (checkpoint kept out of rotation), and
    # the evaluations since it improved (train.early_stopping_patience)
    best_metric: float | None = None
    best_step: int | None = None
    evals_since_best: int = 0
    # Where the checkpoint can be resumed (scale.training.checkpoint): the launch mode and the data-parallel ranks that
    # wrote it, and G. 0 / "": written before these fields (then G = micro_batch_size x GA x world_size of its config).
    mode: str = ""              # single | ddp | zero1 | zero2 | zero3 | fsdp
    data_parallel_size: int = 0
    global_batch_size: int = 0
    eval_pending: bool = False  # a signal cut this step's evaluation short: the resumed run evaluates it first
    # Every other file of the checkpoint, relative path -> [bytes, sha256], recorded when it was written;
    # resume_from=latest|auto takes the newest checkpoint whose files still match (scale.training.checkpoint.verify).
    files: dict[str, list[Any]] = field(default_factory=dict)

    def state_dict(self) -> dict[str, Any]:
        """Every field by name, as ``trainer_state.json`` holds it (:func:`read_state` reads it back)."""
        return asdict(self)

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


STATE_FILE = "trainer_state.json"


def read_state(path: str | Path) -> TrainerState:
    """The :class:`TrainerState` of checkpoint directory ``path`` (its ``trainer_state.json``).

    Raises:
        OSError, ValueError, TypeError: the file is missing, not JSON, or not a state.
    """
    data = json.loads((Path(path) / STATE_FILE).read_text(encoding="utf-8"))
    if not isinstance(data, dict):
        raise TypeError(f"{STATE_FILE} holds {type(data).__name__}, not an object")
    return TrainerState(**data)


def saved_global_batch(state: TrainerState) -> int:
    """``G`` of the run that wrote ``state``: recorded, or for a checkpoint written before it was recorded, its
    config's ``micro_batch_size x gradient_accumulation_steps x world_size``."""
    if state.global_batch_size:
        return state.global_batch_size
    t = state.config.get("train", {})
    return int(t.get("micro_batch_size", 0)) * int(t.get("gradient_accumulation_steps", 0)) * state.world_size


def resume_accumulation(saved_G: int, saved_mb: int, saved_ga: int, mb: int, ga: int, dp: int,
                        where: str = "the checkpoint") -> int:
    """The ``gradient_accumulation_steps`` that keeps the checkpoint's global batch on ``dp`` data-parallel ranks.

    ``micro_batch_size`` and ``gradient_accumulation_steps`` as the checkpoint had them (the run's config,
    unchanged): the accumulation becomes ``G / (micro_batch_size x dp)``. Values changed for this run are kept when
    they give the same ``G``. Anything else would train other rows in every later step: refused.

    Args:
        saved_G: ``G``, rows per optimizer step over all ranks, of the run that wrote the checkpoint.
        saved_mb: its ``train.micro_batch_size``.
        saved_ga: its ``train.gradient_accumulation_steps``.
        mb: this run's ``train.micro_batch_size``.
        ga: this run's ``train.gradient_accumulation_steps``.
        dp: this run's data-parallel ranks (:attr:`scale.distributed.launch.ModePlan.data_parallel_size`).
        where: the checkpoint, named in the message.

    Returns:
        The accumulation steps to use (``ga`` itself when it already keeps ``G``).

    Raises:
        ConfigError: ``G`` cannot be kept; the message lists the valid choices.
    """
    if mb * ga * dp == saved_G:
        return ga
    if (mb, ga) == (saved_mb, saved_ga) and saved_G % (mb * dp) == 0:
        return saved_G // (mb * dp)
    per_rank = saved_G // dp if saved_G % dp == 0 else None
    if per_rank is None:
        fix = (f"{saved_G} rows cannot be split evenly over {dp} data-parallel ranks: use "
               f"{_words([str(d) for d in divisors(saved_G)])} data-parallel ranks (the divisors of {saved_G})")
    else:
        pairs = [f"{m} x {per_rank // m}" for m in divisors(per_rank)]
        fix = (f"on {dp} data-parallel rank(s) set train.micro_batch_size x train.gradient_accumulation_steps to one "
               f"of {', '.join(pairs)}")
        if saved_mb and per_rank % saved_mb == 0:
            fix += (f" (with the checkpoint's micro_batch_size={saved_mb} and gradient_accumulation_steps={saved_ga} "
                    f"the accumulation is computed for you)")
    raise ConfigError(f"{where} was trained with global_batch_size={saved_G}; train.micro_batch_size={mb} x "
                      f"train.gradient_accumulation_steps={ga} x {dp} data-parallel rank(s) = {mb * ga * dp} would "
                      f"train other rows in every later step. Keep {saved_G}: {fix}")


def divisors(n: int) -> list[int]:
    """The divisors of ``n`` >= 1, ascending."""
    return [d for d in range(1, n + 1) if n % d == 0]


def _words(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " or " + items[-1]

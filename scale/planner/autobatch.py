"""The micro-batch search and the run's one door to the planner.

:func:`largest_micro_batch` finds the largest micro-batch whose single-device plan
(:func:`scale.planner.plan.make_plan`) fits a share of one device; :func:`auto_micro_batch` adds
``train.auto_global_batch_size`` (``scale-plan`` and the run share both). :func:`plan_micro_batch` is what the training
start-up asks, and all it asks: ``train.micro_batch_size: auto`` resolved against the GPU's memory before anything reads
the batch (the accelerator, a DeepSpeed config, the loaders), and, for a run with a set micro-batch, the hint when its
plan leaves most of the GPU unused; one line each for the start-up log (:meth:`MicroBatch.line`).

    train.micro_batch_size=auto                                  # gradient_accumulation_steps as set: G grows
    train.micro_batch_size=auto train.auto_global_batch_size=256 # G stays 256: accumulation makes up the rest
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import Any

import torch

from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.planner.census import GIB, PlanError
from scale.planner.layouts import Rank
from scale.planner.plan import HEADROOM, make_plan

# Below this share of the device's memory, a run with a set micro-batch is told about train.micro_batch_size=auto.
UNDER_USED = 0.25
# The largest micro-batch auto picks (scale.planner.autobatch.largest_micro_batch's default bound).
MAX_ROWS = 4096


@dataclass
class AutoBatch:
    """What ``train.micro_batch_size: auto`` resolved to.

    Attributes:
        micro_batch_size: rows per device per forward pass.
        gradient_accumulation_steps: micro-batches per optimizer step on each device.
        data_parallel_size: ranks that hold different rows.
        planned_gib: the plan's bytes per device at that micro-batch (GiB).
        device_gib: one device's memory (GiB).
        fraction: ``train.auto_memory_fraction``.
        kept_global_batch: ``train.auto_global_batch_size`` was set and is kept.
    """

    micro_batch_size: int
    gradient_accumulation_steps: int
    data_parallel_size: int
    planned_gib: float
    device_gib: float
    fraction: float
    kept_global_batch: bool

    def line(self) -> str:
        """The start-up line: ``train.micro_batch_size=auto: micro_batch_size 64 x gradient_accumulation_steps 2 x 1
        data-parallel rank(s) = global_batch_size 128 (gradient_accumulation_steps as set; train.auto_global_batch_size
        keeps one); planned 104.6 GiB of 139.8 GiB per device (train.auto_memory_fraction 0.75)``, and what caps a
        plan under a quarter of the device."""
        G = self.micro_batch_size * self.gradient_accumulation_steps * self.data_parallel_size
        why = ("kept: train.auto_global_batch_size" if self.kept_global_batch
               else "gradient_accumulation_steps as set; train.auto_global_batch_size keeps one")
        text = (f"train.micro_batch_size=auto: micro_batch_size {self.micro_batch_size} x gradient_accumulation_steps "
                f"{self.gradient_accumulation_steps} x {self.data_parallel_size} data-parallel rank(s) = "
                f"global_batch_size {G} ({why}); planned {self.planned_gib:.1f} GiB of {self.device_gib:.1f} GiB per "
                f"device (train.auto_memory_fraction {self.fraction:g})")
        if self.planned_gib < UNDER_USED * self.device_gib:
            text += ("; under a quarter of the device: train.auto_global_batch_size caps the micro-batch"
                     if self.kept_global_batch else f"; under a quarter of the device: {MAX_ROWS} rows is the cap")
        return text


def largest_micro_batch(cfg: Config, gpu_mem_gib: float, fraction: float = 1 - HEADROOM,
                        model_config: str | None = None, upper: int = 4096) -> tuple[int, Rank | None]:
    """The largest ``train.micro_batch_size`` whose single-device plan fits ``fraction`` of one device's memory.

    The plan's total (model states, saved activations, logits, transient bytes and the assumed framework overhead:
    :func:`scale.planner.plan.make_plan`'s ``single`` row) is affine in the micro-batch at a fixed row length
    (everything but the model states scales with the rows), so two plans (1 and 16 rows) give the candidate ``b = (limit
    - total(0)) / slope``; plans at ``b`` and ``b + 1`` confirm it, and a bisection below ``b`` (or a doubling above it)
    takes over when the total is not affine (a loss chunk size that changes with the rows): 4 plans when it is, each a
    fake-tensor forward.

    Args:
        cfg: the training config; every key but ``train.micro_batch_size`` is planned as given.
        gpu_mem_gib: memory of the device (GiB).
        fraction: the share of it the plan may fill (0 < fraction <= 1).
        model_config: a ``config.json`` to plan instead of ``model.name_or_path``'s.
        upper: the largest micro-batch returned.

    Returns:
        ``(micro_batch_size, its single-device Rank)``; ``(0, None)`` when even one row does not fit.

    Raises:
        PlanError: as :func:`scale.planner.plan.make_plan`, or ``fraction`` outside ``(0, 1]``.
    """
    if not 0 < fraction <= 1:
        raise PlanError(f"memory fraction {fraction}: must be in (0, 1]")
    limit = fraction * gpu_mem_gib * GIB
    plans: dict[int, Rank] = {}

    def total(b: int) -> Rank:
        if b not in plans:
            plans[b] = make_plan(replace(cfg, train=replace(cfg.train, micro_batch_size=b)), 1, gpu_mem_gib,
                                 model_config=model_config, single_only=True).ranks[0]
        return plans[b]

    def fits(b: int) -> bool:
        return not total(b).refused and total(b).total <= limit

    if not fits(1):
        return 0, None
    slope = max((total(16).total - total(1).total) / 15, 1.0)
    guess = int(min(max((limit - total(1).total) / slope + 1, 1), upper))
    lo, hi = (guess, guess + 1) if fits(guess) else (1, guess)   # lo fits; hi does not, once checked
    while lo < upper and hi <= upper and fits(hi):                # past the guess: double until a size does not fit
        lo, hi = hi, min(2 * hi, upper + 1)
    if lo >= upper or hi > upper:
        return (upper, total(upper)) if fits(upper) else _bisect(lo, upper, fits, total)
    return _bisect(lo, hi, fits, total)


def auto_micro_batch(cfg: Config, data_parallel_size: int, gpu_mem_gib: float, model_config: str | None = None,
                     upper: int = 4096) -> tuple[int, int, Rank | None]:
    """``train.micro_batch_size: auto`` as the run resolves it: the largest micro-batch whose single-device plan fits
    ``train.auto_memory_fraction`` of ``gpu_mem_gib`` (:func:`largest_micro_batch`, at most ``upper``); with
    ``train.auto_global_batch_size`` ``G``, the largest that also divides ``G / data_parallel_size``, and the
    accumulation that makes up the rest. Shared by ``scale-train`` (:mod:`scale.planner.autobatch`) and ``scale-plan``.

    Returns:
        ``(micro_batch_size, gradient_accumulation_steps, its single-device Rank)``; ``(0, steps as set, None)`` when
        not even one row fits.

    Raises:
        PlanError: ``G`` not divisible by ``data_parallel_size``; as :func:`scale.planner.plan.make_plan`.
    """
    t = cfg.train
    G = t.auto_global_batch_size
    if G is not None and G % data_parallel_size:
        raise PlanError(f"train.auto_global_batch_size={G} is not divisible by the {data_parallel_size} "
                        f"data-parallel ranks: use a multiple of {data_parallel_size}")
    per_rank = G // data_parallel_size if G is not None else upper
    plain = replace(cfg, train=replace(t, auto_global_batch_size=None))  # a number with it set is refused
    b, rank = largest_micro_batch(plain, gpu_mem_gib, t.auto_memory_fraction, model_config, upper=min(per_rank, upper))
    if b == 0 or rank is None or G is None:
        return b, t.gradient_accumulation_steps, rank
    fit, b = b, max(d for d in range(1, b + 1) if per_rank % d == 0)
    if b != fit:
        rank = make_plan(replace(plain, train=replace(plain.train, micro_batch_size=b)), 1, gpu_mem_gib,
                         model_config=model_config, single_only=True).ranks[0]
    return b, per_rank // b, rank


def _bisect(lo: int, hi: int, fits: Any, total: Any) -> tuple[int, Rank]:
    """The largest size in ``[lo, hi)`` that fits, given that ``lo`` fits and ``hi`` does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, total(lo)


def device_memory_gib(device: torch.device | None = None) -> float | None:
    """One GPU's memory in GiB (``torch.cuda.get_device_properties(...).total_memory``): this process's GPU
    (``LOCAL_RANK``, before the accelerator picks it), or ``None`` without CUDA."""
    if device is not None and device.type != "cuda" or not torch.cuda.is_available():
        return None
    index = device.index if device is not None and device.index is not None else (
        int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
    return torch.cuda.get_device_properties(index).total_memory / GIB


def resolve_auto_micro_batch(cfg: Config, data_parallel_size: int, memory_gib: float | None) -> AutoBatch | None:
    """Resolve ``train.micro_batch_size: auto`` in place: the largest micro-batch whose single-device plan
    (:func:`scale.planner.autobatch.largest_micro_batch`) fits ``train.auto_memory_fraction`` of ``memory_gib``; with
    ``train.auto_global_batch_size`` ``G`` set, the largest that also divides ``G / data_parallel_size``, and
    ``train.gradient_accumulation_steps = G / (micro_batch_size x data_parallel_size)`` so the global batch stays.
    Without it, ``gradient_accumulation_steps`` stays as set and the global batch grows with the micro-batch (the
    learning rate is not rescaled). Resolved, the config holds numbers only (``auto_global_batch_size`` null), as
    ``config.yaml`` and the checkpoints then record them; a resume resolves ``auto`` again and keeps the checkpoint's
    global batch as for any change of micro-batch (:func:`scale.training.checkpoint.adapt_to_checkpoint`).

    Every rank resolves alike: the plan is arithmetic on the config and the device's memory (ranks with GPUs of
    different sizes would disagree: set a number there).

    On a CPU (``memory_gib`` None) ``auto`` is refused: the largest micro-batch the host RAM holds is not the
    fastest one there (CPU GEMMs saturate at a few rows; a step of hundreds of rows takes minutes), and RAM is
    shared with the OS and the data loader, so a number is what a CPU run wants.

    Args:
        cfg: the config; ``train.micro_batch_size``, ``train.gradient_accumulation_steps`` and
            ``train.auto_global_batch_size`` are set in place.
        data_parallel_size: ranks that hold different rows (:meth:`scale.config.schema.TrainConfig.data_parallel_size`).
        memory_gib: one device's memory (GiB, :func:`device_memory_gib`); ``None`` on a CPU.

    Returns:
        What was chosen, or ``None`` when ``train.micro_batch_size`` is a number.

    Raises:
        ConfigError: on a CPU; not even one row fits; ``train.auto_global_batch_size`` is not divisible by the
            data-parallel ranks; the model cannot be planned (the planner's message).
    """
    t = cfg.train
    if t.micro_batch_size != "auto":
        return None
    if memory_gib is None:
        raise ConfigError("train.micro_batch_size=auto plans against a GPU's memory and this run has no GPU: set a "
                          "number (train.micro_batch_size=8 is the CPU default)")
    G = t.auto_global_batch_size
    try:
        b, ga, rank = auto_micro_batch(cfg, data_parallel_size, memory_gib, upper=MAX_ROWS)
    except PlanError as e:
        if G is not None and G % data_parallel_size:
            raise ConfigError(str(e)) from None
        raise ConfigError(f"train.micro_batch_size=auto: the memory plan failed ({e}); set a number") from None
    if b == 0 or rank is None:
        raise ConfigError(f"train.micro_batch_size=auto: not even one row of data.max_length={cfg.data.max_length} "
                          f"fits {t.auto_memory_fraction:g} of {memory_gib:.1f} GiB: lower data.max_length, set "
                          f"model.gradient_checkpointing=true or raise train.auto_memory_fraction")
    planned = rank.total
    t.gradient_accumulation_steps = ga
    t.micro_batch_size, t.auto_global_batch_size = b, None  # resolved: config.yaml holds the numbers
    return AutoBatch(b, t.gradient_accumulation_steps, data_parallel_size, planned / GIB, memory_gib,
                     t.auto_memory_fraction, G is not None)


def planned_bytes(cfg: Config, micro_batch_size: int, memory_gib: float) -> int:
    """The single-device plan's bytes (:func:`scale.planner.plan.make_plan`'s first row) at ``micro_batch_size``.

    Raises:
        PlanError: the model cannot be planned.
    """
    return make_plan(replace(cfg, train=replace(cfg.train, micro_batch_size=micro_batch_size)), 1,
                     memory_gib, single_only=True).ranks[0].total


def under_used_line(cfg: Config, memory_gib: float | None) -> str | None:
    """For a GPU run with a set ``train.micro_batch_size``: one start-up line when its plan uses under a quarter of
    the device's memory, naming ``train.micro_batch_size: auto``; ``None`` otherwise (a CPU, ``auto``, a model the
    planner cannot plan, or a plan that uses the device). One plan: a few fake-tensor forwards, no device memory."""
    if memory_gib is None or cfg.train.micro_batch_size == "auto":
        return None
    try:
        planned = planned_bytes(cfg, cfg.train.micro_batch_size, memory_gib) / GIB
    except PlanError:
        return None
    if planned >= UNDER_USED * memory_gib:
        return None
    return (f"memory: the plan of micro_batch_size {cfg.train.micro_batch_size} uses {planned:.1f} GiB of "
            f"{memory_gib:.1f} GiB per device, under a quarter: train.micro_batch_size: auto picks the largest that "
            f"fits train.auto_memory_fraction")


@dataclass
class MicroBatch:
    """The start-up's micro-batch as the planner settled it (:func:`plan_micro_batch`).

    Attributes:
        cfg: the run's config (``train.micro_batch_size`` a number once ``auto`` is resolved).
        memory_gib: one device's memory (GiB), or None on a CPU.
        auto: what ``train.micro_batch_size: auto`` resolved to, or None when the config set a number.
    """

    cfg: Config
    memory_gib: float | None
    auto: AutoBatch | None

    def line(self) -> str | None:
        """The start-up line: ``auto``'s choice (:meth:`AutoBatch.line`), else the hint of :func:`under_used_line`,
        planned from the config as it stands when asked (the main process asks once the accelerator has settled
        ``train.mixed_precision: auto``); None when there is nothing to say."""
        return self.auto.line() if self.auto else under_used_line(self.cfg, self.memory_gib)


def plan_micro_batch(cfg: Config, data_parallel_size: int, device: torch.device) -> MicroBatch:
    """What the training start-up asks the planner: ``train.micro_batch_size: auto`` resolved in place against
    ``device``'s memory (:func:`resolve_auto_micro_batch`), before anything reads the batch, and the line to log
    (:meth:`MicroBatch.line`). Every rank calls it alike.

    Args:
        cfg: the config; resolved in place as :func:`resolve_auto_micro_batch` says.
        data_parallel_size: ranks that hold different rows.
        device: where this rank computes (:func:`device_memory_gib` reads a GPU's memory; a CPU has none).

    Raises:
        ConfigError: as :func:`resolve_auto_micro_batch`.
    """
    memory = device_memory_gib(device)  # None on a CPU
    return MicroBatch(cfg, memory, resolve_auto_micro_batch(cfg, data_parallel_size, memory))

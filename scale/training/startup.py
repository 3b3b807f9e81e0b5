"""The start-up lines: what a run is about to do, logged once by the main process before the first step (the launch
mode and batch, the packing, one optimizer step's tokens, the data counts, a train row as trained, the differences
from TRL's defaults, the mode plan, the precision and the MFU peak). Each line stays within :data:`LINE_WIDTH`
characters where its parts allow: they end up in SLURM and nohup logs.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from scale.config.names import differences_from_trl
from scale.config.schema import Config
from scale.data.token_table import column
from scale.data.tokenize import removed_lines, show_example, show_legend, stats_line
from scale.distributed.launch import ModePlan
from scale.training.checks import dtype_census
from scale.training.parts.data import Data
from scale.training.parts.launch import Launch
from scale.training.parts.loaders import Loaders
from scale.training.precision import PeakFlops, PrecisionChoice
from scale.training.schedule import steps_for_epochs, warmup_steps
from scale.utils.compat import warn_untested

logger = get_logger(__name__)

# The message part of a start-up line: the CLI's timestamp, level, logger name and rank prefix take up to ~60 of the
# 300 characters docs/outputs.md promises for a line of a log file.
LINE_WIDTH = 240


def lines_within(head: str, parts: list[str], width: int = LINE_WIDTH) -> list[str]:
    """``parts`` joined by ``"; "`` after ``head``, as few lines as keep each within ``width`` characters where a part
    allows (a part longer than that gets a line of its own); every line after the first starts ``head`` too.

    >>> lines_within("mode plan: ", ["a", "b"], width=20)
    ['mode plan: a; b']
    """
    lines: list[str] = []
    for part in parts:
        if lines and len(lines[-1]) + 2 + len(part) <= width:
            lines[-1] += f"; {part}"
        else:
            lines.append(head + part)
    return lines or [head.rstrip(": ")]


def step_text(lengths: np.ndarray, tails: np.ndarray, global_batch_size: int,
              bins: list[list[int]] | None = None) -> str:
    """What one optimizer step holds, for the start-up line ``per step: ...``.

    Without packing a step is ``global_batch_size`` rows; with ``data.packing`` it is ``global_batch_size`` bins
    (:func:`scale.data.order.pack_bfd`), each holding several rows, so the figures come from the bins.

    Args:
        lengths: ``[N]`` tokens of each train row.
        tails: ``[N]`` tail tokens (``tail_len``) of each train row.
        global_batch_size: rows (or bins) per optimizer step, ``G``.
        bins: the train rows' bins (row indices), or None without packing.

    Returns:
        ``tokens~T (...), tail tokens~X`` with ``T`` and ``X`` the mean tokens and tail tokens of a full step.
    """
    total, tail = float(np.sum(lengths)), float(np.sum(tails))
    if bins is None:
        n = max(len(lengths), 1)
        g = min(global_batch_size, n)  # a split smaller than the global batch: every step is the whole split
        return f"tokens~{g * total / n:.0f} (mean {total / n:.1f} tokens/row), tail tokens~{g * tail / n:.0f}"
    k = max(len(bins), 1)
    g = min(global_batch_size, k)
    return (f"tokens~{g * total / k:.0f} ({g} bins x mean {total / k:.1f} tokens, {len(lengths) / k:.2f} rows/bin), "
            f"tail tokens~{g * tail / k:.0f}")


def packing_text(rows: int, bins: list[list[int]], lengths: np.ndarray, max_length: int,
                 global_batch_size: int, unit: str = "rows") -> str:
    """The start-up line of ``data.packing``: how many bins the train rows went into, how full they are, and the
    optimizer steps of an epoch (``ceil(bins / global_batch_size)``, :func:`scale.training.schedule.steps_for_epochs`).
    Preference pairs (``unit="pairs"``, ``rows`` pairs) pack into bins of ``max_length`` = 2 x ``data.max_length``
    tokens."""
    k = max(len(bins), 1)
    full = float(np.sum(lengths)) / (k * max_length)
    cap = f"data.max_length={max_length}" if unit == "rows" else \
        f"2 x data.max_length={max_length // 2} = {max_length}"
    return (f"packing: {rows} train {unit} into {len(bins)} bins of up to {cap} tokens "
            f"({rows / k:.2f} {unit}/bin, {full:.0%} full); an epoch is ceil({len(bins)} bins / global_batch_size "
            f"{global_batch_size}) = {steps_for_epochs(len(bins), global_batch_size, 1)} optimizer step(s)")


def mode_plan_lines(notes: list[str], dtypes: dict[str, int], cpu_paths: list[str]) -> list[str]:
    """The start-up lines of the mode plan (:attr:`scale.distributed.launch.ModePlan.notes`), the parameters' dtypes
    (:func:`scale.training.checks.dtype_census`) and the mixed-precision paths in use, each within
    :data:`LINE_WIDTH`."""
    tail = [f"parameter dtypes: {dtypes}"] + ([f"bf16 paths: {', '.join(cpu_paths)}"] if cpu_paths else [])
    return lines_within("mode plan: ", notes or ["defaults"]) + lines_within("", tail)


def launch_comment(plan: ModePlan, processes: int, global_batch_size: int) -> str:
    """The header of ``config.yaml``: the launch's degrees, which no config key holds alone."""
    return (f"launch: mode {plan.mode}, {processes} process(es) = data_parallel_size {plan.data_parallel_size} x "
            f"sequence_parallel_size {plan.sequence_parallel_size}; global_batch_size {global_batch_size} "
            f"(micro_batch_size x gradient_accumulation_steps x data_parallel_size)")


def log_data_stats(stats: dict[str, int], data_cfg: Any = None, unit: str = "rows") -> None:
    """One line with the data counts (:func:`scale.data.stats_line`); a warning for each kind of thing the chat
    template or truncation removed (:func:`scale.data.removed_lines`), and when eval rows (``unit="pairs"``:
    preference pairs) are exact copies of training ones."""
    logger.info("data: %s", stats_line(stats))
    for line in removed_lines(stats, data_cfg, unit) if data_cfg is not None else []:
        logger.warning("data: %s", line)
    if stats.get("data/eval_rows_in_train"):
        logger.warning("%d of %d eval %s are exact copies of training %s: eval figures are not fully held "
                       "out. Set data.deduplicate=true to drop duplicates before the split.",
                       stats["data/eval_rows_in_train"], stats["data/eval_rows"], unit, unit)


def report_start(launch: Launch, cfg: Config, data: Data, loaders: Loaders, model: torch.nn.Module,
                 cpu_paths: list[str], max_steps: int, counts: tuple[int, int]) -> None:
    """The start-up lines of the main process (module docstring), before the first step: the launch, packing,
    one step's tokens and the parameters (``counts``: trainable and total,
    :func:`scale.modeling.build.parameter_counts`), the data counts, a train row as trained, the differences from TRL's
    defaults and the mode plan."""
    acc, plan, splits = launch.acc, launch.plan, data.splits
    if not acc.is_main_process:
        return
    warn_untested(logger)  # one line when a dependency is outside the versions the tests passed on
    trainable, total = counts
    G, bins, sp = loaders.global_batch_size, loaders.bins, cfg.train.sequence_parallel_size
    lengths = column(splits.train, "length")  # per-row columns, no token read
    shared = f" sequence_parallel_size={sp}" if sp > 1 else ""  # world_size = data-parallel x sequence ranks
    logger.info("start: mode=%s world_size=%d%s global_batch_size=%d (micro_batch_size=%d x "
                "gradient_accumulation_steps=%d x %d data-parallel ranks) max_steps=%d", plan.mode,
                acc.num_processes, shared, G, cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps,
                plan.data_parallel_size, max_steps)
    sides, unit = max(len(splits.task.sides), 1), splits.task.unit  # preference: a loader item is a pair, 2 rows
    if bins is not None:
        logger.info(packing_text(len(splits.train) // sides, bins, lengths, cfg.data.max_length * sides, G, unit))
    per_step = (f"{G // cfg.rl.num_generations} prompts x rl.num_generations={cfg.rl.num_generations} = {G} "
                f"completions of <= rl.max_completion_length={cfg.rl.max_completion_length} tokens after prompts of "
                f"{lengths.mean():.1f} tokens on average" if cfg.loss.samples_online() else
                step_text(lengths, column(splits.train, "tail_len"), G * (sides if bins is None else 1), bins))
    logger.info("per step: %s; %s: train=%d eval=%d format=%s; parameters: trainable=%d total=%d (%.3f%%)",
                per_step, unit, splits.stats["data/train_rows"], splits.stats["data/eval_rows"], splits.format,
                trainable, total, 100 * trainable / total)
    log_data_stats(splits.stats, cfg.data, unit)
    if sides > 1:  # a pair's sides are consecutive examples, named by the task
        shown = "\n".join(f"({name})\n{show_example(data.tokenizer, e)}"
                          for name, e in zip(splits.task.sides, splits.train[:sides]))
        logger.info("a train pair as trained (%s):\n%s", show_legend(), shown)
    elif cfg.loss.samples_online():  # a prompt: nothing of it is trained, completions are sampled from it
        logger.info("a train prompt as the model reads it (each round samples rl.num_generations=%d completions of "
                    "it):\n%s", cfg.rl.num_generations, data.tokenizer.decode(splits.train[0].input_ids))
    else:
        logger.info("a train row as trained (%s):\n%s", show_legend(), show_example(data.tokenizer, splits.train[0]))
    for difference in differences_from_trl(cfg, min(warmup_steps(cfg.optim, max_steps), max_steps - 1)):
        logger.info("unlike TRL: %s", difference)
    for line in mode_plan_lines(plan.notes, dtype_census(model), cpu_paths):
        logger.info(line)


def report_experts(lines: list[str], acc: Accelerator, warnings: list[str] = ()) -> None:
    """The lines of a mixture-of-experts model (:mod:`scale.training.parts.experts`): what LoRA trains in it
    (attention, experts, router), its dropout and 4-bit notes, the load-balancing loss' weight; nothing for a dense
    model. ``warnings`` (the saved adapter would not load with the installed peft alone) are logged as warnings."""
    if lines and acc.is_main_process:
        for line in lines_within("", lines):
            logger.info(line)
        for line in warnings:
            logger.warning(line)


def report_precision(precision: PrecisionChoice | None, acc: Accelerator, masters: str | None = None) -> None:
    """The line of ``train.mixed_precision=auto``: what it chose, why, and the GEMM rates it measured. Those are
    this start's probes (one short GEMM per dtype, :func:`scale.training.precision.measure_peak_flops`), read for
    their ratio only; the next line's MFU peak is another figure (the machine's best,
    :func:`scale.training.precision.machine_peak`), and the line says so, since a busy start probes well below it.
    Before it, ``masters``: a full fine-tune's checked precision
    (:func:`scale.training.precision.check_full_precision`).
    """
    if masters is not None and acc.is_main_process:
        logger.info(masters)
    if precision is not None and acc.is_main_process:
        logger.info("train.mixed_precision=auto -> %s: %s%s", precision.choice, precision.reason,
                    "" if precision.fp32_flops is None else
                    f" (this start's probes, one short GEMM each, for their ratio only: fp32 "
                    f"{precision.fp32_flops / 1e9:.3g} GFLOP/s, bf16 {precision.bf16_flops / 1e9:.3g} GFLOP/s; "
                    f"train/mfu divides by the MFU peak below)")


def report_peak(peak: PeakFlops, acc: Accelerator) -> None:
    """The line of the MFU peak: the FLOP/s ``train/mfu`` divides by, and where it came from."""
    if acc.is_main_process:
        logger.info("MFU peak: %s", peak.source)

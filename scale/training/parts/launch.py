"""The launch part: the Accelerator and the mode plan, the precision ``auto`` resolved once for every rank, the
checkpoint a resume continues from (picked and checked before anything is written), the seed, and the
sequence-parallel layout. Collective.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import set_seed
from torch.utils.data import DataLoader

from scale.config.schema import Config
from scale.distributed.launch import ModePlan, build_accelerator, plan_for_mode
from scale.distributed.ulysses import SequenceParallel
from scale.modeling.attention import check_attention, check_sequence_parallel_config
from scale.planner import plan_micro_batch
from scale.training.checkpoint import adapt_to_checkpoint, check_resume, pick_resume, register_hooks, saved_precision
from scale.training.precision import PrecisionChoice, resolve_mixed_precision
from scale.training.state import TrainerState

logger = get_logger(__name__)


@dataclass
class Launch:
    """How this process runs: built once by :func:`build_launch`.

    Attributes:
        acc: the run's Accelerator.
        plan: the launch mode's plan (:class:`scale.distributed.launch.ModePlan`).
        device: where this rank computes (``cuda`` when a GPU is visible, else ``cpu``).
        precision: what ``train.mixed_precision: auto`` resolved to, or None when it was set.
        resume: the checkpoint this run continues from, or None (a fresh start).
        saved: that checkpoint's progress (:class:`scale.training.state.TrainerState`), or None.
        sequence: the sequence-parallel layout (``train.sequence_parallel_size > 1``), or None.
    """

    acc: Accelerator
    plan: ModePlan
    device: torch.device
    precision: PrecisionChoice | None
    resume: Path | None
    saved: TrainerState | None
    sequence: SequenceParallel | None

    @property
    def data_parallel_size(self) -> int:
        """Ranks that train different rows (processes / ``train.sequence_parallel_size``)."""
        return self.plan.data_parallel_size


def build_launch(cfg: Config) -> Launch:
    """The accelerator, the mode plan and the resume, in the order every rank must run them. Collective.

    ``train.mixed_precision=auto`` is resolved in place, once for every rank (rank 0 decides, a resume keeps its
    checkpoint's): ``config.yaml``, the checkpoints and the Accelerator get the choice. ``train.micro_batch_size=auto``
    is resolved in place before anything reads the batch (:func:`scale.planner.plan_micro_batch`), and a GPU
    run whose plan uses under a quarter of the device is told so; one start-up line each. A resume on another number
    of processes keeps the checkpoint's global batch: the accumulation is set before the accelerator (and a
    DeepSpeed config) reads it; ``WORLD_SIZE`` is the launcher's (1 without one).

    Raises:
        ConfigError, LaunchError, CheckpointError: bad input, before anything is written.
    """
    check_attention(cfg.model)  # before the process group, the data and the model
    check_sequence_parallel_config(cfg.model, cfg.train.sequence_parallel_size)  # before the Accelerator
    out = Path(cfg.output_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data_parallel = cfg.train.data_parallel_size(int(os.environ.get("WORLD_SIZE", "1")))
    micro_batch = plan_micro_batch(cfg, data_parallel, device)  # auto resolved: before the accelerator reads the batch
    regrouped = adapt_to_checkpoint(cfg, data_parallel)
    decided: list[Any] = []
    acc = build_accelerator(cfg, settle=lambda: decided.append(
        resolve_mixed_precision(cfg, device, saved=saved_precision(cfg.train.resume_from, out))))  # collective
    plan = plan_for_mode(cfg, acc)
    if acc.is_main_process:
        for line in (micro_batch.line(), regrouped):
            if line:
                logger.info(line)
    resume = pick_resume(acc, cfg)  # collective: latest/auto -> the newest checkpoint that verifies
    saved = check_resume(acc, cfg, plan, resume, regrouped=regrouped is not None)  # collective; before writing
    set_seed(cfg.train.seed)
    sp = cfg.train.sequence_parallel_size
    sequence = SequenceParallel.for_process(acc, sp, cfg.model.attn_implementation) if sp > 1 else None
    return Launch(acc, plan, device, decided[-1], resume, saved, sequence)


def prepare(launch: Launch, cfg: Config, model: torch.nn.Module, optimizer: Any, scheduler: Any, train_dl: DataLoader,
            eval_dl: DataLoader) -> tuple[torch.nn.Module, Any, DataLoader, DataLoader]:
    """``acc.prepare`` for the launch mode: the model, optimizer and loaders wrapped (under sequence parallelism
    accelerate builds the groups and the engine, and the loaders are sharded over data-parallel ranks only); the
    scheduler (not prepared: a prepared one steps ``num_processes`` times per optimizer step) registered for
    checkpointing, and the checkpoint hooks (:func:`scale.training.checkpoint.register_hooks`). Collective.

    Returns:
        ``(model, optimizer, train_dl, eval_dl)`` as prepared.
    """
    acc, sequence = launch.acc, launch.sequence
    if sequence is None:
        model, optimizer, train_dl = acc.prepare(model, optimizer, train_dl)
        acc.even_batches = True  # eval: gather_for_metrics drops the repeated samples
        eval_dl = acc.prepare(eval_dl)
    else:
        config = (model.get_base_model() if hasattr(model, "get_base_model") else model).config
        model, optimizer = acc.prepare(model, optimizer)
        sequence.install(config)
        train_dl = sequence.loader(acc, train_dl, even_batches=False)
        eval_dl = sequence.loader(acc, eval_dl, even_batches=True)
        # Dropout draws per shard (the group's ranks would otherwise repeat one mask on every shard); after the
        # loaders, whose samplers took their seed from this RNG and must agree on every rank.
        torch.manual_seed(cfg.train.seed + sequence.rank)
    acc.register_for_checkpointing(scheduler)
    register_hooks(acc)
    return model, optimizer, train_dl, eval_dl

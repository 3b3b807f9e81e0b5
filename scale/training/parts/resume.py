"""The resume-or-start part: the run's progress (:class:`scale.training.state.TrainerState`), either fresh or restored
from the checkpoint the launch picked (model, optimizer, scheduler and RNG states, in any launch mode). Collective.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from accelerate.logging import get_logger

from scale.config.schema import Config
from scale.data.mixing import data_digest
from scale.training.checkpoint import load_checkpoint
from scale.training.parts.data import Data
from scale.training.parts.launch import Launch
from scale.training.state import TrainerState

logger = get_logger(__name__)


def resume_or_start(launch: Launch, cfg: Config, data: Data, model: torch.nn.Module, optimizer: Any,
                    scheduler: Any) -> TrainerState:
    """This run's progress: step 0 with the digests of what it trains (data file, chat template, tokenized rows),
    or the checkpoint's, once its states are loaded (:func:`scale.training.checkpoint.load_checkpoint`: the digests must
    match). Collective.

    Raises:
        ConfigError: the data, template or rows differ from the checkpoint's.
        CheckpointError: the checkpoint's portable state does not fit this model.
    """
    acc, splits = launch.acc, data.splits
    state = TrainerState(step=0, epoch=0, windows_in_epoch=0, world_size=acc.num_processes,
                         data_sha256=data_digest(cfg, data.path), template_sha256=splits.template_sha256,
                         rows_sha256=splits.fingerprint, mixed_precision=cfg.train.mixed_precision)
    if launch.resume is not None:
        return load_checkpoint(acc, cfg, launch.plan, launch.resume, launch.saved, model, optimizer, scheduler,
                               state)  # collective
    if cfg.train.resume_from in ("latest", "auto") and acc.is_main_process:
        logger.info("resume_from=%s: no checkpoint in %s yet, starting fresh", cfg.train.resume_from,
                    Path(cfg.output_dir) / "checkpoints")
    return state

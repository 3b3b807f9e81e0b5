"""A run, assembled: everything the loop needs, built from the config before the first step (:func:`setup`).

    job = setup(load_config("tiny_cpu"))     # accelerator, mode plan, data, model, optimizer, resume, trackers
    fit(job)                                 # scale.train: the loop

Each part builds itself in its own module (:mod:`scale.training.parts`), as torchtitan's ``Trainer.__init__`` and
torchtune's recipe ``setup()`` do; :func:`setup` is the list, in order. Order matters and is the point: the launch
mode and every resume check come before anything is written; one process prepares the cached assets before the
others read them; the config is written only after the data and the model were accepted; the model is measured
for MFU before ``prepare`` wraps it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from scale.config.load import dump_config
from scale.config.schema import Config
from scale.data.tasks.base import Task
from scale.distributed.launch import ModePlan
from scale.distributed.ulysses import SequenceParallel
from scale.modeling.build import parameter_counts
from scale.objectives import build_objective
from scale.objectives.base import Objective
from scale.objectives.router_aux import with_router_aux
from scale.training.checkpoint import clear_previous_run
from scale.training.metrics import MetricsLog, model_flops
from scale.training.parts.data import build_data, check_type_weights
from scale.training.parts.experts import Experts, build_experts
from scale.training.parts.launch import build_launch, prepare
from scale.training.parts.loaders import build_loaders, warn_larger_than_split
from scale.training.parts.log import build_generation, build_log, pick_eval_samples
from scale.training.parts.model import build_run_model, flops_shape
from scale.training.parts.optimizer import make_optimizer
from scale.training.parts.preference import (keep_reference, load_frozen_reference, precompute_references,
                                             wrap_reference)
from scale.training.parts.resume import resume_or_start
from scale.training.parts.rl import Rl, build_rl, check_rl, pick_rl_metrics, rl_loaders
from scale.training.precision import check_full_precision, resolve_peak_flops
from scale.training.samples import Generation
from scale.training.startup import launch_comment, report_experts, report_peak, report_precision, report_start
from scale.training.state import TrainerState


@dataclass
class Job:
    """Everything :func:`setup` builds and :func:`fit` runs."""

    cfg: Config
    acc: Accelerator
    plan: ModePlan
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    train_dl: DataLoader
    eval_dl: DataLoader
    objective: Objective  # loss.objective (scale.objectives): the micro-batches' weights and loss numerators
    log: MetricsLog
    state: TrainerState
    flops_fn: Callable[[int, int], float] | None = None
    peak_flops: float | None = None
    max_steps: int | None = None  # optimizer steps of the run; None: train.max_steps (see setup for num_epochs)
    gen: Generation | None = None  # eval.generate_samples > 0: what every evaluation generates (scale.training.samples)
    task: Task | None = None  # the eval split's prepared task (its format's metrics); None: the eval loader's
    chat: bool = True  # the rows were rendered by a chat template (Splits.template_sha256): adapter/ carries it
    sequence: SequenceParallel | None = None  # train.sequence_parallel_size > 1 (scale.distributed.ulysses)
    experts: Experts | None = None  # a mixture-of-experts model (scale.training.parts.experts); None for a dense one
    rl: Rl | None = None  # loss.objective=grpo: the rollouts the loop trains and their evaluation (parts/rl.py)

    def __post_init__(self) -> None:
        if self.max_steps is None:
            self.max_steps = self.cfg.train.max_steps


def setup(cfg: Config) -> Job:
    """Build everything the loop needs, resume if asked, and write ``config.yaml``: nothing is trained.

    Raises:
        DataError, ConfigError, LaunchError, CheckpointError: bad input, before anything is written (except
            that an edited data file is detected when the checkpoint is loaded).
    """
    launch = build_launch(cfg)  # collective: accelerator, mode plan, precision; the resume picked and checked
    acc = launch.acc
    data = build_data(launch, cfg)  # collective: the tokenizer and the token cache's splits
    rewards = check_rl(launch, cfg) if cfg.loss.samples_online() else None  # grpo: rewards and generator, first
    model, cpu_paths = build_run_model(launch, cfg, len(data.tokenizer))  # collective
    frozen = load_frozen_reference(launch, cfg, len(data.tokenizer))  # collective; full + dpo/grpo's reference
    experts = build_experts(cfg, model, acc.device, {"zero3": "ZeRO-3", "fsdp": "FSDP2"}.get(launch.plan.mode)
                            if launch.plan.partitioned else None)  # a mixture of experts: its hooks, before writing
    loaders = (rl_loaders(launch, cfg, data.splits) if rewards is not None else
               build_loaders(launch, cfg, data.splits, data.tokenizer.pad_token_id))
    check_type_weights(cfg, data.splits)
    base = build_objective(cfg)  # loss.objective
    keep_reference(cfg, model, base)  # model.adapter under DPO: its frozen copy is the reference
    objective = with_router_aux(base, experts.aux if experts else None)  # + the routers' load-balancing loss
    samples = (pick_rl_metrics(cfg, rewards) if rewards is not None else
               pick_eval_samples(cfg, data.splits, objective))  # checks train.keep_best before step 1
    warn_larger_than_split(launch, cfg, loaders)
    clear_previous_run(acc, cfg, launch.resume)  # collective; train.overwrite_output_dir=true: the old run goes
    max_steps = loaders.max_steps(cfg)
    if acc.is_main_process:
        Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
        dump_config(cfg, Path(cfg.output_dir) / "config.yaml",
                    comment=launch_comment(launch.plan, acc.num_processes, loaders.global_batch_size))
    optimizer, scheduler = make_optimizer(cfg, model, max_steps)
    shape = flops_shape(model)  # before prepare: acc.unwrap_model imports deepspeed whenever it is installed
    model, optimizer, train_dl, eval_dl = prepare(launch, cfg, model, optimizer, scheduler, loaders.train,
                                                  loaders.eval)  # collective
    frozen = wrap_reference(launch, cfg, frozen)  # collective: sharded as the policy; never saved
    if frozen is not None and hasattr(base, "reference_model"):
        base.reference_model = frozen  # loss.reference=model: the objective calls it in the step
    precompute_references(acc, cfg, model, base, data.splits, data.tokenizer.pad_token_id,
                          [train_dl, eval_dl])  # collective; loss.reference=precomputed only
    counts = parameter_counts(model)  # (trainable, total)
    masters = check_full_precision(cfg, launch.plan.mode, model, optimizer)  # model.finetune=full: fp32 masters
    report_start(launch, cfg, data, loaders, model, cpu_paths, max_steps, counts)
    report_experts(experts.lines if experts else [], acc, experts.warnings if experts else [])
    state = resume_or_start(launch, cfg, data, model, optimizer, scheduler)  # collective
    log = build_log(launch, cfg, data.splits, state)
    report_precision(launch.precision, acc, masters)
    peak = resolve_peak_flops(cfg, acc)  # collective when measured on several ranks
    report_peak(peak, acc)
    flops_fn = model_flops(cfg, shape, counts[0]) if shape is not None else None
    chat = bool(data.splits.template_sha256)  # a chat template rendered the rows (classification, text: none did)
    gen = build_generation(launch, cfg, samples, chat, state, base)
    rl = build_rl(launch, cfg, data.splits, model, base, state, rewards, loaders.plan, chat, frozen) \
        if rewards is not None else None  # grpo: the loop trains its rollouts instead of the train loader
    return Job(cfg, acc, launch.plan, model, optimizer, scheduler, rl.source if rl else train_dl, eval_dl, objective,
               log, state, flops_fn, peak.flops, max_steps, gen, data.splits.task, sequence=launch.sequence, chat=chat,
               experts=experts, rl=rl)

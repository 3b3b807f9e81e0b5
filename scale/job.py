"""A run, assembled: everything the loop needs, built from the config before the first step (:func:`setup`).

    job = setup(load_config("tiny_cpu"))     # accelerator, mode plan, data, model, optimizer, resume, trackers
    fit(job)                                 # scale.train: the loop

Order matters and is the point of this module: the launch mode and every resume check come before anything is
written; one process prepares the cached assets before the others read them; the config is written only after
the data and the model were accepted; the model is measured for MFU before ``prepare`` wraps it.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import broadcast_object_list, set_seed
from torch.utils.data import DataLoader

from scale.assets import EMBEDDED_MODEL, resolve_data, resolve_model
from scale.best import check_reported
from scale.checkpoint import (STATE_FILE, TrainerState, adapt_to_checkpoint, check_resume, clear_previous_run,
                              load_checkpoint, pick_resume, register_hooks, resolve_resume)
from scale.checks import dtype_census
from scale.compat import warn_untested
from scale.config import Config, ConfigError, dump_config
from scale.data.cache import load_splits, wait_for_splits
from scale.data.collate import Collator, PackedCollator, PaddingFreeCollator
from scale.data.mixing import data_digest
from scale.data.mixing import sources as mixture_sources
from scale.data.order import LengthGroupedSampler, PackedRows, pack_bfd
from scale.data.read import DataError
from scale.data.sequence import ShardCollator
from scale.data.tasks.base import Task
from scale.data.token_table import column, longest_first
from scale.data.tokenize import Splits, removed_lines, show_example, show_legend, stats_line
from scale.export import serving_tokenizer
from scale.evaluate import metric_names
from scale.launch import ModePlan, build_accelerator, main_process_first, plan_for_mode
from scale.loss import LossSpec
from scale.metrics import JsonlSink, MetricsLog, model_flops, resolve_mixed_precision, resolve_peak_flops
from scale.modeling import (CPU_MIXED_PATHS, TINY, build_model, check_attention, check_packing,
                            check_sequence_parallel, check_sequence_parallel_config, load_tokenizer,
                            parameter_counts, tokenizer_source, use_cpu_mixed_paths)
from scale.moe import ExpertLoad, RouterAux, model_shape, moe_layout, targets_line
from scale.names import differences_from_trl
from scale.samples import SAMPLES_FILE, Generation, pick_samples, sample_metric_names, start_samples_file
from scale.schedule import lr_factor, steps_for_epochs, warmup_steps
from scale.tracking import start_trackers
from scale.ulysses import SequenceParallel

logger = get_logger(__name__)


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
    spec: LossSpec
    log: MetricsLog
    state: TrainerState
    flops_fn: Callable[[int, int], float] | None = None
    peak_flops: float | None = None
    max_steps: int | None = None  # optimizer steps of the run; None: train.max_steps (see setup for num_epochs)
    gen: Generation | None = None  # eval.generate_samples > 0: what every evaluation generates (scale.samples)
    task: Task | None = None  # the eval split's prepared task (its format's metrics); None: the eval loader's
    chat: bool = True  # the rows were rendered by a chat template (Splits.template_sha256): adapter/ carries it
    sequence: SequenceParallel | None = None  # train.sequence_parallel_size > 1 (scale.ulysses)
    expert_load: ExpertLoad | None = None  # a mixture-of-experts model: tokens per expert (scale.moe)
    router_aux: RouterAux | None = None  # its load-balancing loss while the routers train (loss.router_aux_coef)

    def __post_init__(self) -> None:
        if self.max_steps is None:
            self.max_steps = self.cfg.train.max_steps



def make_loaders(cfg: Config, splits: Splits, pad_token_id: int, data_parallel_size: int = 1,
                 sequence: SequenceParallel | None = None) -> tuple[DataLoader, DataLoader]:
    """The train loader (shuffled by ``train.seed``, re-shuffled each epoch) and the eval loader (unprepared).

    accelerate shards the train loader by whole micro-batches (rank ``r`` gets batches ``r, r + W, ...``), so
    every launch mode with the same global batch sees the same rows in every optimizer step. With
    ``data.group_by_length`` the order comes from :class:`scale.data.order.LengthGroupedSampler`, built from the
    global batch (``data_parallel_size`` ranks) before sharding, so that still holds. With ``data.padding_free``
    train micro-batches are packed rows (:class:`scale.data.collate.PaddingFreeCollator`); with ``data.packing`` the
    rows are first packed into bins of ``data.max_length`` tokens (:func:`scale.data.order.pack_bfd`), built from
    the stored lengths alone (the same bins on every rank), and the loader shuffles and shards bins.
    Under sequence parallelism (``sequence``) a train micro-batch becomes this rank's shard of its rows
    (:class:`scale.data.sequence.ShardCollator`); both loaders are later sharded over the data-parallel ranks only.
    """
    collate = Collator(pad_token_id, cfg.data.padding_side)
    train_collate = PaddingFreeCollator() if cfg.data.padding_free else collate
    t = cfg.train
    train, lengths = splits.train, column(splits.train, "length").tolist()  # per-row columns: no token read
    if cfg.data.packing:  # the loader deals in bins of rows (scale.data.order.pack_bfd)
        train = PackedRows(splits.train, pack_bfd(lengths, cfg.data.max_length))
        lengths, train_collate = train.lengths(lengths), PackedCollator()
    if sequence is not None:
        train_collate = ShardCollator(sequence.rank, sequence.size, pad_token_id,
                                      one_row=cfg.data.packing or cfg.data.padding_free)
    if cfg.data.group_by_length:
        sampler = LengthGroupedSampler(lengths, t.global_batch_size(data_parallel_size), cfg.data.mega_batch_steps,
                                       t.seed)
        # A generator of its own: each iter() of a DataLoader draws a base seed from it, else from the global
        # RNG, and a resumed run (one iter() more) would then draw other dropout masks.
        train_dl = DataLoader(train, batch_size=t.micro_batch_size, sampler=sampler, collate_fn=train_collate,
                              generator=torch.Generator().manual_seed(t.seed), num_workers=cfg.data.num_workers)
    else:
        train_dl = DataLoader(train, batch_size=t.micro_batch_size, shuffle=True, collate_fn=train_collate,
                              generator=torch.Generator().manual_seed(t.seed), num_workers=cfg.data.num_workers)
    # Evaluation order does not change its sums; longest first keeps padding (and peak memory) low.
    eval_dl = DataLoader(longest_first(splits.eval),  # a view of a cached split
                         batch_size=t.eval_micro_batch_size, shuffle=False, collate_fn=collate,
                         num_workers=cfg.data.num_workers)
    return train_dl, eval_dl


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
                 global_batch_size: int) -> str:
    """The start-up line of ``data.packing``: how many bins the train rows went into, how full they are, and the
    optimizer steps of an epoch (``ceil(bins / global_batch_size)``, :func:`scale.schedule.steps_for_epochs`)."""
    k = max(len(bins), 1)
    full = float(np.sum(lengths)) / (k * max_length)
    return (f"packing: {rows} train rows into {len(bins)} bins of up to data.max_length={max_length} tokens "
            f"({rows / k:.2f} rows/bin, {full:.0%} full); an epoch is ceil({len(bins)} bins / global_batch_size "
            f"{global_batch_size}) = {steps_for_epochs(len(bins), global_batch_size, 1)} optimizer step(s)")


def make_optimizer(cfg: Config, model: torch.nn.Module, max_steps: int | None = None
                   ) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (or SGD) over the trainable parameters, and the LR schedule of :mod:`scale.schedule` over
    ``max_steps`` optimizer steps (default ``train.max_steps``).

    The scheduler is NOT prepared: a prepared one steps ``num_processes`` times per optimizer step.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    if o.name == "sgd":
        optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    steps = max_steps or cfg.train.max_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, o, steps))
    return optimizer, scheduler


def setup(cfg: Config) -> Job:
    """Build everything the loop needs, resume if asked, and write ``config.yaml``: nothing is trained.

    Raises:
        DataError, ConfigError, LaunchError, CheckpointError: bad input, before anything is written (except
            that an edited data file is detected when the checkpoint is loaded).
    """
    check_attention(cfg.model)  # before the process group, the data and the model
    check_sequence_parallel_config(cfg.model, cfg.train.sequence_parallel_size)  # before the Accelerator
    # train.mixed_precision=auto resolved in place, once for every rank (rank 0 decides, a resume keeps its
    # checkpoint's): config.yaml, the checkpoints and the Accelerator get the choice
    out = Path(cfg.output_dir)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    # A resume on another number of processes keeps the checkpoint's global batch: the accumulation is set before
    # the accelerator (and a DeepSpeed config) reads it. WORLD_SIZE is the launcher's (1 without one).
    regrouped = adapt_to_checkpoint(cfg, cfg.train.data_parallel_size(int(os.environ.get("WORLD_SIZE", "1"))))
    decided: list[Any] = []
    acc = build_accelerator(cfg, settle=lambda: decided.append(
        resolve_mixed_precision(cfg, device, saved=saved_precision(cfg.train.resume_from, out))))  # collective
    precision = decided[-1]
    plan = plan_for_mode(cfg, acc)
    if regrouped and acc.is_main_process:
        logger.info(regrouped)
    resume = pick_resume(acc, cfg)  # collective: latest/auto -> the newest checkpoint that verifies
    saved_state = check_resume(acc, cfg, plan, resume, regrouped=regrouped is not None)  # collective; before writing
    set_seed(cfg.train.seed)
    sp = cfg.train.sequence_parallel_size
    sequence = SequenceParallel.for_process(acc, sp, cfg.model.attn_implementation) if sp > 1 else None
    together = plan.mode == "zero3"  # from_pretrained under ZeRO-3 runs collectives: every rank loads at once

    # What is on this machine (the built-in tiny-llama, an embedded asset, a directory) every rank reads at once,
    # once the main process has prepared it; a hub id (a download) is loaded on the main process first.
    tokenizer_here = on_this_machine(tokenizer_source(cfg.model))
    model_here = on_this_machine(cfg.model.name_or_path)

    def assets() -> tuple[Any, str]:
        tokenizer = None if tokenizer_here else load_tokenizer(cfg.model)
        if tokenizer_here:
            resolve_model(tokenizer_source(cfg.model))  # an embedded asset, prepared once
        if model_here or together:
            resolve_model(cfg.model.name_or_path)  # the asset (SmolLM2's conversion), prepared once
        if cfg.data.datasets:  # data.path is not read; the sources' embedded names are prepared
            mixture_sources(cfg.data)
            return tokenizer, cfg.data.path
        return tokenizer, resolve_data(cfg.data.path)

    def prepare_model() -> torch.nn.Module:
        model = build_model(cfg.model, cfg.lora, len(tokenizer), cfg.train.seed, device_map=plan.device_map)
        check_packing(model, cfg.data.padding_free, cfg.data.packing)  # before anything is written
        return model

    # One process prepares the cached assets, the others then read them; an error there stops every rank.
    run_id = shared_run_id(acc)  # collective
    tokenizer, data_path = main_process_first(acc, assets)  # collective
    if tokenizer is None:
        tokenizer = on_every_rank(acc, lambda: load_tokenizer(cfg.model))  # collective
    # The token cache: the node's main process finds or builds it (build_splits inside) while the
    # other ranks poll its build record: no collective is open during a build of any length. Then the ranks agree.
    splits = on_every_rank(acc, lambda: load_splits(cfg, tokenizer, data_path, run_id) if acc.is_local_main_process
                           else wait_for_splits(cfg, tokenizer, data_path, run_id))  # collective, after the build
    if together:
        model = build_model_on_every_rank(acc, cfg, plan, len(tokenizer))  # collective
    else:
        model = (on_every_rank if model_here else main_process_first)(acc, prepare_model)  # collective
    check_sequence_parallel(model, cfg.model, sp, cfg.data.packing or cfg.data.padding_free, cfg.data.max_length)
    layout = moe_layout(model)  # a mixture-of-experts model: what trains, the tokens per expert, the aux loss
    router_aux = RouterAux.for_run(model, layout, cfg.loss.router_aux_coef, cfg.lora.train_router)  # before writing
    experts_line = targets_line(model, layout, cfg.lora.dropout, cfg.model.quantize_4bit) if layout else None
    expert_load = ExpertLoad(model, layout, acc.device) if layout else None
    # bf16 autocast on CPU: attention, casts and the 4-bit backward where they are fastest (scale.modeling)
    # Under sequence parallelism the attention stays the one Ulysses wraps (its name is what scale.ulysses registers).
    paths = [n for n in CPU_MIXED_PATHS if not (sequence is not None and n == "attention_fp32_short")]
    cpu_paths = (use_cpu_mixed_paths(model, paths) if device.type == "cpu" and cfg.train.mixed_precision == "bf16"
                 and not plan.partitioned else [])
    mb, ga, world = cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps, plan.data_parallel_size
    G = cfg.train.global_batch_size(world)
    train_dl, eval_dl = make_loaders(cfg, splits, tokenizer.pad_token_id, world, sequence)
    items = len(train_dl.dataset)  # rows, or with data.packing the bins of rows the loader deals in
    train_bins = train_dl.dataset if isinstance(train_dl.dataset, PackedRows) else None
    unit = f"bins of up to data.max_length={cfg.data.max_length} tokens" if cfg.data.packing else "rows"
    if mb * world > items:
        raise DataError(f"train.micro_batch_size={mb} x data-parallel ranks={world} is larger than the train split "
                        f"({items} {unit}): a rank's shard would hold less than one micro-batch. "
                        f"Lower train.micro_batch_size to at most {max(1, items // world)} or add data.")
    check_type_weights(cfg, splits)
    spec = LossSpec.from_config(cfg)
    samples = pick_samples(splits.eval, cfg.eval.generate_samples, cfg.data.labels) if cfg.eval.generate_samples \
        else []
    check_reported(cfg.train.keep_best, metric_names(splits.task, spec) | sample_metric_names(samples))  # before step 1
    if G > items and acc.is_main_process:
        logger.warning("global_batch_size=%d (micro_batch_size x gradient_accumulation_steps x data-parallel ranks) is "
                       "larger than the train split (%d %s): every optimizer step sees at most one epoch",
                       G, items, unit)
    clear_previous_run(acc, cfg, resume)  # train.overwrite_output_dir=true: the old run's artefacts go
    # With data.packing an epoch is len(bins) items, not len(rows)
    max_steps = cfg.train.max_steps or steps_for_epochs(len(train_dl.dataset), G, cfg.train.num_epochs)
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out / "config.yaml", comment=launch_comment(plan, acc.num_processes, G))
    optimizer, scheduler = make_optimizer(cfg, model, max_steps)
    shape = flops_shape(model)  # before prepare: acc.unwrap_model imports deepspeed whenever it is installed
    if sequence is None:
        model, optimizer, train_dl = acc.prepare(model, optimizer, train_dl)
        acc.even_batches = True  # eval: gather_for_metrics drops the repeated samples
        eval_dl = acc.prepare(eval_dl)
    else:  # accelerate builds the groups and the engine; the loaders are sharded over data-parallel ranks only
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

    trainable, total = parameter_counts(model)
    lengths = column(splits.train, "length")  # per-row columns, no token read
    bins = train_bins.bins if train_bins is not None else None
    if acc.is_main_process:  # lines under 300 characters: they end up in SLURM and nohup logs
        warn_untested(logger)  # one line when a dependency is outside the versions the tests passed on
        shared = f" sequence_parallel_size={sp}" if sp > 1 else ""  # world_size = data-parallel x sequence ranks
        logger.info("start: mode=%s world_size=%d%s global_batch_size=%d (micro_batch_size=%d x "
                    "gradient_accumulation_steps=%d x %d data-parallel ranks) max_steps=%d", plan.mode,
                    acc.num_processes, shared, G, mb, ga, world, max_steps)
        if bins is not None:
            logger.info(packing_text(len(splits.train), bins, lengths, cfg.data.max_length, G))
        logger.info("per step: %s; rows: train=%d eval=%d format=%s; parameters: trainable=%d total=%d (%.3f%%)",
                    step_text(lengths, column(splits.train, "tail_len"), G, bins), len(splits.train),
                    len(splits.eval), splits.format, trainable, total, 100 * trainable / total)
        if experts_line:
            aux = [f"loss.router_aux_coef={router_aux.coef:g} (load-balancing loss)"] if router_aux else []
            for line in lines_within("", experts_line + aux):
                logger.info(line)
        log_data_stats(splits.stats, cfg.data)
        logger.info("a train row as trained (%s):\n%s", show_legend(), show_example(tokenizer, splits.train[0]))
        for difference in differences_from_trl(cfg, min(warmup_steps(cfg.optim, max_steps), max_steps - 1)):
            logger.info("unlike TRL: %s", difference)
        for line in mode_plan_lines(plan.notes, dtype_census(model), cpu_paths):
            logger.info(line)
    state = TrainerState(step=0, epoch=0, windows_in_epoch=0, world_size=acc.num_processes, data_sha256=data_digest(cfg, data_path),
                         template_sha256=splits.template_sha256, rows_sha256=splits.fingerprint,
                         mixed_precision=cfg.train.mixed_precision)
    if resume is not None:
        state = load_checkpoint(acc, cfg, plan, resume, saved_state, model, optimizer, scheduler, state.data_sha256,
                                state.template_sha256, state.rows_sha256)  # collective
    elif cfg.train.resume_from in ("latest", "auto") and acc.is_main_process:
        logger.info("resume_from=%s: no checkpoint in %s yet, starting fresh", cfg.train.resume_from,
                    out / "checkpoints")
    # A resumed run keeps the history up to its checkpoint and drops what was logged after it; the trackers
    # then continue the job's run and get the rows they lack (scale.tracking).
    sink = JsonlSink(out / "metrics.jsonl", acc.is_main_process, keep_until=state.step if resume else None)
    log = MetricsLog(acc, sink, skip_below=start_trackers(cfg, acc, state))
    if resume is None:
        log.write(0, {**splits.stats, **(precision.metrics() if precision else {})})  # once per run
    if precision is not None and acc.is_main_process:
        logger.info("train.mixed_precision=auto -> %s: %s%s", precision.choice, precision.reason,
                    "" if precision.fp32_flops is None else
                    f" (fp32 {precision.fp32_flops / 1e9:.3g} GFLOP/s, bf16 {precision.bf16_flops / 1e9:.3g} GFLOP/s)")
    peak = resolve_peak_flops(cfg, acc)  # collective when measured on several ranks
    if acc.is_main_process:
        logger.info("MFU peak: %s", peak.source)
    flops_fn = model_flops(cfg, shape, trainable) if shape is not None else None
    gen = None
    chat = bool(splits.template_sha256)  # a chat template rendered the rows (classification, text: none did)
    if cfg.eval.generate_samples:
        serving, stops, _ = serving_tokenizer(cfg, chat=chat)  # EOS and the trained template's end-of-turn marker
        gen = Generation(samples, serving, stops, cfg.eval.max_new_tokens, plan.partitioned, out / SAMPLES_FILE)
        start_samples_file(gen.path, acc.is_main_process, state.step if resume else None)
    return Job(cfg, acc, plan, model, optimizer, scheduler, train_dl, eval_dl, spec, log, state,
               flops_fn, peak.flops, max_steps, gen, splits.task, sequence=sequence, chat=chat,
               expert_load=expert_load, router_aux=router_aux)


def mode_plan_lines(notes: list[str], dtypes: dict[str, int], cpu_paths: list[str]) -> list[str]:
    """The start-up lines of the mode plan (:attr:`scale.launch.ModePlan.notes`), the parameters' dtypes
    (:func:`scale.checks.dtype_census`) and the CPU bf16 paths in use, each within :data:`LINE_WIDTH`."""
    tail = [f"parameter dtypes: {dtypes}"] + ([f"CPU bf16 paths: {', '.join(cpu_paths)}"] if cpu_paths else [])
    return lines_within("mode plan: ", notes or ["defaults"]) + lines_within("", tail)


def launch_comment(plan: ModePlan, processes: int, global_batch_size: int) -> str:
    """The header of ``config.yaml``: the launch's degrees, which no config key holds alone."""
    return (f"launch: mode {plan.mode}, {processes} process(es) = data_parallel_size {plan.data_parallel_size} x "
            f"sequence_parallel_size {plan.sequence_parallel_size}; global_batch_size {global_batch_size} "
            f"(micro_batch_size x gradient_accumulation_steps x data_parallel_size)")


def saved_precision(resume_from: str | None, output_dir: Path) -> str | None:
    """The autocast the checkpoint ``train.resume_from`` names trained in (``bf16``, ``fp16``, ``no``), or None: a
    fresh start, or a checkpoint that cannot be read (:func:`scale.checkpoint.check_resume` then says why, on every
    rank). Read from its :class:`TrainerState` (``mixed_precision``), else from the config it saved (checkpoints
    written before the field existed hold the resolved value there)."""
    import json

    try:
        path = resolve_resume(resume_from, output_dir)
        if path is None:
            return None
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        value = state.get("mixed_precision") or state.get("config", {}).get("train", {}).get("mixed_precision")
    except Exception:  # noqa: BLE001 - reported by check_resume, collectively
        return None
    return value if value in ("bf16", "fp16", "no") else None


def build_model_on_every_rank(acc: Accelerator, cfg: Config, plan: ModePlan, vocab_size: int) -> torch.nn.Module:
    """Build the model on every rank at the same time, as DeepSpeed ZeRO-3 needs. Collective.

    Under ZeRO-3, transformers' ``from_pretrained`` creates the weights inside ``deepspeed.zero.Init`` and
    loads the checkpoint into the partitioned parameters through ``GatheredParameters``: both are collectives
    every rank must enter together. Built on the main process first (as the assets are), rank 0 waited in
    ``from_pretrained``'s broadcast while rank 1 waited in ``main_process_first``'s, and gloo aborted with "Is
    there a distributed collective mismatch". The ranks then agree on the outcome, so that an error
    on one rank (a missing file on one node) stops all of them with its message instead of a hang.

    Raises:
        Whatever :func:`scale.modeling.build_model` raises, on every rank (``rank_local`` when only this one).
    """
    return on_every_rank(acc, lambda: build_model(cfg.model, cfg.lora, vocab_size, cfg.train.seed,
                                                  device_map=plan.device_map))


def on_every_rank(acc: Accelerator, fn: Callable[[], Any]) -> Any:
    """``fn()`` on every rank, then the ranks agree on the outcome (collective): an error on one rank stops all
    of them, with its message, instead of a hang in the next collective.

    Raises:
        What ``fn`` raised on this rank (``rank_local`` when rank 0 did not fail: the CLI prints it), else a
        RuntimeError when ``fn`` failed on another rank only.
    """
    error: BaseException | None = None
    result = None
    try:
        result = fn()
    except Exception as e:  # noqa: BLE001 - agreed on below, then raised
        error = e
    if acc.num_processes == 1:
        if error is not None:
            raise error
        return result
    mine = float(error is not None)
    failed = acc.reduce(torch.tensor([mine * acc.is_main_process, mine], device=acc.device), reduction="sum")
    if error is not None:  # printed by this rank when rank 0 (whose message the CLI prints) did not fail
        error.rank_local = not acc.is_main_process and float(failed[0]) == 0  # type: ignore[attr-defined]
        raise error
    if float(failed[1]) > 0:
        raise RuntimeError("a step every rank runs failed on another rank (its message is in that rank's output)")
    return result


def on_this_machine(name_or_path: str) -> bool:
    """Whether a model or tokenizer source is read from this machine, not downloaded: the built-in ``tiny-llama``,
    an embedded asset (:func:`scale.assets.resolve_model`) or a directory. Every rank then loads it at once."""
    return name_or_path in (TINY, EMBEDDED_MODEL) or Path(name_or_path).is_dir()


def shared_run_id(acc: Accelerator) -> str:
    """A random id drawn on rank 0 and broadcast (collective): the ranks of one launch share it (the token
    cache's failure marker names it, :func:`scale.data.cache.wait_for_splits`)."""
    box = [uuid.uuid4().hex]
    if acc.num_processes > 1:
        broadcast_object_list(box, from_process=0)
    return box[0]


def flops_shape(model: torch.nn.Module) -> Any:
    """The model's matmul shape for the FLOPs count (:func:`scale.moe.model_shape`: a mixture of experts counts the
    experts a token uses), or ``None`` with one
    warning: an optional metric must never stop training."""
    try:
        return model_shape(model)
    except Exception as e:  # noqa: BLE001 - any family the count does not understand
        logger.warning("no FLOPs count (train/mfu) for this model: %s: %s", type(e).__name__, e,
                       main_process_only=True)
        return None


def check_type_weights(cfg: Config, splits: Splits) -> None:
    """Every row's type id has a weight in ``loss.type_weights``, before anything is written.

    Raises:
        ConfigError: classification without ``data.type_column`` (the label index is the type id) and fewer
            weights than labels.
        DataError: a row whose type id has no weight (names the row).
    """
    weights = cfg.loss.type_weights
    if weights is None:
        return
    labels = cfg.data.labels
    if splits.types_are_labels and cfg.data.type_column is None and len(weights) < len(labels):
        raise ConfigError(f"loss.type_weights={weights} has {len(weights)} weight(s) but data.labels has "
                          f"{len(labels)} labels, whose indices are the type ids (data.type_column is null); give "
                          f"one weight per label")
    unweighted = None
    for part in (splits.train, splits.eval):  # per-row columns, no token read
        types = column(part, "type_indicator")
        bad = np.flatnonzero((types < 0) | (types >= len(weights)))
        if unweighted is None and len(bad):
            unweighted = SimpleNamespace(row=int(column(part, "row")[bad[0]]), type_indicator=int(types[bad[0]]))
    if unweighted is not None:
        raise DataError(f"row {unweighted.row} has type id {unweighted.type_indicator} (data.type_column="
                        f"{cfg.data.type_column!r}) but loss.type_weights={weights} has weights for ids 0.."
                        f"{len(weights) - 1} only; give one weight per type id")


def log_data_stats(stats: dict[str, int], data_cfg: Any = None) -> None:
    """One line with the data counts (:func:`scale.data.stats_line`); a warning for each kind of thing the chat
    template or truncation removed (:func:`scale.data.removed_lines`), and when eval rows are exact copies of
    training rows."""
    logger.info("data: %s", stats_line(stats))
    for line in removed_lines(stats, data_cfg) if data_cfg is not None else []:
        logger.warning("data: %s", line)
    if stats.get("data/eval_rows_in_train"):
        logger.warning("%d of %d eval rows are exact copies of training rows: eval figures are not fully held "
                       "out. Set data.deduplicate=true to drop duplicates before the split.",
                       stats["data/eval_rows_in_train"], stats["data/eval_rows"])

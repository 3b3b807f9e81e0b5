"""The training loop: tail-loss LoRA/QLoRA fine-tuning on ``accelerate.Accelerator``.

    scale-train                                            # the default job (configs/train/default.yaml)
    scale-train --config configs/train/tiny_cpu.yaml train.max_steps=20
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m scale.train --config configs/train/tiny_cpu.yaml

Shapes: ``B`` micro-batch rows, ``T`` padded length, ``N`` the longest tail in a micro-batch, ``V`` vocabulary.
``step`` always counts optimizer steps; a forward/backward on one micro-batch is a micro-step.

The maths of one optimizer step: the window of ``gradient_accumulation_steps`` micro-batches on every rank
contributes ``sum(weighted tail CE) / sum(weights)`` where both sums run over the whole window and all
ranks. A partial last window (end of an epoch) is normalised by its own sums: not dropped, not rescaled.

Reading order: :func:`fit` (the loop), :func:`train_window` (one optimizer step),
:class:`scale.training.commit.StepCommit` (when that step is applied), :func:`scale.training.windows.windows` (how ranks
stay in step), :func:`run` (:func:`scale.training.job.setup`, which builds everything before the loop, + fit + the
adapter).
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from scale.config.schema import Config
from scale.distributed.ulysses import sharded
from scale.generation.export import save_serving_files, serving_tokenizer
from scale.training.best import observe, out_of_patience, write_best
from scale.training.checkpoint import (model_files, rng_states, save_adapter, save_checkpoint, save_model,
                                      set_rng_states)
from scale.training.checks import check_invariants, fingerprints
from scale.training.commit import HeldWindow, StepCommit, nonfinite_flag, where_text
from scale.training.evaluate import evaluate
from scale.training.job import Job, setup
from scale.training.metrics import Progress, StepMeter, duration_text
from scale.training.samples import SAMPLES_FILE, generate_samples, sample_metrics, write_samples
from scale.training.state import SaveTimer
from scale.training.tracking import finish_trackers, log_model
from scale.training.windows import Window, skip_trained, windows
from scale.utils.signals import EvalInterrupted, Preempted, Preemption

logger = get_logger(__name__)


def fit(job: Job, preemption: Preemption | None = None) -> dict[str, float]:
    """Run optimizer steps from ``job.state.step`` to ``job.max_steps``; evaluate at step 0, every
    ``eval_every`` and at the end; checkpoint every ``save_every`` steps or ``save_every_minutes``, at the end
    (when either is set), when pre-empted (also during an evaluation), and at each new best of
    ``train.keep_best``; stop early after ``train.early_stopping_patience`` evaluations without one.

    A resumed ``state`` continues mid-epoch: each rank skips the ``windows_in_epoch * GA`` micro-batches
    of its shard it already trained on (keeping the last as its stand-in for a window its shard has no batch for),
    so the sample order and the stand-ins equal an uninterrupted run's.

    Returns:
        The final evaluation metrics.

    Raises:
        Preempted: a signal arrived; a checkpoint of the last finished step was written.
        NonFiniteError: the gradient norm (or loss) is non-finite and ``train.on_nonfinite=error``; nothing is
            saved after it, so the newest checkpoint is the last good state.
    """
    cfg, acc, state, t = job.cfg, job.acc, job.state, job.cfg.train
    last_eval = evaluate_and_log(job) if state.step == 0 else {}
    if preemption is not None:
        preemption.defer()  # until here a signal stopped the start-up at once; now it ends an optimizer step
    meter = StepMeter(acc.device, job.flops_fn, job.peak_flops, cfg.data.max_length,
                      job.plan.sequence_parallel_size, getattr(job.objective, "metric_names", ()))  # after step-0 eval
    pbar = Progress(job.max_steps, state.step, acc.is_local_main_process)  # a bar, or lines in a log file
    timer = SaveTimer(t.save_every_minutes)
    commit = StepCommit(job, meter)
    if state.eval_pending:  # resumed from a checkpoint whose evaluation a signal cut short: that evaluation first
        last_eval, _ = conclude_step(job, pbar, preemption, timer, True, False, state.step >= job.max_steps, commit)
    job.model.train()
    while state.step < job.max_steps and state.reason != "early_stopped":  # an early-stopped run resumes stopped
        ready = time.perf_counter()
        batches, last = epoch_loader(job)
        for window in windows(acc, batches, t.gradient_accumulation_steps, job.objective, preemption, timer, commit,
                              last):
            # host time waiting for batches (and the gather), not the previous step's optimizer step it applied nor
            # the sampling of a round of rollouts (grpo: compute, reported as train/rollout_s)
            sampled = job.rl.source.meter.take_pending() if job.rl is not None else 0.0
            meter.data_s += time.perf_counter() - ready - commit.take_spent() - sampled
            if window.stop:
                preempted(job, pbar)
            train_window(job, window, meter, commit)
            lr = job.scheduler.get_last_lr()[0]  # the step's rate: the scheduler steps when the step is applied
            state.step += 1
            state.windows_in_epoch += 1
            meter.steps += 1
            pbar.update()
            done = state.step >= job.max_steps
            if state.step % t.log_every == 0 or done:
                commit.flush()  # a host read of its own (and an all-reduce): logging steps only
                metrics = meter.flush(acc, lr)  # collective + host sync: the log interval's only one
                if job.experts is not None:  # collectives: tokens per expert (and the aux loss), summed over ranks
                    for watcher in (job.experts.load, job.experts.aux):
                        if watcher is not None:
                            metrics.update(watcher.flush(lambda t: acc.reduce(t, reduction="sum")))
                if job.rl is not None:  # grpo: the interval's rounds of rollouts, and some of the latest's completions
                    metrics.update(rollout_metrics(job, metrics))
                if t.on_nonfinite == "skip":
                    metrics["train/skipped_steps"] = state.skipped_steps
                if 0.0 in (cfg.loss.type_weights or ()):
                    metrics["train/zero_weight_steps"] = state.zero_weight_steps
                job.log.write(state.step, metrics)
                pbar.show(state.step, metrics)
            paused = time.perf_counter()
            due = bool(done or (t.eval_every and state.step % t.eval_every == 0))
            evaluated, stop = conclude_step(job, pbar, preemption, timer, due, window.save_due, done, commit)
            last_eval = evaluated if evaluated is not None else last_eval
            if stop:
                break
            ready = time.perf_counter()
            meter.paused_s += ready - paused  # evaluation and checkpoints are not training time
        else:  # the epoch ran out
            state.epoch += 1
            state.windows_in_epoch = 0
    commit.flush()  # already applied wherever the loop ends (the last step logs); kept for any later exit
    pbar.close()
    # Resumed from the last step's checkpoint: nothing was trained, the figures are already logged.
    return last_eval or run_evaluation(job, None)[0]


def conclude_step(job: Job, pbar: Any, preemption: Preemption | None, timer: SaveTimer, evaluate_now: bool,
                  save_due: bool, done: bool, commit: StepCommit) -> tuple[dict[str, float] | None, bool]:
    """What follows optimizer step ``job.state.step``: its evaluation when due, the ``train.keep_best`` /
    early-stopping verdict, and its checkpoint (interval, time, best, early stop, end). Collective. Either first
    applies the held optimizer step (``commit``).

    A signal during the evaluation checkpoints the step with the evaluation marked pending
    (``TrainerState.eval_pending``); the resumed run calls this first for that step (:func:`fit`), so its eval
    lines, ``best.json``, early stop and checkpoints are those of an uninterrupted run.

    Returns:
        ``(metrics, stop)``: the evaluation's metrics (``None`` when none was due), and whether training ends here
        (the last step, or early stopping).

    Raises:
        Preempted: a signal arrived during the evaluation; the checkpoint was written.
    """
    cfg, acc, state, t = job.cfg, job.acc, job.state, job.cfg.train
    metrics, best, stopping = None, False, False
    if evaluate_now:
        commit.flush()
        before = rng_states()  # an evaluation draws from the global RNG: each eval loader iterator takes a seed
        try:
            metrics = evaluate_and_log(job, preemption)
        except EvalInterrupted:  # a signal during the evaluation: this step's checkpoint, within seconds
            state.eval_pending = True
            set_rng_states(before)  # saved as the evaluation found them: the resumed run's re-run draws the same
            preempted(job, pbar)
        state.eval_pending = False
        best, stopping = judge(job, metrics)
    interval = t.save_every and state.step % t.save_every == 0
    if interval or save_due or best or stopping or (done and (t.save_every or t.save_every_minutes)):
        why = "end" if done else "early_stopped" if stopping else "best" if best else "interval"
        commit.flush()
        path = save_checkpoint(acc, cfg, job.plan, state.with_reason(why), job.model, job.optimizer,
                               extra=job.rl.source.save if job.rl is not None else None)
        if best and acc.is_main_process:
            write_best(cfg.output_dir, state, t.keep_best)  # after the checkpoint it names is whole
        if cfg.log.wandb_log_model == "checkpoint":
            full = cfg.model.finetune == "full"
            log_model(acc, cfg, path, "model" if full else "adapter", state.step, [path.name], model_files(path, full))
        timer.reset()
    return metrics, done or stopping


def preempted(job: Job, pbar: Any) -> None:
    """Checkpoint the last finished optimizer step and raise :class:`Preempted`. Collective.

    Raises:
        Preempted: always.
    """
    save_checkpoint(job.acc, job.cfg, job.plan, job.state.with_reason("preempted"), job.model, job.optimizer,
                    extra=job.rl.source.save if job.rl is not None else None)  # collective
    pbar.close()
    raise Preempted(f"pre-empted at step {job.state.step}: checkpoint written; rerun with "
                    f"train.resume_from=latest to continue")


def judge(job: Job, metrics: dict[str, float]) -> tuple[bool, bool]:
    """``(best, stop)`` after an evaluation: a new best of ``train.keep_best`` (checkpoint it, keep it), and
    ``train.early_stopping_patience`` evaluations without one (stop now). Every rank decides alike (the figures
    are reduced over all ranks)."""
    t, state = job.cfg.train, job.state
    if t.keep_best is None:
        return False, False
    best = observe(state, metrics, t.keep_best, t.keep_best_mode)
    stop = out_of_patience(state, t.early_stopping_patience)
    if stop:
        job.log.write(state.step, {"train/early_stopped": 1.0})
        if job.acc.is_main_process:
            logger.info("early stopping at step %d: %s has not improved for %d evaluations (best %.6g at step %d; "
                        "its checkpoint is kept, see best.json)", state.step, t.keep_best, state.evals_since_best,
                        state.best_metric, state.best_step)
    return best, stop


def train_window(job: Job, window: Window, meter: StepMeter, commit: StepCommit) -> None:
    """One optimizer step: forward/backward every micro-batch of ``window``, clip, and hand the step to ``commit``,
    which applies it (or skips it when non-finite) once the next host read tells every rank's verdict.

    Every rank calls it with a window of the same length (collectives inside). A window whose weights sum to
    zero on every rank trains nothing: no forward, no optimizer step (AdamW's momentum would still move the
    weights), identically in every launch mode; the schedule still steps.
    """
    acc, state = job.acc, job.state
    if window.den == 0:
        state.zero_weight_steps += 1
        meter.grad_norm = torch.zeros((), device=acc.device)  # this step's gradient is exactly zero
        commit.hold(None)
        return
    ga, avg = job.cfg.train.gradient_accumulation_steps, job.plan.gradient_average_size
    max_norm = job.cfg.optim.max_grad_norm if job.cfg.optim.max_grad_norm is not None else math.inf
    sync_on_last_micro_batch(acc, len(window.micro))
    nums, kept = [], []
    for mb in window.micro:
        # Under sequence parallelism the attention joins the group's shards, in forward and in the backward's
        # recomputation (checkpointing) alike: every rank of the group runs the same micro-batches.
        with acc.accumulate(job.model), (sharded() if job.sequence else contextlib.nullcontext()):
            num = job.objective.loss_step(job.model, mb.batch, mb.weights)
            nums.append(num.detach())
            kept.append(job.objective.metrics() if hasattr(job.objective, "metrics") else None)  # e.g. DPO rewards
            # backward() divides by GA, and DDP/ZeRO divide the gradient summed over the ranks by the world size
            # (ZeRO-1/2 under sequence parallelism by the data-parallel degree: ModePlan.gradient_average_size);
            # undo both so the update is sum(weighted token CE) / den for the whole window on every rank (the
            # ranks of a sequence-parallel group each hold a part of their rows' loss: summed, never averaged).
            # A stand-in backpropagates 0.
            acc.backward(num * ((ga * avg) / window.den if mb.real else 0.0))
            if acc.sync_gradients:
                meter.grad_norm = full_norm(acc.clip_grad_norm_(job.model.parameters(), max_norm))
    commit.hold(HeldWindow(window, nums, kept, meter.grad_norm, nonfinite_flag(acc, meter.grad_norm, nums),
                           where_text(job)))


def sync_on_last_micro_batch(acc: Accelerator, n_micro: int) -> None:
    """Make ``accumulate()`` sync gradients (and step the optimizer) on the last of the next ``n_micro``
    micro-batches, also when the window is shorter than ``gradient_accumulation_steps`` (end of an epoch).

    ``Accelerator._do_sync`` (accelerate/accelerator.py) increments ``acc.step`` on entering ``accumulate()``
    and syncs when ``step % num_steps == 0`` (with ``sync_with_dataloader=False``, as :mod:`scale.distributed.launch`
    configures it). Starting the counter at ``num_steps - n_micro`` puts the sync on the window's last
    micro-batch. ``acc.step`` is public but not documented: checked against accelerate 1.10 to 1.15, and
    ``tests/test_accumulation.py`` fails if the sync point moves.
    """
    acc.step = acc.gradient_accumulation_steps - n_micro


def epoch_loader(job: Job) -> tuple[Iterable[dict[str, torch.Tensor]], dict[str, torch.Tensor] | None]:
    """This rank's train micro-batches of ``state.epoch`` and the one trained before them (:func:`windows`'
    ``last``): mid-epoch after a resume, without the ``windows_in_epoch * GA`` already trained, the last of which
    is a rank's stand-in if its shard holds no batch for the next window
    (:func:`scale.training.windows.skip_trained`). Under ``grpo`` the rounds already trained are skipped and a round
    cut mid-way is restored (:meth:`scale.training.parts.rl.RolloutSource.resume_at`); every rank holds the same
    number of micro-batches, so no stand-in is needed."""
    trained = job.state.windows_in_epoch * job.cfg.train.gradient_accumulation_steps
    if job.rl is not None:
        job.rl.source.set_epoch(job.state.epoch)
        return job.rl.source.resume_at(trained), None
    return skip_trained(job.acc, job.train_dl, job.state.epoch, trained)


def full_norm(grad_norm: Any) -> Any:
    """The gradient norm as a plain tensor: under FSDP2 ``clip_grad_norm_`` returns a ``DTensor`` (a partial
    reduction over the shards); ``full_tensor()`` finishes it (a collective, every rank calls it). Else unchanged."""
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(grad_norm, DTensor):
            return grad_norm.full_tensor()
    return grad_norm


def evaluate_and_log(job: Job, preemption: Preemption | None = None) -> dict[str, float]:
    """:func:`evaluate` at the current step, plus the generated samples (:mod:`scale.training.samples`), logged and
    announced in one line. Collective.

    Raises:
        EvalInterrupted: ``preemption`` was requested during it (checked between eval batches and samples).
    """
    stop = (lambda: preemption.requested) if preemption is not None else None
    started = time.perf_counter()
    if job.acc.is_main_process:  # a line before it starts: the first evaluation of a real run takes minutes
        generating = f" + {len(job.gen.samples)} generated answers" if job.gen is not None and job.gen.samples else ""
        unit = job.task.unit if job.task is not None else "rows"
        logger.info("eval step %d: evaluating %s held-out %s%s", job.state.step,
                    len(getattr(job.eval_dl, "dataset", ())), unit, generating)
    metrics, records = run_evaluation(job, stop)
    if records:  # grpo: greedy completions of the first held-out prompts, with their rewards
        write_samples(job.acc, Path(job.cfg.output_dir) / SAMPLES_FILE, job.state.step,
                      [{"split": "eval", **r} for r in records], job.state.step >= job.log.skip_below)
    if job.gen is not None and job.gen.samples:
        records = generate_samples(job.acc, job.model, job.gen, stop)  # collective
        metrics |= sample_metrics(records)
        write_samples(job.acc, job.gen.path, job.state.step, records, job.state.step >= job.log.skip_below)
    job.log.write(job.state.step, metrics)
    if job.acc.is_main_process:
        logger.info("eval step %d (%s): %s", job.state.step, duration_text(time.perf_counter() - started), "  ".join(
            f"{k.removeprefix('eval/')} {v:.4f}" if isinstance(v, float) else f"{k.removeprefix('eval/')} {v}"
            for k, v in metrics.items()))
    return metrics


def run_evaluation(job: Job, stop: Any) -> tuple[dict[str, float], list[dict[str, Any]]]:
    """``(metrics, records)`` of one evaluation: :func:`evaluate` (no records), or under ``loss.objective: grpo`` the
    rewards of greedy completions of the held-out prompts (:func:`scale.training.rollouts.evaluate_prompts`).
    Collective."""
    if job.rl is not None:
        return job.rl.evaluate(stop)
    return evaluate(job.acc, job.model, job.eval_dl, job.objective, stop=stop, task=job.task,
                    sequence=job.sequence), []


def rollout_metrics(job: Job, metrics: dict[str, float]) -> dict[str, float]:
    """The log interval's rounds of rollouts (:class:`scale.training.parts.rl.RoundMeter`) and the share of its wall
    time spent sampling (``train/rollout_fraction``); the latest round's first ``rl.log_completions`` completions on
    this rank go to ``samples.jsonl`` and the W&B table ``train/rollouts``."""
    out = job.rl.source.meter.flush()
    wall = metrics.get("train/data_s", 0.0) + metrics.get("train/compute_s", 0.0)
    if out and wall > 0:
        out["train/rollout_fraction"] = out["train/rollout_s"] / wall
    keep = job.rl.source.last_records[:job.cfg.rl.log_completions]
    if keep:
        write_samples(job.acc, Path(job.cfg.output_dir) / SAMPLES_FILE, job.state.step,
                      [{"split": "train", **r} for r in keep], job.state.step >= job.log.skip_below,
                      table="train/rollouts")
        job.rl.source.last_records = []
    return out


def outputs_text(output_dir: str | Path) -> str:
    """What a finished run left in ``output_dir``, for the run's last log line: ``runs/x: adapter/, checkpoints/
    (2: step_000050, step_000100), config.yaml, metrics.jsonl, samples.jsonl, wandb/``."""
    out = Path(output_dir)
    parts = []
    for entry in sorted(out.iterdir()) if out.is_dir() else []:
        if entry.name == "checkpoints" and entry.is_dir():
            steps = sorted(p.name for p in entry.iterdir() if p.is_dir() and not p.name.endswith(".tmp"))
            shown = ", ".join(steps if len(steps) <= 3 else [steps[0], "...", steps[-1]])
            parts.append(f"checkpoints/ ({len(steps)}{': ' + shown if steps else ''})")
        else:
            parts.append(entry.name + ("/" if entry.is_dir() else ""))
    return f"{out}: {', '.join(parts) or 'nothing'}"


def run(cfg: Config, preemption: Preemption | None = None) -> dict[str, float]:
    """Build everything from ``cfg``, train (or resume), evaluate, save the adapter; return final eval metrics.

    Raises:
        Preempted: a signal arrived; a checkpoint of the last finished step was written.
        DataError, ConfigError, LaunchError, CheckpointError, NonFiniteError: see the functions they come from.
    """
    job = setup(cfg)
    acc = job.acc
    before = fingerprints(acc, job.model) if cfg.train.check_invariants else None  # the base, before training
    try:
        final = fit(job, preemption)
    except Preempted:
        acc.end_training()
        raise
    if cfg.train.check_invariants:  # on every rank: under ZeRO-3 only rank 0 gets a `before`
        checks = check_invariants(acc, job.model, before, full=cfg.model.finetune == "full")
        job.log.sink.write(job.max_steps, checks)
        if acc.is_main_process:
            logger.info("invariants: %s", checks)
    if cfg.train.save_adapter:
        what = "model" if cfg.model.finetune == "full" else "adapter"
        if what == "model":  # every weight: the fp32 masters as a plain transformers directory
            save_model(acc, job.plan, job.model, Path(cfg.output_dir) / what, cfg.train.max_shard_size)  # collective
        else:
            save_adapter(acc, job.plan, job.model, Path(cfg.output_dir) / what)  # collective
        if acc.is_main_process:  # the tokenizer as trained (its chat template, or none) and where generation stops
            save_serving_files(*serving_tokenizer(cfg, chat=job.chat)[:2], Path(cfg.output_dir) / what)
        if cfg.log.wandb_log_model:
            log_model(acc, cfg, Path(cfg.output_dir) / what, what, job.max_steps, ["final", "latest"])
    finish_trackers(acc, final)  # the W&B summary is the final evaluation
    main = acc.is_main_process
    if main:
        logger.info("final: %s", "  ".join(f"{k.removeprefix('eval/')} {v:.4g}" if isinstance(v, float) else
                                           f"{k.removeprefix('eval/')} {v}" for k, v in final.items()))
    acc.end_training()  # W&B prints its footer here
    if main:  # the last line: where the outputs are (after the trackers' own output)
        logging.getLogger(__name__).info("done: %s", outputs_text(cfg.output_dir))
    return final


if __name__ == "__main__":  # `python -m scale.train` (what launchers run) is `scale-train`: hand over to the CLI
    import runpy

    runpy.run_module("scale.cli", run_name="__main__", alter_sys=True)

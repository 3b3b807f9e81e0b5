"""The training loop: tail-loss LoRA/QLoRA fine-tuning on ``accelerate.Accelerator``.

    scale-train                                            # the default job (configs/train/default.yaml)
    scale-train --config configs/train/tiny_cpu.yaml train.max_steps=20
    accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m scale.train --config configs/train/tiny_cpu.yaml

Shapes: ``B`` micro-batch rows, ``T`` padded length, ``N`` tail tokens (``loss.threshold``), ``V`` vocabulary.
``step`` always counts optimizer steps; a forward/backward on one micro-batch is a micro-step.

The maths of one optimizer step: the window of ``gradient_accumulation_steps`` micro-batches on every rank
contributes ``sum(weighted tail CE) / sum(weights)`` where both sums run over the whole window and all
ranks. A partial last window (end of an epoch) is normalised by its own sums: not dropped, not rescaled.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import logging
import math
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration
from accelerate.logging import get_logger
from accelerate.utils import (DistributedType, GradientAccumulationPlugin, InitProcessGroupKwargs,
                               ProjectConfiguration, gather_object, set_seed)
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from scale import loss as L
from scale.assets import resolve_data
from scale.checkpoint import (CheckpointError, TrainerState, check_resume, file_sha256, load_checkpoint,
                              register_hooks, resolve_resume, save_checkpoint)
from scale.config import Config, ConfigError, dump_config, load_config, to_dict
from scale.data import Collator, DataError, build_splits
from scale.flops import flops_per_token, peak_flops
from scale.metrics import JsonlSink, StepMeter
from scale.modeling import build_model, full_numel, load_tokenizer, parameter_counts, restore_inference_config
from scale.schedule import lr_factor

logger = get_logger(__name__)


@dataclass
class LossSpec:
    """Everything :func:`loss_step` needs besides the model and the batch."""

    threshold: int
    padding_side: str
    type_weights: list[float] | None
    criterion: L.Criterion | None
    criterion_mode: str
    target_position: int
    label_token_ids: torch.Tensor  # [L]

    @classmethod
    def from_config(cls, cfg: Config, label_token_ids: list[int]) -> LossSpec:
        return cls(
            threshold=cfg.loss.threshold,
            padding_side=cfg.data.padding_side,
            type_weights=cfg.loss.type_weights,
            criterion=L.load_criterion(cfg.loss.criterion) if cfg.loss.criterion else None,
            criterion_mode=cfg.loss.criterion_mode,
            target_position=cfg.loss.target_position,
            label_token_ids=torch.tensor(label_token_ids, dtype=torch.long),
        )

    def weights(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """``[B, N]`` tail-token weights of a batch (a user criterion counts every token once)."""
        if self.criterion is not None:
            return torch.ones(batch["input_ids"].shape[0], self.threshold, device=batch["input_ids"].device)
        return L.token_weights(batch["type_indicator"], self.threshold, self.type_weights)


def loss_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], spec: LossSpec,
              weights: torch.Tensor) -> torch.Tensor:
    """Forward one micro-batch; return the tail-loss numerator ``[]`` under ``weights`` ``[B, N]``.

    Pure: no collectives. The tail logits ``[B, N, V]`` are freed before returning.
    """
    tail_logits, targets = L.forward_tail(model, batch, spec.threshold, spec.padding_side)   # [B, N, V], [B, N]
    num, _ = L.tail_loss(tail_logits, targets, weights, batch["type_indicator"], spec.criterion, spec.criterion_mode)
    return num


@torch.no_grad()
def evaluate(acc: Accelerator, model: torch.nn.Module, eval_dl: DataLoader, spec: LossSpec) -> dict[str, float]:
    """Tail loss (ratio of sums), target NLL (nats) and label accuracy over the whole eval split.

    Per-example figures go through ``gather_for_metrics``, which drops the samples accelerate repeats to
    even out the last batch across ranks. Collective: every rank must call it.
    """
    was_training = model.training
    model.eval()
    label_ids = spec.label_token_ids.to(acc.device)
    rows = []
    for batch in eval_dl:
        tail_logits, targets = L.forward_tail(model, batch, spec.threshold, spec.padding_side)
        weights = spec.weights(batch)
        # One tail_loss per row (also for a user criterion that returns a mean), so that gathered rows
        # keep their own numerator and denominator.
        per_row = [L.tail_loss(tail_logits[b:b + 1], targets[b:b + 1], weights[b:b + 1],
                               batch["type_indicator"][b:b + 1], spec.criterion, spec.criterion_mode)
                   for b in range(tail_logits.shape[0])]
        num, den = (torch.stack(column) for column in zip(*per_row))                # [B], [B]
        stats = L.target_stats(tail_logits, batch["target_token"], label_ids, spec.target_position)
        rows.append(acc.gather_for_metrics(torch.stack([num, den, stats.logprob, stats.correct], dim=1)))
    table = torch.cat(rows).double()                                                # [n_eval, 4]
    num, den, logprob, correct = table.sum(0).tolist()  # host sync (eval only)
    n = table.shape[0]
    if was_training:
        model.train()
    return {"eval/loss": num / den, "eval/target_nll": -logprob / n, "eval/accuracy": correct / n,
            "eval/examples": n}


def windows(acc: Accelerator, dl: DataLoader, ga: int, preemption: Preemption | None = None
            ) -> Iterator[tuple[list[tuple[dict[str, torch.Tensor], bool]], bool]]:
    """Yield ``(window, stop)``: accumulation windows of at most ``ga`` micro-batches, the same length on
    every rank, and whether any rank was asked to stop (SIGTERM/SIGINT) before this window.

    Each window item is ``(batch, real)``. With ``even_batches=False`` a rank can run out of batches before
    the others at the end of an epoch; it then repeats its last batch with ``real=False`` (the loop zeroes its
    loss weight), so every rank runs the same number of forward/backward passes and no collective hangs.
    The epoch ends when no rank has a batch left. Collective: one tiny all-gather per window, which also
    carries the stop flag (pre-emption costs no extra collective).
    """
    it, last = iter(dl), None
    while True:
        window = list(itertools.islice(it, ga))
        last = window[-1] if window else last
        flag = preemption is not None and preemption.signum is not None
        n = torch.tensor([[len(window), int(flag)]], device=acc.device)
        n_max, stop = (int(v) for v in acc.gather(n).max(0).values)  # collective + host sync, once per window
        if stop:
            yield [], True
            return
        if n_max == 0:
            return
        if last is None:
            raise RuntimeError("a rank got no batch in an epoch: lower train.micro_batch_size or num_processes")
        yield [(b, True) for b in window] + [(last, False)] * (n_max - len(window)), False


EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): checkpoint written after SIGTERM/SIGINT; rerun to resume
EXIT_BAD_INPUT = 2   # config, data, launch or checkpoint rejected before training; the message names the fix


class Preemption:
    """SIGTERM/SIGINT (SLURM pre-emption, Ctrl-C) become a request the loop honours between optimizer steps.

    The first signal only sets :attr:`signum`. Ranks agree on it in :func:`windows`, finish the optimizer
    step in flight, write a checkpoint and exit with :data:`EXIT_PREEMPTED`. A second signal takes the
    default action at once (Ctrl-C twice). Under ``accelerate launch``/``torchrun`` the launcher forwards
    SIGTERM to the ranks and kills them 30 s later (torch elastic's shutdown timeout).
    """

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # signal handlers live in the main thread
            self._previous = {s: signal.signal(s, self._handle) for s in self.SIGNALS}

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum
        # No logging here (not async-signal-safe); one line straight to stderr.
        os.write(2, f"scale: got signal {signum}: finishing this optimizer step, then checkpoint and exit "
                    f"{EXIT_PREEMPTED}\n".encode())


class NonFiniteError(FloatingPointError):
    """A non-finite loss or gradient norm (``train.on_nonfinite=error``); the message names the step and rows."""


class Preempted(Exception):
    """Raised out of :func:`run` after a pre-emption checkpoint was written; :func:`main` exits 75."""


class LaunchError(RuntimeError):
    """The launch mode contradicts itself or the training config; the message names the fix."""


def check_launch_environment(env: dict[str, str] | None = None) -> None:
    """Fail fast on launches that would start fewer processes than asked, before any work is done.

    ``accelerate launch --cpu --num_processes 2`` and a ``MULTI_CPU`` YAML start ONE process (accelerate
    1.15): it is recognisable by a rendezvous address without a ``WORLD_SIZE``.

    Raises:
        LaunchError: the environment is such a launch.
    """
    env = os.environ if env is None else env
    launched_by_accelerate = "ACCELERATE_MIXED_PRECISION" in env
    if launched_by_accelerate and "MASTER_ADDR" in env and "WORLD_SIZE" not in env:
        raise LaunchError("accelerate launch started ONE process for a multi-process CPU launch (--cpu with "
                          "--num_processes > 1, or distributed_type: MULTI_CPU). Use "
                          "--config_file configs/accelerate/cpu_ddp.yaml (MULTI_GPU, num_processes: 2): on a "
                          "machine without CUDA the loop then runs a real gloo process group.")


def _cpu_threads(env: dict[str, str]) -> None:
    """The ``deepspeed`` launcher leaves ``OMP_NUM_THREADS`` unset: 2 ranks on 2 cores ran 37x slower."""
    local = int(env.get("LOCAL_WORLD_SIZE", env.get("LOCAL_SIZE", "1")))
    if local > 1 and "OMP_NUM_THREADS" not in env and not torch.cuda.is_available():
        threads = max(1, (os.cpu_count() or 1) // local)
        torch.set_num_threads(threads)
        logging.getLogger(__name__).warning("OMP_NUM_THREADS unset with %d local ranks: using %d threads per rank",
                                            local, threads)


def build_accelerator(cfg: Config) -> Accelerator:
    """Create the Accelerator for the launch mode found in the environment, with start-up guards.

    Raises:
        LaunchError: several processes were launched but accelerate did not set up a process group; a
            DeepSpeed config contradicts the training config (gradient_accumulation_steps, gradient_clipping);
            see also :func:`check_launch_environment`.
    """
    check_launch_environment()
    use_deepspeed = (os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
                     or cfg.train.deepspeed_config is not None)
    on_cpu = not torch.cuda.is_available()
    # DeepSpeed on CPU needs gloo (cpu=True would silently drop DeepSpeed); otherwise accelerate picks.
    # The timeout bounds how long a rank waits for a peer that died on another node.
    handlers = [InitProcessGroupKwargs(backend="gloo" if on_cpu and use_deepspeed else None,
                                       timeout=timedelta(seconds=cfg.train.collective_timeout_s))]
    plugin = None
    if cfg.train.deepspeed_config is not None:  # e.g. under the `deepspeed` launcher or torchrun
        from accelerate.utils import DeepSpeedPlugin

        plugin = DeepSpeedPlugin(hf_ds_config=cfg.train.deepspeed_config)
    acc = Accelerator(
        cpu=on_cpu and not use_deepspeed,
        mixed_precision=cfg.train.mixed_precision,
        gradient_accumulation_plugin=GradientAccumulationPlugin(
            num_steps=cfg.train.gradient_accumulation_steps, sync_with_dataloader=False),
        # even_batches=False: no sample is repeated to even out ranks (that would change the maths).
        dataloader_config=DataLoaderConfiguration(even_batches=False, use_seedable_sampler=True),
        deepspeed_plugin=plugin,
        log_with=[t for t in cfg.log.trackers if t != "none"] or None,
        project_config=ProjectConfiguration(project_dir=cfg.output_dir,
                                            save_on_each_node=cfg.train.save_on_each_node),
        kwargs_handlers=handlers,
    )
    _cpu_threads(dict(os.environ))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 and acc.distributed_type == DistributedType.NO:
        raise LaunchError(f"WORLD_SIZE={world} but accelerate runs DistributedType.NO: the processes would "
                          f"train unsynced replicas. Launch with a MULTI_GPU/DEEPSPEED accelerate config.")
    if use_deepspeed and acc.distributed_type != DistributedType.DEEPSPEED:
        raise LaunchError(f"a DeepSpeed launch ended up as {acc.distributed_type}: DeepSpeed was dropped")
    if acc.distributed_type == DistributedType.DEEPSPEED:
        _reconcile_deepspeed(cfg, acc.state.deepspeed_plugin.deepspeed_config)
    return acc


def _reconcile_deepspeed(cfg: Config, ds: dict[str, Any]) -> None:
    """Make the DeepSpeed JSON agree with the training config; a contradiction is an error.

    DeepSpeed's ``gradient_accumulation_steps`` silently wins over ours (accelerate only warns), and an
    unset ``gradient_clipping: "auto"`` becomes 1.0; both would change the maths without a word.
    """
    ours = {"gradient_accumulation_steps": cfg.train.gradient_accumulation_steps,
            "gradient_clipping": cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else 0.0,
            "train_micro_batch_size_per_gpu": cfg.train.micro_batch_size}
    for key, value in ours.items():
        theirs = ds.get(key, "auto")
        if theirs == "auto":
            ds[key] = value
        elif float(theirs) != float(value):
            raise LaunchError(f"the DeepSpeed config sets {key}={theirs} but the training config has {value} "
                              f"(train.*/optim.*); set it to \"auto\" in the JSON so the training config owns it")
    if ds.get("train_batch_size", "auto") == "auto":
        ds.pop("train_batch_size", None)  # DeepSpeed derives it from micro-batch x GA x world size


@dataclass
class ModePlan:
    """Every knob that differs by launch mode, decided in one place (:func:`plan_for_mode`) and logged."""

    mode: str
    device_map: Any
    notes: list[str]


def plan_for_mode(cfg: Config, acc: Accelerator) -> ModePlan:
    """Decide checkpointing and QLoRA placement for the resolved launch mode.

    - Re-entrant checkpointing under DDP with LoRA fails ("Expected to mark a variable ready only once",
      peft#313, trl#921): an error, with the fix. Non-reentrant also works under ZeRO-3 + PEFT here
      (measured: ZeRO-3 parity within 4e-7 of single device, benchmarks/parity.py), so we do not force
      re-entrant there as TRL does.
    - QLoRA: each rank loads its 4-bit model onto its own device (``device_map`` per local rank). Under
      ZeRO-3 or FSDP the packed 4-bit weights are only partitioned when their storage dtype is a float
      equal to the compute dtype (``bnb_4bit_quant_storage``).

    Raises:
        LaunchError: one of the combinations above.
    """
    dt = acc.distributed_type
    zero = acc.state.deepspeed_plugin.zero_stage if dt == DistributedType.DEEPSPEED else None
    mode = {DistributedType.NO: "single", DistributedType.DEEPSPEED: f"zero{zero}",
            DistributedType.FSDP: "fsdp"}.get(dt, "ddp")
    m, notes = cfg.model, []
    if m.gradient_checkpointing and m.use_reentrant and mode in ("ddp", "zero1", "zero2") and acc.num_processes > 1:
        raise LaunchError("model.use_reentrant=true with LoRA under data parallelism fails with 'marked ready "
                          "twice' (peft#313, trl#921); set model.use_reentrant=false")
    if cfg.train.on_nonfinite == "skip" and dt == DistributedType.DEEPSPEED:
        raise LaunchError("train.on_nonfinite=skip cannot work under DeepSpeed: its optimizer steps inside "
                          "backward(), before the loop sees the gradient norm; use train.on_nonfinite=error")
    if m.gradient_checkpointing:
        notes.append(f"checkpointing use_reentrant={m.use_reentrant}")
    device_map = None
    if m.quantize_4bit:
        if mode != "zero3":  # transformers refuses a device_map under ZeRO-3
            device_map = {"": acc.local_process_index} if acc.device.type == "cuda" else "cpu"
        notes.append(f"4-bit base on {device_map or 'ZeRO-3 placement'}, storage {m.bnb_4bit_quant_storage}")
        if mode in ("zero3", "fsdp") and m.bnb_4bit_quant_storage != m.bnb_4bit_compute_dtype:
            raise LaunchError(f"{mode} shards 4-bit weights only when model.bnb_4bit_quant_storage equals the "
                              f"compute dtype; set model.bnb_4bit_quant_storage={m.bnb_4bit_compute_dtype}")
    return ModePlan(mode, device_map, notes)


def dtype_census(model: torch.nn.Module) -> dict[str, int]:
    """Parameter elements per ``dtype/trainable|frozen`` (catches a bf16 run silently upcast to fp32)."""
    census: dict[str, int] = {}
    for p in model.parameters():
        key = f"{str(p.dtype).replace('torch.', '')}/{'trainable' if p.requires_grad else 'frozen'}"
        census[key] = census.get(key, 0) + full_numel(p)
    return census


def fingerprints(acc: Accelerator, model: torch.nn.Module) -> dict[str, Any] | None:
    """sha256 of the full (gathered) LoRA weights and of the base weights, and how many ``lora_B`` tensors
    are non-zero. ``None`` on ranks that get no full copy (ZeRO-3 gathers onto rank 0 only).
    Collective: every rank calls."""
    import hashlib

    state = acc.get_state_dict(model, unwrap=True)  # collective: gathers ZeRO-3 shards
    if not state:
        return None
    digests = {"lora": hashlib.sha256(), "base": hashlib.sha256()}
    lora_b = []
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes()
        digests["lora" if "lora_" in name else "base"].update(name.encode() + raw)
        if "lora_B" in name:
            lora_b.append(t.numel() > 0 and bool(t.abs().max() > 0))
    return {"lora": digests["lora"].hexdigest(), "base": digests["base"].hexdigest(),
            "lora_B": len(lora_b), "lora_B_nonzero": sum(lora_b)}


def check_invariants(acc: Accelerator, model: torch.nn.Module, before: dict[str, Any] | None) -> dict[str, Any]:
    """After training: base weights bit-identical to ``before``; LoRA weights equal on every rank that holds
    a full copy; every ``lora_B`` non-zero. Collective: every rank calls; every rank gets the same answer."""
    after = fingerprints(acc, model)
    pairs = [p for p in gather_object([(before, after)]) if p[1] is not None]  # collective: every rank
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel() for p in model.parameters())
    full = sum(full_numel(p) for p in model.parameters())
    return {"check/base_unchanged": all(b is not None and b["base"] == a["base"] for b, a in pairs),
            "check/param_elements_local_fraction": local / full,  # < 1 where ZeRO-3 partitions weights
            "check/ranks_agree": len({a["lora"] for _, a in pairs}) == 1,
            "check/ranks_compared": len(pairs),
            "check/lora_B_nonzero": all(a["lora_B_nonzero"] == a["lora_B"] for _, a in pairs),
            "check/lora_B_tensors": pairs[0][1]["lora_B"]}


def setup_trackers(cfg: Config, acc: Accelerator) -> None:
    """Start the trackers on the main process. W&B without an API key runs offline (one-line notice).

    A tracker that cannot start (W&B unreachable, a bad key, the package missing) costs one warning:
    training goes on and ``metrics.jsonl`` still gets every figure.
    """
    trackers = [t for t in cfg.log.trackers if t != "none"]
    if not trackers:
        return
    init_kwargs: dict[str, Any] = {}
    if "wandb" in trackers:
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            os.environ["WANDB_MODE"] = "offline"
            logger.info("W&B: no API key configured, logging offline to %s/wandb (upload later with "
                        "`wandb sync`)", cfg.output_dir, main_process_only=True)
        init_kwargs["wandb"] = {"dir": cfg.output_dir, "name": cfg.log.run_name}
    try:
        acc.init_trackers(cfg.log.project, config=to_dict(cfg), init_kwargs=init_kwargs)  # main process only
    except Exception as e:  # noqa: BLE001 - any tracker failure must not stop training
        _drop_trackers(acc, cfg, e)


def _drop_trackers(acc: Accelerator, cfg: Config, error: BaseException) -> None:
    logger.warning("trackers %s failed (%s: %s); training goes on, metrics stay in %s/metrics.jsonl",
                   cfg.log.trackers, type(error).__name__, str(error).splitlines()[0][:200], cfg.output_dir)
    acc.trackers = []


def save_adapter(acc: Accelerator, model: torch.nn.Module, out: Path) -> None:
    """Write the PEFT adapter to ``out`` atomically (temp dir, then rename). Collective: every rank calls."""
    state_dict = acc.get_state_dict(model)  # collective: gathers ZeRO-3 shards on every rank
    if acc.is_main_process:
        unwrapped = acc.unwrap_model(model)
        restore_inference_config(unwrapped)
        tmp = out.with_name(out.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        old = out.with_name(out.name + ".old")
        if out.exists():
            os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    acc.wait_for_everyone()  # collective: every rank must reach this


def fit(cfg: Config, acc: Accelerator, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler, train_dl: DataLoader, eval_dl: DataLoader,
        spec: LossSpec, sink: JsonlSink, state: TrainerState, preemption: Preemption | None = None,
        flops_fn: Callable[[int, int], float] | None = None, peak_flops: float | None = None
        ) -> tuple[dict[str, float], bool]:
    """Run optimizer steps from ``state.step`` to ``train.max_steps``; evaluate at step 0, every
    ``eval_every`` and at the end; checkpoint every ``save_every``, at the end, and when pre-empted.

    A resumed ``state`` continues mid-epoch: each rank skips the ``windows_in_epoch * GA`` micro-batches
    of its shard it already trained on (``skip_first_batches``), so the sample order equals an
    uninterrupted run's.

    Returns:
        ``(final eval metrics, pre-empted)``; when pre-empted a checkpoint of the last finished step exists.

    Raises:
        NonFiniteError: the gradient norm (or loss) is non-finite and ``train.on_nonfinite=error``; nothing is
            saved after it, so the newest checkpoint is the last good state.
    """
    t = cfg.train
    ga, world = t.gradient_accumulation_steps, acc.num_processes
    max_norm = cfg.optim.max_grad_norm if cfg.optim.max_grad_norm is not None else math.inf

    def log(metrics: dict[str, float]) -> None:
        sink.write(state.step, metrics)
        try:
            acc.log(metrics, step=state.step)  # main process only
        except Exception as e:  # noqa: BLE001 - a tracker that fails mid-run is dropped, with one warning
            _drop_trackers(acc, cfg, e)

    def checkpoint(reason: str) -> None:
        state.reason = reason
        save_checkpoint(acc, cfg, state)  # collective: every rank

    last_eval: dict[str, float] = {}
    if state.step == 0:
        last_eval = evaluate(acc, model, eval_dl, spec)
        log(last_eval)
    meter = StepMeter(acc.device, flops_fn, peak_flops)  # after the step-0 eval: throughput counts training
    pbar = tqdm(total=t.max_steps, initial=state.step, disable=not acc.is_local_main_process,
                desc="optimizer steps")
    model.train()
    while state.step < t.max_steps:
        train_dl.set_epoch(state.epoch)
        dl = train_dl
        if state.windows_in_epoch:  # resumed mid-epoch; the copy must be told the epoch too (accelerate#2016)
            dl = acc.skip_first_batches(train_dl, state.windows_in_epoch * ga)
            dl.set_epoch(state.epoch)
        ready = time.perf_counter()
        for window, stop in windows(acc, dl, ga, preemption):
            meter.data_s += time.perf_counter() - ready  # host time waiting for batches (and the gather)
            if stop:
                checkpoint("preempted")
                pbar.close()
                return last_eval, True
            weighted = [(b, spec.weights(b) * float(r), r) for b, r in window]      # weights [B, N]
            # The window's denominator, summed over its micro-batches and all ranks.
            den = acc.reduce(sum(w.sum() for _, w, _ in weighted), reduction="sum")  # collective: every rank
            # accumulate() syncs when its counter hits a multiple of GA: start the counter so that the
            # window's last micro-batch is the sync point, whatever the window's length.
            acc.step = ga - len(weighted)
            nums, finite = [], True
            for batch, weights, real in weighted:
                with acc.accumulate(model):
                    num = loss_step(model, batch, spec, weights)
                    nums.append(num.detach())
                    # backward() divides by GA and DDP/ZeRO average over ranks; undo both so the update
                    # is sum(weighted token CE) / den for the whole window on every rank.
                    # A stand-in batch (real=False) backpropagates an exact zero.
                    acc.backward(num * ((ga * world) / den if real else 0.0))
                    if acc.sync_gradients:
                        meter.grad_norm = acc.clip_grad_norm_(model.parameters(), max_norm)
                        finite = all_finite(acc, meter.grad_norm, nums)  # collective + host sync, per step
                        if not finite:
                            _nonfinite(cfg, state, weighted, nums, meter.grad_norm)
                    if finite:
                        optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
            if finite:
                for (batch, weights, real), num in zip(weighted, nums):
                    if real:
                        meter.add_micro(num, weights.sum(), batch, spec.threshold)
            else:
                state.skipped_steps += 1
            lr = scheduler.get_last_lr()[0]
            scheduler.step()  # unprepared: exactly once per optimizer step, whatever num_processes is
            state.step += 1
            state.windows_in_epoch += 1
            meter.steps += 1
            pbar.update(1)
            if state.step % t.log_every == 0 or state.step == t.max_steps:
                metrics = meter.flush(acc, lr)
                if t.on_nonfinite == "skip":
                    metrics["train/skipped_steps"] = state.skipped_steps
                log(metrics)
                pbar.set_postfix(loss=f"{metrics.get('train/loss', math.nan):.4f}")
            paused = time.perf_counter()
            if state.step == t.max_steps or (t.eval_every and state.step % t.eval_every == 0):
                last_eval = evaluate(acc, model, eval_dl, spec)
                log(last_eval)
            if t.save_every and (state.step % t.save_every == 0 or state.step == t.max_steps):
                checkpoint("end" if state.step == t.max_steps else "interval")
            if state.step >= t.max_steps:
                break
            ready = time.perf_counter()
            meter.paused_s += ready - paused
        else:  # the epoch ran out
            state.epoch += 1
            state.windows_in_epoch = 0
    pbar.close()
    if not last_eval:  # resumed from a checkpoint of the last step: nothing was trained
        last_eval = evaluate(acc, model, eval_dl, spec)
    return last_eval, False


def all_finite(acc: Accelerator, grad_norm: Any, nums: list[torch.Tensor]) -> bool:
    """Whether the gradient norm and every rank's window losses are finite; the same answer on every rank.

    A NaN loss usually brings NaN gradients, but not always (a criterion can add a constant NaN), and a
    rank that skipped the optimizer step alone would silently fork the replicas. Collective (one tiny
    all-reduce per optimizer step when world size > 1) and a host sync.
    """
    local = torch.stack([torch.as_tensor(grad_norm, dtype=torch.float32, device=acc.device).reshape(()),
                         torch.stack(nums).sum().float().to(acc.device)])
    bad = (~torch.isfinite(local)).any().float()
    if acc.num_processes > 1:
        bad = acc.reduce(bad, reduction="sum")  # collective: every rank reaches the sync micro-batch
    return not bool(bad)


def _nonfinite(cfg: Config, state: TrainerState, weighted: list, nums: list[torch.Tensor],
               grad_norm: Any) -> None:
    """Name the step and the rows of a non-finite optimizer step; raise unless ``on_nonfinite=skip``."""
    bad_rows = [int(r) for (batch, _, real), num in zip(weighted, nums) if real and not torch.isfinite(num)
                for r in batch["row"].tolist()]
    where = (f"optimizer step {state.step + 1} (epoch {state.epoch}, window {state.windows_in_epoch} of the "
             f"epoch): gradient norm {float(torch.as_tensor(grad_norm)):.4g}; ")
    where += (f"micro-batches with a non-finite loss on this rank hold data-file rows {bad_rows}" if bad_rows
              else "the losses on this rank are finite (the bad rows are on another rank, or the weights are)")
    if cfg.train.on_nonfinite == "skip":
        logger.warning("skipping %s", where)
        return
    raise NonFiniteError(f"non-finite loss at {where}. Nothing was saved after the last good step; fix the data "
                         f"or lower optim.lr, or set train.on_nonfinite=skip to drop such steps.")


def model_flops(cfg: Config, acc: Accelerator, model: torch.nn.Module, trainable: int
                ) -> tuple[Callable[[int, int], float], float | None]:
    """``(flops_fn, peak)`` for ``train/mfu``: model FLOPs of a ``[B, T]`` micro-batch (:mod:`scale.flops`: LoRA
    count, only the tail's logits) and the device's peak FLOP/s (``log.peak_flops``, else the GPU's name looked
    up in a table; ``None`` on CPU or an unknown GPU, then no MFU is reported)."""
    config = acc.unwrap_model(model).config
    threshold = cfg.loss.threshold

    def flops_fn(rows: int, seq_len: int) -> float:
        per_position = flops_per_token(config, seq_len, lora_params=trainable, logits_fraction=threshold / seq_len)
        return rows * seq_len * per_position

    peak = cfg.log.peak_flops
    if peak is None and acc.device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(acc.device))
    return flops_fn, peak


def run(cfg: Config, preemption: Preemption | None = None) -> dict[str, float]:
    """Build everything from ``cfg``, train (or resume), evaluate, save the adapter; return final eval metrics.

    Raises:
        Preempted: a signal arrived; a checkpoint of the last finished step was written.
        DataError, ConfigError, LaunchError, CheckpointError, NonFiniteError: see the functions they come from.
    """
    acc = build_accelerator(cfg)
    out = Path(cfg.output_dir)
    resume = resolve_resume(cfg.train.resume_from, out)
    saved_state = check_resume(acc, cfg, resume)  # collective; before anything is written
    if acc.is_main_process:
        out.mkdir(parents=True, exist_ok=True)
        dump_config(cfg, out / "config.yaml")
    set_seed(cfg.train.seed)
    plan = plan_for_mode(cfg, acc)
    with acc.main_process_first():  # one process prepares the cached assets, the others then read them
        tokenizer = load_tokenizer(cfg.model)
        data_path = resolve_data(cfg.data.path)
        splits = build_splits(cfg.data, cfg.loss, tokenizer, data_path, cfg.train.seed)
        model = build_model(cfg.model, cfg.lora, len(tokenizer), cfg.train.seed, device_map=plan.device_map)
    mb, ga, world = cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps, acc.num_processes
    if mb * world > len(splits.train):
        raise DataError(f"train.micro_batch_size={mb} x num_processes={world} is larger than the train split "
                        f"({len(splits.train)} rows): a rank's shard would hold less than one micro-batch. "
                        f"Lower train.micro_batch_size to at most {max(1, len(splits.train) // world)} or add data.")
    if mb * ga * world > len(splits.train):
        logger.warning("global_batch_size=%d (micro_batch_size x gradient_accumulation_steps x num_processes) is "
                       "larger than the train split (%d rows): every optimizer step sees at most one epoch",
                       mb * ga * world, len(splits.train), main_process_only=True)
    spec = LossSpec.from_config(cfg, splits.label_token_ids)
    collate = Collator(tokenizer.pad_token_id, cfg.data.padding_side)
    train_dl = DataLoader(splits.train, batch_size=mb, shuffle=True, collate_fn=collate,
                          generator=torch.Generator().manual_seed(cfg.train.seed), num_workers=cfg.data.num_workers)
    # Evaluation order does not change its sums; longest first keeps padding (and peak memory) low.
    eval_dl = DataLoader(sorted(splits.eval, key=lambda e: -len(e.input_ids)),
                         batch_size=cfg.train.eval_micro_batch_size, shuffle=False, collate_fn=collate,
                         num_workers=cfg.data.num_workers)
    params = [p for p in model.parameters() if p.requires_grad]
    o = cfg.optim
    if o.name == "sgd":
        optimizer = torch.optim.SGD(params, lr=o.lr, weight_decay=o.weight_decay)
    else:
        optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    # The scheduler is NOT prepared: a prepared one steps num_processes times per optimizer step. It is
    # registered so that save_state/load_state carry it.
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, o, cfg.train.max_steps))
    model, optimizer, train_dl = acc.prepare(model, optimizer, train_dl)
    acc.even_batches = True  # eval: gather_for_metrics drops the repeated samples
    eval_dl = acc.prepare(eval_dl)
    acc.register_for_checkpointing(scheduler)
    register_hooks(acc)

    trainable, total = parameter_counts(model)
    mean_len = sum(len(e.input_ids) for e in splits.train) / len(splits.train)
    logger.info(
        "start: mode=%s world_size=%d micro_batch_size=%d gradient_accumulation_steps=%d global_batch_size=%d "
        "tokens_per_step~%d (mean %.1f tokens/row) tail_tokens_per_step=%d trainable=%d total=%d (%.3f%%) "
        "train=%d eval=%d", acc.distributed_type, world, mb, ga, mb * ga * world, mb * ga * world * mean_len,
        mean_len, mb * ga * world * cfg.loss.threshold, trainable, total, 100 * trainable / total,
        len(splits.train), len(splits.eval), main_process_only=True)
    logger.info("mode plan: %s %s; parameter dtypes: %s", plan.mode, "; ".join(plan.notes), dtype_census(model),
                main_process_only=True)
    before = fingerprints(acc, model) if cfg.train.check_invariants else None  # the base, before any resume
    state = TrainerState(step=0, epoch=0, windows_in_epoch=0, world_size=world, data_sha256=file_sha256(data_path))
    if resume is not None:
        state = load_checkpoint(acc, resume, saved_state, state.data_sha256)  # collective
    elif cfg.train.resume_from == "latest":
        logger.info("resume_from=latest: no checkpoint in %s yet, starting fresh", out / "checkpoints",
                    main_process_only=True)
    setup_trackers(cfg, acc)
    # A resumed run keeps the history up to its checkpoint and drops what was logged after it.
    sink = JsonlSink(out / "metrics.jsonl", acc.is_main_process, keep_until=state.step if resume else None)
    flops_fn, peak = model_flops(cfg, acc, model, trainable)
    final, preempted = fit(cfg, acc, model, optimizer, scheduler, train_dl, eval_dl, spec, sink, state, preemption,
                           flops_fn, peak)
    if preempted:
        acc.end_training()
        raise Preempted(f"pre-empted at step {state.step}: checkpoint written; rerun with "
                        f"train.resume_from=latest to continue")
    if cfg.train.check_invariants:  # on every rank: under ZeRO-3 only rank 0 gets a `before`
        checks = check_invariants(acc, model, before)
        sink.write(cfg.train.max_steps, checks)
        logger.info("invariants: %s", checks, main_process_only=True)
    if cfg.train.save_adapter:
        save_adapter(acc, model, out / "adapter")
    logger.info("final: %s", json.dumps(final), main_process_only=True)
    acc.end_training()
    return final


def main(argv: list[str] | None = None) -> int:
    """``scale-train [--config PATH] [section.key=value ...]``: parse, train; return the exit code.

    Exit codes: 0 trained; 2 (:data:`EXIT_BAD_INPUT`) the config, data, launch or checkpoint was rejected
    before training, with the message on stderr; 75 (:data:`EXIT_PREEMPTED`) a signal arrived and a
    checkpoint was written; 1 any other failure (a non-finite loss, a crash).
    """
    parser = argparse.ArgumentParser(prog="scale-train", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="training YAML (default: configs/train/default.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.max_steps=50")
    # The `deepspeed` launcher appends --local_rank=N; the rank is read from LOCAL_RANK in the environment.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_intermixed_args(argv)  # overrides may come before and after --config
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO)
    for noisy in ("httpx", "urllib3", "datasets", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    try:
        cfg = load_config(args.config, args.overrides)
    except (ConfigError, FileNotFoundError) as e:
        sys.stderr.write(f"scale-train: error: {type(e).__name__}: {e}\n")
        return EXIT_BAD_INPUT
    preemption = Preemption()
    preemption.install()
    try:
        run(cfg, preemption)
    except Preempted as e:
        logger.warning("%s; exit code %d", e, EXIT_PREEMPTED)
        return EXIT_PREEMPTED
    except (ConfigError, DataError, LaunchError, CheckpointError) as e:  # bad input: the message is the help
        sys.stderr.write(f"scale-train: error: {type(e).__name__}: {e}\n")
        return EXIT_BAD_INPUT
    except NonFiniteError as e:
        sys.stderr.write(f"scale-train: error: {type(e).__name__}: {e}\n")
        return 1
    finally:
        preemption.uninstall()
    return 0


def cli() -> None:
    """Console entry point: :func:`main`, then a clean process exit.

    torch 2.13 + gloo aborts 10-25% of multi-process runs at interpreter exit ("terminate called without an
    active exception", pytorch/pytorch#190489: a gloo thread frees a tensor during finalization). We end
    the process group and collect garbage while the interpreter is whole, flush, and leave with
    ``os._exit`` so finalization never runs. Trackers were already closed by ``end_training()``.
    """
    code = main()
    distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
    if distributed:
        torch.distributed.destroy_process_group()
    gc.collect()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if distributed:
        os._exit(code)
    sys.exit(code)


if __name__ == "__main__":
    cli()

"""Device-side metric sums, reduced across ranks only at log time; one logging path to trackers and a file.

Cross-rank numbers are ratios of sums: every rank adds numerators and denominators on its device; at
``train.log_every`` the sums are reduced once (a collective every rank must reach) and divided once.
Every logged figure goes through :class:`MetricsLog`: ``<output_dir>/metrics.jsonl`` always, plus the
trackers (W&B) on the main process, which may fail without stopping training.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scale.fileio import write_text_atomic

if TYPE_CHECKING:  # types only: scale.report imports read_jsonl without accelerate
    from accelerate import Accelerator

    from scale.config import Config

logger = logging.getLogger(__name__)


def peak_memory_gib(device: torch.device) -> float:
    """Peak memory of this process in GiB: max allocated on a CUDA device, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # Linux reports KiB


class StepMeter:
    """Accumulates training sums between two log points, on device (no host sync until :meth:`flush`).

    Sums: ``loss_num`` (weighted tail CE, nats), ``loss_den`` (weights), ``tokens`` (real tokens seen),
    ``tail_tokens``, ``samples`` (sequences), ``flops`` (model FLOPs of the micro-batches, from
    ``flops_fn``). Counts come from tensors, never from the length of the batch dict. ``data_s`` is host
    time spent waiting for the next window (data loading plus the window-length all-gather).

    Args:
        device: where the sums live.
        flops_fn: ``(rows B, padded length T) -> model FLOPs`` of one micro-batch (:mod:`scale.flops`).
        peak_flops: the device's dense bf16 peak FLOP/s; with it, :meth:`flush` reports ``train/mfu``.
    """

    KEYS = ("loss_num", "loss_den", "tokens", "tail_tokens", "samples", "flops")

    def __init__(self, device: torch.device, flops_fn: Callable[[int, int], float] | None = None,
                 peak_flops: float | None = None) -> None:
        self.device = device
        self.flops_fn = flops_fn
        self.peak_flops = peak_flops
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.t0 = time.perf_counter()
        self.steps = 0
        self.data_s = 0.0
        self.paused_s = 0.0  # evaluation and checkpoints inside the interval: not training time

    def add_micro(self, loss_num: torch.Tensor, loss_den: torch.Tensor, batch: dict[str, torch.Tensor],
                  threshold: int) -> None:
        """Add one micro-batch: its loss numerator/denominator and its token/sample/FLOP counts."""
        n_rows, seq_len = batch["input_ids"].shape
        flops = self.flops_fn(n_rows, seq_len) if self.flops_fn is not None else 0.0
        self.sums += torch.stack([
            loss_num.detach().double(),
            loss_den.detach().double(),
            batch["attention_mask"].sum().double(),
            torch.tensor(float(n_rows * threshold), dtype=torch.float64, device=self.device),
            torch.tensor(float(n_rows), dtype=torch.float64, device=self.device),
            torch.tensor(flops, dtype=torch.float64, device=self.device),
        ])

    def flush(self, acc: Accelerator, lr: float) -> dict[str, float]:
        """Reduce the sums over ranks, return ``train/*`` metrics for the interval and reset.

        ``train/peak_mem_gib`` is the largest peak over ranks; ``train/data_s`` and ``train/compute_s`` split
        rank 0's wall time of the interval (seconds); ``train/mfu`` (a fraction) needs ``peak_flops``.
        Collective: every rank must call it at the same step.
        """
        totals = acc.reduce(self.sums.clone(), reduction="sum")  # collective: every rank must reach this
        peak = acc.gather(torch.tensor([peak_memory_gib(self.device)], device=self.device)).max()  # collective
        grad_norm = float(self.grad_norm)  # host sync (log interval only)
        loss_num, loss_den, tokens, tail_tokens, samples, flops = totals.tolist()  # host sync (log interval only)
        elapsed = max(time.perf_counter() - self.t0 - self.paused_s, 1e-9)
        out = {
            "train/loss": loss_num / loss_den if loss_den > 0 else None,  # None: every step was skipped
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens / elapsed,
            "train/tail_tokens_per_s": tail_tokens / elapsed,
            "train/samples_per_s": samples / elapsed,
            "train/steps_per_s": self.steps / elapsed,
            "train/peak_mem_gib": float(peak),
            "train/data_s": self.data_s,
            "train/compute_s": elapsed - self.data_s,
        }
        if self.peak_flops:
            out["train/mfu"] = flops / elapsed / (self.peak_flops * acc.num_processes)
        if acc.scaler is not None:  # fp16 loss scaling
            out["train/loss_scale"] = float(acc.scaler.get_scale())
        if out["train/loss"] is None:
            del out["train/loss"]
        self.sums.zero_()
        self.steps = 0
        self.data_s = 0.0
        self.paused_s = 0.0
        self.t0 = time.perf_counter()
        return out


def bar_text(metrics: dict[str, Any]) -> str:
    """The progress bar's text at a log step: ``loss 2.3456 lr 2.00e-04 tok/s 1.2e+03 gnorm 0.812``."""
    loss = metrics.get("train/loss")
    return (f"loss {loss:.4f} " if loss is not None else "loss - ") + (
        f"lr {metrics['train/lr']:.2e} tok/s {metrics['train/tokens_per_s']:.3g} "
        f"gnorm {metrics['train/grad_norm']:.3g}")


class JsonlSink:
    """Append one JSON object per call to ``<output_dir>/metrics.jsonl`` (main process only).

    Args:
        path: the file.
        enabled: write at all (the main process).
        keep_until: resuming from this optimizer step: keep the lines of steps ``<= keep_until`` (what the
            checkpoint had seen) and drop later ones (logged after it, before the crash). ``None``: start empty.
    """

    def __init__(self, path: Path, enabled: bool, keep_until: int | None = None) -> None:
        self.path = path
        self.enabled = enabled
        if enabled:
            path.parent.mkdir(parents=True, exist_ok=True)
            kept = []
            if keep_until is not None and path.exists():
                kept = [json.dumps(r) + "\n" for r in read_jsonl(path) if r.get("step", 0) <= keep_until]
            write_text_atomic(path, "".join(kept))  # a crash here leaves the old history, never half of it

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``{"step": step, **metrics}`` as one line and flush."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")


def model_flops(cfg: Config, model_config: Any, device: torch.device, trainable: int
                ) -> tuple[Callable[[int, int], float], float | None]:
    """``(flops_fn, peak)`` for ``train/mfu``.

    Args:
        cfg: the run's config (``loss.threshold``, ``log.peak_flops``).
        model_config: the base model's transformers config.
        device: the run's device.
        trainable: trainable (LoRA) parameter count.

    Returns:
        ``flops_fn(B, T)``: model FLOPs of a ``[B, T]`` micro-batch (:mod:`scale.flops`: LoRA count, only the
        tail's logits); and the device's peak FLOP/s (``log.peak_flops``, else the GPU's name looked up in a
        table; ``None`` on CPU or an unknown GPU, then no MFU is reported).
    """
    from scale.flops import flops_per_token, peak_flops

    threshold = cfg.loss.threshold

    def flops_fn(rows: int, seq_len: int) -> float:
        per_position = flops_per_token(model_config, seq_len, lora_params=trainable,
                                       logits_fraction=threshold / seq_len)
        return rows * seq_len * per_position

    peak = cfg.log.peak_flops
    if peak is None and device.type == "cuda":
        peak = peak_flops(torch.cuda.get_device_name(device))
    return flops_fn, peak


def start_trackers(cfg: Config, acc: Accelerator) -> None:
    """Start the trackers on the main process. W&B without an API key runs offline (one-line notice).

    A tracker that cannot start (W&B unreachable, a bad key, the package missing) costs one warning:
    training goes on and ``metrics.jsonl`` still gets every figure.
    """
    from scale.config import to_dict

    trackers = [t for t in cfg.log.trackers if t != "none"]
    if not trackers:
        return
    init_kwargs: dict[str, Any] = {}
    if "wandb" in trackers:
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            os.environ["WANDB_MODE"] = "offline"
            if acc.is_main_process:
                logger.info("W&B: no API key configured, logging offline to %s/wandb (upload later with "
                            "`wandb sync`)", cfg.output_dir)
        init_kwargs["wandb"] = {"dir": cfg.output_dir, "name": cfg.log.run_name}
    try:
        acc.init_trackers(cfg.log.project, config=to_dict(cfg), init_kwargs=init_kwargs)  # main process only
    except Exception as e:  # noqa: BLE001 - any tracker failure must not stop training
        drop_trackers(acc, e, trackers)


def drop_trackers(acc: Accelerator, error: BaseException, names: list[str] | None = None) -> None:
    """Stop logging to the trackers after ``error``, with one warning; ``metrics.jsonl`` goes on."""
    names = names or [getattr(t, "name", type(t).__name__) for t in acc.trackers]
    logger.warning("trackers %s failed (%s: %s); training goes on, metrics stay in %s/metrics.jsonl",
                   names, type(error).__name__,
                   str(error).splitlines()[0][:200] if str(error) else "", acc.project_configuration.project_dir)
    acc.trackers = []


class MetricsLog:
    """The one place figures are logged: ``metrics.jsonl`` (main process) and the trackers.

    Args:
        acc: the run's Accelerator (its trackers were started by :func:`start_trackers`).
        sink: the ``metrics.jsonl`` writer.
    """

    def __init__(self, acc: Accelerator, sink: JsonlSink) -> None:
        self.acc = acc
        self.sink = sink

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Log ``metrics`` at optimizer step ``step``; a tracker that fails is dropped with one warning."""
        self.sink.write(step, metrics)
        try:
            self.acc.log(metrics, step=step)  # main process only
        except Exception as e:  # noqa: BLE001 - a tracker that fails mid-run must not stop training
            drop_trackers(self.acc, e)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` back into a list of dicts."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]

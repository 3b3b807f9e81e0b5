"""Device-side metric sums, reduced across ranks only at log time, and the local ``metrics.jsonl`` sink.

Cross-rank numbers are ratios of sums: every rank adds numerators and denominators on its device; at
``train.log_every`` the sums are reduced once (a collective every rank must reach) and divided once.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # a type only: scale.report imports read_jsonl without accelerate
    from accelerate import Accelerator


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
            tmp = path.with_name(path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            os.replace(tmp, path)  # atomic: a crash here leaves the old history, never half of it

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Write ``{"step": step, **metrics}`` as one line and flush."""
        if not self.enabled:
            return
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"step": step, **metrics}) + "\n")


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` back into a list of dicts."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]

"""Device-side metric sums, reduced across ranks only at log time, and the local ``metrics.jsonl`` sink.

Cross-rank numbers are ratios of sums: every rank adds numerators and denominators on its device; at
``train.log_every`` the sums are reduced once (a collective every rank must reach) and divided once.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator


class StepMeter:
    """Accumulates training sums between two log points, on device (no host sync until :meth:`flush`).

    Sums: ``loss_num`` (weighted tail CE, nats), ``loss_den`` (weights), ``tokens`` (real tokens seen),
    ``tail_tokens``, ``samples`` (sequences). Counts come from tensors, never from the length of the batch dict.
    """

    KEYS = ("loss_num", "loss_den", "tokens", "tail_tokens", "samples")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.t0 = time.perf_counter()
        self.steps = 0

    def add_micro(self, loss_num: torch.Tensor, loss_den: torch.Tensor, batch: dict[str, torch.Tensor],
                  threshold: int) -> None:
        """Add one micro-batch: its loss numerator/denominator and its token/sample counts."""
        n_rows = batch["input_ids"].shape[0]
        self.sums += torch.stack([
            loss_num.detach().double(),
            loss_den.detach().double(),
            batch["attention_mask"].sum().double(),
            torch.tensor(float(n_rows * threshold), dtype=torch.float64, device=self.device),
            torch.tensor(float(n_rows), dtype=torch.float64, device=self.device),
        ])

    def flush(self, acc: Accelerator, lr: float) -> dict[str, float]:
        """Reduce the sums over ranks, return ``train/*`` metrics for the interval and reset.

        Collective: every rank must call it at the same step.
        """
        totals = acc.reduce(self.sums.clone(), reduction="sum")  # collective: every rank must reach this
        grad_norm = float(self.grad_norm)  # host sync (log interval only)
        loss_num, loss_den, tokens, tail_tokens, samples = totals.tolist()  # host sync (log interval only)
        elapsed = max(time.perf_counter() - self.t0, 1e-9)
        out = {
            "train/loss": loss_num / loss_den if loss_den > 0 else None,  # None: every step was skipped
            "train/lr": lr,
            "train/grad_norm": grad_norm,
            "train/tokens_per_s": tokens / elapsed,
            "train/tail_tokens_per_s": tail_tokens / elapsed,
            "train/samples_per_s": samples / elapsed,
            "train/steps_per_s": self.steps / elapsed,
        }
        if out["train/loss"] is None:
            del out["train/loss"]
        self.sums.zero_()
        self.steps = 0
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

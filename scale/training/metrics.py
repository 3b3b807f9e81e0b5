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
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scale.utils.fileio import write_text_atomic
from scale.utils.flops import flops_per_token, reference_flops_per_token

if TYPE_CHECKING:  # types only: scale.report imports read_jsonl without accelerate
    from accelerate import Accelerator

    from scale.config.schema import Config

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
    ``flops_fn``), ``positions`` (positions computed, padding included). Counts come from tensors, never
    from the length of the batch dict. ``data_s`` is host time spent waiting for the next window (data
    loading plus the window-length all-gather).

    Args:
        device: where the sums live.
        flops_fn: ``(rows B, padded length T, LM-head positions per row N) -> model FLOPs`` of one micro-batch
            (:func:`model_flops`).
        peak_flops: one device's peak FLOP/s (:func:`resolve_peak_flops`); with it, :meth:`flush` reports
            ``train/mfu``.
        max_seq_len: the longest row (``data.max_length``); sizes the per-row FLOPs table that padding-free
            micro-batches (``seq_lens`` in the batch) are counted with.
        sequence_parallel_size: ``N`` ranks share each row (a batch holding ``shard_index``): each counts its shard's
            tokens and positions and ``1/N`` of the rows' FLOPs; rank 0 of the group counts the rows.
    """

    KEYS = ("loss_num", "loss_den", "tokens", "tail_tokens", "samples", "flops", "positions")

    def __init__(self, device: torch.device, flops_fn: Callable[[int, int], float] | None = None,
                 peak_flops: float | None = None, max_seq_len: int = 0, sequence_parallel_size: int = 1,
                 term_names: tuple[str, ...] = ()) -> None:
        self.device = device
        self.term_names = tuple(term_names)  # an objective's metrics (train/<name>), summed like the loss
        self.terms = torch.zeros(len(self.term_names), dtype=torch.float64, device=device)
        self.sp = sequence_parallel_size
        self.flops_fn = flops_fn
        self.peak_flops = peak_flops
        # Padding-free micro-batches: FLOPs of one row of n tokens without the LM head, n = 0..max_seq_len, plus the
        # LM head's FLOPs per position it computes (flops_fn is affine in the head's positions).
        self.row_flops = None if flops_fn is None or max_seq_len < 1 else torch.tensor(
            [0.0] + [flops_fn(1, n, 0) for n in range(1, max_seq_len + 1)], dtype=torch.float64, device=device)
        self.head_flops = 0.0 if flops_fn is None else flops_fn(1, 1, 1) - flops_fn(1, 1, 0)
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.t0 = time.perf_counter()
        self.steps = 0
        self.data_s = 0.0
        self.paused_s = 0.0  # evaluation and checkpoints inside the interval: not training time

    def add_micro(self, loss_num: torch.Tensor, loss_den: torch.Tensor, batch: dict[str, torch.Tensor],
                  terms: dict[str, torch.Tensor] | None = None, threshold: int | None = None) -> None:
        """Add one micro-batch: its loss numerator/denominator, its token/sample/FLOP counts and an objective's
        metric sums (``terms``: ``[]`` each, under the same weights as the loss: :meth:`flush` reports
        ``train/<name>`` as their sum over the interval divided by the loss denominator's, or by the sum of the
        term ``<name>/n`` when the objective counts one: GRPO's per-token means).

        Tail tokens are counted from ``batch["tail_mask"]`` (tails differ per row); ``threshold`` only for a
        batch without one.
        """
        if terms:
            self.terms += torch.stack([terms[k].detach().double() for k in self.term_names]).to(self.device)
        if "shard_index" in batch:  # one rank's shard of sequence-parallel rows (scale.data.sequence.shard_rows)
            rows, C = batch["input_ids"].shape
            n_rows = batch["row_lens"].shape[0] * batch["sp_first"].double()  # counted once per group
            positions, tokens = rows * C, batch["shard_tokens"].double()
            flops = torch.tensor(self.flops_fn(rows, C * self.sp, batch["tail_mask"].shape[1]) / self.sp
                                 if self.flops_fn is not None else 0.0, dtype=torch.float64, device=self.device)
        elif "seq_lens" in batch:  # padding-free: B rows packed into [1, L]; every position is a real token
            n_rows, positions = batch["seq_lens"].shape[0], batch["input_ids"].shape[1]
            tokens = batch["seq_lens"].sum().double()
            # Per-row FLOPs from a table (no host sync): attention grows with each row's own length; the LM head
            # computes each row's tail_mask width (the batch's longest tail) of positions, as in a padded batch.
            kept = batch["tail_mask"].shape[1] if "tail_mask" in batch else (threshold or 0)
            flops = (self.row_flops[batch["seq_lens"]].sum() + n_rows * kept * self.head_flops
                     if self.row_flops is not None else tokens * 0)
        else:
            n_rows, seq_len = batch["input_ids"].shape
            positions, tokens = n_rows * seq_len, batch["attention_mask"].sum().double()
            kept = batch["tail_mask"].shape[1] if "tail_mask" in batch else threshold  # LM-head positions per row
            flops = torch.tensor(self.flops_fn(n_rows, seq_len, kept) if self.flops_fn is not None else 0.0,
                                 dtype=torch.float64, device=self.device)
        tail_tokens = (batch["tail_mask"].sum().double() if "tail_mask" in batch else
                       torch.tensor(float(n_rows * (threshold or 0)), dtype=torch.float64, device=self.device))
        self.sums += torch.stack([
            loss_num.detach().double(),
            loss_den.detach().double(),
            tokens,
            tail_tokens.to(self.device),
            torch.as_tensor(n_rows, dtype=torch.float64, device=self.device).reshape(()),
            flops,
            torch.tensor(float(positions), dtype=torch.float64, device=self.device),
        ])

    def flush(self, acc: Accelerator, lr: float) -> dict[str, float]:
        """Reduce the sums over ranks, return ``train/*`` metrics for the interval and reset.

        ``train/peak_mem_gib`` is the largest peak over ranks; ``train/data_s`` and ``train/compute_s`` split
        rank 0's wall time of the interval (seconds); ``train/pad_fraction`` is padded / total positions of
        the interval's micro-batches; ``train/mfu`` (a fraction) needs ``flops_fn`` and ``peak_flops``.
        Collective: every rank must call it at the same step.
        """
        totals = acc.reduce(torch.cat([self.sums, self.terms]), reduction="sum")  # collective: every rank
        terms, totals = totals[len(self.KEYS):].tolist(), totals[:len(self.KEYS)]  # host sync (log only)
        peak = acc.gather(torch.tensor([peak_memory_gib(self.device)], device=self.device)).max()  # collective
        grad_norm = float(self.grad_norm)  # host sync (log interval only)
        loss_num, loss_den, tokens, tail_tokens, samples, flops, positions = totals.tolist()  # host sync (log only)
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
            "train/pad_fraction": 1.0 - tokens / positions if positions > 0 else 0.0,
        }
        if self.peak_flops and self.flops_fn is not None:
            out["train/mfu"] = flops / elapsed / (self.peak_flops * acc.num_processes)
        if acc.scaler is not None:  # fp16 loss scaling
            out["train/loss_scale"] = float(acc.scaler.get_scale())
        named = dict(zip(self.term_names, terms))
        for k, v in named.items():  # a term with a count of its own (<name>/n) is its mean over that count
            if k.endswith("/n"):
                continue
            if f"{k}/n" in named:
                if named[f"{k}/n"] > 0:
                    out[f"train/{k}"] = v / named[f"{k}/n"]
            elif loss_den > 0:
                out[f"train/{k}"] = v / loss_den
        if out["train/loss"] is None:
            del out["train/loss"]
        self.sums.zero_()
        self.terms.zero_()
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


def plain_progress(stream: Any = None) -> bool:
    """Whether progress goes out as plain log lines instead of a bar: ``SCALE_PROGRESS=lines`` or ``bar``, else
    lines when ``stream`` (default stderr, where tqdm draws) is not a terminal (SLURM, nohup, ``2> file``): a bar
    redrawn with carriage returns there makes one line of kilobytes."""
    choice = os.environ.get("SCALE_PROGRESS", "").lower()
    if choice in ("lines", "bar"):
        return choice == "lines"
    stream = sys.stderr if stream is None else stream
    return not (hasattr(stream, "isatty") and stream.isatty())


def duration_text(seconds: float) -> str:
    """``3h05m``, ``4m20s`` or ``37s``."""
    seconds = max(int(round(seconds)), 0)
    if seconds >= 3600:
        return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"
    return f"{seconds // 60}m{seconds % 60:02d}s" if seconds >= 60 else f"{seconds}s"


def step_line(step: int, total: int, metrics: dict[str, Any]) -> str:
    """One log line for a log step: ``step 20/100 (20%) loss 2.3456 lr 2.00e-04 tok/s 1.2e+03 mfu 0.39 gnorm 0.81
    eta 2m40s`` (the ETA from this interval's optimizer steps per second, evaluations not counted)."""
    line = f"step {step}/{total} ({100 * step / max(total, 1):.0f}%) {bar_text(metrics)}"
    if metrics.get("train/mfu") is not None:
        line += f" mfu {metrics['train/mfu']:.3f}"
    rate = metrics.get("train/steps_per_s")
    if rate:
        line += f" eta {duration_text((total - step) / rate)}"
    return line


class Progress:
    """Progress of the optimizer steps on the local main process: a tqdm bar on a terminal, else (a log file) one
    plain line per ``train.log_every`` steps (:func:`step_line`), never longer than a few hundred characters.

    Args:
        total: the run's optimizer steps; initial: the step it starts from (a resumed run).
        enabled: this process shows progress (the local main process).
    """

    def __init__(self, total: int, initial: int, enabled: bool) -> None:
        from tqdm.auto import tqdm

        self.total, self.enabled, self.lines = total, enabled, plain_progress()
        self.bar = tqdm(total=total, initial=initial, desc="optimizer steps") if enabled and not self.lines else None

    def update(self) -> None:
        """One optimizer step done."""
        if self.bar is not None:
            self.bar.update(1)

    def show(self, step: int, metrics: dict[str, Any]) -> None:
        """The figures of a log step: the bar's text, or a log line."""
        if self.bar is not None:
            self.bar.set_postfix_str(bar_text(metrics), refresh=False)
        elif self.enabled:
            logger.info(step_line(step, self.total, metrics))

    def close(self) -> None:
        """End the bar (nothing for lines)."""
        if self.bar is not None:
            self.bar.close()


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


def model_flops(cfg: Config, model_config: Any, trainable: int) -> Callable[..., float]:
    """``flops_fn(B, T, N)``: model FLOPs of a ``[B, T]`` micro-batch whose LM head computes ``N`` positions per
    row (the tail width, ``tail_mask.shape[1]``; default ``loss.threshold``), for ``train/mfu``.

    Args:
        cfg: the run's config (``loss.threshold``).
        model_config: the base model's matmul shape (:func:`scale.utils.flops.model_shape`) or transformers config.
        trainable: trainable (LoRA) parameter count.

    Returns:
        ``flops_fn`` (:mod:`scale.utils.flops`: LoRA count, only the tail's logits (ORPO under
        ``data.pair_conventions: trl``: every position's), padding positions counted; with DPO's in-step reference
        (``loss.reference: adapter``) its forward too, :func:`scale.utils.flops.reference_flops_per_token`).
    """
    in_step_reference = cfg.loss.objective == "dpo" and cfg.loss.reference in ("adapter", "model")
    whole_rows = cfg.loss.objective == "orpo" and cfg.data.pair_conventions == "trl"  # TRL's NLL: every position

    def flops_fn(rows: int, seq_len: int, kept: int | None = None) -> float:
        if whole_rows or kept is None and cfg.loss.threshold == "all":  # loss.threshold: all keeps every position
            kept = seq_len
        elif kept is None:
            kept = cfg.loss.threshold
        fraction = min(1.0, kept / seq_len)
        per_position = flops_per_token(model_config, seq_len, lora_params=trainable, logits_fraction=fraction)
        if in_step_reference:  # DPO's reference forward runs in the same step over the same rows
            per_position += reference_flops_per_token(model_config, seq_len, fraction,
                                                      trainable if cfg.model.adapter else 0)
        return rows * seq_len * per_position

    return flops_fn


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
        acc: the run's Accelerator (its trackers were started by :func:`scale.training.tracking.start_trackers`).
        sink: the ``metrics.jsonl`` writer.
        skip_below: rows of steps below it go to ``metrics.jsonl`` only (a resumed online W&B run already
            holds them: :mod:`scale.training.tracking`).
    """

    def __init__(self, acc: Accelerator, sink: JsonlSink, skip_below: int = 0) -> None:
        self.acc = acc
        self.sink = sink
        self.skip_below = skip_below  # steps the trackers already hold (scale.training.tracking.start_trackers)

    def write(self, step: int, metrics: dict[str, Any]) -> None:
        """Log ``metrics`` at optimizer step ``step``; a tracker that fails is dropped with one warning."""
        self.sink.write(step, metrics)
        if step < self.skip_below:
            return
        try:
            self.acc.log(metrics, step=step)  # main process only
        except Exception as e:  # noqa: BLE001 - a tracker that fails mid-run must not stop training
            drop_trackers(self.acc, e)


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read ``metrics.jsonl`` back into a list of dicts."""
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]

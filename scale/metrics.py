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
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scale.fileio import write_text_atomic
from scale.flops import flops_per_token, peak_flops

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
                 peak_flops: float | None = None, max_seq_len: int = 0, sequence_parallel_size: int = 1) -> None:
        self.device = device
        self.sp = sequence_parallel_size
        self.flops_fn = flops_fn
        self.peak_flops = peak_flops
        # FLOPs of one row of n tokens, n = 0..max_seq_len, for padding-free micro-batches.
        self.row_flops = None if flops_fn is None or max_seq_len < 1 else torch.tensor(
            [0.0] + [flops_fn(1, n) for n in range(1, max_seq_len + 1)], dtype=torch.float64, device=device)
        self.sums = torch.zeros(len(self.KEYS), dtype=torch.float64, device=device)
        self.grad_norm = torch.zeros((), device=device)
        self.t0 = time.perf_counter()
        self.steps = 0
        self.data_s = 0.0
        self.paused_s = 0.0  # evaluation and checkpoints inside the interval: not training time

    def add_micro(self, loss_num: torch.Tensor, loss_den: torch.Tensor, batch: dict[str, torch.Tensor],
                  threshold: int | None = None) -> None:
        """Add one micro-batch: its loss numerator/denominator and its token/sample/FLOP counts.

        Tail tokens are counted from ``batch["tail_mask"]`` (tails differ per row); ``threshold`` only for a
        batch without one.
        """
        if "shard_index" in batch:  # one rank's shard of sequence-parallel rows (scale.data.sequence.shard_rows)
            rows, C = batch["input_ids"].shape
            n_rows = batch["row_lens"].shape[0] * batch["sp_first"].double()  # counted once per group
            positions, tokens = rows * C, batch["shard_tokens"].double()
            flops = torch.tensor(self.flops_fn(rows, C * self.sp, batch["tail_mask"].shape[1]) / self.sp
                                 if self.flops_fn is not None else 0.0, dtype=torch.float64, device=self.device)
        elif "seq_lens" in batch:  # padding-free: B rows packed into [1, L]; every position is a real token
            n_rows, positions = batch["seq_lens"].shape[0], batch["input_ids"].shape[1]
            tokens = batch["seq_lens"].sum().double()
            # Per-row FLOPs from a table (no host sync): attention grows with each row's own length.
            flops = self.row_flops[batch["seq_lens"]].sum() if self.row_flops is not None else tokens * 0
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
        totals = acc.reduce(self.sums.clone(), reduction="sum")  # collective: every rank must reach this
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


@dataclass
class PeakFlops:
    """One device's peak FLOP/s for ``train/mfu`` and where it came from.

    Attributes:
        flops: FLOP/s of one device (one rank); ``None``: no MFU is reported.
        source: the figure in words, for the start-up log (``"measured: float32 GEMM 2048^3 on cpu, 2 threads"``).
    """

    flops: float | None
    source: str


AUTO_BF16_RATIO = 1.3
"""``train.mixed_precision: auto`` picks bf16 on CPU when bf16 GEMMs measure at least this many times fp32."""


@dataclass
class PrecisionChoice:
    """What ``train.mixed_precision: auto`` resolved to, and why.

    Attributes:
        choice: ``"bf16"`` or ``"no"``.
        fp32_flops: measured fp32 GEMM FLOP/s (``None`` where not measured).
        bf16_flops: measured bf16 GEMM FLOP/s (``None`` where not measured).
        reason: one sentence for the log.
    """

    choice: str
    fp32_flops: float | None
    bf16_flops: float | None
    reason: str

    def metrics(self) -> dict[str, float]:
        """``precision/*`` figures for ``metrics.jsonl``: bf16 (1/0) and both measurements in GFLOP/s."""
        out = {"precision/bf16": 1.0 if self.choice == "bf16" else 0.0}
        for key, v in (("precision/fp32_gflops", self.fp32_flops), ("precision/bf16_gflops", self.bf16_flops)):
            if v is not None:
                out[key] = v / 1e9
        return out


def resolve_mixed_precision(cfg: Config, device: torch.device, saved: str | None = None) -> PrecisionChoice | None:
    """Resolve ``train.mixed_precision: auto`` for ``device`` (and ``model.bnb_4bit_compute_dtype: auto`` with it),
    in place on ``cfg``'s sections; return the choice, or None when the precision was set explicitly.

    - a resumed run (``saved``: the precision its checkpoint trained in, :attr:`TrainerState.mixed_precision`):
      kept, not measured again, so that a probe within noise of the threshold cannot change the dtype mid-run
      (an explicit setting that differs is the resume's maths-change error, scale.checkpoint.check_resume);
    - QLoRA with ``model.bnb_4bit_compute_dtype: float32``: ``no`` (autocast needs a matching compute dtype);
    - a CUDA GPU: ``bf16`` when ``torch.cuda.is_bf16_supported()`` (tensor cores run it at 2x+ fp32), else ``no``;
    - CPU: both GEMMs timed (:func:`measure_peak_flops`, bounded in time); ``bf16`` when bf16 measures at least
      :data:`AUTO_BF16_RATIO` x fp32 (AMX CPUs: ~7x), else ``no`` (AVX2 CPUs have no bf16 kernel: ~0.5x).

    Decided once per launch: rank 0 decides (it alone measures) and broadcasts its choice, and every rank applies
    it; ranks deciding on their own measurements could split on a ratio within noise of the threshold and train
    one model in two dtypes. Collective when a process group is up (every rank calls it, after the group starts
    and before the Accelerator is made: ``scale.launch.build_accelerator``'s ``settle``).
    """
    if cfg.train.mixed_precision != "auto":
        if cfg.model.bnb_4bit_compute_dtype == "auto":
            cfg.model.bnb_4bit_compute_dtype = "bfloat16" if cfg.train.mixed_precision == "bf16" else "float32"
        return None
    import torch.distributed as dist

    group = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    box: list[PrecisionChoice | None] = [None]
    if not group or dist.get_rank() == 0:
        box[0] = (PrecisionChoice(saved, None, None, "kept from the checkpoint this run resumes")
                  if saved in ("bf16", "fp16", "no") else _auto_precision(cfg, device))
    if group:
        dist.broadcast_object_list(box, src=0)  # collective
    choice = box[0]
    if choice is None:
        raise RuntimeError("train.mixed_precision=auto: rank 0's choice did not arrive")
    cfg.train.mixed_precision = choice.choice
    if cfg.model.bnb_4bit_compute_dtype == "auto":
        cfg.model.bnb_4bit_compute_dtype = {"bf16": "bfloat16", "fp16": "float16"}.get(choice.choice, "float32")
    return choice


def _auto_precision(cfg: Config, device: torch.device) -> PrecisionChoice:
    m = cfg.model
    if m.quantize_4bit and m.bnb_4bit_compute_dtype == "float32":
        return PrecisionChoice("no", None, None, "QLoRA computes in model.bnb_4bit_compute_dtype=float32")
    if device.type == "cuda":
        ok = torch.cuda.is_bf16_supported()
        return PrecisionChoice("bf16" if ok else "no", None, None,
                               f"{torch.cuda.get_device_name(device)} {'supports' if ok else 'lacks'} bf16")
    fp32, bf16 = measure_peak_flops(device, torch.float32), measure_peak_flops(device, torch.bfloat16)
    ratio = bf16 / fp32
    choice = "bf16" if ratio >= AUTO_BF16_RATIO else "no"
    return PrecisionChoice(choice, fp32, bf16, f"bf16 GEMMs measure {ratio:.2f}x fp32 on this {device.type} "
                                               f"({'>=' if choice == 'bf16' else '<'} {AUTO_BF16_RATIO}x)")


def compute_dtype(cfg: Config) -> torch.dtype:
    """The dtype the run's matmuls compute in: the autocast dtype under ``train.mixed_precision``, else the
    4-bit compute dtype for QLoRA, else ``model.dtype``."""
    if cfg.train.mixed_precision in ("bf16", "fp16"):  # "auto" is resolved at start-up (resolve_mixed_precision)
        return torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float16
    return getattr(torch, cfg.model.bnb_4bit_compute_dtype if cfg.model.quantize_4bit else cfg.model.dtype)


_MEASURED: dict[tuple[str, torch.dtype, int, int], tuple[float, int]] = {}  # per process: the hardware does not change


def measure_peak_flops(device: torch.device, dtype: torch.dtype, seconds: float = 0.4, n: int | None = None
                       ) -> float:
    """Best FLOP/s of a dense ``[n, n] @ [n, n]`` matmul (``2 n^3`` FLOPs) on ``device`` in ``dtype``.

    One warm-up product (kernel selection), then products for about ``seconds`` (at least 3): the best one
    counts, so a noisy neighbour lowers the figure less than a mean would. ``n`` defaults to 8192 on a GPU; on
    CPU it grows from 256 by doubling up to 2048 while one product takes under ``seconds / 8``, so that a dtype
    the CPU has no fast kernel for (bf16 on an AVX2-only CPU: 0.2 GFLOP/s measured, one 2048^3 product ~80 s)
    is measured in well under a second instead of stalling the start-up. Measured once per process for a
    device, dtype, thread count and ``n`` (:func:`measured_size` gives the size used).

    Returns:
        FLOP/s.
    """
    return _measure(device, dtype, seconds, n)[0]


def measured_size(device: torch.device, dtype: torch.dtype, seconds: float = 0.4, n: int | None = None) -> int:
    """The GEMM size ``n`` :func:`measure_peak_flops` used (measuring first if needed)."""
    return _measure(device, dtype, seconds, n)[1]


def _measure(device: torch.device, dtype: torch.dtype, seconds: float, n: int | None) -> tuple[float, int]:
    key = (str(device), dtype, torch.get_num_threads(), n or 0)
    if key not in _MEASURED:
        if n is None and device.type != "cuda":
            size = 256
            while size < 2048 and 2.0 * size**3 / _time_gemm(device, dtype, 0.0, size, reps=1) < seconds / 8:
                size *= 2
        else:
            size = n or 8192
        _MEASURED[key] = (_time_gemm(device, dtype, seconds, size), size)
    return _MEASURED[key]


def _time_gemm(device: torch.device, dtype: torch.dtype, seconds: float, n: int, reps: int = 3) -> float:
    g = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=g)
    out = torch.empty(n, n, device=device, dtype=dtype)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    torch.matmul(a, b, out=out)
    sync()
    best, done, stop = 0.0, 0, time.perf_counter() + seconds
    while done < reps or (time.perf_counter() < stop and done < 100):
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        sync()
        best = max(best, 2.0 * n**3 / (time.perf_counter() - t0))
        done += 1
    return best


PEAK_PROBES = 3
"""Probes (each the best product of about 0.4 s, :func:`measure_peak_flops`) whose best is a machine's cached peak."""


def device_model(device: torch.device) -> str:
    """What a measured peak belongs to: the GPU's name, or the CPU's model name (``/proc/cpuinfo``; the platform's
    processor string elsewhere)."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown CPU"


def peak_cache_path() -> Path:
    """``$SCALE_CACHE/peak_flops.json`` (default ``~/.cache/scale``, the asset cache of :mod:`scale.assets`)."""
    return Path(os.environ.get("SCALE_CACHE", Path.home() / ".cache" / "scale")) / "peak_flops.json"


def machine_peak(key: str, probe: Callable[[], tuple[float, int]], path: Path, probes: int = PEAK_PROBES
                 ) -> tuple[dict[str, Any], bool]:
    """The peak FLOP/s of ``key`` (device model, torch version, dtype, threads) as ``path`` caches it, measured
    once: the best of ``probes`` calls of ``probe`` (each ``(FLOP/s, GEMM size n)``) when ``path`` holds none.

    One figure per machine keeps ``train/mfu`` comparable between runs: a probe at every start measured 0.44-0.70
    vs 0.25-0.35 MFU for two identical runs, the second on a busy machine. The best of several probes is the figure
    least lowered by a neighbour's load; the cache is the one figure every later run divides by. Delete the file
    (or set ``log.peak_flops: measure``) to measure again.

    Returns:
        ``({"flops", "n", "probes", "date"}, cached)``: ``cached`` is False when measured by this call. A cache
        that cannot be written (read-only home) is skipped: the figure is then this run's best probe.
    """
    try:
        table = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        table = {}
    entry = table.get(key) if isinstance(table, dict) else None
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        return entry, True
    runs = [probe() for _ in range(probes)]
    flops, n = max(runs)
    entry = {"flops": flops, "n": n, "probes": probes, "date": time.strftime("%Y-%m-%d")}
    table = {**(table if isinstance(table, dict) else {}), key: entry}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps(table, indent=1, sort_keys=True) + "\n")
    except OSError:
        pass
    return entry, False


def _machine_peak(device: torch.device, dtype: torch.dtype) -> tuple[dict[str, Any], bool, str]:
    key = (f"{device_model(device)} | torch {torch.__version__} | {str(dtype).removeprefix('torch.')} | "
           f"{torch.get_num_threads()} threads")
    n = measured_size(device, dtype)  # the size grown as for one probe (scale to this dtype's speed)

    def probe() -> tuple[float, int]:
        return _time_gemm(device, dtype, 0.4, n), n

    entry, cached = machine_peak(key, probe, peak_cache_path())
    return entry, cached, key


def resolve_peak_flops(cfg: Config, acc: Accelerator) -> PeakFlops:
    """One device's peak FLOP/s for ``train/mfu`` from ``log.peak_flops``.

    - a number: used as given;
    - ``false``: no MFU;
    - ``null``: a GPU's dense bf16 figure from :data:`scale.flops.PEAK_BF16_FLOPS` by device name; on CPU, or
      a GPU missing from the table, this machine's figure: measured once (best of :data:`PEAK_PROBES` probes) and
      cached per device model, torch version, dtype and thread count (:func:`machine_peak`), so identical runs
      divide by the same peak;
    - ``"measure"``: measured now, :func:`measure_peak_flops` at the run's :func:`compute_dtype` on every rank at once
      (so that ranks sharing a machine measure what they share), averaged over ranks. On CPU the other of
      float32/bfloat16 is measured too, and the source names it when it is faster (a hint for
      ``train.mixed_precision`` / ``model.bnb_4bit_compute_dtype``).

    Collective when measuring with several processes (a barrier and one gather): every rank calls it.
    """
    setting, device = cfg.log.peak_flops, acc.device
    if setting is False:
        return PeakFlops(None, "none (log.peak_flops=false): no train/mfu")
    if isinstance(setting, float):
        return PeakFlops(setting, f"{_fmt_flops(setting)} per device (log.peak_flops)")
    if setting is None and device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        table = peak_flops(name)
        if table is not None:
            return PeakFlops(table, f"{_fmt_flops(table)} per device (dense bf16 of {name}, scale.flops table)")
    dtype = compute_dtype(cfg)
    other = {torch.float32: torch.bfloat16, torch.bfloat16: torch.float32}.get(dtype) if device.type == "cpu" else None
    acc.wait_for_everyone()  # collective: ranks on one machine measure together, as they will train
    once = setting is None  # null: the machine's figure, measured once and cached; "measure": measured now
    if once:
        entries = [_machine_peak(device, d) for d in [dtype] + ([other] if other else [])]
        measured, n = [e["flops"] for e, _, _ in entries], int(entries[0][0]["n"])
    else:
        measured = [measure_peak_flops(device, dtype)] + ([measure_peak_flops(device, other)] if other else [])
        n = measured_size(device, dtype)
    mine = torch.tensor([measured], dtype=torch.float64, device=device)
    flops = acc.gather(mine).mean(0).tolist() if acc.num_processes > 1 else mine[0].tolist()  # collective
    n_threads = torch.get_num_threads()
    threads = f", {n_threads} thread{'s' if n_threads != 1 else ''}" if device.type == "cpu" else ""
    source = (f"{_fmt_flops(flops[0])} per device (measured: {str(dtype).removeprefix('torch.')} GEMM {n}^3 on "
              f"{device.type}{threads}")
    if once:
        entry, cached, _ = entries[0]
        where = str(peak_cache_path()).replace(str(Path.home()), "~", 1)
        source += (f"; best of {entry.get('probes', PEAK_PROBES)} probes "
                   + (f"of {entry.get('date', '?')}, cached" if cached else "now, cached") + f" in {where})")
    else:
        source += "; measured now)"
    if other is not None:
        other_name = str(other).removeprefix("torch.")
        faster = "faster" if flops[1] > flops[0] else "slower"
        source += f"; {other_name} measures {_fmt_flops(flops[1])} ({faster} on this CPU)"
    return PeakFlops(flops[0], source)


def _fmt_flops(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"


def model_flops(cfg: Config, model_config: Any, trainable: int) -> Callable[..., float]:
    """``flops_fn(B, T, N)``: model FLOPs of a ``[B, T]`` micro-batch whose LM head computes ``N`` positions per
    row (the tail width, ``tail_mask.shape[1]``; default ``loss.threshold``), for ``train/mfu``.

    Args:
        cfg: the run's config (``loss.threshold``).
        model_config: the base model's matmul shape (:func:`scale.flops.model_shape`) or transformers config.
        trainable: trainable (LoRA) parameter count.

    Returns:
        ``flops_fn`` (:mod:`scale.flops`: LoRA count, only the tail's logits, padding positions counted).
    """
    def flops_fn(rows: int, seq_len: int, kept: int | None = None) -> float:
        if kept is None:  # loss.threshold: all keeps every position
            kept = seq_len if cfg.loss.threshold == "all" else cfg.loss.threshold
        per_position = flops_per_token(model_config, seq_len, lora_params=trainable,
                                       logits_fraction=min(1.0, kept / seq_len))
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
        acc: the run's Accelerator (its trackers were started by :func:`scale.tracking.start_trackers`).
        sink: the ``metrics.jsonl`` writer.
        skip_below: rows of steps below it go to ``metrics.jsonl`` only (a resumed online W&B run already
            holds them: :mod:`scale.tracking`).
    """

    def __init__(self, acc: Accelerator, sink: JsonlSink, skip_below: int = 0) -> None:
        self.acc = acc
        self.sink = sink
        self.skip_below = skip_below  # steps the trackers already hold (scale.tracking.start_trackers)

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

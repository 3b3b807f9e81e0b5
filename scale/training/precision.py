"""The run's precision and one device's peak FLOP/s: ``train.mixed_precision: auto`` decided from a GEMM probe
(bf16 against fp32 on this device), the compute dtype, the peak that ``train/mfu`` divides by, and the check that a
full fine-tune's optimizer steps fp32 masters (:func:`check_full_precision`).

The probe times square matrix products (:func:`measure_peak_flops`); the same measurement serves the ``auto``
choice and ``log.peak_flops: measure``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from scale.distributed.launch import LaunchError
from scale.modeling.finetune import weights_plan
from scale.utils.fileio import write_text_atomic
from scale.utils.flops import peak_flops

if TYPE_CHECKING:
    from accelerate import Accelerator

    from scale.config.schema import Config

logger = logging.getLogger(__name__)


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
      (an explicit setting that differs is the resume's maths-change error, scale.training.checkpoint.check_resume);
    - QLoRA with ``model.bnb_4bit_compute_dtype: float32``: ``no`` (autocast needs a matching compute dtype);
    - a CUDA GPU: ``bf16`` when ``torch.cuda.is_bf16_supported()`` (tensor cores run it at 2x+ fp32), else ``no``;
    - CPU: both GEMMs timed (:func:`measure_peak_flops`, bounded in time); ``bf16`` when bf16 measures at least
      :data:`AUTO_BF16_RATIO` x fp32 (AMX CPUs: ~7x), else ``no`` (AVX2 CPUs have no bf16 kernel: ~0.5x).

    Decided once per launch: rank 0 decides (it alone measures) and broadcasts its choice, and every rank applies
    it; ranks deciding on their own measurements could split on a ratio within noise of the threshold and train
    one model in two dtypes. Collective when a process group is up (every rank calls it, after the group starts
    and before the Accelerator is made: ``scale.distributed.launch.build_accelerator``'s ``settle``).
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
    """``$SCALE_CACHE/peak_flops.json`` (default ``~/.cache/scale``, the asset cache of :mod:`scale.utils.assets`)."""
    return Path(os.environ.get("SCALE_CACHE", Path.home() / ".cache" / "scale")) / "peak_flops.json"


def machine_peak(key: str, probe: Callable[[], tuple[float, int]], path: Path, probes: int = PEAK_PROBES
                 ) -> tuple[dict[str, Any], bool]:
    """The peak FLOP/s of ``key`` (device model, torch version, dtype, threads): the best probe this machine ever
    measured, as ``path`` caches it.

    The first call takes the best of ``probes`` calls of ``probe`` (each ``(FLOP/s, GEMM size n)``); every later call
    runs one probe and keeps the higher of it and the cached figure, writing the cache when the probe beat it. So
    the figure only rises, towards the idle machine's: a probe on a busy machine (a neighbour's load lowers it, as
    two identical runs measured 0.44-0.70 vs 0.25-0.35 MFU with a probe at every start) neither lowers the figure
    nor, once cached, replaces it; and ``train/mfu`` never divides by less than what this run just measured (a
    figure cached while the machine was busy would put it above 1). Delete the file (or set ``log.peak_flops:
    measure``) to start over.

    Returns:
        ``({"flops", "n", "probes", "date"}, cached)``: ``cached`` is True when the cached figure stood (this call's
        probe did not beat it). A cache that cannot be written (read-only home) is skipped: the figure is then this
        call's best probe.
    """
    try:
        table = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    except (OSError, ValueError):
        table = {}
    table = table if isinstance(table, dict) else {}
    entry = table.get(key)
    if isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float)) and entry["flops"] > 0:
        flops, n = probe()
        if flops <= entry["flops"]:
            return entry, True
        entry = {"flops": flops, "n": n, "probes": int(entry.get("probes", 0)) + 1, "date": time.strftime("%Y-%m-%d")}
    else:
        flops, n = max(probe() for _ in range(probes))
        entry = {"flops": flops, "n": n, "probes": probes, "date": time.strftime("%Y-%m-%d")}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text_atomic(path, json.dumps({**table, key: entry}, indent=1, sort_keys=True) + "\n")
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
    - ``null``: a GPU's dense bf16 figure from :data:`scale.utils.flops.PEAK_BF16_FLOPS` by device name; on CPU, or
      a GPU missing from the table, this machine's figure: the best probe it ever measured (first the best of
      :data:`PEAK_PROBES`, then one probe a start that can only raise it), cached per device model, torch version,
      dtype and thread count (:func:`machine_peak`), so a busy machine does not change the peak runs divide by;
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
            return PeakFlops(table, f"{_fmt_flops(table)} per device (dense bf16 of {name}, scale.utils.flops table)")
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


def check_full_precision(cfg: Config, mode: str, model: torch.nn.Module, optimizer: Any) -> str | None:
    """For ``model.finetune=full``, after ``prepare``: check on the real objects what
    :func:`scale.modeling.finetune.weights_plan` says for ``mode``, and return the start-up line that states it
    (None for a LoRA run).

    Checked: every tensor the torch optimizer steps is float32 (one device, DDP, FSDP2: the parameters themselves;
    ZeRO-1/2/3: DeepSpeed's fp32 partitions, ZeRO-1 under bf16 ``BF16_Optimizer``'s, read from DeepSpeed's optimizer
    as ZeRO-3 lists them in the torch optimizer only while it steps), so its state, created like
    them (``torch.zeros_like``), is float32 too; gradients accumulate in float32 (DeepSpeed:
    ``engine.get_data_types()``; elsewhere the ``.grad`` of float32 parameters); the forward's weights have the
    plan's ``module_dtype`` (bfloat16 where DeepSpeed's bf16 casts the module).

    Raises:
        LaunchError: a library stepped, accumulated or cast otherwise (the mode and what was found).
    """
    if cfg.model.finetune != "full":
        return None
    plan = weights_plan(cfg, mode)
    zero = getattr(optimizer, "optimizer", optimizer)  # AcceleratedOptimizer / DeepSpeed's wrapper
    inner = getattr(zero, "optimizer", zero)  # DeepSpeed's ZeRO / BF16 optimizer -> the torch optimizer
    # DeepSpeed's fp32 partitions: ZeRO-3 hands them to the torch optimizer only while it steps, ZeRO-1/2 always
    flat = next((getattr(zero, a) for a in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups",
                                            "fp32_groups_flat_partition") if getattr(zero, a, None)), None)
    stepped = list(flat) if flat else [p for g in inner.param_groups for p in g["params"]]
    masters = sorted({str(p.dtype).replace("torch.", "") for p in stepped})
    module = sorted({str(p.dtype).replace("torch.", "") for p in model.parameters()})
    accum = (model.get_data_types()[1] if hasattr(model, "get_data_types") else
             next(iter({p.dtype for p in model.parameters() if p.requires_grad}), None))
    accum = str(accum).replace("torch.", "")
    found = {"optimizer steps": masters, "gradients accumulate in": [accum], "forward weights": module}
    wanted = {"optimizer steps": [plan.master_dtype], "gradients accumulate in": [plan.grad_accum_dtype],
              "forward weights": [plan.module_dtype]}
    wrong = [f"{k} {'/'.join(found[k])} (expected {wanted[k][0]})" for k in found if found[k] != wanted[k]]
    if wrong:
        raise LaunchError(f"model.finetune=full under {mode}: {'; '.join(wrong)}: this library version changed what "
                          f"the mode does with full weights; report it with scale-env's output")
    elements = sum(p.numel() for p in stepped)
    return (f"precision: full weights under {mode}: forward weights {module[0]}, the optimizer steps {len(stepped)} "
            f"float32 tensor(s) of {elements} elements on this rank (the masters), gradients accumulate in float32, "
            f"{cfg.optim.name} state float32")


def _fmt_flops(flops: float) -> str:
    return f"{flops / 1e12:.3g} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.3g} GFLOP/s"

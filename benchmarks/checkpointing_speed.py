"""Gradient checkpointing on vs off: step time, peak RSS and saved activation bytes, for the same LoRA job.

    OMP_NUM_THREADS=2 python benchmarks/checkpointing_speed.py      # SmolLM2-135M shape; 5 min here with 1 thread
    python benchmarks/checkpointing_speed.py --seq 256 --repeats 5 --steps 4
    python benchmarks/checkpointing_speed.py --shape small --seq 64         # ~45 s here

Each run is a fresh Python process (``--worker``), so one setting's memory peak cannot leak into the other's;
runs alternate off, on, off, on, ... ``--repeats`` times. A worker builds the model (a random-weight Llama of
``--shape`` from a config, LoRA r=16 on all linear layers, fp32, non-reentrant checkpointing through
``scale.modeling.build.add_lora`` exactly as the harness enables it), then trains ``--steps`` optimizer steps on the
same full-length rows (``--batch`` x ``--seq`` tokens, no padding): ``forward_tail`` + ``tail_loss``, backward,
clipping, AdamW. It reports:

- step time: median over the steps after the first (warm-up) step;
- peak RSS delta: the process's peak resident set during the steps minus its resident set just before the
  first step (Linux: the peak is reset through ``/proc/self/clear_refs`` and read from ``VmHWM``). It includes
  gradients, optimizer state and everything the allocator holds, so it is a whole-step figure, noisier than:
- saved for backward: the bytes autograd keeps from one forward until its backward (unique storages,
  parameters excluded; ``benchmarks/checkpointing_memory.py``'s count), measured once on the first repeat;
- the per-step losses, which must agree between the settings (checkpointing recomputes, it does not change
  the maths).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/checkpointing_speed.py`: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPES, Job, build_lora_model, fmt_spread, machine_line, max_rel_diff, synthetic_examples

ROOT = Path(__file__).resolve().parents[1]


def _status_kib(key: str) -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def reset_peak_rss() -> int:
    """Reset the kernel's peak-RSS counter for this process; return the current RSS in bytes."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as fh:
        fh.write("5")
    return _status_kib("VmRSS") * 1024


def peak_rss() -> int:
    """Peak RSS (bytes) since the last :func:`reset_peak_rss`."""
    return _status_kib("VmHWM") * 1024


def worker(job: Job, measure_saved: bool) -> dict:
    """Train ``job.steps`` steps in this process; return step times, RSS figures, losses (and saved bytes)."""
    from benchmarks.checkpointing_memory import saved_bytes
    import scale.loss as scale_loss
    from scale.data import Collator

    model = build_lora_model(job.shape, job.model_cfg(), job.lora_cfg(), job.seed, "cpu", job.seq)
    rows = synthetic_examples(job.micro_batch_size, job.seq, SHAPES[job.shape]["vocab_size"], job.seed, min_len=job.seq,
                              tail_len=job.threshold)
    batch = Collator(0, "left")(rows)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=job.lr)
    weights = torch.ones(job.micro_batch_size, job.threshold)
    rss0 = reset_peak_rss()
    times, losses = [], []
    for _ in range(job.steps):
        t0 = time.perf_counter()
        tail, targets = scale_loss.forward_tail(model, batch, job.threshold)
        num, den = scale_loss.tail_loss(tail, targets, weights)
        loss = num / den
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    out = {"step_s": statistics.median(times[job.warmup:]), "times": times, "losses": losses,
           "rss_before": rss0, "rss_peak": peak_rss(), "tokens_per_step": int(batch["attention_mask"].sum())}
    if measure_saved:
        out["saved_bytes"] = saved_bytes(model, batch, job.threshold)[0]
        optimizer.zero_grad(set_to_none=True)
    return out


def run_worker(job: Job, measure_saved: bool, timeout: float = 3600) -> dict:
    """Run :func:`worker` in a fresh interpreter and return its JSON answer."""
    spec = json.dumps({**job.__dict__, "measure_saved": measure_saved})
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--worker", spec], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"worker exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def compare(job: Job, repeats: int) -> dict:
    """Alternate off/on workers ``repeats`` times."""
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(repeats):
        for on in (False, True):
            j = Job(**{**job.__dict__, "checkpointing": on})
            runs[on].append(run_worker(j, measure_saved=r == 0))
    loss_diff = max(max_rel_diff(a["losses"], b["losses"]) for a, b in zip(runs[False], runs[True]))
    return {"runs": runs, "loss_max_rel_diff": loss_diff,
            "time_ratio": [b["step_s"] / a["step_s"] for a, b in zip(runs[False], runs[True])],
            "rss_ratio": [(b["rss_peak"] - b["rss_before"]) / max(a["rss_peak"] - a["rss_before"], 1)
                          for a, b in zip(runs[False], runs[True])]}


def table(job: Job, res: dict, repeats: int) -> str:
    off, on = res["runs"][False], res["runs"][True]
    mib = 2 ** 20

    def col(runs: list[dict], f) -> str:
        return fmt_spread([f(r) for r in runs])

    def delta(r: dict) -> float:
        return (r["rss_peak"] - r["rss_before"]) / mib

    rows = ["| | checkpointing off | on | on / off |", "|---|---|---|---|",
            f"| step time (s), median (min-max) | {col(off, lambda r: r['step_s'])} | {col(on, lambda r: r['step_s'])} "
            f"| {fmt_spread(res['time_ratio'])} |",
            f"| tokens/s | {col(off, lambda r: r['tokens_per_step'] / r['step_s'])} | "
            f"{col(on, lambda r: r['tokens_per_step'] / r['step_s'])} | |",
            f"| peak RSS delta during the steps (MiB) | {col(off, delta)} | {col(on, delta)} | "
            f"{fmt_spread(res['rss_ratio'])} |",
            f"| peak RSS, whole process (MiB) | {col(off, lambda r: r['rss_peak'] / mib)} | "
            f"{col(on, lambda r: r['rss_peak'] / mib)} | |",
            f"| saved for backward (MiB, one forward) | {off[0]['saved_bytes'] / mib:.1f} | "
            f"{on[0]['saved_bytes'] / mib:.1f} | {on[0]['saved_bytes'] / off[0]['saved_bytes']:.3f} "
            f"({off[0]['saved_bytes'] / on[0]['saved_bytes']:.1f}x less) |"]
    return "\n".join([
        f"{job.shape} shape, LoRA r={job.lora_r} all-linear, fp32, micro-batch {job.micro_batch_size} x T={job.seq} "
        f"(no padding), threshold {job.threshold}, {job.steps} steps per run (first {job.warmup} not timed), "
        f"{repeats} repeats, alternating, one process per run",
        *rows,
        "",
        f"per-step losses, max relative difference off vs on: {res['loss_max_rel_diff']:.2e}",
        machine_line(),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=["tiny", "small", "smollm2-135m", "llama-1b"])
    p.add_argument("--seq", type=int, default=128, help="row length T (every row full, no padding)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is warm-up)")
    p.add_argument("--warmup", type=int, default=1, help="leading steps not timed")
    p.add_argument("--repeats", type=int, default=3, help="runs per setting, alternating off/on")
    p.add_argument("--threshold", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker is not None:
        spec = json.loads(a.worker)
        measure = spec.pop("measure_saved")
        sys.stdout.write(json.dumps(worker(Job(**spec), measure)) + "\n")
        return 0
    if a.steps <= a.warmup:
        p.error("--steps must exceed --warmup")
    job = Job(shape=a.shape, seq=a.seq, micro_batch_size=a.batch, gradient_accumulation_steps=1, steps=a.steps,
              warmup=a.warmup, threshold=a.threshold, lora_r=a.lora_r, min_len=a.seq)
    res = compare(job, a.repeats)
    sys.stdout.write("\n" + table(job, res, a.repeats) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

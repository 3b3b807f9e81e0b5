"""The default job, today's settings vs the new defaults: train tokens/s, alternating, on the same rows.

    python benchmarks/speedup.py                          # 32 steps x 2 repeats (~5 min idle, estimated)
    python benchmarks/speedup.py --steps 16 --repeats 3 --contestants before,after,after+bf16
    python benchmarks/speedup.py --profile 3              # where a step's time goes, per contestant

Contestants are overrides of ``configs/train/default.yaml`` (the real SmolLM2-135M, NF4 4-bit base with
double quantization, LoRA r=16 all-linear, micro-batch 8, the review data):

- ``before``: the settings of the default job before issue 12: fp32 compute, no autocast, random batches
  (``data.group_by_length=false``), LoRA dropout 0.05;
- ``after``: ``configs/train/default.yaml`` as it is now;
- ``after+bf16``: the new defaults with bf16 compute (``model.bnb_4bit_compute_dtype=bfloat16``,
  ``train.mixed_precision=bf16``), for CPUs whose bf16 GEMM is faster than fp32 (the start-up log of a run
  names both figures);
- ``after+padding_free``: the new defaults with padding-free micro-batches (``data.padding_free=true``).
- ``auto`` / ``fp32``: the default job with the dtype the start-up probe picks (``train.mixed_precision:
  auto``, the default: bf16 where the probe's bf16 GEMMs measure >= 1.3x fp32) against fp32 forced
  (``--contestants fp32,auto``: the speedup line is then auto over fp32; each MFU is against the peak of the
  dtype that run used). On a CPU without fast bf16 both run fp32 and the ratio is ~1.
- ``auto-without-paths``: ``auto`` with ``scale.modeling``'s CPU bf16 paths (``CPU_MIXED_PATHS``: fp32 attention
  for short keys, adapter inputs cast once, the LM head's cast kept, the 4-bit backward dequantized to bf16)
  switched off after setup: the bf16 path before them (``--contestants fp32,auto-without-paths,auto``).

Each run is a fresh process (``--worker``) that builds the job with ``scale.training.job.setup`` and trains it with
``scale.train.fit`` for ``--steps`` optimizer steps (``train.log_every=1``; the evaluations at step 0 and at
the end run on one batch: they are excluded from the rates anyway). Runs alternate (before, after, before,
...). Throughput is real (unpadded) tokens over the seconds of the steps after the first ``--warmup``, from
the per-step ``train/tokens_per_s``, ``train/data_s`` and ``train/compute_s`` the run logged; ``mfu`` is the
time-weighted ``train/mfu`` of the ``after`` runs, against the peak each run measured at start-up
(``log.peak_flops``: a dense GEMM at the run's compute dtype).

Same rows: with ``data.group_by_length`` the rows of each mega-batch (``data.mega_batch_steps`` global batches)
are the rows the random order puts there (the same ``randperm`` by seed and epoch), so when ``--steps`` is a
multiple of ``data.mega_batch_steps`` every contestant trains on the same set of rows; the script checks it.

The last lines are ``speedup: <x>`` (median of the per-pair ratios after/before of tokens/s) and
``mfu: <m>`` (median over the ``after`` runs), by wall time, or with ``--clock cpu`` by process CPU time (for
a machine shared with other work: ``OMP_NUM_THREADS=1 python benchmarks/speedup.py --clock cpu``).
``--profile K`` instead runs K steps of each contestant under ``torch.profiler`` (after one
warm-up step) and prints where a step's time goes: 4-bit dequantization, base matmuls, LoRA matmuls,
attention, LM head and loss, optimizer, other ops, and host time between ops.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/speedup.py`: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "train" / "default.yaml"
CONTESTANTS: dict[str, list[str]] = {
    "before": ["model.bnb_4bit_compute_dtype=float32", "train.mixed_precision='no'", "data.group_by_length=false",
               "lora.dropout=0.05"],
    "after": [],
    "after+bf16": ["model.bnb_4bit_compute_dtype=bfloat16", "train.mixed_precision=bf16"],
    "after+padding_free": ["data.padding_free=true"],
    # issue 19: the dtype the start-up probe picks (bf16 where its GEMMs measure >= 1.3x fp32) against fp32
    "auto": ["train.mixed_precision=auto", "model.bnb_4bit_compute_dtype=auto"],
    "fp32": ["train.mixed_precision='no'", "model.bnb_4bit_compute_dtype=float32"],
    # auto with scale.modeling's CPU bf16 paths switched off after setup: the bf16 path as it was before them
    "auto-without-paths": ["train.mixed_precision=auto", "model.bnb_4bit_compute_dtype=auto"],
}


def job_overrides(name: str, steps: int, out: str) -> list[str]:
    return [*CONTESTANTS[name], f"train.max_steps={steps}", "train.log_every=1", "train.eval_every=0",
            "train.save_every=0", "train.save_every_minutes=null", "train.save_adapter=false", "log.trackers=[]",
            f"output_dir={out}"]


# ---------------------------------------------------------------------------------------------- worker side

def worker(name: str, steps: int, out: str, profile: int) -> dict:
    """Build and train one contestant in this process; return its per-step figures (or its profile)."""
    import torch
    from torch.utils.data import DataLoader

    from scale.config.load import load_config
    from scale.data import Collator
    from scale.train import fit
    from scale.training.job import setup

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    cfg = load_config(DEFAULT, job_overrides(name, steps + (1 if profile else 0), out))
    job = setup(cfg)
    if name == "auto-without-paths":
        from scale.modeling.mixed_paths import use_mixed_paths

        use_mixed_paths(job.model, on=False)
    # Evaluation is not timed; one batch keeps the run short (the step-0 and final evaluations still run).
    ev = sorted(job.eval_dl.dataset, key=lambda e: -len(e.input_ids))[: cfg.train.micro_batch_size]
    job.eval_dl = job.acc.prepare(DataLoader(ev, batch_size=len(ev), collate_fn=Collator(
        job.eval_dl.collate_fn.pad_token_id, cfg.data.padding_side)))
    if profile:
        return {"profile": profile_steps(job, profile), "peak": job.peak_flops}
    peak = job.peak_flops
    stamps: list[tuple[float, float]] = []  # (wall, process CPU) after each optimizer step
    step = job.scheduler.step

    def stamped_step(*args, **kwargs):
        step(*args, **kwargs)
        stamps.append((time.perf_counter(), time.process_time()))

    job.scheduler.step = stamped_step  # called exactly once per optimizer step by fit()
    t0 = time.perf_counter()
    fit(job)
    job.acc.end_training()
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"rows": [r for r in rows if "train/tokens_per_s" in r], "wall": time.perf_counter() - t0,
            "threads": torch.get_num_threads(), "stamps": stamps, "peak": peak}


def profile_steps(job, steps: int) -> dict[str, float]:
    """Run one warm-up step, then ``steps`` steps under the profiler; return milliseconds per step by category."""
    from torch.profiler import ProfilerActivity, profile

    from scale.train import epoch_loader, train_window
    from scale.training.commit import StepCommit
    from scale.training.metrics import StepMeter
    from scale.training.windows import windows

    job.model.train()
    meter = StepMeter(job.acc.device)
    commit = StepCommit(job, meter)  # each step applied at once (flush), as fit does at a log step
    batches, last = epoch_loader(job)
    it = iter(windows(job.acc, batches, job.cfg.train.gradient_accumulation_steps, job.objective, last=last))
    train_window(job, next(it), meter, commit)
    commit.flush()
    batches = [next(it) for _ in range(steps)]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        t0 = time.perf_counter()
        for window in batches:
            train_window(job, window, meter, commit)
            commit.flush()
        wall = time.perf_counter() - t0
    return categorize(prof.events(), wall, steps, job.model.config.vocab_size, job.cfg.lora.r)


def categorize(events, wall: float, steps: int, vocab: int, rank: int) -> dict[str, float]:
    """Self CPU time of every profiled op, summed by category, in ms per step; host = wall - ops."""
    cats: dict[str, float] = {}
    matmuls = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")

    def ancestors(e):
        p = e.cpu_parent
        while p is not None:
            yield p
            p = p.cpu_parent

    for e in events:
        if e.device_type.name != "CPU" or e.self_cpu_time_total <= 0:
            continue
        names = [e.name, *(a.name for a in ancestors(e))]
        shapes = [d for s in (e.input_shapes or []) for d in (s or [])]
        if any(n.startswith("Optimizer.") for n in names):
            cat = "optimizer (AdamW on the LoRA weights)"
        elif "dequantize" in e.name:
            cat = "dequantize (NF4 -> compute dtype, forward and backward)"
        elif "scaled_dot_product" in e.name or "attention" in e.name:
            cat = "attention (sdpa)"
        elif (e.name in matmuls and vocab in shapes) or any(k in e.name for k in ("log_softmax", "nll_loss",
                                                                                   "cross_entropy")):
            cat = "LM head (tail logits) and loss"
        elif e.name in matmuls and rank in shapes:
            cat = "LoRA matmuls"
        elif e.name in matmuls:
            cat = "base matmuls (dequantized weights)"
        elif e.name.startswith(("aten::", "bitsandbytes::")):
            cat = "other ops (norms, RoPE, SiLU, LoRA scale/add, dropout, casts, copies)"
        else:
            continue  # record_function ranges, autograd nodes: their ops are counted above
        cats[cat] = cats.get(cat, 0.0) + e.self_cpu_time_total / 1e3
    ops = sum(cats.values())
    cats["host (Python, autograd engine, between ops)"] = max(0.0, wall * 1e3 - ops)
    return {k: v / steps for k, v in cats.items()}


# ---------------------------------------------------------------------------------------------- parent side

def run_worker(name: str, steps: int, profile: int = 0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", name, "--steps", str(steps),
               "--out", tmp, "--profile", str(profile)]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"{name} worker failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        result["log"] = [line for line in proc.stderr.splitlines() if "MFU peak" in line]
        return result


def throughput(res: dict, warmup: int) -> dict[str, float]:
    """Figures of one run over the logged steps after ``warmup``.

    Wall seconds per step are the run's own ``train/data_s + train/compute_s``; CPU seconds (all threads of
    the process) come from the stamps after each optimizer step: a busy machine distorts them less than wall
    time (with ``OMP_NUM_THREADS=1`` a CPU-second is a second of one core that was really ours). Model FLOPs
    are ``train/mfu x the run's start-up peak x seconds``, so MFU can be taken against any peak.

    Returns:
        ``tps`` (real tokens per wall second), ``tpc`` (real tokens per CPU-second), ``flops`` and ``secs`` and
        ``cpu`` (totals), ``pad`` (mean pad fraction), ``peak`` (the run's start-up peak, FLOP/s).
    """
    rows = res["rows"]
    timed = [r for r in rows if r["step"] > warmup]
    secs = [r["train/data_s"] + r["train/compute_s"] for r in timed]
    tokens = [r["train/tokens_per_s"] * s for r, s in zip(timed, secs)]
    peak = res["peak"] or float("nan")
    flops = [r.get("train/mfu", float("nan")) * peak * s for r, s in zip(timed, secs)]
    cpu = [b[1] - a[1] for a, b in zip(res["stamps"], res["stamps"][1:])]  # step k+2's CPU seconds at index k
    cpu_timed = cpu[warmup - 1:] if warmup >= 1 else cpu
    n = len(cpu_timed)
    return {"tps": sum(tokens) / sum(secs), "tpc": sum(tokens[-n:]) / sum(cpu_timed) if n else float("nan"),
            "flops": sum(flops), "flops_cpu": sum(flops[-n:]), "secs": sum(secs), "cpu": sum(cpu_timed),
            "pad": statistics.fmean(r["train/pad_fraction"] for r in timed), "peak": peak}


def same_rows(steps: int) -> str:
    """Check that grouped and random orders put the same rows into the first ``steps`` global batches."""
    import torch

    from scale.config.load import load_config
    from scale.data import build_splits
    from scale.data.order import length_grouped_order
    from scale.modeling.build import load_tokenizer
    from scale.utils.assets import resolve_data

    cfg = load_config(DEFAULT)
    G = cfg.train.micro_batch_size * cfg.train.gradient_accumulation_steps
    tok = load_tokenizer(cfg.model)
    train = build_splits(cfg.data, cfg.loss, tok, resolve_data(cfg.data.path), cfg.train.seed).train
    lengths = [len(e.input_ids) for e in train]
    grouped = length_grouped_order(lengths, G, cfg.data.mega_batch_steps, cfg.train.seed, 0)[: steps * G]
    random_order = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.train.seed)).tolist()
    same = set(grouped) == set(random_order[: steps * G])
    aligned = "" if steps % cfg.data.mega_batch_steps == 0 else ", --steps is not a multiple"
    return (f"same rows: {'yes' if same else 'NO'} ({steps * G} rows; mega-batches of {cfg.data.mega_batch_steps} "
            f"steps{aligned})")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=32, help="optimizer steps per run (a multiple of mega_batch_steps)")
    p.add_argument("--warmup", type=int, default=2, help="leading steps of each run not timed")
    p.add_argument("--repeats", type=int, default=2, help="runs per contestant, alternating")
    p.add_argument("--contestants", default="before,after", help=f"comma-separated subset of {list(CONTESTANTS)}")
    p.add_argument("--profile", type=int, default=0, help="profile this many steps per contestant instead")
    p.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                   help="what the speedup/mfu lines use: wall time (an idle machine) or process CPU time (a shared "
                        "one; run with OMP_NUM_THREADS=1)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        sys.stdout.write("\n" + json.dumps(worker(a.worker, a.steps, a.out, a.profile)) + "\n")
        return 0
    names = [c.strip() for c in a.contestants.split(",")]
    unknown = set(names) - set(CONTESTANTS)
    if unknown:
        p.error(f"unknown contestants {sorted(unknown)}; choose from {list(CONTESTANTS)}")
    from benchmarks.common import fmt_spread, machine_line

    if a.profile:
        profiles = {n: run_worker(n, a.profile, profile=a.profile) for n in names}
        cats = sorted({c for r in profiles.values() for c in r["profile"]})
        lines = ["| where a step's time goes (ms per optimizer step) | " + " | ".join(names) + " |",
                 "|---|" + "---|" * len(names)]
        for c in cats:
            lines.append(f"| {c} | " + " | ".join(f"{profiles[n]['profile'].get(c, 0.0):.0f}" for n in names) + " |")
        lines.append("| **total** | " + " | ".join(f"**{sum(profiles[n]['profile'].values()):.0f}**" for n in names)
                     + " |")
        sys.stdout.write("\n".join(lines) + f"\n\n{a.profile} steps per contestant under torch.profiler (after one "
                         f"warm-up step); op self time by category, host = wall - ops\n{machine_line()}\n")
        return 0
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in names}
    peaks: dict[str, list[str]] = {n: [] for n in names}
    for r in range(a.repeats):
        for n in names:
            res = run_worker(n, a.steps)
            runs[n].append(throughput(res, a.warmup))
            peaks[n] += res["log"]
            sys.stderr.write(f"repeat {r + 1} {n}: {runs[n][-1]['tps']:.1f} tokens/s, {runs[n][-1]['tpc']:.1f} "
                             f"tokens per CPU-second\n")
    import torch

    threads = torch.get_num_threads()
    # MFU against the best peak any run measured for its dtype: a start-up measurement that fell into a busy
    # moment would otherwise flatter that run.
    best = {n: max(x["peak"] for x in runs[n]) for n in names}
    mfu = {n: [x["flops"] / x["secs"] / best[n] for x in runs[n]] for n in names}
    mfu_cpu = {n: [x["flops_cpu"] / x["cpu"] / (best[n] / threads) for x in runs[n]] for n in names}
    base = names[0]
    ratio = {n: [x["tps"] / b["tps"] for x, b in zip(runs[n], runs[base])] for n in names}
    ratio_cpu = {n: [x["tpc"] / b["tpc"] for x, b in zip(runs[n], runs[base])] for n in names}
    lines = ["| contestant | pad fraction | real tokens/s (wall) | vs before, per pair | MFU (wall) | real tokens per "
             "CPU-second | vs before (CPU time) | MFU (CPU time) |", "|---|---|---|---|---|---|---|---|"]
    for n in names:
        lines.append(f"| {n} | {statistics.fmean(x['pad'] for x in runs[n]):.3f} | "
                     f"{fmt_spread([x['tps'] for x in runs[n]])} | {fmt_spread(ratio[n])} | {fmt_spread(mfu[n])} | "
                     f"{fmt_spread([x['tpc'] for x in runs[n]])} | {fmt_spread(ratio_cpu[n])} | "
                     f"{fmt_spread(mfu_cpu[n])} |")
    target = "after" if "after" in names else names[-1]
    use_cpu = a.clock == "cpu"
    out = [f"default job (configs/train/default.yaml), {a.steps} optimizer steps per run ({a.warmup} warm-up not "
           f"timed), {a.repeats} repeats alternating {', '.join(names)}",
           *lines, "", same_rows(a.steps),
           "MFU: model FLOPs (scale/utils/flops.py, as train/mfu counts them) over the best peak the runs measured at "
           f"start-up for their dtype ({', '.join(f'{n} {best[n] / 1e9:.0f} GFLOP/s' for n in names)}); CPU time: "
           f"per CPU-second against that peak / {threads} thread(s)",
           *sorted({line.split('MFU peak: ')[-1] for n in names for line in peaks[n]}), machine_line(),
           f"clock for the last two lines: {a.clock}",
           f"speedup: {statistics.median((ratio_cpu if use_cpu else ratio)[target]):.3f}",
           f"mfu: {statistics.median((mfu_cpu if use_cpu else mfu)[target]):.3f}"]
    sys.stdout.write("\n" + "\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

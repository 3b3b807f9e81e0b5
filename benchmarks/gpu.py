"""GPU throughput of the harness: bf16 LoRA vs QLoRA, tokens/s, MFU and peak memory. Needs CUDA.

    python benchmarks/gpu.py                      # SmolLM2-135M and ~1B Llama shapes (estimated < 5 min, H200)
    python benchmarks/gpu.py --shapes llama-1b --seq 2048 --batch 4 --checkpointing
    python benchmarks/gpu.py --peak-tflops 989    # a GPU missing from scale.utils.flops.PEAK_BF16_FLOPS
    python benchmarks/gpu.py --measure-peak       # MFU against a bf16 GEMM timed on this GPU, not the datasheet
    python benchmarks/gpu.py --dry-run            # CPU, tiny shape: the same code path, numbers meaningless

For each model shape (random weights built from a ``LlamaConfig``, no download: ``smollm2-135m`` is SmolLM2-135M's
shape, ``llama-1b`` Llama-3.2-1B's: hidden 2048, 16 layers, 32 heads, 8 KV heads, MLP 8192, vocab 128,256, tied
embeddings) it trains two contestants through the real ``scale.train.fit`` loop (one Accelerator,
``mixed_precision=bf16``; see ``benchmarks/common.py``):

- LoRA: bf16 base weights, LoRA r=16 on all linear layers (adapter weights fp32, as peft keeps them);
- QLoRA: NF4 4-bit base with double quantization, bf16 compute, same LoRA (``prepare_model_for_kbit_training``
  casts the non-quantized weights, embeddings and norms, to fp32, as in the harness).

Rows are full length (``--batch`` x ``--seq`` tokens, no padding, so tokens = positions), tail loss over the last
``--threshold`` tokens with ``logits_to_keep``. The contestants alternate (LoRA, QLoRA, LoRA, ...) ``--repeats``
times, each run ``--steps`` optimizer steps of which the first ``--warmup`` are not timed.

- tokens/s: timed tokens over timed seconds (stamps after each ``scheduler.step()``, with a CUDA sync);
- MFU: ``tokens/s x FLOPs per token / peak`` (``scale.utils.flops.mfu``), FLOPs per token from
  ``scale.training.metrics.model_flops`` (``scale.utils.flops.flops_per_token`` with ``lora_params=trainable`` and
  ``logits_fraction=threshold/T``): model FLOPs of LoRA training, ``4 (N + f N_head) + 6 N_lora + 12 L T
  d_attn`` per token (PaLM appendix B's ``6N + 12LHQT`` without weight gradients for the frozen base;
  recomputation from checkpointing not counted); peak = dense bf16 from ``scale.utils.flops.PEAK_BF16_FLOPS`` by device
  name, ``--peak-tflops``, or a bf16 GEMM timed on the device (``--measure-peak``; the default on CPU and for a GPU
  missing from the table), resolved by ``scale.training.precision.resolve_peak_flops`` as ``log.peak_flops`` is in a
  run: the same code that logs ``train/mfu``;
- peak memory: ``torch.cuda.max_memory_allocated`` during the contestant's first run, minus what was allocated
  before its model was built: its weights, adapters, optimizer state, activations and workspace (GiB);
- predicted vs measured: ``scale-plan``'s single-device prediction of that peak (``scale.planner.plan.make_plan`` with
  the shape's config, ``--full-rows``: the rows have no padding; its ``allocated``, i.e. without the assumed CUDA
  context and fragmentation overhead) next to ``max_memory_allocated``; the goal is within 15%.

Figures: none measured on this commit yet (docs/benchmarks.md holds no GPU table; a GPU run's table belongs
there, with the GPU's name and the commit). ``--dry-run`` runs the same functions on CPU at the tiny shape in CI
(tests/test_benchmarks.py), so a device mismatch or a broken code path fails there, not on the first GPU.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python benchmarks/gpu.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import Harness, Job, RunResult, fmt_spread, llama_config, machine_line, reset_accelerate
from scale.planner.plan import make_plan
from scale.training.metrics import model_flops
from scale.training.precision import PeakFlops, resolve_peak_flops
from scale.utils.flops import mfu

NO_CUDA = ("benchmarks/gpu.py needs a CUDA GPU: torch.cuda.is_available() is False (torch {v}). Run it on a GPU "
           "machine with a CUDA build of torch, or pass --dry-run to exercise the same code path on CPU.")


def contestants(shape: str, args: argparse.Namespace) -> dict[str, Job]:
    common = dict(shape=shape, seq=args.seq, micro_batch_size=args.batch, gradient_accumulation_steps=args.ga,
                  steps=args.steps, warmup=args.warmup, threshold=args.threshold, lora_r=args.lora_r,
                  checkpointing=args.checkpointing, dtype="bfloat16", mixed_precision="bf16", log_every=args.steps,
                  min_len=args.seq)
    return {"LoRA bf16": Job(**common), "QLoRA nf4/bf16": Job(**common, quantize_4bit=True)}


def trainable(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def predicted_gib(job: Job, shape: str, seq: int) -> float:
    """``scale-plan``'s prediction of this contestant's peak allocated memory on one device (GiB): model states,
    saved activations, tail logits and transient buffers of the job's config, rows of exactly ``seq`` tokens."""
    from dataclasses import replace

    with tempfile.TemporaryDirectory() as tmp:
        cfg = job.config(tmp)
        cfg.data = replace(cfg.data, max_length=seq)
        path = Path(tmp) / "config.json"
        llama_config(shape, seq).to_json_file(path)
        single = make_plan(cfg, gpus=1, model_config=str(path), padded=False).ranks[0]
    return single.allocated / 2**30


def bench_shape(shape: str, args: argparse.Namespace, acc, device: str) -> dict:
    """Build both contestants of one shape on the shared Accelerator, alternate their runs, return the figures."""
    from scale.training.checks import dtype_census

    cuda = device.startswith("cuda")
    jobs = contestants(shape, args)
    harnesses: dict[str, Harness] = {}
    runs: dict[str, list[RunResult]] = {name: [] for name in jobs}
    peak: dict[str, float] = {}
    for r in range(args.repeats):
        for name, job in jobs.items():
            if name not in harnesses:  # first run: build, then measure this contestant's peak memory
                before = torch.cuda.memory_allocated() if cuda else 0
                harnesses[name] = Harness(job, device=device, acc=acc)
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                runs[name].append(harnesses[name].run())
                peak[name] = (torch.cuda.max_memory_allocated() - before) / 2**30 if cuda else float("nan")
            else:
                runs[name].append(harnesses[name].run())
    config = llama_config(shape, args.seq)
    out = {}
    for name, job in jobs.items():
        n_lora = trainable(harnesses[name].model)
        cfg = harnesses[name].cfg
        fpt = model_flops(cfg, config, n_lora)(args.batch, args.seq) / (args.batch * args.seq)  # as train/mfu counts
        out[name] = {"tps": [r.tokens_per_s for r in runs[name]], "fpt": fpt, "peak_gib": peak[name],
                     "predicted_gib": predicted_gib(job, shape, args.seq),
                     "trainable": n_lora, "loss": runs[name][0].losses[-1],
                     "dtypes": dtype_census(harnesses[name].model),
                     "linear4bit": sum(type(m).__name__ == "Linear4bit" for m in harnesses[name].model.modules())}
    names = list(jobs)
    out["ratio"] = [b.tokens_per_s / a.tokens_per_s for a, b in zip(runs[names[0]], runs[names[1]])]
    for h in harnesses.values():
        h.close()
    del harnesses
    acc.free_memory()
    gc.collect()
    if cuda:
        torch.cuda.empty_cache()  # between shapes only, so that the next shape's peak starts from a clean pool
    return out


def dry_run_peak(cfg: Any, acc: Any) -> PeakFlops:
    """The MFU peak of the CPU dry run: the faster of this CPU's bf16 and fp32 GEMM figures
    (:func:`scale.training.precision.resolve_peak_flops` at each dtype, the machine's best probes).

    The contestants train a bf16 model; on a CPU without fast bf16 kernels (AVX2: a bf16 GEMM probe measures a
    fraction of fp32) the tiny shapes' small matmuls run faster than the bf16 probe, and an MFU against it came out
    above 100%. The fastest GEMM the CPU measured in either dtype bounds what the dry run's matmuls reach.
    """
    bf16 = resolve_peak_flops(cfg, acc)
    fp32 = resolve_peak_flops(replace(cfg, train=replace(cfg.train, mixed_precision="no"),
                                      model=replace(cfg.model, dtype="float32", quantize_4bit=False)), acc)
    best = max((bf16, fp32), key=lambda p: p.flops or 0.0)
    return PeakFlops(best.flops, f"{best.source}; the faster of this CPU's bf16 and fp32 GEMM figures (dry run)")


def table(results: dict[str, dict], args: argparse.Namespace, peak: PeakFlops, device_name: str) -> str:
    rows = ["| shape | method | tokens/s, median (min-max) | GFLOP/token | MFU | peak memory (GiB) | trainable params |"
            " QLoRA/LoRA tokens/s |", "|---|---|---|---|---|---|---|---|"]
    for shape, res in results.items():
        for i, name in enumerate(n for n in res if n != "ratio"):
            r = res[name]
            tps = statistics.median(r["tps"])
            util = f"{100 * mfu(tps, r['fpt'], peak.flops):.1f}%" if peak.flops else "n/a"
            ratio = fmt_spread(res["ratio"]) if i == 1 else ""
            rows.append(f"| {shape} | {name} | {fmt_spread(r['tps'])} | {r['fpt'] / 1e9:.3g} | {util} | "
                        f"{r['peak_gib']:.2f} | {r['trainable']:,} | {ratio} |")
    census = [f"{shape} {name}: parameter elements by dtype {res[name]['dtypes']}, {res[name]['linear4bit']} "
              f"Linear4bit layers, last logged train/loss {res[name]['loss']:.4f}"
              for shape, res in results.items() for name in res if name != "ratio"]
    return "\n".join([
        f"{device_name}, peak {peak.source}; micro-batch {args.batch} x GA {args.ga} x T={args.seq} (no padding), "
        f"tail threshold {args.threshold}, LoRA r={args.lora_r} all-linear, checkpointing "
        f"{'on' if args.checkpointing else 'off'}, {args.steps} steps per run ({args.warmup} warm-up not timed), "
        f"{args.repeats} repeats alternating LoRA/QLoRA, through scale.train.fit",
        *rows,
        "",
        "MFU = tokens/s x model FLOPs per token / peak; LoRA FLOPs per token = 4(N + f N_head) + 6 N_lora + "
        "12 L T d_attn (scale/utils/flops.py; recomputation not counted)",
        *census,
        "",
        "predicted (scale-plan, one device, no overhead) vs torch.cuda.max_memory_allocated, goal within 15%:",
        "| shape | method | predicted (GiB) | max_memory_allocated (GiB) | predicted / measured |",
        "|---|---|---|---|---|",
        *(f"| {shape} | {name} | {res[name]['predicted_gib']:.2f} | {res[name]['peak_gib']:.2f} | "
          f"{res[name]['predicted_gib'] / res[name]['peak_gib']:.3f} |" if res[name]["peak_gib"] == res[name]["peak_gib"]
          else f"| {shape} | {name} | {res[name]['predicted_gib']:.4f} | n/a (no CUDA) | n/a |"
          for shape, res in results.items() for name in res if name != "ratio"),
        machine_line(),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", default=["smollm2-135m", "llama-1b"],
                   choices=["tiny", "small", "smollm2-135m", "llama-1b"])
    p.add_argument("--seq", type=int, default=1024, help="row length T (full rows, no padding)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--ga", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="leading steps of each run not timed")
    p.add_argument("--repeats", type=int, default=3, help="runs per contestant, alternating")
    p.add_argument("--threshold", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (harness default)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak of this GPU, TFLOP/s")
    p.add_argument("--measure-peak", action="store_true", help="time a bf16 GEMM on the device for the MFU peak")
    p.add_argument("--dry-run", action="store_true",
                   help="CPU, tiny shape, tiny sizes: runs the same code path without a GPU (numbers meaningless)")
    args = p.parse_args(argv)
    if args.dry_run:
        args.shapes, args.seq, args.batch, args.steps, args.warmup, args.repeats = ["tiny"], 32, 2, 3, 1, 2
        device = "cpu"
    elif not torch.cuda.is_available():
        sys.stderr.write(NO_CUDA.format(v=torch.__version__) + "\n")
        return 2
    else:
        device = "cuda"
    from scale.distributed.launch import build_accelerator

    t0 = time.perf_counter()
    reset_accelerate()
    tmp = tempfile.TemporaryDirectory()
    cfg = contestants(args.shapes[0], args)["LoRA bf16"].config(tmp.name)
    acc = build_accelerator(cfg)
    device_name = torch.cuda.get_device_name() if device == "cuda" else "CPU (dry run)"
    cfg.log.peak_flops = args.peak_tflops * 1e12 if args.peak_tflops else ("measure" if args.measure_peak else None)
    # the contestants compute in bf16 (mixed_precision=bf16)
    peak = dry_run_peak(cfg, acc) if args.dry_run else resolve_peak_flops(cfg, acc)
    results = {}
    for shape in args.shapes:
        results[shape] = bench_shape(shape, args, acc, device)
        sys.stderr.write(f"{shape}: done\n")
    sys.stdout.write("\n" + table(results, args, peak, device_name) + "\n")
    sys.stdout.write(f"wall time after imports: {time.perf_counter() - t0:.0f} s\n")
    tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())

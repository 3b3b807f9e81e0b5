"""Sequence parallelism's memory: the activation peak per rank of one long row at SP=1 and SP=2, and the longest row
that trains within a fixed per-rank budget.

    python benchmarks/sp_memory.py [--tokens 4096] [--budget-mib 128] [--max-tokens 12288] [--step 1024]

The job is the harness's own (:func:`scale.training.job.setup` of ``configs/train/tiny_cpu.yaml`` at a wider Llama
shape: hidden 256, 4 layers, 4 heads, 2 key/value heads, MLP 768, SmolLM2's 49,152-token vocabulary; LoRA r=8 on every
linear layer, fp32, gradient checkpointing on): SP=1 is one process, SP=2 is DeepSpeed ZeRO-2 with Ulysses on 2 CPU
processes (``configs/accelerate/cpu_zero2.yaml``, ``train.sequence_parallel_size=2``). One row of ``T`` tokens whose
last 16 are trained (a long document, a short answer) goes through the product's path: the row cut into the rank's shard
(:func:`scale.data.sequence.shard_rows`), :meth:`scale.objectives.tail.LossSpec.loss_step` under the sharded attention,
and the gradient of the LoRA weights (``torch.autograd.grad``: the activations' backward without ZeRO's gradient
buckets, which are model states, planned by ``scale-plan``). The **activation peak** is the most tensor bytes alive at
once during that forward and backward beyond what was alive before it (a ``TorchDispatchMode`` that follows every
storage, as tests/test_plan.py counts the single-device peak: the CPU stand-in for ``torch.cuda.max_memory_allocated``
minus the model states).

Prints a table (peak per rank at each length; SP=2: the larger of the two ranks), then::

    sp_memory: ratio=X        # peak at --tokens, SP=1 / SP=2 (target >= 1.6 at >= 4k tokens)
    sp_memory: longest row within B MiB per rank: SP=1 T1 tokens, SP=2 T2 tokens

The longest row is searched on a grid of ``--step`` tokens up to ``--max-tokens``: the longest length whose peak
stays within ``--budget-mib`` (on CPU nothing runs out of memory; on a GPU the same budget would be the card).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/sp_memory.py`: make `scale`/`tests` importable from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
SHAPE = ["model.tiny_hidden_size=256", "model.tiny_num_layers=4", "model.tiny_num_heads=4",
         "model.tiny_intermediate_size=768", "model.gradient_checkpointing=true", "lora.dropout=0.0",
         "train.micro_batch_size=1", "train.gradient_accumulation_steps=1", "log.trackers=[]",
         "log.peak_flops=1e12", "eval.generate_samples=0"]
TAIL = 16


def worker(args: argparse.Namespace) -> None:
    """Measure the activation peak at each length on this rank; print one JSON line per length."""
    import contextlib

    import torch

    from scale.config.load import load_config
    from scale.data import Example
    from scale.data.sequence import shard_rows
    from scale.distributed.ulysses import sharded
    from scale.training.checkpoint import unwrap
    from scale.training.job import setup
    from tests.live_bytes import LiveBytes

    lengths = [int(x) for x in args.lengths.split(",")]
    cfg = load_config(ROOT / "configs" / "train" / "tiny_cpu.yaml",
                      [*SHAPE, f"data.max_length={max(lengths)}", f"train.sequence_parallel_size={args.sp}",
                       f"output_dir={args.out}/sp{args.sp}", "train.overwrite_output_dir=true",
                       f"data.path={ROOT / 'configs' / 'data' / 'tiny_reviews.jsonl'}"])
    job = setup(cfg)
    rank, size = (job.sequence.rank, job.sequence.size) if job.sequence else (0, 1)
    # The module inside DeepSpeed's engine: the engine's forward would arm ZeRO's gradient reduction for a backward
    # that torch.autograd.grad never runs (the activations are the same; the reduction buckets are model states).
    net = unwrap(job.acc, job.model)
    lora = [p for p in net.parameters() if p.requires_grad]
    g = torch.Generator().manual_seed(0)
    budget = args.budget_mib * 2**20
    for T in lengths:
        row = [[Example(torch.randint(3, 40000, (T,), generator=g).tolist(), TAIL)]]
        batch = {k: v.to(job.acc.device) for k, v in shard_rows(row, rank, size, 0).items()}
        live = LiveBytes(*net.parameters(), *net.buffers(), *batch.values())
        t0 = time.perf_counter()
        with live, (sharded() if job.sequence else contextlib.nullcontext()):
            num = job.objective.loss_step(net, batch, job.objective.weights(batch))
            grads = torch.autograd.grad(num, lora, allow_unused=True)
        del num, grads
        peak = live.peak - live.before  # the activations' peak: beyond the weights and the batch
        with open(Path(args.out) / f"peaks.sp{size}.rank{rank}.jsonl", "a") as fh:  # one file per rank: no interleaving
            fh.write(json.dumps({"sp": size, "rank": rank, "tokens": T, "peak": peak,
                                 "seconds": round(time.perf_counter() - t0, 2)}) + "\n")
        # every rank of a group stops at the same length: the peaks are compared over the group
        over = torch.tensor(float(peak > budget), device=job.acc.device)
        if size > 1:
            over = job.acc.reduce(over, reduction="sum")  # collective
        if args.stop_over_budget and float(over) > 0:
            break
    job.acc.end_training()


def run(sp: int, lengths: list[int], args: argparse.Namespace) -> list[dict]:
    worker_args = ["--worker", "--sp", str(sp), "--lengths", ",".join(map(str, lengths)), "--out", args.out,
                   "--budget-mib", str(args.budget_mib)] + (["--stop-over-budget"] if args.stop_over_budget else [])
    script = str(Path(__file__).resolve())
    if sp == 1:
        cmd = [sys.executable, script, *worker_args]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
               str(ROOT / "configs" / "accelerate" / "cpu_zero2.yaml"), "--main_process_port",
               str(29500 + os.getpid() % 1000), script, *worker_args]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    for old in Path(args.out).glob(f"peaks.sp{sp}.rank*.jsonl"):
        old.unlink()
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"SP={sp} exited {proc.returncode}:\n{(proc.stdout + proc.stderr)[-3000:]}")
    return [json.loads(line) for path in sorted(Path(args.out).glob(f"peaks.sp{sp}.rank*.jsonl"))
            for line in path.read_text().splitlines()]


def per_length(records: list[dict]) -> dict[int, int]:
    """tokens -> the largest peak over the group's ranks."""
    out: dict[int, int] = {}
    for r in records:
        out[r["tokens"]] = max(out.get(r["tokens"], 0), r["peak"])
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="row length of the ratio (tokens, >= 4096)")
    parser.add_argument("--budget-mib", type=float, default=128.0, help="activation budget per rank (MiB)")
    parser.add_argument("--max-tokens", type=int, default=12288, help="longest row tried (tokens)")
    parser.add_argument("--step", type=int, default=1024, help="grid of row lengths (tokens)")
    parser.add_argument("--out", default="/tmp/sp_memory")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--sp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--lengths", default="", help=argparse.SUPPRESS)
    parser.add_argument("--stop-over-budget", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args)
        return 0
    grid = sorted({*range(args.step, args.max_tokens + 1, args.step), args.tokens})
    args.stop_over_budget = True
    peaks = {sp: per_length(run(sp, grid, args)) for sp in (1, 2)}
    lines = ["| row tokens | SP=1 peak (MiB) | SP=2 peak per rank (MiB) | SP=1 / SP=2 |", "|---|---|---|---|"]
    for T in grid:
        a, b = peaks[1].get(T), peaks[2].get(T)
        if a is None and b is None:
            continue
        cell = lambda x: f"{x / 2**20:.1f}" if x is not None else "over budget"
        lines.append(f"| {T} | {cell(a)} | {cell(b)} | {a / b:.2f} |" if a and b else f"| {T} | {cell(a)} | {cell(b)} | |")
    print("\n".join(lines))
    budget = args.budget_mib * 2**20
    longest = {sp: max((T for T, p in peaks[sp].items() if p <= budget), default=0) for sp in (1, 2)}
    if args.tokens not in peaks[1] or args.tokens not in peaks[2]:
        print(f"sp_memory: --tokens {args.tokens} exceeded the budget at SP=1; raise --budget-mib to measure the ratio")
        return 1
    ratio = peaks[1][args.tokens] / peaks[2][args.tokens]
    print(f"sp_memory: ratio={ratio:.2f} (activation peak per rank at {args.tokens} tokens, SP=1 / SP=2; target >= 1.6)")
    print(f"sp_memory: longest row within {args.budget_mib:g} MiB per rank: SP=1 {longest[1]} tokens, "
          f"SP=2 {longest[2]} tokens (grid of {args.step}, up to {args.max_tokens})")
    return 0 if ratio >= 1.6 else 1


if __name__ == "__main__":
    sys.exit(main())

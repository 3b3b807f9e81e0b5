"""Loop overhead: the harness's optimizer step (``scale.train.fit``) vs a bare hand-written PyTorch loop.

    OMP_NUM_THREADS=2 python benchmarks/bare_loop.py                # small Llama; 1.5 min here with 1 thread
    python benchmarks/bare_loop.py --shape smollm2-135m --seq 128 --steps 8 --repeats 3
    python benchmarks/bare_loop.py --checkpointing --repeats 5            # any size/recipe knob below

Both contestants train the same model (a random-weight Llama of ``--shape`` built from a config, LoRA on all
linear layers, the same seed, so the same starting weights) on the same synthetic left-padded batches in the
same order, with the same micro-batch size and gradient accumulation, the same tail loss (cross-entropy over
the last ``--threshold`` real tokens, token-weighted over the whole accumulation window), AdamW with the same
warmup+cosine schedule, and gradient clipping at 1.0.

- harness: the real ``scale.train.fit`` (``build_accelerator``, ``acc.prepare``, ``windows()`` with its
  per-window gather, the window denominator's ``acc.reduce``, ``accumulate()``, ``acc.backward``,
  ``acc.clip_grad_norm_``, ``StepMeter``, metrics every ``--log-every`` steps, the tqdm bar); evaluation at
  step 0 and at the end runs on one batch, outside the timed steps;
- bare: plain torch, no accelerate: a ``DataLoader`` (same collator, windows of GA batches by ``islice``),
  ``model(..., logits_to_keep=torch.arange(T-N-1, T-1))`` (the same kept positions, passed the same way as
  the harness), ``F.cross_entropy(sum) / window_tokens``, ``backward``, ``clip_grad_norm_``, ``step``,
  ``zero_grad``, ``scheduler.step``; it records the same per-step loss.

A trap measured while writing this (torch 2.13 CPU): ``logits_to_keep`` as a slice (an int becomes one too,
in transformers' ``slice_logits_to_keep``) hands the LM head a non-contiguous ``[B, N, H]`` view, which
``F.linear`` runs as ``bmm`` (forward and backward) instead of one ``mm``: on the tiny shape a micro-batch's
forward+backward took 20-22 ms instead of 12-17 ms with a position tensor (whose gather is a contiguous
copy). ``--bare-keep slice`` puts that variant in the bare loop.

Contestants alternate (harness, bare, harness, bare, ...); each run rebuilds the model from the seed and
trains ``--steps`` optimizer steps, of which the first ``--warmup`` are not timed. Reported: real (unpadded)
tokens per second of each, the ratio harness/bare per adjacent pair (median and min-max over repeats), and
the largest relative difference between the two per-step loss trajectories (the check that both did the
same work). Step times come from stamps taken after each ``scheduler.step()`` (see ``benchmarks/common.py``).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader

if __package__ in (None, ""):  # `python benchmarks/bare_loop.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (SHAPES, Harness, Job, RunResult, TimedLambdaLR, build_lora_model, collator,
                               fmt_spread, machine_line, max_rel_diff, step_tokens, timed_span, window_batches)
from scale.data import Example


def bare_run(job: Job, model: torch.nn.Module, examples: list[Example], device: torch.device,
             keep: str = "tensor") -> RunResult:
    """Train ``job.steps`` optimizer steps with a hand-written loop; time the steps after ``job.warmup``.

    Batches come from a plain ``DataLoader`` (same collator, no shuffling) in windows of ``ga`` micro-batches;
    an epoch's last window may be shorter and is normalised by its own token count, as in the harness.
    ``keep``: ``"tensor"`` passes the kept positions as a tensor (as the harness does), ``"slice"`` as a slice.
    """
    from scale.training.schedule import lr_factor

    o = job.optim_cfg()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = TimedLambdaLR(optimizer, lambda s: lr_factor(s, o, job.steps))
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=job.mixed_precision == "bf16")
    loader = DataLoader(examples, batch_size=job.micro_batch_size, shuffle=False, collate_fn=collator())
    N, ga = job.threshold, job.gradient_accumulation_steps
    model.train()
    losses: list[tuple[torch.Tensor, float]] = []   # per step: (loss sum on ``device``, tail tokens)
    while len(losses) < job.steps:                                      # epochs
        batches = iter(loader)
        while len(losses) < job.steps:                                  # optimizer steps
            window = [{k: v.to(device) for k, v in b.items()} for b in itertools.islice(batches, ga)]
            if not window:
                break
            n_tail = sum(b["input_ids"].shape[0] * N for b in window)   # every tail token has weight 1
            step_loss = torch.zeros((), device=device)
            for b in window:
                ids, mask = b["input_ids"], b["attention_mask"]
                T = ids.shape[1]
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)       # left padding: count real tokens only
                kept = torch.arange(T - N - 1, T - 1, device=device) if keep == "tensor" else slice(T - N - 1, T - 1)
                with autocast:
                    logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids,
                                   logits_to_keep=kept, use_cache=False).logits                   # [B, N, V]
                loss_sum = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, T - N:].reshape(-1),
                                           reduction="sum")
                (loss_sum / n_tail).backward()
                step_loss += loss_sum.detach()
            torch.nn.utils.clip_grad_norm_(params, job.max_grad_norm)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            scheduler.step()
            losses.append((step_loss, float(n_tail)))
    windows = window_batches(examples, job.micro_batch_size, ga, job.steps)
    seconds, tokens = timed_span(scheduler.stamps, step_tokens(windows), job.warmup)
    return RunResult(seconds, tokens, logged_losses([[s.item(), n] for s, n in losses], job.log_every))


def logged_losses(sums: list[list[float]], log_every: int) -> list[float]:
    """The losses the harness logs from per-step ``(numerator, denominator)`` sums: one ratio of sums per
    ``log_every`` steps and one at the last step."""
    out, num, den = [], 0.0, 0.0
    for step, (n, d) in enumerate(sums, start=1):
        num, den = num + n, den + d
        if step % log_every == 0 or step == len(sums):
            out.append(num / den)
            num, den = 0.0, 0.0
    return out


def compare(job: Job, repeats: int, device: str | None = None, keep: str = "tensor") -> dict:
    """Alternate harness and bare runs ``repeats`` times; return tokens/s, pair ratios and loss agreement."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    examples = job.examples()
    runs: dict[str, list[RunResult]] = {"harness": [], "bare": []}
    for _ in range(repeats):
        harness = Harness(job, device=str(dev))
        runs["harness"].append(harness.run())
        harness.close()
        del harness
        gc.collect()
        model = build_lora_model(job.shape, job.model_cfg(), job.lora_cfg(), job.seed, dev, job.seq)
        runs["bare"].append(bare_run(job, model, examples, dev, keep))
        del model
        gc.collect()
    # Both lists are the losses the harness logs: every log_every steps (a ratio of sums over the interval).
    loss_diff = max(max_rel_diff(h.losses, b.losses) for h, b in zip(runs["harness"], runs["bare"]))
    return {
        "tokens_per_s": {k: [r.tokens_per_s for r in v] for k, v in runs.items()},
        "step_ms": {k: [1e3 * r.seconds / (job.steps - job.warmup) for r in v] for k, v in runs.items()},
        "ratio": [h.tokens_per_s / b.tokens_per_s for h, b in zip(runs["harness"], runs["bare"])],
        "loss_max_rel_diff": loss_diff,
        "losses": {k: v[0].losses for k, v in runs.items()},
    }


def table(job: Job, res: dict, repeats: int, keep: str = "tensor") -> str:
    tps, ms = res["tokens_per_s"], res["step_ms"]
    rows = ["| contestant | tokens/s, median (min-max) | ms per optimizer step |", "|---|---|---|",
            f"| harness (`scale.train.fit`) | {fmt_spread(tps['harness'])} | {fmt_spread(ms['harness'])} |",
            f"| bare PyTorch loop (logits_to_keep as a {keep}) | {fmt_spread(tps['bare'])} | "
            f"{fmt_spread(ms['bare'])} |",
            f"| **ratio harness/bare** (per pair) | **{fmt_spread(res['ratio'])}** | |"]
    return "\n".join([
        f"{job.describe()}, {repeats} repeats, alternating; log_every={job.log_every}",
        *rows,
        "",
        f"loss trajectories, max relative difference harness vs bare over all runs: {res['loss_max_rel_diff']:.2e}",
        machine_line(),
    ])


def parse_job(argv: list[str] | None = None) -> tuple[Job, argparse.Namespace]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=sorted(SHAPES))
    p.add_argument("--seq", type=int, default=128, help="max row length T (rows are T/2..T tokens)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--ga", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=12, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="leading steps of each run not timed (>= 1)")
    p.add_argument("--repeats", type=int, default=5, help="runs per contestant, alternating")
    p.add_argument("--threshold", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (both sides)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast on both sides (harness: mixed_precision=bf16)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="base weights' dtype")
    p.add_argument("--log-every", type=int, default=1,
                   help="harness metrics interval; the losses are compared at the logged steps")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--bare-keep", default="tensor", choices=["tensor", "slice"],
                   help="how the bare loop passes logits_to_keep (the harness passes a tensor)")
    a = p.parse_args(argv)
    job = Job(shape=a.shape, seq=a.seq, micro_batch_size=a.batch, gradient_accumulation_steps=a.ga, steps=a.steps,
              warmup=a.warmup, threshold=a.threshold, lora_r=a.lora_r, checkpointing=a.checkpointing,
              mixed_precision="bf16" if a.bf16 else "no", log_every=a.log_every, dtype=a.dtype)
    return job, a


def main(argv: list[str] | None = None) -> int:
    job, a = parse_job(argv)
    res = compare(job, a.repeats, a.device, a.bare_keep)
    sys.stdout.write("\n" + table(job, res, a.repeats, a.bare_keep) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

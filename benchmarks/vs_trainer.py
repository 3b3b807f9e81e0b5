"""Throughput of our loop vs transformers' ``Trainer`` on the same tail-loss LoRA job.

    OMP_NUM_THREADS=2 python benchmarks/vs_trainer.py               # small Llama; 1.8 min here with 1 thread
    python benchmarks/vs_trainer.py --contestants ours,trainer --repeats 5  # drop the third contestant
    python benchmarks/vs_trainer.py --shape smollm2-135m --steps 8 --repeats 3

Same for every contestant: the model (a random-weight Llama of ``--shape`` built from a config, LoRA r=16 on all
linear layers, same seed so same starting weights), the synthetic left-padded rows and their order (no
shuffling), ``scale.data.Collator`` for padding, micro-batch size, gradient accumulation, precision, the
number of optimizer steps, torch AdamW with the same warmup+cosine ``LambdaLR``, clipping at 1.0, and the
loss maths: cross-entropy over the last ``--threshold`` real tokens of each row, summed over the whole
accumulation window and divided once by the window's tail-token count.

- ``ours``: ``scale.train.fit`` as ``scale-train`` runs it (see ``benchmarks/bare_loop.py``): the model is asked
  for the tail logits only (``logits_to_keep``, ``[B, N, V]``); metrics are logged once, at the last step
  (``--log-every``), and the step-0/final evaluations run on one batch outside the timed steps. Its tqdm bar
  stays on.
- ``trainer``: ``transformers.Trainer`` with ``compute_loss_func``. The collator wraps the same
  ``Collator`` and adds ``position_ids`` (from the mask, as ours, so both see the same positions) and
  ``labels`` (-100 except the last N tokens; the Trainer counts them into ``num_items_in_batch`` over the
  whole window). The model runs as the Trainer runs it, returning full ``[B, T, V]`` logits; the loss
  function slices the N tail predictions out of them (no ``[B, T, V]`` cross-entropy), returns
  ``sum / num_items_in_batch`` and the Trainer does not divide by GA again. This full-logits cost is exactly
  the difference the comparison is meant to show.
- ``trainer+keep``: the same Trainer, but the collator also passes ``logits_to_keep`` (the N tail positions,
  as a tensor like ours), so the model returns ``[B, N, V]``: what remains is the loops' own overhead.

Trainer overhead switched off: ``eval_strategy/save_strategy/logging_strategy="no"``, ``report_to="none"``,
``disable_tqdm``, ``logging_nan_inf_filter=False`` (a per-micro-step host sync for logging),
``dataloader_pin_memory=False``, ``remove_unused_columns=False``, ``train_sampling_strategy="sequential"``; the
optimizer and scheduler are passed in (``optimizers=``), so it creates neither.

Contestants alternate (ours, trainer, trainer+keep, ours, ...), each run on a freshly built model (same seed)
and a fresh accelerate state; the first ``--warmup`` optimizer steps of each run are not timed. Reported:
real tokens per second (median, min-max over repeats), the ratio ours/other per adjacent run, and each
contestant's training loss over the run (token-weighted mean over all steps; the same number for all if the
work is the same). Step times come from stamps after each ``scheduler.step()``, which both loops call once per
optimizer step.
"""

from __future__ import annotations

import argparse
import gc
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # `python benchmarks/vs_trainer.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (Harness, Job, RunResult, TimedLambdaLR, build_lora_model, collator, fmt_spread,
                               machine_line, max_rel_diff, reset_accelerate, step_tokens, timed_span,
                               window_batches)
from scale.data import Example

CONTESTANTS = ("ours", "trainer", "trainer+keep")


class TrainerCollator:
    """``scale.data.Collator`` plus ``position_ids``, ``labels`` (tail only) and optionally ``logits_to_keep``."""

    def __init__(self, threshold: int, keep_logits: bool) -> None:
        self.collate = collator()
        self.N = threshold
        self.keep_logits = keep_logits

    def __call__(self, examples: list[Example]) -> dict[str, torch.Tensor]:
        b = self.collate(examples)
        ids, mask = b["input_ids"], b["attention_mask"]
        T, N = ids.shape[1], self.N
        labels = torch.full_like(ids, -100)
        labels[:, T - N:] = ids[:, T - N:]  # left padding: the tail is the last N positions
        out = {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0),
               "labels": labels}
        if self.keep_logits:
            out["logits_to_keep"] = torch.arange(T - N - 1, T - 1)
        return out


def tail_loss_func(threshold: int, records: list[tuple[torch.Tensor, torch.Tensor]]):
    """A ``compute_loss_func``: CE over the tail predictions, summed, over the window's tail-token count.

    Works on full ``[B, T, V]`` logits (slices positions ``T-N-1 .. T-2``) and on kept ``[B, N, V]`` ones.
    Appends the detached ``(sum, count)`` of every micro-batch to ``records``.
    """
    N = threshold

    def loss_func(outputs, labels, num_items_in_batch=None):
        logits = outputs.logits
        pred = logits if logits.shape[1] == N else logits[:, -N - 1:-1]                  # [B, N, V]
        targets = labels[:, -N:]                                                          # [B, N]
        loss_sum = F.cross_entropy(pred.float().reshape(-1, pred.shape[-1]), targets.reshape(-1), reduction="sum")
        records.append((loss_sum.detach(), torch.tensor(float(targets.numel()))))
        return loss_sum / num_items_in_batch

    return loss_func


def trainer_run(job: Job, examples: list[Example], tokens: list[int], keep_logits: bool,
                device: torch.device) -> RunResult:
    """Train ``job.steps`` optimizer steps with ``transformers.Trainer``; time the steps after ``job.warmup``."""
    from transformers import Trainer, TrainingArguments

    from scale.schedule import lr_factor

    reset_accelerate()
    model = build_lora_model(job.shape, job.model_cfg(), job.lora_cfg(), job.seed, device, job.seq)
    o = job.optim_cfg()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = TimedLambdaLR(optimizer, lambda s: lr_factor(s, o, job.steps))
    records: list[tuple[torch.Tensor, torch.Tensor]] = []
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, per_device_train_batch_size=job.micro_batch_size,
            gradient_accumulation_steps=job.gradient_accumulation_steps, max_steps=job.steps,
            learning_rate=o.lr, max_grad_norm=job.max_grad_norm, seed=job.seed,
            bf16=job.mixed_precision == "bf16", use_cpu=device.type == "cpu",
            eval_strategy="no", save_strategy="no", logging_strategy="no", report_to="none", disable_tqdm=True,
            logging_nan_inf_filter=False, dataloader_pin_memory=False, dataloader_num_workers=0,
            remove_unused_columns=False, train_sampling_strategy="sequential",
        )
        trainer = Trainer(model=model, args=args, train_dataset=examples,
                          data_collator=TrainerCollator(job.threshold, keep_logits),
                          optimizers=(optimizer, scheduler), compute_loss_func=tail_loss_func(job.threshold, records))
        trainer.train()
    ga = job.gradient_accumulation_steps
    per_step = [records[i:i + ga] for i in range(0, len(records), ga)]
    losses = [float(sum(n for n, _ in w) / sum(d for _, d in w)) for w in per_step]
    total = float(sum(n for n, _ in records) / sum(d for _, d in records))
    seconds, timed_tokens = timed_span(scheduler.stamps, tokens, job.warmup)
    del trainer, model
    return RunResult(seconds, timed_tokens, losses, {"run_loss": total})


def ours_run(job: Job, device: torch.device) -> RunResult:
    """One harness run on a freshly built model; ``extra["run_loss"]`` is the loss logged at the last step."""
    harness = Harness(job, device=str(device))
    res = harness.run()
    harness.close()
    res.extra["run_loss"] = res.losses[-1] if job.log_every >= job.steps else float("nan")
    return res


def compare(job: Job, repeats: int, contestants: tuple[str, ...] = CONTESTANTS, device: str | None = None) -> dict:
    """Alternate the contestants ``repeats`` times; return tokens/s, ratios to ``ours`` and losses."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    examples = job.examples()
    tokens = step_tokens(window_batches(examples, job.micro_batch_size, job.gradient_accumulation_steps, job.steps))
    runs: dict[str, list[RunResult]] = {c: [] for c in contestants}
    for _ in range(repeats):
        for c in contestants:
            if c == "ours":
                runs[c].append(ours_run(job, dev))
            else:
                runs[c].append(trainer_run(job, examples, tokens, keep_logits=c == "trainer+keep", device=dev))
            gc.collect()
    reset_accelerate()
    out = {"tokens_per_s": {c: [r.tokens_per_s for r in v] for c, v in runs.items()},
           "run_loss": {c: [r.extra["run_loss"] for r in v] for c, v in runs.items()},
           "losses": {c: v[0].losses for c, v in runs.items()}, "ratio": {}}
    if "ours" in runs:
        for c in contestants:
            if c != "ours":
                out["ratio"][c] = [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs["ours"], runs[c])]
        first = runs["ours"][0].extra["run_loss"]
        out["loss_rel_diff"] = {c: max_rel_diff([first], [runs[c][0].extra["run_loss"]]) for c in contestants}
    return out


def table(job: Job, res: dict, repeats: int) -> str:
    rows = ["| contestant | tokens/s, median (min-max) | ours / this, per pair | train loss over the run |",
            "|---|---|---|---|"]
    names = {"ours": "ours (`scale.train.fit`, tail logits)", "trainer": "Trainer + compute_loss_func (full logits)",
             "trainer+keep": "Trainer + compute_loss_func + logits_to_keep"}
    for c, tps in res["tokens_per_s"].items():
        ratio = "**" + fmt_spread(res["ratio"][c]) + "**" if c in res["ratio"] else "1"
        loss = res["run_loss"][c][0]
        rows.append(f"| {names[c]} | {fmt_spread(tps)} | {ratio} | {loss:.6f} |")
    diffs = ", ".join(f"{c} {d:.1e}" for c, d in res.get("loss_rel_diff", {}).items() if c != "ours")
    return "\n".join([
        f"{job.describe()}, {repeats} repeats, alternating",
        *rows,
        "",
        f"train loss over the run (first repeat), relative difference from ours: {diffs}",
        machine_line(),
    ])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small", choices=["tiny", "small", "smollm2-135m", "llama-1b"])
    p.add_argument("--seq", type=int, default=128, help="max row length T (rows are T/2..T tokens)")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--ga", type=int, default=2, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="leading steps of each run not timed (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per contestant, alternating")
    p.add_argument("--threshold", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (all contestants)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast everywhere (Trainer: bf16=True)")
    p.add_argument("--log-every", type=int, default=None, help="ours: metrics interval (default: only the last step)")
    p.add_argument("--contestants", default=",".join(CONTESTANTS), help=f"comma-separated subset of {CONTESTANTS}")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    a = p.parse_args(argv)
    contestants = tuple(c.strip() for c in a.contestants.split(","))
    unknown = set(contestants) - set(CONTESTANTS)
    if unknown:
        p.error(f"unknown contestants {sorted(unknown)}; choose from {CONTESTANTS}")
    job = Job(shape=a.shape, seq=a.seq, micro_batch_size=a.batch, gradient_accumulation_steps=a.ga, steps=a.steps,
              warmup=a.warmup, threshold=a.threshold, lora_r=a.lora_r, checkpointing=a.checkpointing,
              mixed_precision="bf16" if a.bf16 else "no", log_every=a.log_every or a.steps)
    res = compare(job, a.repeats, contestants, a.device)
    sys.stdout.write("\n" + table(job, res, a.repeats) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of our loop vs transformers' ``Trainer`` at its best, on the same tail-loss QLoRA job.

    python benchmarks/vs_trainer.py               # best settings (~4 min idle, estimated)
    python benchmarks/vs_trainer.py --bf16        # bf16 autocast in both (Trainer: bf16=True), for a bf16-fast CPU/GPU
    python benchmarks/vs_trainer.py --contestants ours,trainer,trainer+keep --no-group-by-length --no-qlora \\
        --shape small --seq 128 --ga 2            # the earlier comparison: same rows in the same order

Same for every contestant: the model (a random-weight Llama of ``--shape`` built from a config, by default the
default job's: SmolLM2-135M's shape, NF4 4-bit base with double quantization, LoRA r=16 on all linear layers,
same seed so same starting weights), the synthetic left-padded rows (``--min-len``..``--seq`` tokens, like the
review data's 10..86), ``scale.data.Collator`` for padding, micro-batch size, gradient accumulation,
precision, the number of optimizer steps, torch AdamW with the same warmup+cosine ``LambdaLR``, clipping at
1.0, and the loss maths: cross-entropy over the last ``--threshold`` real tokens of each row, summed over the
whole accumulation window and divided once by the window's tail-token count.

- ``ours``: ``scale.train.fit`` as ``scale-train`` runs it (see ``benchmarks/bare_loop.py``): the model is asked
  for the tail logits only (``logits_to_keep``, ``[B, N, V]``); rows grouped by length with
  ``scale.data.order.LengthGroupedSampler`` (``--mega-batch-steps``, default 50 like the Trainer's); metrics
  are logged once, at the last step (``--log-every``), and the step-0/final evaluations run on one batch
  outside the timed steps. Its tqdm bar stays on.
- ``trainer+keep`` (the Trainer at its best): ``transformers.Trainer`` with ``compute_loss_func``; the collator
  wraps the same ``Collator`` and adds ``position_ids`` (from the mask, as ours), ``labels`` (-100 except the
  last N tokens; the Trainer counts them into ``num_items_in_batch`` over the whole window) and
  ``logits_to_keep`` (the N tail positions, as a tensor like ours), so the model returns ``[B, N, V]``; its
  own length grouping (``train_sampling_strategy="group_by_length"``: ``LengthGroupedSampler``, mega-batches
  of ``min(rows / (4 x global batch), 50)`` global batches; ``--rows`` defaults to 200 global batches so that
  it reaches 50); ``bf16=True`` with ``--bf16``.
- ``trainer``: the same without ``logits_to_keep`` (full ``[B, T, V]`` logits; the loss function slices the N
  tail predictions out of them): what a Trainer user gets without passing ``logits_to_keep``.

Trainer overhead switched off: ``eval_strategy/save_strategy/logging_strategy="no"``, ``report_to="none"``,
``disable_tqdm``, ``logging_nan_inf_filter=False`` (a per-micro-step host sync for logging),
``dataloader_pin_memory=False``, ``remove_unused_columns=False``; the optimizer and scheduler are passed in
(``optimizers=``), so it creates neither.

A contestant may name its precision: ``ours@bf16``, ``trainer+keep@fp32`` (bf16 autocast, the Trainer with
``bf16=True``; fp32 without autocast); without a suffix it follows ``--bf16``. On a CPU with fast bf16 each loop's
best dtype is compared: ``--contestants ours@bf16,trainer+keep@bf16,trainer+keep@fp32`` (our bf16 runs get
``scale.modeling``'s CPU bf16 paths, as ``scale-train`` applies them; the Trainer runs the model as transformers
and peft ship it). The last line then compares ours with the Trainer at its faster dtype.

Contestants alternate (ours, trainer+keep, ours, ...), each run on a freshly built model (same seed) and a fresh
accelerate state; the first ``--warmup`` optimizer steps of each run are not timed. Reported: real (unpadded)
tokens per second (median, min-max over repeats), the ratio ours/other per adjacent run, each contestant's
pad fraction (padded / all positions of the steps it trained) and training loss over the run (token-weighted
mean over all steps; the same number for all when the rows and their order are the same, i.e. without
grouping). Step times come from stamps after each ``scheduler.step()``, which both loops call once per
optimizer step. The last line is ``ratio vs Trainer (best settings): <r>``, the median ours/trainer+keep ratio.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import statistics
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F

if __package__ in (None, ""):  # `python benchmarks/vs_trainer.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import (Harness, Job, RunResult, TimedLambdaLR, build_lora_model, collator, fmt_spread,
                               machine_line, max_rel_diff, pad_fraction, reset_accelerate, timed_span)
from scale.data import Example

CONTESTANTS = ("ours", "trainer", "trainer+keep")


class TrainerCollator:
    """``scale.data.Collator`` plus ``position_ids``, ``labels`` (tail only) and optionally ``logits_to_keep``.

    Records the real tokens and positions of every micro-batch it builds (``tokens``, ``positions``), in the
    order the Trainer asks for them. Takes :class:`scale.data.Example` rows or ``{"input_ids", "example"}``
    dicts (the form the Trainer's length grouping reads lengths from).
    """

    def __init__(self, threshold: int, keep_logits: bool) -> None:
        self.collate = collator()
        self.N = threshold
        self.keep_logits = keep_logits
        self.tokens: list[int] = []
        self.positions: list[int] = []

    def __call__(self, examples: list[Example | dict]) -> dict[str, torch.Tensor]:
        b = self.collate([e["example"] if isinstance(e, dict) else e for e in examples])
        self.tokens.append(int(b["attention_mask"].sum()))
        self.positions.append(b["input_ids"].numel())
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


def trainer_run(job: Job, examples: list[Example], keep_logits: bool, device: torch.device) -> RunResult:
    """Train ``job.steps`` optimizer steps with ``transformers.Trainer``; time the steps after ``job.warmup``.

    With ``job.group_by_length`` the Trainer groups rows with its own ``LengthGroupedSampler``
    (``train_sampling_strategy="group_by_length"``); otherwise it reads them in order. Real tokens per step
    come from the micro-batches its collator built.
    """
    from transformers import Trainer, TrainingArguments

    from scale.training.schedule import lr_factor

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
            remove_unused_columns=False,
            train_sampling_strategy="group_by_length" if job.group_by_length else "sequential",
        )
        collate = TrainerCollator(job.threshold, keep_logits)
        dataset = [{"input_ids": e.input_ids, "example": e} for e in examples] if job.group_by_length else examples
        trainer = Trainer(model=model, args=args, train_dataset=dataset, data_collator=collate,
                          optimizers=(optimizer, scheduler), compute_loss_func=tail_loss_func(job.threshold, records))
        trainer.train()
    ga = job.gradient_accumulation_steps
    per_step = [records[i:i + ga] for i in range(0, len(records), ga)]
    losses = [float(sum(n for n, _ in w) / sum(d for _, d in w)) for w in per_step]
    total = float(sum(n for n, _ in records) / sum(d for _, d in records))
    n_micro = job.steps * ga  # the collator may have built one batch ahead
    tokens = [sum(collate.tokens[i:i + ga]) for i in range(0, n_micro, ga)]
    seconds, timed_tokens = timed_span(scheduler.stamps, tokens, job.warmup)
    pad = 1.0 - sum(collate.tokens[:n_micro]) / sum(collate.positions[:n_micro])
    del trainer, model
    return RunResult(seconds, timed_tokens, losses, {"run_loss": total, "pad_fraction": pad})


def ours_run(job: Job, device: torch.device) -> RunResult:
    """One harness run on a freshly built model; ``extra["run_loss"]`` is the loss logged at the last step."""
    harness = Harness(job, device=str(device))
    res = harness.run()
    harness.close()
    res.extra["run_loss"] = res.losses[-1] if job.log_every >= job.steps else float("nan")
    res.extra["pad_fraction"] = pad_fraction(harness.windows)
    return res


def split_name(contestant: str, job: Job) -> tuple[str, Job]:
    """``"trainer+keep@bf16"`` -> ``("trainer+keep", job in bf16)``; no suffix: ``job`` as it is."""
    name, _, dtype = contestant.partition("@")
    if not dtype:
        return name, job
    return name, dataclasses.replace(job, mixed_precision="bf16" if dtype == "bf16" else "no")


def compare(job: Job, repeats: int, contestants: tuple[str, ...] = CONTESTANTS, device: str | None = None) -> dict:
    """Alternate the contestants ``repeats`` times; return tokens/s, ratios to the first ``ours`` and losses."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    examples = job.examples()
    runs: dict[str, list[RunResult]] = {c: [] for c in contestants}
    for _ in range(repeats):
        for c in contestants:
            name, cjob = split_name(c, job)
            if name == "ours":
                runs[c].append(ours_run(cjob, dev))
            else:
                runs[c].append(trainer_run(cjob, examples, keep_logits=name == "trainer+keep", device=dev))
            gc.collect()
    reset_accelerate()
    out = {"tokens_per_s": {c: [r.tokens_per_s for r in v] for c, v in runs.items()},
           "run_loss": {c: [r.extra["run_loss"] for r in v] for c, v in runs.items()},
           "losses": {c: v[0].losses for c, v in runs.items()}, "ratio": {},
           "pad_fraction": {c: v[0].extra["pad_fraction"] for c, v in runs.items()}}
    ours = next((c for c in contestants if c.partition("@")[0] == "ours"), None)
    if ours is not None:
        for c in contestants:
            if c != ours:
                out["ratio"][c] = [a.tokens_per_s / b.tokens_per_s for a, b in zip(runs[ours], runs[c])]
        first = runs[ours][0].extra["run_loss"]
        out["loss_rel_diff"] = {c: max_rel_diff([first], [runs[c][0].extra["run_loss"]]) for c in contestants}
    return out


def table(job: Job, res: dict, repeats: int) -> str:
    rows = ["| contestant | real tokens/s, median (min-max) | ours / this, per pair | pad fraction | train loss over "
            "the run |", "|---|---|---|---|---|"]
    grouped = " + group_by_length" if job.group_by_length else ""
    names = {"ours": f"ours (`scale.train.fit`, tail logits{', length-grouped' if job.group_by_length else ''})",
             "trainer": f"Trainer + compute_loss_func (full logits){grouped}",
             "trainer+keep": f"Trainer + compute_loss_func + logits_to_keep{grouped}"}
    for c, tps in res["tokens_per_s"].items():
        name, _, dtype = c.partition("@")
        ratio = "**" + fmt_spread(res["ratio"][c]) + "**" if c in res["ratio"] else "1"
        loss = res["run_loss"][c][0]
        label = names[name] + (f", {dtype}" if dtype else "")
        rows.append(f"| {label} | {fmt_spread(tps)} | {ratio} | {res['pad_fraction'][c]:.3f} | {loss:.6f} |")
    diffs = ", ".join(f"{c} {d:.1e}" for c, d in res.get("loss_rel_diff", {}).items() if c.partition("@")[0] != "ours")
    order = ("each loop groups with its own sampler (ours: mega-batches of "
             f"{job.mega_batch_steps} global batches; the Trainer's: min(rows / (4 x global batch), 50)), so the "
             "rows per step and the losses differ" if job.group_by_length else "same rows in the same order")
    per = any("@" in c for c in res["tokens_per_s"])
    describe = job.describe() + (" (unless the contestant names its own: @bf16, @fp32)" if per else "")
    lines = [f"{describe}, {repeats} repeats, alternating; {job.rows or 'one epoch of'} rows; {order}", *rows,
             "", f"train loss over the run (first repeat), relative difference from ours: {diffs}", machine_line()]
    best = [c for c in res["ratio"] if c.partition("@")[0] == "trainer+keep"]
    if best:  # the Trainer at its faster dtype (median tokens/s) when several were run
        fastest = max(best, key=lambda c: statistics.median(res["tokens_per_s"][c]))
        lines.append(f"ratio vs Trainer (best settings): {statistics.median(res['ratio'][fastest]):.3f}"
                     + (f" ({fastest})" if len(best) > 1 else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="smollm2-135m", choices=["tiny", "small", "smollm2-135m", "llama-1b"])
    p.add_argument("--seq", type=int, default=96, help="max row length T")
    p.add_argument("--min-len", type=int, default=10, help="shortest row (tokens); rows are min-len..T")
    p.add_argument("--batch", type=int, default=8, help="micro-batch size")
    p.add_argument("--ga", type=int, default=1, help="gradient accumulation steps")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="leading steps of each run not timed (>= 1)")
    p.add_argument("--repeats", type=int, default=3, help="runs per contestant, alternating")
    p.add_argument("--threshold", type=int, default=2)
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--checkpointing", action="store_true", help="gradient checkpointing on (all contestants)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast everywhere (Trainer: bf16=True)")
    p.add_argument("--qlora", action=argparse.BooleanOptionalAction, default=True,
                   help="NF4 4-bit base, as the default job (--no-qlora: fp32 base)")
    p.add_argument("--group-by-length", action=argparse.BooleanOptionalAction, default=True,
                   help="length-grouped batches in every contestant (Trainer: train_sampling_strategy=group_by_length)")
    p.add_argument("--mega-batch-steps", type=int, default=50, help="ours: data.mega_batch_steps (the Trainer's is 50)")
    p.add_argument("--rows", type=int, default=None,
                   help="rows in the data set (default: 200 global batches with grouping, so that the Trainer's "
                        "grouping reaches its 50-batch mega-batches; else exactly --steps global batches)")
    p.add_argument("--log-every", type=int, default=None, help="ours: metrics interval (default: only the last step)")
    p.add_argument("--contestants", default="ours,trainer+keep",
                   help=f"comma-separated subset of {CONTESTANTS}, each optionally @bf16 or @fp32")
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    a = p.parse_args(argv)
    contestants = tuple(c.strip() for c in a.contestants.split(","))
    unknown = {c for c in contestants if c.partition("@")[0] not in CONTESTANTS
               or c.partition("@")[2] not in ("", "bf16", "fp32")}
    if unknown:
        p.error(f"unknown contestants {sorted(unknown)}; choose from {CONTESTANTS}")
    rows = a.rows or (200 * a.batch * a.ga if a.group_by_length else None)
    job = Job(shape=a.shape, seq=a.seq, micro_batch_size=a.batch, gradient_accumulation_steps=a.ga, steps=a.steps,
              warmup=a.warmup, threshold=a.threshold, lora_r=a.lora_r, checkpointing=a.checkpointing,
              mixed_precision="bf16" if a.bf16 else "no", log_every=a.log_every or a.steps, min_len=a.min_len,
              quantize_4bit=a.qlora, group_by_length=a.group_by_length, mega_batch_steps=a.mega_batch_steps, rows=rows)
    res = compare(job, a.repeats, contestants, a.device)
    sys.stdout.write("\n" + table(job, res, a.repeats) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Throughput of the SFT job in our loop vs TRL's ``SFTTrainer`` at its best, one pass over the same rows.

    pip install -e ".[bench]"                      # trl
    python benchmarks/vs_trl.py                    # the SFT job (configs/train/sft.yaml), ours packed vs TRL best
    python benchmarks/vs_trl.py --repeats 2 --max-rows 400

Same for every contestant: the SFT job's model (the real SmolLM2-135M-Instruct, embedded asset), fp32 weights,
LoRA (r=16, alpha 32, dropout 0.05, all linear layers, same seed so the same initial adapter), the same token ids
(our pipeline tokenizes the ChatterBot chats once with the job's ChatML template; TRL receives them pre-tokenized
as ``input_ids`` + ``assistant_masks``, so both train exactly the assistant turns' tokens of every turn),
``max_length`` 128, micro-batch size 8 (packed rows when packing), gradient accumulation 1, AdamW with the job's
lr and warmup+cosine ``LambdaLR``, clipping at 1.0, one epoch.

- ``ours+packing``: ``scale.train.fit`` as ``scale-train --config sft data.packing=true`` runs it: rows packed
  best-fit-decreasing into 128-token bins, 8 bins per padding-free micro-batch; the LM head and the loss see
  only the trained positions (``logits_to_keep``, chunked tail cross-entropy).
- ``ours``: the job as shipped (padded micro-batches of 8 rows, ``data.group_by_length`` off).
- ``trl``: ``trl.SFTTrainer`` (``trl==1.16``) at its best on this data: ``packing=True`` with
  ``packing_strategy="bfd"`` (which turns padding-free on), the assistant-token mask as labels, its fused
  chunked LM head (built in since 1.x); logging/eval/save off, ``report_to="none"``, the optimizer and scheduler
  passed in (``optimizers=``).

Precision per contestant: ``name@bf16`` (ours: ``train.mixed_precision=bf16``, with ``scale.modeling``'s CPU bf16
paths as ``scale-train`` applies them; TRL: ``bf16=True``, the model as transformers and peft ship it) or
``name@fp32`` (the default: no autocast). On a CPU with fast bf16 (AMX, AVX512-BF16) compare each at its best:
``--contestants ours+packing@bf16,trl@bf16,trl@fp32`` (the last line takes TRL's faster one).

Timing: each contestant's scheduler records ``time.perf_counter()`` after every optimizer step; the first
``--warmup`` steps are not timed. Real tokens per step are recorded by wrapping each side's collator (tokens in
the micro-batch that are not padding). Reported: real tokens/s per run, its median, the ratio to TRL, and the
last line ``ratio vs TRL (best settings): X`` (median ``ours+packing`` / median ``trl``). Contestants alternate
(ours+packing, trl, ours, ...) and each run starts from a freshly built model (same seed).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # `python benchmarks/vs_trl.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import TimedLambdaLR, machine_line, reset_accelerate, timed_span  # noqa: E402


class CountingCollator:
    """Wraps a collator; records the real (non-pad) tokens of every train micro-batch it builds, in order.

    Evaluation batches are collated under ``torch.no_grad()`` (``scale.training.evaluate.evaluate``) and not counted."""

    def __init__(self, inner: Any, count: Any) -> None:
        self.inner, self.count, self.tokens = inner, count, []

    def __call__(self, items: Any) -> Any:
        batch = self.inner(items)
        if torch.is_grad_enabled():
            self.tokens.append(int(self.count(batch)))
        return batch


PRECISION = {"bf16": "train.mixed_precision=bf16", "fp32": "train.mixed_precision='no'"}


def sft_config(out: str, packing: bool, max_rows: int | None, precision: str = "fp32") -> Any:
    from scale.config.load import load_config

    overrides = [f"output_dir={out}", f"data.packing={str(packing).lower()}", "train.eval_every=0",
                 "train.save_adapter=false", "train.log_every=1000", "data.cache=false", "train.check_invariants=false",
                 "eval.generate_samples=0", PRECISION[precision]]
    if max_rows:
        overrides.append(f"data.max_train_examples={max_rows}")
    return load_config("sft", overrides)


def run_ours(packing: bool, warmup: int, max_rows: int | None, precision: str = "fp32") -> tuple[float, int, int]:
    """One epoch of the SFT job in ``scale.train.fit``; returns (seconds, real tokens, steps) of the timed span."""
    import scale.training.parts.loaders
    from scale.train import fit
    from scale.training.job import setup

    reset_accelerate()
    name = "PackedCollator" if packing else "Collator"
    original = getattr(scale.training.parts.loaders, name)
    count = (lambda b: b["seq_lens"].sum()) if packing else (lambda b: b["attention_mask"].sum())
    counter = CountingCollator(None, count)

    def counted(*args: Any) -> CountingCollator:  # the train loader's collator, built inside setup()
        counter.inner = original(*args)
        return counter

    setattr(scale.training.parts.loaders, name, counted)
    with tempfile.TemporaryDirectory() as out:
        try:
            job = setup(sft_config(out, packing, max_rows, precision))
        finally:
            setattr(scale.training.parts.loaders, name, original)
        timed = TimedLambdaLR(job.scheduler.optimizer, job.scheduler.lr_lambdas[0])
        job.scheduler = timed
        fit(job)
        seconds, tokens = timed_span(timed.stamps, counter.tokens, warmup)
        job.acc.end_training()
    return seconds, tokens, len(timed.stamps)


def run_trl(warmup: int, max_rows: int | None, precision: str = "fp32") -> tuple[float, int, int]:
    """One epoch of the same rows in ``trl.SFTTrainer`` (packing BFD + padding-free, assistant-only labels)."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    from scale.data import build_splits
    from scale.modeling.build import build_model, load_tokenizer
    from scale.training.parts.optimizer import make_optimizer
    from scale.utils.assets import resolve_data

    reset_accelerate()
    with tempfile.TemporaryDirectory() as out:
        cfg = sft_config(out, True, max_rows, precision)
        tok = load_tokenizer(cfg.model)
        splits = build_splits(cfg.data, cfg.loss, tok, resolve_data(cfg.data.path), cfg.train.seed)
        rows = [{"input_ids": list(e.input_ids),
                 "assistant_masks": [0] * (len(e.input_ids) - e.tail_len) + e.tail_flags()} for e in splits.train]
        torch.manual_seed(cfg.train.seed)
        model = build_model(cfg.model, cfg.lora, len(tok), seed=cfg.train.seed)
        t = cfg.train
        # One epoch of packed rows: the scheduler's length is set after packing (TRL packs inside the trainer).
        optimizer, _ = make_optimizer(cfg, model, max_steps=1)
        args = SFTConfig(output_dir=out, per_device_train_batch_size=t.micro_batch_size,
                         gradient_accumulation_steps=t.gradient_accumulation_steps, num_train_epochs=1,
                         max_length=cfg.data.max_length, packing=True, packing_strategy="bfd", seed=t.seed,
                         data_seed=t.seed, max_grad_norm=cfg.optim.max_grad_norm or 0.0, report_to="none",
                         save_strategy="no", eval_strategy="no", logging_strategy="no", disable_tqdm=True, use_cpu=True,
                         dataloader_pin_memory=False, bf16=precision == "bf16", gradient_checkpointing=False)
        trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tok,
                             optimizers=(optimizer, None))
        steps = len(trainer.get_train_dataloader()) // t.gradient_accumulation_steps
        _, sched = make_optimizer(cfg, model, max_steps=steps)
        timed = TimedLambdaLR(optimizer, sched.lr_lambdas[0])
        trainer.lr_scheduler = timed
        trainer.create_scheduler = lambda *a, **k: timed  # keep ours: the Trainer would build its own otherwise
        counter = CountingCollator(trainer.data_collator, lambda b: (b["input_ids"] != tok.pad_token_id).sum()
                                   if "position_ids" not in b else b["input_ids"].numel())
        trainer.data_collator = counter
        trainer.train()
        seconds, tokens = timed_span(timed.stamps, counter.tokens, warmup)
    return seconds, tokens, len(timed.stamps)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=1, help="runs of each contestant (alternating)")
    parser.add_argument("--warmup", type=int, default=3, help="first optimizer steps not timed")
    parser.add_argument("--max-rows", type=int, default=None, help="train rows (default: the job's, all)")
    parser.add_argument("--contestants", default="ours+packing,trl,ours",
                        help="comma-separated; each optionally @bf16 or @fp32 (default fp32), e.g. "
                             "ours+packing@bf16,trl@bf16,trl@fp32")
    args = parser.parse_args(argv)
    names = args.contestants.split(",")
    for n in names:
        if n.partition("@")[0] not in ("ours+packing", "ours", "trl") or n.partition("@")[2] not in ("", *PRECISION):
            parser.error(f"unknown contestant {n!r}")
    runs: dict[str, list[tuple[float, int, int]]] = {n: [] for n in names}
    for r in range(args.repeats):
        for name in names:
            t0 = time.perf_counter()
            base, _, precision = name.partition("@")
            if base == "trl":
                res = run_trl(args.warmup, args.max_rows, precision or "fp32")
            else:
                res = run_ours(base == "ours+packing", args.warmup, args.max_rows, precision or "fp32")
            runs[name].append(res)
            print(f"run {r + 1} {name:>13}: {res[1] / res[0]:8.1f} real tokens/s over {res[2] - args.warmup} timed "
                  f"steps ({res[1]} tokens, {res[0]:.1f} s; wall {time.perf_counter() - t0:.0f} s)", flush=True)
    med = {n: statistics.median(t / s for s, t, _ in runs[n]) for n in names}
    trls = [n for n in names if n.partition("@")[0] == "trl"]
    trl = max(trls, key=lambda n: med[n]) if trls else None  # TRL at its faster dtype
    ours = max((n for n in names if n.partition("@")[0] == "ours+packing"), key=lambda n: med[n], default=None)
    print(f"\n{'contestant':>18} | {'real tokens/s (median)':>22} | {'steps':>5} | vs {trl or 'trl'}")
    print(f"{'-' * 18}-+-{'-' * 22}-+-{'-' * 5}-+-------")
    for n in names:
        rel = f"{med[n] / med[trl]:.2f}x" if trl else "-"
        print(f"{n:>18} | {med[n]:22.1f} | {runs[n][0][2]:5d} | {rel}")
    print(machine_line())
    if trl and ours:
        print(f"ratio vs TRL (best settings): {med[ours] / med[trl]:.2f}" + (f" ({ours} vs {trl})" if "@" in ours + trl
                                                                              else ""))


if __name__ == "__main__":
    main()

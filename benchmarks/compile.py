"""``torch.compile`` on a job's own micro-batches: step time and numbers, eager vs compiled, in one process.

    python benchmarks/compile.py                                    # the SFT job, 6 micro-batches x 2 rounds
    python benchmarks/compile.py --config configs/train/default.yaml --micro-batches 4
    python benchmarks/compile.py --set data.packing=true            # any override of the job

Issue 19 asks to measure ``torch.compile`` on the jobs and to offer ``train.compile`` only if it is faster and exact.
The job's model is built as ``scale.modeling.build.build_model`` builds it (LoRA on the real SmolLM2-135M), and its
first ``--micro-batches`` train micro-batches come from the job's own loader
(``scale.training.parts.loaders.make_loaders``: the same collator, padding or packing). One forward + backward of the
tail loss (``scale.objectives.tail.LossSpec.loss_step``) per micro-batch, timed; no optimizer step, so eager and
compiled see the same weights and their losses and LoRA gradients are compared directly (with ``lora.dropout=0``: the
two would draw different dropout masks). The compiled module is ``torch.compile(model)`` (inductor, default mode,
``dynamic`` left to dynamo: it marks the sequence length dynamic after the first recompile). Round 1 of the compiled
model includes compilation (reported apart); later rounds alternate eager and compiled.

Prints a table and ``compile: speedup=X`` (eager seconds / compiled seconds over the rounds after the first).
"""

from __future__ import annotations

import argparse
import sys
import time

import torch


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/train/sft.yaml")
    parser.add_argument("--set", nargs="*", default=[], help="key=value overrides of the job")
    parser.add_argument("--micro-batches", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3, help="passes over the micro-batches (the first compiles)")
    args = parser.parse_args()

    from scale.config.load import load_config
    from scale.data import build_splits
    from scale.modeling.build import build_model, load_tokenizer
    from scale.objectives.tail import LossSpec
    from scale.training.parts.loaders import make_loaders
    from scale.utils.assets import resolve_data

    # LoRA dropout off: inductor draws its own dropout masks (philox), so eager and compiled would differ by the
    # masks, not by the arithmetic (measured with the SFT job's 0.05: loss 2.9e-3 apart, gradients 2.2x).
    cfg = load_config(args.config, ["data.cache=false", "lora.dropout=0.0", *args.set])
    tok = load_tokenizer(cfg.model)
    splits = build_splits(cfg.data, cfg.loss, tok, resolve_data(cfg.data.path), cfg.train.seed)
    train_dl, _ = make_loaders(cfg, splits, tok.pad_token_id)
    batches = [b for _, b in zip(range(args.micro_batches), train_dl)]
    spec = LossSpec.from_config(cfg)
    model = build_model(cfg.model, cfg.lora, len(tok), cfg.train.seed)
    for p in model.parameters():  # LoRA B starts at 0: give every adapter a value so every gradient path counts
        if p.requires_grad:
            p.data.normal_(0, 0.02, generator=torch.Generator().manual_seed(p.numel()))
    compiled = torch.compile(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def one(m: torch.nn.Module, batch: dict) -> tuple[float, float, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.train.mixed_precision == "bf16"):
            w = spec.weights(batch)
            num = spec.loss_step(m, batch, w)
        (num / w.sum()).backward()
        seconds = time.perf_counter() - t0
        return seconds, float(num / w.sum()), [p.grad.clone() for _, p in params]

    eager_s, compiled_s, first_compiled, loss_dev, grad_dev = 0.0, 0.0, 0.0, 0.0, 0.0
    for r in range(args.rounds):
        for batch in batches:
            order = [("eager", model), ("compiled", compiled)]
            if r % 2:
                order.reverse()
            got = {name: one(m, batch) for name, m in order}
            (es, el, eg), (cs, cl, cg) = got["eager"], got["compiled"]
            loss_dev = max(loss_dev, abs(el - cl) / abs(el))
            grad_dev = max(grad_dev, max(float((a - b).abs().max() / a.abs().max().clamp(min=1e-30))
                                         for a, b in zip(eg, cg)))
            if r == 0:
                first_compiled += cs
            else:
                eager_s, compiled_s = eager_s + es, compiled_s + cs
    from torch._dynamo.utils import counters

    shapes = sorted({tuple(b["input_ids"].shape) for b in batches})
    n = args.micro_batches * (args.rounds - 1)
    sys.stdout.write(
        f"{args.config} {' '.join(args.set)}: {args.micro_batches} micro-batches, shapes {shapes}, "
        f"torch {torch.__version__}, {torch.get_num_threads()} threads\n"
        "| | eager | torch.compile |\n|---|---|---|\n"
        f"| forward + backward, s per micro-batch (rounds 2..{args.rounds}) | {eager_s / n:.3f} | {compiled_s / n:.3f} |\n"
        f"| round 1 (compiled: includes compilation), s | - | {first_compiled:.1f} |\n"
        f"| graphs compiled | - | {counters['stats'].get('unique_graphs', 0)} |\n"
        f"| max rel diff vs eager: loss / LoRA gradients | - | {loss_dev:.1e} / {grad_dev:.1e} |\n"
        f"compile: speedup={eager_s / compiled_s:.3f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

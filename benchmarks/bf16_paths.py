"""The CPU mixed-precision paths (``scale.modeling.mixed_paths.MIXED_PATHS``), each measured alone: time and exactness.

    python benchmarks/bf16_paths.py                       # the default job's model and rows, 8 rounds
    python benchmarks/bf16_paths.py --rounds 12 --micro 2

One process builds the default job's model twice (``configs/train/default.yaml``: the real SmolLM2-135M, NF4
4-bit base with double quantization, LoRA r=16 on all linear layers) with the same LoRA weights (``lora_B`` drawn
from N(0, 0.01) so that every LoRA gradient is non-zero):

- the **fp32 reference**: ``model.bnb_4bit_compute_dtype=float32``, no autocast (the maths of an fp32 run);
- the **bf16 model**: compute dtype bfloat16, its forward under ``torch.autocast("cpu", bfloat16)`` as
  ``accelerate`` wraps it (``train.mixed_precision=bf16``).

Variants of the bf16 model: ``none`` (every path off: the bf16 path before the paths existed), each path alone, ``all``
and ``all but <path>``. Each round runs every variant once, in a new order each round, on the same ``--micro``
micro-batches of 8 rows (forward + tail loss + backward, as ``scale.objectives.tail.LossSpec.loss_step`` and the loop do
it), after one untimed micro-batch (a path that caches, like the LM head's cast, starts warm as in a run); a variant's
time is its median over rounds and its ratio to ``none`` is the median of the per-round ratios (so a busy moment hits
both sides of a ratio). Exactness: the relative L2 difference of the LoRA gradients (all LoRA tensors as one vector) and
of the loss against the fp32 reference, beside the same figure for ``none`` (the bf16 round-off every bf16 run has): a
path is kept when it is faster and its difference stays at ``none``'s.

The last lines are ``speedup_all: <x>`` (``none`` time / ``all`` time) and ``grad_diff_all: <d>``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/bf16_paths.py`: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
DEFAULT = ROOT / "configs" / "train" / "default.yaml"


def build(compute: str, seed: int):
    """The default job's model with ``model.bnb_4bit_compute_dtype=compute``, its LoRA B drawn from ``seed``."""
    import torch

    from scale.config.load import load_config
    from scale.modeling.build import build_model, load_tokenizer

    cfg = load_config(DEFAULT, [f"model.bnb_4bit_compute_dtype={compute}",
                                "train.mixed_precision=" + ("bf16" if compute == "bfloat16" else "'no'")])
    tok = load_tokenizer(cfg.model)
    model = build_model(cfg.model, cfg.lora, len(tok), cfg.train.seed)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.01)
    return cfg, tok, model


def micro_batches(cfg, tok, n: int, rows: int = 8):
    """``n`` micro-batches of ``rows`` train rows of similar length (as ``data.group_by_length`` makes them)."""
    from scale.data import Collator, build_splits
    from scale.objectives.tail import LossSpec
    from scale.utils.assets import resolve_data

    splits = build_splits(cfg.data, cfg.loss, tok, resolve_data(cfg.data.path), cfg.train.seed)
    train = sorted(splits.train, key=lambda e: len(e.input_ids))
    mid = len(train) // 2  # rows of the median length: the batches a grouped run trains on most
    collate = Collator(tok.pad_token_id, cfg.data.padding_side)
    batches = [collate(train[mid + i * rows: mid + (i + 1) * rows]) for i in range(n)]
    spec = LossSpec.from_config(cfg)
    return batches, spec


def step(model, batches, spec, autocast: bool) -> tuple[float, dict]:
    """Forward + backward of every micro-batch; return the summed loss numerator and the LoRA gradients."""
    import torch

    total = 0.0
    for b in batches:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            num = spec.loss_step(model, b, spec.weights(b))  # the model's forward under autocast, as accelerate
        num.backward()
        total += float(num.detach())
    grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return total, grads


def rel_diff(grads: dict, ref: dict) -> float:

    num = sum(float((grads[n] - ref[n]).pow(2).sum()) for n in ref)
    den = sum(float(ref[n].pow(2).sum()) for n in ref)
    return (num / den) ** 0.5 if den else float("nan")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=8, help="timed rounds (every variant once per round)")
    p.add_argument("--micro", type=int, default=2, help="micro-batches of 8 rows per timed step")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    import torch

    from benchmarks.common import machine_line
    from scale.modeling.mixed_paths import MIXED_PATHS as CPU_MIXED_PATHS
    from scale.modeling.mixed_paths import use_mixed_paths as use_cpu_mixed_paths

    cfg, tok, ref_model = build("float32", a.seed)
    batches, spec = micro_batches(cfg, tok, a.micro)
    ref_loss, ref_grads = step(ref_model, batches, spec, autocast=False)
    del ref_model
    _, _, model = build("bfloat16", a.seed)
    model.train()
    names = list(CPU_MIXED_PATHS)
    variants = {"none": [], **{n: [n] for n in names}, "all": names,
                **{f"all but {n}": [m for m in names if m != n] for n in names}}

    def set_variant(on: list[str]) -> None:
        use_cpu_mixed_paths(model, on=False)
        if on:
            changed = use_cpu_mixed_paths(model, on, on=True)
            missing = set(on) - set(changed)
            if missing:
                raise RuntimeError(f"paths {sorted(missing)} changed nothing on this model")

    exact: dict[str, tuple[float, float]] = {}
    first: dict = {}
    for v, on in variants.items():
        set_variant(on)
        step(model, batches, spec, autocast=True)  # warm-up (oneDNN primitive creation, caches)
        loss, grads = step(model, batches, spec, autocast=True)
        exact[v] = (abs(loss - ref_loss) / abs(ref_loss), rel_diff(grads, ref_grads))
        first = first or grads
    set_variant([])
    repeat = rel_diff(step(model, batches, spec, autocast=True)[1], first)  # 0 when bf16 steps are deterministic
    times: dict[str, list[float]] = {v: [] for v in variants}
    order = list(variants)
    rng = random.Random(a.seed)
    for r in range(a.rounds):
        rng.shuffle(order)
        for v in order:
            set_variant(variants[v])
            step(model, batches[:1], spec, autocast=True)  # untimed: a path's caches filled, as in a run
            t0 = time.perf_counter()
            step(model, batches, spec, autocast=True)
            times[v].append(time.perf_counter() - t0)
        sys.stderr.write(f"round {r + 1}/{a.rounds}: none {times['none'][-1] * 1e3:.0f} ms, all "
                         f"{times['all'][-1] * 1e3:.0f} ms\n")
    rows = sum(len(b["input_ids"]) for b in batches)
    tokens = sum(int(b["attention_mask"].sum()) for b in batches)
    lines = [f"default job's model, {a.micro} micro-batch(es) of 8 rows ({tokens} real tokens in {rows} rows) per "
             f"timed step, forward + tail loss + backward, {a.rounds} rounds in shuffled order",
             "", "| variant | ms per step (median) | speedup vs none (median of per-round ratios) | loss diff vs fp32 "
             "| LoRA grad diff vs fp32 (rel. L2) |", "|---|---|---|---|---|"]
    for v in variants:
        ratio = statistics.median(n / t for n, t in zip(times["none"], times[v]))
        lines.append(f"| {v} | {statistics.median(times[v]) * 1e3:.0f} | {ratio:.3f} | {exact[v][0]:.3e} | "
                     f"{exact[v][1]:.3e} |")
    speedup = statistics.median(n / t for n, t in zip(times["none"], times["all"]))
    lines += ["", f"fp32 reference loss numerator {ref_loss:.6f}; `none` run again differs from its first run by "
              f"{repeat:.1e}; threads {torch.get_num_threads()}", machine_line(),
              f"speedup_all: {speedup:.3f}", f"grad_diff_all: {exact['all'][1]:.3e}"]
    sys.stdout.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GRPO's speed, side by side in one process: rollouts against a bare ``generate`` loop, the GRPO train step
against the SFT step on the same tokens, and the share of a real run's wall time spent sampling.

    python benchmarks/grpo_speed.py [--shape smollm2-135m] [--batch 16] [--prompt 48] [--new 32] [--repeats 3]
                                    [--threads 2] [--run-steps 6]

1. **Rollouts**: ``scale.generation.rollout.TransformersGenerator`` (``model.generate`` with the seeded Gumbel-max
   sampler, one generator per completion, recording each token's log-prob) against a bare ``model.generate``
   (``do_sample=True``, its own multinomial sampling, the global RNG) on the same left-padded batch, both forced to
   ``--new`` tokens (no stop token), alternating, ``--repeats`` times; tokens/s is generated tokens over wall seconds.
2. **The train step**: one forward + backward of a micro-batch of ``--batch`` rows of ``--prompt`` + ``--new``
   tokens (the completion is the tail) under ``GrpoObjective`` (``rl.loss_type: dapo``, stored old log-probs, the KL
   term's reference log-probs given) against the SFT tail loss (``LossSpec``) on the very same rows: tokens/s.
3. **A real run** (``--run-steps`` > 0): ``configs/train/tiny_cpu.yaml``-style GRPO job through ``scale.train.run`` on
   ``--shape`` weights: ``train/rollout_fraction`` (sampling's share of wall time) per logged step.

Random weights of ``--shape`` (``benchmarks/common.py``'s SHAPES; no download). Targets (issue 49): rollouts >= 0.95x
the bare loop, the train step >= 0.95x SFT's. The load average is printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/grpo_speed.py`: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import build_lora_model, machine_line  # noqa: E402
from scale.config.schema import LoraConfig, ModelConfig  # noqa: E402
from scale.data.collate import Collator  # noqa: E402
from scale.data.tasks.base import Example  # noqa: E402
from scale.generation.rollout import Sampling, TransformersGenerator, completion_seed  # noqa: E402
from scale.objectives.grpo import GrpoObjective  # noqa: E402
from scale.objectives.tail import LossSpec  # noqa: E402


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length // 2 .. length`` random tokens (left padding in a batch)."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(length // 2, length + 1, (n,), generator=g).tolist()
    return [torch.randint(3, vocab, (k,), generator=g).tolist() for k in lens]


def bare_generate(model: torch.nn.Module, batch: list[list[int]], new: int) -> int:
    """``model.generate`` as a user calls it for sampling: its own warpers and multinomial draw, no stop token."""
    from transformers import GenerationConfig

    P = max(map(len, batch))
    ids = torch.zeros((len(batch), P), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, p in enumerate(batch):
        ids[b, P - len(p):] = torch.tensor(p)
        mask[b, P - len(p):] = 1
    config = GenerationConfig(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=new,
                              min_new_tokens=0, eos_token_id=None, pad_token_id=0, use_cache=True)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, generation_config=config)
    return int(out[:, P:].numel())


def rollout_table(model: torch.nn.Module, batch: list[list[int]], new: int, repeats: int) -> list[str]:
    ours = TransformersGenerator(Sampling(temperature=1.0, max_completion_length=new, stop_ids=(), pad_id=0))
    seeds = [completion_seed(0, 0, i, 0) for i in range(len(batch))]
    times: dict[str, list[float]] = {"bare generate": [], "scale rollouts": []}
    tokens = {}
    for r in range(repeats + 1):  # the first pass warms both up
        for name in times:
            t0 = time.perf_counter()
            n = bare_generate(model, batch, new) if name == "bare generate" else ours.generate(model, batch, seeds).tokens
            if r:
                times[name].append(time.perf_counter() - t0)
                tokens[name] = n
    ratios = [tokens["scale rollouts"] / o / (tokens["bare generate"] / b)
              for b, o in zip(times["bare generate"], times["scale rollouts"])]
    lines = ["| rollouts | tokens | tokens/s (median) | ratio to bare |", "|---|---|---|---|"]
    for name in times:
        med = statistics.median(times[name])
        ratio = f"{statistics.median(ratios):.3f}" if name == "scale rollouts" else "1"
        lines.append(f"| {name} | {tokens[name]} | {tokens[name] / med:.1f} | {ratio} |")
    return lines


def step_table(model: torch.nn.Module, batch: list[list[int]], new: int, repeats: int, vocab: int) -> list[str]:
    g = torch.Generator().manual_seed(1)
    rows = [Example(p + torch.randint(3, vocab, (new,), generator=g).tolist(), new) for p in batch]
    b = Collator(0)(rows)
    tokens = int(b["attention_mask"].sum())
    grpo = GrpoObjective(loss_type="dapo", beta=0.04, temperature=1.0, max_completion_length=new)
    with torch.no_grad():
        logps, _ = grpo.forward_logps(model, b)
    gb = {**b, "loss_mask": b["tail_mask"], "advantages": torch.randn(len(rows), generator=g),
          "round_weight": torch.tensor([float(b["tail_mask"].sum())]), "old_logps": logps - 0.01,
          "ref_logps": logps + 0.02, "sampler_logps": logps}
    sft = LossSpec(padding_side="left")
    contestants = {"SFT tail loss": (sft, b), "GRPO (dapo, old + ref logps)": (grpo, gb)}
    times: dict[str, list[float]] = {k: [] for k in contestants}
    for r in range(repeats + 1):
        for name, (objective, batch_) in contestants.items():
            t0 = time.perf_counter()
            num = objective.loss_step(model, batch_, objective.weights(batch_))
            num.backward()
            model.zero_grad(set_to_none=True)
            if r:
                times[name].append(time.perf_counter() - t0)
    ratios = [s / g_ for s, g_ in zip(times["SFT tail loss"], times["GRPO (dapo, old + ref logps)"])]
    lines = ["| train step (forward + backward) | tokens | tokens/s (median) | ratio to SFT |", "|---|---|---|---|"]
    for name in contestants:
        ratio = f"{statistics.median(ratios):.3f}" if name.startswith("GRPO") else "1"
        lines.append(f"| {name} | {tokens} | {tokens / statistics.median(times[name]):.1f} | {ratio} |")
    return lines


def run_table(shape: str, steps: int) -> list[str]:
    """A tiny GRPO run through the harness: the share of its wall time spent sampling."""
    from benchmarks.common import SHAPES
    from scale.config.load import load_config
    from scale.train import run

    root = Path(__file__).resolve().parents[1]
    s = SHAPES[shape]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(root / "configs" / "train" / "tiny_cpu.yaml", [
            f"output_dir={tmp}/run", f"data.path={root / 'configs' / 'data' / 'tiny_prompts.jsonl'}",
            "data.format=prompts", "loss.objective=grpo", "rl.num_generations=8", "train.micro_batch_size=16",
            "train.gradient_accumulation_steps=1", "rl.max_completion_length=32", "data.max_length=64",
            "rl.rewards=[{fn: 'tests.rl_rewards:first_token_parity'}]", f"train.max_steps={steps}",
            "train.log_every=1", "train.eval_every=0", "data.eval_size=2", "log.trackers=[]", "train.save_every=0",
            "train.save_every_minutes=null", "train.save_adapter=false", f"model.tiny_hidden_size={s['hidden_size']}",
            f"model.tiny_num_layers={s['num_hidden_layers']}", f"model.tiny_num_heads={s['num_attention_heads']}",
            f"model.tiny_intermediate_size={s['intermediate_size']}", "log.peak_flops=false"])
        run(cfg)
        rows = [json.loads(line) for line in (Path(tmp) / "run" / "metrics.jsonl").read_text().splitlines()]
    logged = [r for r in rows if "train/rollout_fraction" in r]
    lines = ["| step | rollout s | rollout tokens/s | train tokens/s | share of wall time sampling |", "|---|---|---|---|---|"]
    for r in logged:
        lines.append(f"| {r['step']} | {r['train/rollout_s']:.2f} | {r['train/rollout_tokens_per_s']:.1f} | "
                     f"{r['train/tokens_per_s']:.1f} | {r['train/rollout_fraction']:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="small")
    p.add_argument("--batch", type=int, default=16, help="completions per batch (a micro-batch, a generate call)")
    p.add_argument("--prompt", type=int, default=48, help="longest prompt (tokens); prompts are half to all of it")
    p.add_argument("--new", type=int, default=32, help="completion tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--run-steps", type=int, default=0, help="also run a GRPO job of this many steps (0: no)")
    args = p.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_lora_model(args.shape, ModelConfig(name_or_path="tiny-llama", gradient_checkpointing=False),
                             LoraConfig(r=16, dropout=0.0)).eval()
    vocab = model.get_input_embeddings().weight.shape[0]
    batch = prompts(args.batch, args.prompt, vocab)
    shape = (f"shape {args.shape}, {args.batch} rows, prompts <= {args.prompt} tokens, {args.new} new tokens, "
             f"{torch.get_num_threads()} threads, load {os.getloadavg()[0]:.1f}")
    out = [machine_line(), shape, ""]
    out += rollout_table(model, batch, args.new, args.repeats) + [""]
    model.train()
    out += step_table(model, batch, args.new, args.repeats, vocab) + [""]
    if args.run_steps:
        out += run_table(args.shape, args.run_steps) + [""]
    out.append(f"load average after: {os.getloadavg()[0]:.1f}")
    sys.stdout.write("\n".join(out) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

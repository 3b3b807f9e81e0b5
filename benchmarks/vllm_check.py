"""``rl.generator: vllm`` on a CUDA GPU: the colocated vLLM engine (scale/generation/vllm.py) checked against the
trainer, and a few GRPO steps through the real loop with it. Section 8 of ``benchmarks/gpu_check.py``.

    python benchmarks/vllm_check.py            # alone (CUDA and ``pip install 'scale[vllm]'``)

Where it cannot run (no CUDA: every ``--dry-run``; no vllm package) the section is one line, the refusal a run gets
(:func:`scale.generation.rollout.check_generator`), and passes: nothing to check.

What it checks, on the embedded SmolLM2-135M-Instruct (bf16 on the GPU) with a LoRA adapter (r 16, all-linear):

1. **Seeded**: the same prompts with the same per-completion seeds, sampled twice (the adapter synced again as a new
   ``LoRARequest`` the second time): the same completions, token for token.
2. **The log-probs vLLM reports are the trainer's**: mean |vLLM - trainer| over the sampled tokens (what
   ``train/logprob_mismatch`` logs) within the bf16 rounding of the logits: a sampled token's log-prob
   ``z_t - logsumexp(z)`` moves by at most ``2 d`` when every logit moves by ``d``, and two bf16 computations of a
   logit differ by about ``EPS_BF16 x max|z|`` (tests/bounds.py), so the bound is ``2 EPS_BF16 max|z|`` with
   ``max|z|`` the trainer's largest logit on those rows.
3. **Only the adapter moves, and it does move**: the adapter changed as a step would (every ``lora_B`` set to
   N(0, 0.02^2)), the same seeds sampled again: some completions change, and vLLM's log-probs of the new completions
   are within the bound of the trainer's with the new adapter and outside it against the trainer without the
   adapter (a stale engine would match the base model instead).
4. **The loop**: ``configs/train/grpo.yaml`` with ``rl.generator=vllm`` for 2 steps (2 prompts x 4 completions,
   no evaluation, nothing saved), run twice in subprocesses: the same train rollouts in ``samples.jsonl``, and every
   step's ``train/logprob_mismatch`` finite and within the bound of 2.
"""

from __future__ import annotations

import gc
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/vllm_check.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
PROMPTS = ["Review: a gorgeous, witty, seductive movie.\nSentiment (positive or negative):",
           "Review: the plot is nothing but boilerplate clichés.\nSentiment (positive or negative):",
           "Write one sentence about the sea.", "List three prime numbers:"]
GENERATIONS = 4
MAX_NEW = 24
LOOP = ["rl.generator=vllm", "train.max_steps=2", "train.micro_batch_size=8", "train.gradient_accumulation_steps=1",
        "rl.num_generations=4", "rl.max_completion_length=8", "train.eval_every=0", "train.save_every=0",
        "train.save_adapter=false", "train.resume_from=null", "train.log_every=1", "log.trackers=[]",
        "data.eval_size=8", "rl.log_completions=8", "train.mixed_precision=bf16", "optim.warmup_steps=0"]


def skip_line(dry: bool) -> str | None:
    """The one line the section is where the engine cannot run here, else ``None``."""
    from scale.generation.rollout import check_generator

    try:
        check_generator("vllm", torch.cuda.is_available() and not dry)
    except ValueError as e:
        return f"skipped: {e}"
    return None


def _trainer_logps(model, prompts: list[list[int]], completions: list[list[int]], pad: int) -> tuple[list, float]:
    """The trainer's log-prob of each completion token (``GrpoObjective.forward_logps``, temperature 1) and the
    largest |logit| on those rows."""
    from scale.data.collate import Collator
    from scale.data.tasks.base import Example
    from scale.objectives.grpo import GrpoObjective

    batch = Collator(pad)([Example(p + c, len(c)) for p, c in zip(prompts, completions)])
    batch = {k: v.cuda() for k, v in batch.items()}
    with torch.no_grad():
        logps, _ = GrpoObjective(temperature=1.0, max_completion_length=MAX_NEW).forward_logps(model, batch)
        zmax = float(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.abs().max())
    return [logps[b, logps.shape[1] - len(c):].float().cpu() for b, c in enumerate(completions)], zmax


def _gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """Mean |a - b| over every token (nats)."""
    diff = torch.cat([(x.float() - y.float()).abs() for x, y in zip(a, b)])
    return float(diff.mean())


def engine_checks() -> tuple[list[str], bool, float]:
    """Checks 1-3 on one in-process engine; returns the report's rows, whether all held, and the bound."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scale.generation.rollout import Sampling, completion_seed
    from scale.generation.vllm import VllmGenerator
    from scale.utils.assets import resolve_model
    from tests.bounds import EPS_BF16

    base = resolve_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.bfloat16).cuda()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    model.eval()
    prompts = [tok(p)["input_ids"] for p in PROMPTS for _ in range(GENERATIONS)]
    seeds = [completion_seed(1234, 0, i, g) for i in range(len(PROMPTS)) for g in range(GENERATIONS)]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    gen = VllmGenerator(Sampling(1.0, 1.0, 0, MAX_NEW, (tok.eos_token_id,), pad), base, 16, 0.3, 256)
    rows, ok = ["| check | value | bound | holds |", "|---|---|---|---|"], True
    try:
        a, b = gen.generate(model, prompts, seeds), gen.generate(model, prompts, seeds)
        same = a.completion_ids == b.completion_ids
        rows.append(f"| 1. same seeds twice: the same {len(prompts)} completions | {same} | | {same} |")
        mine, zmax = _trainer_logps(model, prompts, a.completion_ids, pad)
        bound = 2 * EPS_BF16 * zmax
        gap = _gap(a.sampler_logps, mine)
        rows.append(f"| 2. mean abs(vLLM - trainer) log-prob, nats (2 EPS_BF16 max abs(z), max abs(z) = {zmax:.1f}) | "
                    f"{gap:.4f} | {bound:.4f} | {gap <= bound} |")
        g = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_((torch.randn(p.shape, generator=g) * 0.02).to(p))
        c = gen.generate(model, prompts, seeds)
        changed = sum(x != y for x, y in zip(a.completion_ids, c.completion_ids))
        moved, _ = _trainer_logps(model, prompts, c.completion_ids, pad)
        with model.disable_adapter():
            stale, _ = _trainer_logps(model, prompts, c.completion_ids, pad)
        g_new, g_stale = _gap(c.sampler_logps, moved), _gap(c.sampler_logps, stale)
        rows.append(f"| 3. after the adapter moved: completions changed | {changed} of {len(prompts)} | > 0 | "
                    f"{changed > 0} |")
        rows.append(f"| 3. mean abs(vLLM - trainer with the new adapter) | {g_new:.4f} | {bound:.4f} | "
                    f"{g_new <= bound} |")
        rows.append(f"| 3. mean abs(vLLM - trainer without the adapter) | {g_stale:.4f} | > {bound:.4f} | "
                    f"{g_stale > bound} |")
        ok = same and gap <= bound and changed > 0 and g_new <= bound < g_stale
    finally:
        del gen
        gc.collect()
        torch.cuda.empty_cache()
    return rows, ok, bound


def loop_runs(bound: float) -> tuple[list[str], bool]:
    """Check 4: two subprocess runs of the GRPO config with the vLLM generator."""
    rows, runs = ["| run | step | train/logprob_mismatch | train/reward/total/mean |", "|---|---|---|---|"], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(2):
            out = Path(tmp) / f"run{k}"
            cmd = [sys.executable, "-m", "scale.train", "--config", str(ROOT / "configs/train/grpo.yaml"),
                   f"output_dir={out}", *LOOP]
            done = subprocess.run(cmd, check=False, cwd=ROOT, capture_output=True, text=True, timeout=900)
            if done.returncode:
                raise RuntimeError(f"exit {done.returncode}: {done.stderr[-1500:]}")
            metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            steps = [r for r in metrics if "train/logprob_mismatch" in r]
            samples = [(r["step"], r["row"], r["completion"]) for r in
                       map(json.loads, (out / "samples.jsonl").read_text().splitlines()) if r["split"] == "train"]
            runs.append((steps, samples))
            for r in steps:
                rows.append(f"| {k + 1} | {r['step']} | {r['train/logprob_mismatch']:.4f} | "
                            f"{r.get('train/reward/total/mean', float('nan')):.3f} |")
    mismatch = [r["train/logprob_mismatch"] for steps, _ in runs for r in steps]
    ok = (len(runs[0][0]) == 2 and bool(runs[0][1]) and runs[0][1] == runs[1][1]
          and all(math.isfinite(m) and m <= bound for m in mismatch))
    rows.append(f"\nthe same train rollouts in both runs: **{runs[0][1] == runs[1][1]}**; every step's mismatch "
                f"within {bound:.4f}: **{all(math.isfinite(m) and m <= bound for m in mismatch)}**")
    return rows, ok


def run(dry: bool) -> tuple[str, dict]:
    """The section: ``(report text, {ok, ...})``."""
    line = skip_line(dry)
    if line is not None:
        return line, {"ok": True, "skipped": True}
    import vllm

    rows, ok, bound = engine_checks()
    loop, loop_ok = loop_runs(bound)
    head = (f"vllm {vllm.__version__}; SmolLM2-135M-Instruct bf16 + LoRA r 16; {len(PROMPTS)} prompts x "
            f"{GENERATIONS} completions of at most {MAX_NEW} tokens, temperature 1")
    text = "\n".join([head, "", *rows, "", f"configs/train/grpo.yaml + `{' '.join(LOOP)}`, twice:", "", *loop])
    return f"{text}\n\nall checks hold: **{ok and loop_ok}**", {"ok": ok and loop_ok, "bound": bound}


def main(argv: list[str] | None = None) -> int:
    text, info = run(False)
    print(text)
    return 0 if info["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

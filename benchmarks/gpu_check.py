"""The whole GPU proof in one offline command: runs every GPU check and writes ONE Markdown report.

    make gpu-check                                     # = python benchmarks/gpu_check.py --out gpu_check.md
    python benchmarks/gpu_check.py --out report.md --skip bench bare   # only some sections
    python benchmarks/gpu_check.py --dry-run --out report.md           # CPU, tiny shapes, ~1 min: CI's unit test

Sections (each timed; a section that raises, or whose check fails (a GPU test, the parity bounds), is reported and
the command exits 1 at the end, so one broken section never loses the others' figures):

1. ``pytest -m gpu`` (:data:`GPU_TEST_FILES`): the pass/skip/fail counts and pytest's summary line.
2. ``bench``: benchmarks/gpu.py, LoRA and QLoRA tokens/s, MFU against a bf16 GEMM timed on this device
   (``--measure-peak``), peak ``max_memory_allocated`` against ``scale-plan``'s prediction (SmolLM2-135M and
   Llama-3.2-1B shapes, 8 x 1024 full rows).
3. ``bare``: benchmarks/bare_loop.py, the harness (``scale.train.fit``) against a hand-written PyTorch loop on the
   same 1B-shape bf16 job (the goal is >= 0.98x).
4. ``parity``: a tiny fp32 job (plain SGD, TF32 off) trained on the device and on the CPU from the same initial
   weights: each step's loss and each adapter tensor within the float32 bound of tests/bounds.py (the maths is the
   same on both; only the order of the sums differs, see :func:`parity`).
5. ``auto``: the default job (configs/train/default.yaml: QLoRA on the embedded SmolLM2-135M and review snippets,
   no download) at its own micro-batch and at the largest one ``scale.planner.autobatch.largest_micro_batch`` fits into
   ``--memory-fraction`` of the device, tokens/s of each (``train/tokens_per_s``, the last logged interval).
6. ``casts``: LoRA and QLoRA (1B shape, 8 x 1024) with the mixed-precision paths (``scale.modeling.mixed_paths``) off
   and on, and on with ``model.kernels: liger``: dtype casts (aten ``_to_copy``) and aten ops of one micro-batch's
   forward and backward, tokens/s through ``scale.train.fit``, the last loss (:func:`run_casts`).
7. ``moe``: benchmarks/moe_experts.py, expert LoRA split (``lora.expert_impl: split``) against peft's: one
   Qwen3-30B-A3B-shaped MoE layer in bf16 and fp32 (peak bytes, time), and the whole Qwen3-30B-A3B
   (configs/models/qwen3-30b-a3b.json, random bf16 weights) trained through the real loop on 8 x 2048 tokens: the
   split path's peak ``max_memory_allocated`` (goal <= 63 GB on one H200) and its tokens/s over the peft path's
   (goal >= 2).
8. ``vllm``: benchmarks/vllm_check.py, ``rl.generator: vllm`` (the colocated engine, only the LoRA adapter synced):
   the same seeds give the same completions twice, vLLM's log-probs within bf16 rounding of the trainer's, a moved
   adapter changes the samples (and vLLM then matches the trainer with it, not without it), and 2 GRPO steps
   through the loop twice (the same rollouts, ``train/logprob_mismatch`` within the bound). Where vllm or CUDA is
   missing (and in every dry run) one line: the refusal a run gets.

``--dry-run`` runs every section on the CPU at tiny shapes (the device side of ``parity`` is then the CPU on one
thread, against all threads: the same maths, summed in other orders where a kernel splits by thread), and
``auto`` plans the tiny CPU job against ``--memory-gib``): the same code paths, the report with real values,
checked by tests/test_benchmarks.py. Nothing here downloads: the GPU machine needs only the wheelhouse
(``make wheelhouse`` on a connected machine, ``make gpu-check WHEELS=dir`` there).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import math
import platform
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/gpu_check.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import SHAPES, Harness, Job, build_lora_model, machine_line, reset_accelerate

ROOT = Path(__file__).resolve().parents[1]
SECTIONS = ("pytest", "bench", "bare", "parity", "auto", "casts", "moe", "vllm")


GPU_TEST_FILES = ("tests/test_gpu.py", "tests/test_mixed_paths.py", "tests/test_kernels.py")
"""The files whose ``gpu``-marked tests section 1 runs."""


def run_pytest(dry: bool) -> tuple[str, dict]:
    """``pytest -m gpu`` in a subprocess; returns the report text and ``{passed, skipped, failed, errors}``."""
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    summary = next((line for line in reversed(done.stdout.splitlines()) if " in " in line and "=" not in line[:1]),
                   done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)")
    counts = {k: int(m.group(1)) if (m := re.search(rf"(\d+) {k}", summary)) else 0
              for k in ("passed", "skipped", "failed", "errors")}
    failures = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))]
    text = "\n".join([f"`{' '.join(cmd[1:])}`: exit {done.returncode}", "", f"    {summary.strip()}",
                      *(f"- {line}" for line in failures)])
    return text, {**counts, "returncode": done.returncode, "ok": done.returncode == 0}


def capture(main: Callable[[list[str]], int], argv: list[str]) -> str:
    """Run a benchmark's ``main(argv)``, return what it printed; raises if it returns non-zero."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(argv)
    if rc:
        raise RuntimeError(f"exit {rc}: {out.getvalue()[-500:]}")
    return out.getvalue().strip()


def run_bench(dry: bool) -> tuple[str, dict]:
    from benchmarks import gpu

    argv = ["--dry-run"] if dry else ["--shapes", "smollm2-135m", "llama-1b", "--measure-peak", "--repeats", "2"]
    text = capture(gpu.main, argv)
    return f"`python benchmarks/gpu.py {' '.join(argv)}`\n\n{text}", {}


def run_bare(dry: bool) -> tuple[str, dict]:
    from benchmarks import bare_loop

    argv = (["--device", "cpu", "--shape", "tiny", "--seq", "16", "--batch", "2", "--ga", "2", "--steps", "3",
             "--warmup", "1", "--repeats", "1"] if dry else
            ["--shape", "llama-1b", "--seq", "1024", "--batch", "8", "--ga", "1", "--steps", "10", "--warmup", "3",
             "--repeats", "2", "--bf16", "--dtype", "bfloat16", "--log-every", "10"])
    job, a = bare_loop.parse_job(argv)
    res = bare_loop.compare(job, a.repeats, a.device, a.bare_keep)
    ratio = sorted(res["ratio"])[len(res["ratio"]) // 2]
    return (f"`python benchmarks/bare_loop.py {' '.join(argv)}`\n\n{bare_loop.table(job, res, a.repeats)}\n\n"
            f"median ratio harness/bare: **{ratio:.3f}** (goal >= 0.98)"), {"ratio": ratio,
                                                                           "loss_diff": res["loss_max_rel_diff"]}


def adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainable (LoRA) tensors by name, float64 on the CPU."""
    return {n: p.detach().double().cpu() for n, p in model.named_parameters() if p.requires_grad}


def parity_run(job: Job, device: str, acc=None) -> tuple[list[float], list[dict[str, torch.Tensor]]]:
    """Train ``job`` on ``device``; the loss of each step and the adapters before and after each optimizer step."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    # built on the CPU, then moved: a model initialised on a GPU draws from the CUDA generator (other weights)
    model = build_lora_model(job.shape, job.model_cfg(), job.lora_cfg(), job.seed, "cpu", job.seq).to(device)
    h = Harness(job, device=device, model=model, acc=acc)
    states = [adapters(h.model)]
    hook = register_optimizer_step_post_hook(lambda *_: states.append(adapters(h.model)))
    try:
        losses = h.run().losses   # log_every=1: one logged loss per step
    finally:
        hook.remove()
        h.close()
    return losses, states


PARITY_STEPS = 2


def parity(device: str) -> tuple[str, dict]:
    """A tiny fp32 job on ``device`` (TF32 off) against the same job on the CPU, from the same initial weights.

    Bounds (tests/bounds.py): both runs compute each step's loss and gradients in float32 from weights that agree
    to float32 round-off, summing in different orders, so each step's loss is within ``r = TINY_JOB_REL`` (=
    ``fp32_paths_rel(49152, 128)``: the vocabulary reduction and the 128-wide dot products) of the other's,
    relative. Plain SGD makes the adapters' movement linear in the gradients: ``W_k - W_0 = -sum_j lr c_j g_j``
    (``c_j`` the clipping factor, itself a norm within ``r``), so each element of the two runs' ``W_k`` differs by
    at most ``2 r sum_j max|W_j - W_(j-1)|`` (every gradient within ``r`` of its tensor's largest element, the
    factor within ``r``) plus the rounding of the additions, ``k eps32 max|W|``.
    """
    from tests.bounds import EPS32, TINY_JOB_REL

    assert SHAPES["tiny"]["vocab_size"] == 49152 and SHAPES["tiny"]["intermediate_size"] == 128  # TINY_JOB_REL's

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    job = Job(shape="tiny", seq=32, micro_batch_size=4, gradient_accumulation_steps=2, steps=PARITY_STEPS, warmup=1,
              optimizer="sgd", lr=0.05, log_every=1, min_len=24)
    threads = torch.get_num_threads()
    if device == "cpu":  # the dry run: one thread against all of them, so that the sums still run in other orders
        torch.set_num_threads(1)
    try:
        dev_losses, dev_states = parity_run(job, device)
    finally:
        torch.set_num_threads(threads)
    acc = None
    if device != "cpu":  # a CPU Accelerator on a CUDA machine (build_accelerator would pick the GPU)
        from accelerate import Accelerator

        reset_accelerate()
        acc = Accelerator(cpu=True)
    cpu_losses, cpu_states = parity_run(job, "cpu", acc)
    assert len(dev_states) == len(cpu_states) == PARITY_STEPS + 1, (len(dev_states), len(cpu_states))
    r = TINY_JOB_REL
    rows = ["| quantity | device | CPU | difference | bound | within |", "|---|---|---|---|---|---|"]
    ok = True
    for j, (a, b) in enumerate(zip(dev_losses, cpu_losses), start=1):
        diff, bound = abs(a - b), r * abs(b)
        ok &= diff <= bound
        rows.append(f"| loss, step {j} | {a:.8f} | {b:.8f} | {diff:.2e} | {bound:.2e} | {diff <= bound} |")
    worst = (0.0, 0.0, "")
    for name in cpu_states[0]:
        moved = sum(float((cpu_states[j][name] - cpu_states[j - 1][name]).abs().max()) for j in
                    range(1, PARITY_STEPS + 1))
        bound = 2 * r * moved + PARITY_STEPS * EPS32 * float(cpu_states[-1][name].abs().max())
        diff = float((dev_states[-1][name] - cpu_states[-1][name]).abs().max())
        ok &= diff <= bound
        if diff / bound >= worst[0] / max(worst[1], 1e-300) or not worst[2]:
            worst = (diff, bound, name)
    rows.append(f"| adapters after {PARITY_STEPS} steps, {len(cpu_states[0])} tensors (worst: `{worst[2]}`) | | | "
                f"{worst[0]:.2e} | {worst[1]:.2e} | {worst[0] <= worst[1]} |")
    head = (f"{job.describe().replace('left-padded', 'left-padded rows')}; optimizer SGD lr {job.lr}; TF32 off; "
            f"{'cpu with 1 thread' if device == 'cpu' else device} against cpu with {threads} threads. "
            f"Bound r = TINY_JOB_REL = {r:.2e} (tests/bounds.py), adapters "
            f"2 r sum_j max|W_j - W_j-1| + k eps32 max|W|.")
    return f"{head}\n\n" + "\n".join(rows) + f"\n\nall within their bounds: **{ok}**", {
        "ok": ok, "losses": (dev_losses, cpu_losses), "adapter_diff": worst[0], "adapter_bound": worst[1]}


def run_auto(dry: bool, memory_gib: float | None, fraction: float) -> tuple[str, dict]:
    """The default job at its own micro-batch and at the largest the plan fits into ``fraction`` of the device."""
    from scale.config.load import load_config
    from scale.planner.autobatch import largest_micro_batch
    from scale.train import run
    from scale.training.metrics import read_jsonl

    yaml = ROOT / "configs" / "train" / ("tiny_cpu.yaml" if dry else "default.yaml")
    steps = 4 if dry else 30
    common = [f"train.max_steps={steps}", f"train.log_every={steps // 2}", "log.trackers=[]", "train.eval_every=0",
              "data.eval_size=32", "train.save_every=0", "train.save_adapter=false", "train.resume_from=null"]
    if memory_gib is None:
        memory_gib = torch.cuda.get_device_properties(0).total_memory / 2**30
    cfg = load_config(yaml, common)
    t0 = time.perf_counter()
    best, rank = largest_micro_batch(cfg, memory_gib, fraction)
    planning_s = time.perf_counter() - t0
    rows = ["| micro_batch_size | tokens/s (last logged interval) | last train/loss | peak allocated (GiB) | "
            "scale-plan total (GiB) |", "|---|---|---|---|---|"]
    figures = {}
    for b in (cfg.train.micro_batch_size, best):
        with tempfile.TemporaryDirectory() as out:
            reset_accelerate()
            if torch.cuda.is_available():
                torch.cuda.reset_peak_memory_stats()
            run(load_config(yaml, [*common, f"output_dir={out}", f"train.micro_batch_size={b}"]))
            logged = [r for r in read_jsonl(Path(out) / "metrics.jsonl") if "train/tokens_per_s" in r]
        peak = torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else float("nan")
        figures[b] = logged[-1]["train/tokens_per_s"]
        planned = largest_plan_total(cfg, b, memory_gib)
        rows.append(f"| {b} | {figures[b]:,.0f} | {logged[-1]['train/loss']:.4f} | "
                    f"{'n/a' if math.isnan(peak) else f'{peak:.2f}'} | {planned:.2f} |")
    speedup = figures[best] / figures[cfg.train.micro_batch_size]
    head = (f"`{yaml.relative_to(ROOT)}`, {steps} steps; largest micro-batch whose plan fits {fraction:.0%} of "
            f"{memory_gib:.1f} GiB: **{best}** (planned in {planning_s:.0f} s; the global batch grows with it, the "
            f"learning rate does not: a throughput measurement)")
    return f"{head}\n\n" + "\n".join(rows) + f"\n\ntokens/s at {best} / at {cfg.train.micro_batch_size}: " \
                                             f"**{speedup:.2f}x** (goal >= 10x on the default job)", {
        "best": best, "tokens_per_s": figures, "speedup": speedup, "plan_total_gib": rank.total / 2**30}


CAST_VARIANTS = {"paths off": dict(mixed_paths=False), "paths on": dict(mixed_paths=True),
                 "paths on + liger": dict(mixed_paths=True, kernels="liger")}
"""The rows of :func:`run_casts` per job: ``benchmarks.common.Job`` fields."""


def count_step_ops(h: Harness, job: Job) -> dict[str, int]:
    """aten ops of one micro-batch's forward and backward through ``h``'s prepared model under its autocast (the
    first training batch, loss ``mean(tail logits ** 2)``): ``{'_to_copy': dtype casts, 'ops': all ops}``. A warm-up
    pass first, so that lazy initialisations are not counted."""
    from tests.test_mixed_paths import CastCount

    batch = next(iter(h.train_dl))
    ids, mask = batch["input_ids"], batch["attention_mask"]

    def fwd_bwd() -> None:
        with h.acc.autocast():
            logits = h.model(input_ids=ids, attention_mask=mask, logits_to_keep=job.threshold).logits
        logits.float().pow(2).mean().backward()
        h.model.zero_grad(set_to_none=True)

    fwd_bwd()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    with CastCount() as c:
        fwd_bwd()
    return {"_to_copy": c.ops["_to_copy"], "ops": sum(c.ops.values())}


def liger_globals() -> dict:
    """The ``transformers.models.llama.modeling_llama`` names Liger's ``apply_liger_kernel_to_llama`` replaces for
    the whole process (RoPE, the RMSNorm and MLP classes), as they are now."""
    from transformers.models.llama import modeling_llama

    return {n: getattr(modeling_llama, n) for n in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP")}


def run_casts(dry: bool) -> tuple[str, dict]:
    """LoRA and QLoRA with the mixed-precision paths off, on, and on with Liger's kernels: casts and aten ops of one
    micro-batch's forward and backward, tokens/s and the last loss of a short ``scale.train.fit`` run each. A
    ``model.kernels: liger`` row that cannot run here (CPU, no liger-kernel) shows the one-line refusal a run gets.
    The section fails (exit 1) when the paths do not cut the casts of either job."""
    import gc

    from transformers.models.llama import modeling_llama

    from scale.config.validation import ConfigError
    from scale.distributed.inputs import check_kernels

    device = "cpu" if dry else "cuda"
    common = (dict(shape="tiny", seq=32, micro_batch_size=2, gradient_accumulation_steps=1, steps=3, warmup=1,
                   min_len=32) if dry else
              dict(shape="llama-1b", seq=1024, micro_batch_size=8, gradient_accumulation_steps=1, steps=6, warmup=2,
                   min_len=1024))
    jobs = {"LoRA bf16": dict(dtype="bfloat16"), "QLoRA nf4/bf16": dict(dtype="bfloat16", quantize_4bit=True)}
    rows = ["| job | variant | casts (`_to_copy`) per micro-batch fwd+bwd | aten ops | tokens/s | last loss |",
            "|---|---|---|---|---|---|"]
    figures: dict[str, dict[str, dict]] = {}
    for jname, extra in jobs.items():
        figures[jname] = {}
        for vname, variant in CAST_VARIANTS.items():
            job = Job(**common, **extra, **variant, mixed_precision="bf16", log_every=common["steps"])
            if job.kernels is not None:
                try:
                    with tempfile.TemporaryDirectory() as tmp:
                        check_kernels(job.config(tmp))
                except ConfigError as e:
                    rows.append(f"| {jname} | {vname} | refused: {e} | | | |")
                    continue
            reset_accelerate()
            patched = liger_globals()  # Liger rebinds these module-wide: the next rows must run transformers' own
            h = Harness(job, device=device)
            try:
                ops = count_step_ops(h, job)
                res = h.run()
            finally:
                for name, value in patched.items():
                    setattr(modeling_llama, name, value)
                h.close()
                del h
                gc.collect()
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
            figures[jname][vname] = {**ops, "tokens_per_s": res.tokens_per_s, "loss": res.losses[-1]}
            rows.append(f"| {jname} | {vname} | {ops['_to_copy']} | {ops['ops']} | {res.tokens_per_s:,.0f} | "
                        f"{res.losses[-1]:.4f} |")
    ok = all(f["paths on"]["_to_copy"] < f["paths off"]["_to_copy"] for f in figures.values())
    head = (f"{Job(**common).describe().split(', LoRA')[0]}, micro-batch {common['micro_batch_size']} x "
            f"T={common['seq']}, {common['steps']} steps ({common['warmup']} warm-up not timed), one run per row, "
            f"through scale.train.fit; paths: scale.modeling.mixed_paths.paths_for('{device}'); liger: "
            f"model.kernels=liger (RMSNorm, SwiGLU, RoPE)")
    return f"{head}\n\n" + "\n".join(rows) + f"\n\nthe paths cut the casts of every job: **{ok}**", {
        "ok": ok, "figures": figures}


MOE_PEAK_GOAL = 63e9  # bytes: Qwen3-30B-A3B bf16 LoRA on 8 x 2048 tokens on one H200 (unsloth's figure, issue 50)


def run_moe(dry: bool) -> tuple[str, dict]:
    """benchmarks/moe_experts.py: the layer (bf16, fp32) and the whole Qwen3-30B-A3B through the real loop. A peft
    that cannot adapt fused expert parameters (``target_parameters``, peft >= 0.17) has no expert LoRA to compare:
    the section says so and passes (nothing to check)."""
    from benchmarks import moe_experts
    from scale.utils.compat import installed, peft_adapts_parameters

    if not peft_adapts_parameters():
        return (f"skipped: peft {installed('peft')} cannot adapt fused expert parameters (target_parameters needs "
                f"peft >= 0.17), so there is no expert LoRA to compare"), {"ok": True, "skipped": True}
    argv = (["--device", "cpu", "--experts", "8", "--hidden", "64", "--width", "32", "--tokens", "2", "16",
             "--dtypes", "fp32", "--repeats", "1", "--model", "--model-config", "tiny", "--model-tokens", "2", "32",
             "--steps", "2"] if dry else
            ["--device", "cuda", "--dtypes", "bf16", "fp32", "--repeats", "3", "--model", "--model-config",
             str(ROOT / "configs" / "models" / "qwen3-30b-a3b.json"), "--model-tokens", "8", "2048",
             "--model-dtype", "bf16", "--steps", "4"])
    text = capture(moe_experts.main, argv)
    rows = {m.group(1): (float(m.group(2)), float(m.group(3).replace(",", ""))) for m in re.finditer(
        r"\n\| (peft|split) \| [\d.e+-]+ \| ([\d.e+-]+) \| ([\d,]+) \|", text)}
    peak, speedup = rows["split"][0] * 2**30, rows["split"][1] / rows["peft"][1]
    planned = [float(r) for r in re.findall(r"\| [\d.e+-]+ \(([\d.]+)\) \|", text)]  # scale-plan / measured
    plan_ok = bool(planned) and all(abs(r - 1) <= 0.05 for r in planned)
    ok = plan_ok and (dry or (peak <= MOE_PEAK_GOAL and speedup >= 2))
    return (f"`python benchmarks/moe_experts.py {' '.join(argv)}`\n\n{text}\n\nthe layer: scale-plan within 5% of "
            f"the measured bytes on both paths: **{plan_ok}**; model, split path: peak allocated {peak / 1e9:.1f} GB "
            f"(goal <= {MOE_PEAK_GOAL / 1e9:.0f} GB), tokens/s {speedup:.2f}x the peft path's (goal >= 2)"
            f"{' (dry run: no goal)' if dry else ''}: **{ok}**"), {"ok": ok, "peak": peak, "speedup": speedup,
                                                                    "planned": planned}


def run_vllm(dry: bool) -> tuple[str, dict]:
    """benchmarks/vllm_check.py (section 8); one line where vllm or CUDA is missing (every dry run)."""
    from benchmarks import vllm_check

    return vllm_check.run(dry)


def largest_plan_total(cfg, b: int, memory_gib: float) -> float:
    from dataclasses import replace

    from scale.planner.plan import make_plan

    return make_plan(replace(cfg, train=replace(cfg.train, micro_batch_size=b)), 1, memory_gib).ranks[0].total / 2**30


def header(dry: bool) -> str:
    from scale.utils.compat import installed

    if torch.cuda.is_available() and not dry:
        p = torch.cuda.get_device_properties(0)
        device = f"{p.name}, {p.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        device = "CPU (dry run: tiny shapes, numbers are not GPU figures)"
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return "\n".join(["# scale GPU check", "",
                      f"- date (UTC): {time.strftime('%Y-%m-%d %H:%M', time.gmtime())}",
                      f"- commit: {commit.stdout.strip() or 'unknown'}; scale {installed('scale') or 'not installed'}",
                      f"- device: {device}", f"- {machine_line()}", f"- python {platform.python_version()}"])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="gpu_check.md", help="the Markdown report (written after every section)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes: the same code paths in ~1 min")
    p.add_argument("--skip", nargs="*", default=[], choices=SECTIONS, help="sections not to run")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="device memory for the auto micro-batch (default: the GPU's; dry run: 1.2)")
    p.add_argument("--memory-fraction", type=float, default=0.9, help="share of it the plan may fill")
    a = p.parse_args(argv)
    if not a.dry_run and not torch.cuda.is_available():
        sys.stderr.write("benchmarks/gpu_check.py needs a CUDA GPU (torch.cuda.is_available() is False); pass "
                         "--dry-run (make gpu-check ARGS=\"--dry-run\") to run the same sections on the CPU at tiny "
                         "shapes.\n")
        return 2
    device = "cpu" if a.dry_run else "cuda"
    memory = a.memory_gib if a.memory_gib is not None else (1.2 if a.dry_run else None)
    runners: dict[str, tuple[str, Callable[[], tuple[str, dict]]]] = {
        "pytest": ("1. pytest -m gpu", lambda: run_pytest(a.dry_run)),
        "bench": ("2. LoRA and QLoRA throughput, MFU, memory against scale-plan", lambda: run_bench(a.dry_run)),
        "bare": ("3. Harness against a bare PyTorch loop", lambda: run_bare(a.dry_run)),
        "parity": ("4. fp32 on the device against the CPU", lambda: parity(device)),
        "auto": ("5. The default job at the largest micro-batch that fits",
                 lambda: run_auto(a.dry_run, memory, a.memory_fraction)),
        "casts": ("6. Fewer casts (scale.modeling.mixed_paths) and Liger kernels, on and off",
                  lambda: run_casts(a.dry_run)),
        "moe": ("7. Mixture-of-experts LoRA: split against peft (layer; Qwen3-30B-A3B through the loop)",
                lambda: run_moe(a.dry_run)),
        "vllm": ("8. GRPO with rl.generator=vllm: the engine against the trainer, steps through the loop",
                 lambda: run_vllm(a.dry_run)),
    }
    parts, failed, t_all = [header(a.dry_run)], [], time.perf_counter()
    out = Path(a.out)
    for key, (title, fn) in runners.items():
        if key in a.skip:
            continue
        t0 = time.perf_counter()
        try:
            text, info = fn()
            if info.get("ok") is False:  # ran, but a check inside it failed
                failed.append(key)
        except Exception:  # noqa: BLE001 - reported in the file; the command exits 1 at the end
            failed.append(key)
            text = "**FAILED**\n\n```\n" + traceback.format_exc()[-3000:] + "```"
        parts.append(f"## {title}\n\n{text}\n\n({time.perf_counter() - t0:.0f} s)")
        out.write_text("\n\n".join(parts) + "\n")
        sys.stderr.write(f"gpu_check: {key} {'FAILED' if key in failed else 'done'} "
                         f"({time.perf_counter() - t0:.0f} s)\n")
    parts.append(f"total: {time.perf_counter() - t_all:.0f} s; failed sections: {', '.join(failed) or 'none'}")
    out.write_text("\n\n".join(parts) + "\n")
    sys.stderr.write(f"gpu_check: report in {out}\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

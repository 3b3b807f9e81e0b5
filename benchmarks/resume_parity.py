"""Resume parity: in every launch mode, 8 steps = 4 steps + checkpoint + resume + 4 steps, bit for bit; and
across modes and process counts with the same global batch, within 1e-5.

    python benchmarks/resume_parity.py [--modes ddp,zero3] [--set data.group_by_length=true] [--sigterm-at 3]
    python benchmarks/resume_parity.py --across [--pairs "ddp>single,zero3>fsdp2"] [--variants lora-adamw]

Job: the parity job (configs/train/tiny_cpu.yaml on 20 examples, windows of 8, 8, 4 examples per epoch)
with AdamW, LoRA dropout 0.1 (so the RNG state matters) and 8 optimizer steps, checkpointing every 4: the
checkpoint at step 4 sits mid-way through the second epoch. For each mode it runs the 8 steps once, then
resumes a fresh output directory from the step-4 checkpoint, and compares the per-step losses of steps 5-8
and the final LoRA weights. Exits 1 unless every mode is bit-exact. ``tests/test_resume.py`` and
``tests/test_faults.py`` check single process and DDP on every CI run; this adds the DeepSpeed stages and FSDP2
(on CPU through the test-only shim ``tests/fsdp_cpu.py``). With ``--sigterm-at K`` each mode also runs the 8 steps
with a SIGTERM sent (to the launcher) once step K is logged, checks that the run left exit code 75 and one
``preempted`` checkpoint, reruns it with ``train.resume_from=latest`` and compares it with the uninterrupted run.

``--across``: the step-4 checkpoint of a run in one mode is resumed in another mode or on another number of
processes (:data:`ACROSS`), with the source run's config (``gradient_accumulation_steps`` is recomputed to keep
the global batch of 8), for LoRA and QLoRA, SGD and AdamW (:data:`VARIANTS`), LoRA dropout 0. Each row compares
the losses of steps 5-8 and the final LoRA weights with the uninterrupted run in the source mode (max relative
deviation; tolerance 1e-5). Exits 1 unless every row is within it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/resume_parity.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.launching import JOB, ROOT, TINY, modes, rel_dev, run_mode, weight_dev  # noqa: E402

RESUME_JOB = ["train.max_steps=8", "train.save_every=4", "lora.dropout=0.1", "optim.name=adamw", "optim.lr=1e-3"]
MODES = ["single 1x(2,4)", "ddp 2x(2,2)", "zero1 2x(2,2)", "zero2 2x(2,2)", "zero3 2x(2,2)", "fsdp2 2x(2,2)",
         "ulysses sp2 zero2 2x(4,2)", "ulysses sp2 zero3 2x(4,2)"]
# (checkpoint written in, resumed in): modes of tests.launching.modes(); G = 8 rows in every one
ACROSS = [("ddp 2x(2,2)", "single 1x(2,4)"), ("single 1x(2,4)", "ddp 2x(2,2)"), ("zero2 2x(2,2)", "ddp 2x(2,2)"),
          ("ddp 2x(2,2)", "zero3 2x(2,2)"), ("zero3 2x(2,2)", "fsdp2 2x(2,2)"), ("fsdp2 2x(2,2)", "zero3 2x(2,2)")]
QLORA = ["model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=float32", "model.bnb_4bit_quant_storage=float32"]
VARIANTS = {"lora-sgd": ["optim.name=sgd", "optim.lr=0.5"], "lora-adamw": ["optim.name=adamw", "optim.lr=1e-3"],
            "qlora-sgd": [*QLORA, "optim.name=sgd", "optim.lr=0.5"],
            "qlora-adamw": [*QLORA, "optim.name=adamw", "optim.lr=1e-3"]}
ACROSS_JOB = ["train.max_steps=8", "train.save_every=4", "lora.dropout=0.0"]
TOLERANCE = 1e-5


def across(pairs: list[tuple[str, str]], variants: list[str], extra: list[str], out: Path) -> tuple[list[str], bool]:
    """Run each (source, target) pair for each variant; return the table's lines and whether every row held."""
    table = modes()
    lines = [("| checkpoint from | resumed in | model, optimizer | losses 5-8 max rel dev | final LoRA max rel dev "
              "| wall s |"), "|---|---|---|---|---|---|"]
    refs: dict[tuple[str, str], dict] = {}
    ok = True
    for variant in variants:
        for i, (src, dst) in enumerate(pairs):
            t0 = time.perf_counter()
            src_cmds, src_over = table[src]
            job = [*src_over, *ACROSS_JOB, *VARIANTS[variant], *extra]
            ref_dir = out / f"ref-{variant}-{src.split()[0]}"
            if (variant, src) not in refs:
                shutil.rmtree(ref_dir, ignore_errors=True)  # a run of an earlier invocation
                refs[(variant, src)] = run_mode(src_cmds, job, ref_dir)
            ref = refs[(variant, src)]
            res_dir = out / f"across-{variant}-{i}"
            shutil.rmtree(res_dir, ignore_errors=True)
            ckpt = ref_dir / "checkpoints" / "step_000004"
            got = run_mode(table[dst][0], [*job, f"train.resume_from={ckpt}"], res_dir)
            saved = json.loads((res_dir / "checkpoints" / "step_000008" / "trainer_state.json").read_text())
            t = saved["config"]["train"]  # as resumed: the accumulation recomputed for its number of processes
            resumed = f"{dst.split()[0]} {saved['world_size']}x({t['micro_batch_size']},{t['gradient_accumulation_steps']})"
            loss_dev = rel_dev(ref["loss"][4:], got["loss"]) if got["steps"] == [5, 6, 7, 8] else float("inf")
            w_dev = weight_dev(ref["weights"], got["weights"])
            ok &= loss_dev <= TOLERANCE and w_dev <= TOLERANCE
            lines.append(f"| {src} | {resumed} | {variant} | {loss_dev:.1e} | {w_dev:.1e} | "
                         f"{time.perf_counter() - t0:.0f} |")
            sys.stdout.write(lines[-1] + "\n")
            sys.stdout.flush()
    return lines, ok


def preempt(cmds: list[list[str]], overrides: list[str], out: Path, at: int) -> tuple[bool, float]:
    """Run the job, SIGTERM it once step ``at`` is logged; return (exit code 75 reported and exactly one
    ``preempted`` checkpoint written, seconds from the signal to the exit)."""
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "preempted.log", "w") as log:
        proc = subprocess.Popen(cmds[0] + args, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        sent = time.perf_counter()
        while proc.poll() is None:
            rows = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").exists() else []
            if any(json.loads(r).get("step", 0) >= at and "train/loss" in r for r in rows if r.endswith("}")):
                sent = time.perf_counter()
                proc.send_signal(signal.SIGTERM)  # a launcher forwards it to every rank
                break
            time.sleep(0.02)
        proc.wait(timeout=600)
    waited = time.perf_counter() - sent
    saved = sorted((out / "checkpoints").glob("step_*[0-9]"))
    reasons = [json.loads((p / "trainer_state.json").read_text())["reason"] for p in saved]
    return "exit code 75" in (out / "preempted.log").read_text(errors="replace") and reasons == ["preempted"], waited


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=None, help="comma-separated substrings of the mode names")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every mode, e.g. --set data.group_by_length=true")
    parser.add_argument("--out", default=str(ROOT / "runs" / "resume_parity"))
    parser.add_argument("--sigterm-at", type=int, default=None, metavar="K",
                        help="also pre-empt each mode with SIGTERM after step K (1-3) and resume with latest")
    parser.add_argument("--across", action="store_true",
                        help="resume each checkpoint in another mode or process count (ACROSS x VARIANTS)")
    parser.add_argument("--pairs", default=None, help='with --across: e.g. "ddp>single,zero3>fsdp2" (mode prefixes)')
    parser.add_argument("--variants", default=",".join(VARIANTS),
                        help=f"with --across: comma-separated of {', '.join(VARIANTS)}")
    args = parser.parse_args()
    if args.across:
        known = [m for pair in ACROSS for m in pair] + list(modes())  # "single": the 2 x 4 one of ACROSS first
        pick = lambda prefix: next(m for m in known if m.startswith(prefix))
        pairs = ACROSS if not args.pairs else [(pick(a), pick(b)) for a, b in
                                               (x.split(">") for x in args.pairs.split(","))]
        lines, ok = across(pairs, args.variants.split(","), args.set, Path(args.out))
        sys.stdout.write("\n" + "\n".join(lines) + "\n")
        return 0 if ok else 1
    names = [m for m in MODES if not args.modes or any(w in m for w in args.modes.split(","))]
    table = modes()
    lines = ["| mode | losses 5-8 identical | final weights identical | max abs weight diff | wall s |",
             "|---|---|---|---|---|"]
    ok = True
    for i, name in enumerate(names):
        cmds, overrides = table[name]
        t0 = time.perf_counter()
        ref_dir, res_dir = Path(args.out) / f"ref{i}", Path(args.out) / f"resumed{i}"
        ref = run_mode(cmds, [*overrides, *RESUME_JOB, *args.set], ref_dir)
        ckpt = ref_dir / "checkpoints" / "step_000004"
        got = run_mode(cmds, [*overrides, *RESUME_JOB, *args.set, f"train.resume_from={ckpt}"], res_dir)
        same_loss = got["steps"] == [5, 6, 7, 8] and got["loss"] == ref["loss"][4:]
        a, b = ref["weights"], got["weights"]
        same_w = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        diff = max((a[k] - b[k]).abs().max().item() for k in a) if a.keys() == b.keys() else float("inf")
        ok &= same_loss and same_w
        if args.sigterm_at is not None:  # the signal before the step-4 checkpoint: the only one is the pre-empted one
            sig_dir = Path(args.out) / f"sigterm{i}"
            clean, waited = preempt(cmds, [*overrides, *RESUME_JOB, *args.set], sig_dir, args.sigterm_at)
            again = run_mode(cmds, [*overrides, *RESUME_JOB, *args.set, "train.resume_from=latest"], sig_dir)
            same = again["loss"] == ref["loss"] and all(torch.equal(a[k], again["weights"][k]) for k in a)
            ok &= clean and same
            name += (f" (SIGTERM at {args.sigterm_at}: exit 75 and checkpoint {clean}, {waited:.1f} s; "
                     f"resumed identical {same})")
        lines.append(f"| {name} | {same_loss} | {same_w} | {diff:.1e} | {time.perf_counter() - t0:.0f} |")
        sys.stdout.write(lines[-1] + "\n")
        sys.stdout.flush()
    sys.stdout.write("\n" + "\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Resume parity: in every launch mode, 8 steps = 4 steps + checkpoint + resume + 4 steps, bit for bit.

    python benchmarks/resume_parity.py [--modes ddp,zero3] [--set data.group_by_length=true] [--sigterm-at 3]

Job: the parity job (configs/train/tiny_cpu.yaml on 20 examples, windows of 8, 8, 4 examples per epoch)
with AdamW, LoRA dropout 0.1 (so the RNG state matters) and 8 optimizer steps, checkpointing every 4: the
checkpoint at step 4 sits mid-way through the second epoch. For each mode it runs the 8 steps once, then
resumes a fresh output directory from the step-4 checkpoint, and compares the per-step losses of steps 5-8
and the final LoRA weights. Exits 1 unless every mode is bit-exact. ``tests/test_resume.py`` and
``tests/test_faults.py`` check single process and DDP on every CI run; this adds the DeepSpeed stages and FSDP2
(on CPU through the test-only shim ``tests/fsdp_cpu.py``). With ``--sigterm-at K`` each mode also runs the 8 steps
with a SIGTERM sent (to the launcher) once step K is logged, checks that the run left exit code 75 and one
``preempted`` checkpoint, reruns it with ``train.resume_from=latest`` and compares it with the uninterrupted run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/resume_parity.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.launching import JOB, ROOT, TINY, modes, run_mode  # noqa: E402

RESUME_JOB = ["train.max_steps=8", "train.save_every=4", "lora.dropout=0.1", "optim.name=adamw", "optim.lr=1e-3"]
MODES = ["single 1x(2,4)", "ddp 2x(2,2)", "zero1 2x(2,2)", "zero2 2x(2,2)", "zero3 2x(2,2)", "fsdp2 2x(2,2)",
         "ulysses sp2 zero2 2x(4,2)", "ulysses sp2 zero3 2x(4,2)"]


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
    args = parser.parse_args()
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

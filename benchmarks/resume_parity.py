"""Resume parity: in every launch mode, 8 steps = 4 steps + checkpoint + resume + 4 steps, bit for bit.

    python benchmarks/resume_parity.py [--modes ddp,zero3] [--set data.group_by_length=true]

Job: the parity job (configs/train/tiny_cpu.yaml on 20 examples, windows of 8, 8, 4 examples per epoch)
with AdamW, LoRA dropout 0.1 (so the RNG state matters) and 8 optimizer steps, checkpointing every 4: the
checkpoint at step 4 sits mid-way through the second epoch. For each mode it runs the 8 steps once, then
resumes a fresh output directory from the step-4 checkpoint, and compares the per-step losses of steps 5-8
and the final LoRA weights. Exits 1 unless every mode is bit-exact. ``tests/test_resume.py`` and
``tests/test_faults.py`` check single process and DDP on every CI run; this adds the DeepSpeed stages and FSDP2
(on CPU through the test-only shim ``tests/fsdp_cpu.py``).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

if __package__ in (None, ""):  # `python benchmarks/resume_parity.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.launching import ROOT, modes, run_mode  # noqa: E402

RESUME_JOB = ["train.max_steps=8", "train.save_every=4", "lora.dropout=0.1", "optim.name=adamw", "optim.lr=1e-3"]
MODES = ["single 1x(2,4)", "ddp 2x(2,2)", "zero1 2x(2,2)", "zero2 2x(2,2)", "zero3 2x(2,2)", "fsdp2 2x(2,2)"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=None, help="comma-separated substrings of the mode names")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every mode, e.g. --set data.group_by_length=true")
    parser.add_argument("--out", default=str(ROOT / "runs" / "resume_parity"))
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
        lines.append(f"| {name} | {same_loss} | {same_w} | {diff:.1e} | {time.perf_counter() - t0:.0f} |")
        sys.stdout.write(lines[-1] + "\n")
        sys.stdout.flush()
    sys.stdout.write("\n" + "\n".join(lines) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Parity: the same tiny fp32 tail-loss job under every launch mode gives the same numbers.

    python benchmarks/parity.py [--modes single_8x1,ddp_2x2x2 ...] [--jobs reviews,completions] [--tolerance 1e-5]
                                [--set data.group_by_length=true]

Jobs: configs/train/tiny_cpu.yaml on 20 examples (global batch 8, so every epoch ends with a partial
window of 4), 6 optimizer steps (2 epochs), plain SGD (Adam would hide a gradient-scale error), no dropout,
logged every step: ``reviews`` (classification, every tail 2 tokens) and ``completions``
(configs/data/tiny_completions.jsonl, prompt/completion rows whose tails are 2 to 12 tokens, so the micro-batches of
a window hold tails of different lengths) and ``chats`` (configs/data/tiny_chats.jsonl, 1-3 exchange chats,
every assistant turn trained: tails up to ~90 tokens, weight-0 user turns inside). For each job and mode it reads
``metrics.jsonl`` (per-step ``train/loss`` and ``train/grad_norm``) and the saved adapter, and prints the max relative deviation from
the job's first row; exits 1 if any row exceeds the tolerance. The ``zero3 from a directory`` row loads the same
tiny model from a ``save_pretrained`` directory (``from_pretrained`` under ZeRO-3's ``zero.Init``, as a real model).
The ``fsdp2`` row is accelerate's FSDP2 preparation on 2 CPU processes through the test-only shim ``tests/fsdp_cpu.py``.
The ``ulysses`` rows are sequence parallelism (``train.sequence_parallel_size=2``, DeepSpeed Ulysses): 2 processes
share every row (ZeRO-1/2/3), or 4 processes form 2 data-parallel groups of 2 (ZeRO-2/3). The ``late_tails`` job
(the reviews cut to 16 tokens) puts every tail prediction on the second rank's shard: the first rank's loss is an
exact 0 in every micro-batch. The ``moe`` job trains a tiny Qwen3-MoE (8 experts, top-2; LoRA on every expert)
whose routers never send a token to 4 of the experts (``tests.launching.save_tiny_moe_directory``); its rows are the
modes that load a directory (not the ``from a directory`` row, which loads the tiny Llama, nor the Ulysses rows).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/parity.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.launching import (CHATS, COMPLETIONS, LATE_TAILS, ROOT, modes, rel_dev, run_mode,  # noqa: E402
                             save_tiny_directory, save_tiny_moe_directory, weight_dev)

JOBS = {"reviews": [], "completions": COMPLETIONS, "chats": CHATS, "late_tails": LATE_TAILS, "moe": []}
SKIP = {"moe": ("from a directory", "ulysses")}  # rows a job cannot run as the others do (see the module docstring)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default=None, help="comma-separated subset of the mode names (substring match)")
    parser.add_argument("--jobs", default=",".join(j for j in JOBS if j != "moe"),
                        help=f"comma-separated subset of {list(JOBS)}")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every mode, e.g. --set data.group_by_length=true")
    parser.add_argument("--out", default=str(ROOT / "runs" / "parity"))
    args = parser.parse_args()
    # The tiny model saved as a directory: the ZeRO-3 row loading it goes through from_pretrained under zero.Init.
    table = modes(save_tiny_directory(Path(args.out) / "tiny-llama-dir"))
    if args.modes:
        wanted = args.modes.split(",")
        table = {k: v for i, (k, v) in enumerate(table.items()) if i == 0 or any(w in k for w in wanted)}
    worst, report = 0.0, []
    if "moe" in args.jobs.split(","):
        moe = save_tiny_moe_directory(Path(args.out) / "tiny-qwen3-moe-dir")
        JOBS["moe"] = [f"model.name_or_path={moe}", "model.tokenizer=smollm2-135m", "model.gradient_checkpointing=true"]
    for job in args.jobs.split(","):
        results = {}
        header = f"| {job + ': mode':<34} | {'loss':>9} | {'grad_norm':>9} | {'weights':>9} | {'wall s':>6} |"
        lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
        for i, (name, (cmds, overrides)) in enumerate(table.items()):
            if any(skip in name for skip in SKIP.get(job, ())):
                continue
            t0 = time.perf_counter()
            res = run_mode(cmds, [*JOBS[job], *overrides, *args.set], Path(args.out) / f"{job}{i}")
            wall = time.perf_counter() - t0
            results[name] = res
            ref = next(iter(results.values()))
            devs = (rel_dev(ref["loss"], res["loss"]), rel_dev(ref["grad_norm"], res["grad_norm"]),
                    weight_dev(ref["weights"], res["weights"]))
            worst = max(worst, *devs)
            lines.append(f"| {name:<34} | {devs[0]:9.2e} | {devs[1]:9.2e} | {devs[2]:9.2e} | {wall:6.1f} |")
            sys.stdout.write(lines[-1] + "\n")
            sys.stdout.flush()
        report += [*lines, "", f"{job}: steps {ref['steps']}, losses {[round(x, 6) for x in ref['loss']]}", ""]
    sys.stdout.write("\n" + "\n".join(report) + "\n(windows of 8, 8, 4 examples per epoch)\n")
    sys.stdout.write(f"max relative deviation: {worst:.3e}\n")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())

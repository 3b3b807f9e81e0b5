"""Elastic soak: one worker of a 2-process ``torchrun --max-restarts`` job SIGKILLed at random steps, N times; and
a node range: one of 2 "nodes" lost, the job continues on the other.

    python benchmarks/elastic.py [--kills 10] [--steps 30] [--seed 0]
    python benchmarks/elastic.py --node-range [--trials 5] [--steps 12]

The tiny job of tests/launching.py (SGD, no dropout, a checkpoint every step, ``train.resume_from=auto``) runs
once uninterrupted, then once with ``--kills`` kills, each at a random step after the previous recovery. Prints,
per kill, the seconds from the kill until the restarted group logged a new step (``time lost``: the restart, the
start-up and the steps repeated since the last checkpoint), then whether the run finished with every step logged
and a final adapter bit-identical to the uninterrupted one. Exits 1 otherwise.

``--node-range``: ``launch/elastic.sh`` with ``NNODES=1:2`` on 2 "nodes" of 1 process on loopback
(:func:`tests.launching.run_node_range`: micro-batch 2 x GA 2 x 2 ranks = 8 rows per step, a checkpoint every step).
Each trial kills the second node (its agent and worker, SIGKILL) once a random step is logged; the first node's
group restarts alone, resumes the newest checkpoint on 1 process with GA 4 (the same 8 rows per step) and finishes.
Each trial is compared with the uninterrupted run on the 2 nodes: every step's loss and the final adapter within
1e-5 (relative). Exits 1 unless every trial recovered within it.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/elastic.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from tests.launching import rel_dev, run_elastic, run_node_range, weight_dev  # noqa: E402


def node_range(trials: int, steps: int, seed: int, root: Path) -> int:
    """The node-range scenario (module docstring); prints one row per trial and a summary; returns the exit code."""
    rng = random.Random(seed)
    job = ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2", f"train.max_steps={steps}",
           "data.max_train_examples=40", "train.rendezvous_timeout_s=30"]
    t0 = time.perf_counter()
    ref = run_node_range(root / "ref", job, kill_at=None)
    ref_s = time.perf_counter() - t0
    if ref["returncode"] != 0 or ref["weights"] is None:
        sys.stdout.write(ref["log"][-3000:] + "\nuninterrupted run failed\n")
        return 1
    lines = [("| trial | node lost after step | time lost s | exit | steps logged | losses max rel dev | "
              "final LoRA max rel dev |"), "|---|---|---|---|---|---|---|"]
    good = 0
    for trial in range(trials):
        at = rng.randint(1, steps - 2)
        got = run_node_range(root / f"trial{trial}", job, kill_at=at)
        logged = sorted(got["losses"])
        loss_dev = rel_dev([ref["losses"][s] for s in logged], [got["losses"][s] for s in logged]) \
            if logged == list(range(1, steps + 1)) else float("inf")
        w_dev = weight_dev(ref["weights"], got["weights"]) if got["weights"] is not None else float("inf")
        ok = got["returncode"] == 0 and got["recovery_s"] is not None and max(loss_dev, w_dev) <= 1e-5
        good += ok
        rec = f"{got['recovery_s']:.1f}" if got["recovery_s"] is not None else "-"
        lines.append(f"| {trial + 1} | {at} | {rec} | {got['returncode']} | {len(logged)} of {steps} | "
                     f"{loss_dev:.1e} | {w_dev:.1e} |")
        sys.stdout.write(lines[-1] + "\n")
        sys.stdout.flush()
    sys.stdout.write("\n" + "\n".join(lines) + f"\n{good} of {trials} trials recovered within 1e-5; "
                     f"uninterrupted on 2 nodes {ref_s:.0f} s\n")
    return 0 if good == trials else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kills", type=int, default=10)
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps of the job")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="working directory (default: a temporary one)")
    parser.add_argument("--node-range", action="store_true", help="the node-range scenario (NNODES=1:2) instead")
    parser.add_argument("--trials", type=int, default=5, help="with --node-range: trials, each losing a node")
    args = parser.parse_args()
    if args.node_range:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(args.out or tmp)
            root.mkdir(parents=True, exist_ok=True)
            return node_range(args.trials, args.steps, args.seed, root)
    rng = random.Random(args.seed)
    job = ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2", f"train.max_steps={args.steps}",
           "data.max_train_examples=40"]
    # Distinct kill steps spread over the run, each after the previous one (a kill is taken once that step is logged).
    kill_at = sorted(rng.sample(range(1, args.steps), args.kills))
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.out or tmp)
        root.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()
        ref = run_elastic(root / "ref", job, kill_at=[], max_restarts=0)
        ref_s = time.perf_counter() - t0
        if ref["returncode"] != 0:
            sys.stdout.write(ref["log"][-3000:] + "\nuninterrupted run failed\n")
            return 1
        t0 = time.perf_counter()
        got = run_elastic(root / "killed", job, kill_at=kill_at, max_restarts=args.kills + 2, seed=args.seed)
        got_s = time.perf_counter() - t0
    exact = (got["weights"] is not None and got["weights"].keys() == ref["weights"].keys()
             and all(torch.equal(got["weights"][k], ref["weights"][k]) for k in ref["weights"]))
    same_losses = got["losses"] == ref["losses"] and sorted(got["losses"]) == list(range(1, args.steps + 1))
    rec = got["recovery_s"]
    lines = ["| kill | at step | time lost s |", "|---|---|---|"]
    lines += [f"| {i + 1} | {s} | {r:.1f} |" for i, (s, r) in enumerate(zip(kill_at, rec))]
    sys.stdout.write("\n".join(lines) + "\n")
    recovered = len(rec) if got["returncode"] == 0 else max(0, len(rec) - 1)
    sys.stdout.write(f"kills {len(rec)} of {args.kills}, recoveries {recovered}, exit {got['returncode']}; "
                     f"time lost per restart: median {statistics.median(rec) if rec else float('nan'):.1f} s, "
                     f"max {max(rec, default=float('nan')):.1f} s; uninterrupted {ref_s:.0f} s, with kills "
                     f"{got_s:.0f} s; losses identical {same_losses}; final adapter bit-identical {exact}\n")
    return 0 if got["returncode"] == 0 and exact and same_losses and len(rec) == args.kills else 1


if __name__ == "__main__":
    sys.exit(main())

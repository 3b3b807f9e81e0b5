"""Parity: the same tiny fp32 tail-loss job under every launch mode gives the same numbers.

    python benchmarks/parity.py [--modes "ulysses,ddp 2x(2,2)" ...] [--jobs reviews,completions] [--tolerance 1e-5]
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
modes that load a directory (not the ``from a directory`` row, which loads the tiny Llama, nor the Ulysses rows);
it runs when ``--jobs`` names it. The ``dpo``, ``simpo`` and ``orpo`` jobs train preference pairs
(configs/data/tiny_pairs.jsonl, 20 pairs: windows of 8, 8 and 4 pairs; DPO with its in-step reference, the adapter
disabled, SimPO and ORPO without one; ``loss.beta=0.5``): every row but the Ulysses ones, which pairs refuse; they
run when ``--jobs`` names them. The ``full`` job (opt-in) is the reviews job with ``model.finetune=full``: every
weight trains, the weights compared are the final ``model/`` directory's; its derived bounds
(:data:`tests.bounds.FULL_STEP_REL`, :func:`tests.bounds.full_loss_bounds`, :func:`tests.bounds.full_drift`) and the
rows' weight differences in L2 print under its table. The ``full_dpo`` job (opt-in) is the ``dpo`` job on full
weights: its reference is the frozen copy of the starting weights (``loss.reference: model``, the default under
``model.finetune=full``: partitioned under ZeRO-3 and FSDP2), the same bounds printed under its table (the DPO loss
moves with the weights by at most ``||g|| ||dW||`` to first order, as the SFT loss; the reference is the same
forward of the same starting weights in every row); every row but the Ulysses ones. The ``grpo`` job (``tests.launching.GRPO``: online RL on
configs/data/tiny_prompts.jsonl, 4 completions per prompt, every round trained twice, the KL to the adapter-less
reference) runs when ``--jobs`` names it, on every row but the Ulysses ones: its first step of a round has a loss of
~0 by construction (the advantages of a group sum to 0), so its loss column is ``max |loss - ref| / max |ref|`` over
the steps, and its ``completions`` column says whether every completion the row logged is one the reference sampled
(seeded per completion, not per rank).

``--modes`` takes items separated by commas outside parentheses (names hold commas inside them, as ``4x(2,2)``): an
item equal to a mode name selects that row only, any other item the rows whose names contain it (``ulysses``);
an item that selects nothing stops with exit 2. The first row, the reference, always runs. A row this machine
cannot launch (more processes than its GPUs, or without a GPU than ``max(2, CPU cores)``: the launcher's own
``scale.distributed.launch.check_ranks_per_machine``) is skipped with one line saying why, before it starts; the summary
still prints.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import yaml

if __package__ in (None, ""):  # `python benchmarks/parity.py`: make `tests.launching` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.bounds import FULL_STEP_REL, full_drift, full_loss_bounds, full_norm_rel, l2_dev  # noqa: E402
from tests.launching import (CHATS, COMPLETIONS, GRPO, LATE_TAILS, PAIRS, ROOT, modes, rel_dev,  # noqa: E402
                             run_mode, save_tiny_directory, save_tiny_moe_directory, scaled_dev, weight_dev)

JOBS = {"reviews": [], "completions": COMPLETIONS, "chats": CHATS, "late_tails": LATE_TAILS, "moe": [],
        "dpo": PAIRS, "simpo": [*PAIRS, "loss.objective=simpo"], "orpo": [*PAIRS, "loss.objective=orpo"],
        "full": ["model.finetune=full"], "full_dpo": ["model.finetune=full", *PAIRS], "grpo": GRPO}
OPT_IN = ("moe", "dpo", "simpo", "orpo", "full", "full_dpo", "grpo")  # run when --jobs names them
# rows a job cannot run as the others do (see the module docstring)
SKIP = {"moe": ("from a directory", "ulysses"), "dpo": ("ulysses",), "simpo": ("ulysses",), "orpo": ("ulysses",),
        "full_dpo": ("ulysses",), "grpo": ("ulysses",)}


def _flag(cmd: list[str], name: str) -> str | None:
    """The value after the last ``name`` in ``cmd`` (a later flag overrides an earlier one), or None."""
    at = [i for i, a in enumerate(cmd) if a == name]
    return cmd[at[-1] + 1] if at else None


def local_processes(cmds: list[list[str]]) -> int:
    """How many processes a row's commands start on this machine together: ``--num_processes`` (else the
    ``--config_file`` YAML's ``num_processes``) over ``--num_machines`` for ``accelerate launch``,
    ``--num_accelerators`` for the ``deepspeed`` launcher, 1 for a plain ``python -m``."""
    total = 0
    for cmd in cmds:
        if (n := _flag(cmd, "--num_accelerators")) is not None:
            total += int(n)
            continue
        tree = {}
        if (path := _flag(cmd, "--config_file")) is not None:
            tree = yaml.safe_load(Path(path).read_text()) or {}
        procs = int(_flag(cmd, "--num_processes") or tree.get("num_processes", 1))
        machines = int(_flag(cmd, "--num_machines") or tree.get("num_machines", 1))
        total += max(1, procs // machines)
    return total


def launch_problem(cmds: list[list[str]]) -> str | None:
    """Why this machine cannot launch the row (the launcher's :func:`scale.distributed.launch.check_ranks_per_machine`
    on the row's :func:`local_processes`), or None."""
    from scale.distributed.launch import LaunchError, check_ranks_per_machine

    try:
        check_ranks_per_machine({"LOCAL_WORLD_SIZE": str(local_processes(cmds))})
    except LaunchError as e:
        return str(e).split(": launch with")[0]   # the count and the limit; the fix names flags this row fixes
    return None


def split_modes(text: str) -> list[str]:
    """``--modes``'s items: split at commas outside parentheses (``"ddp 2x(2,2),ulysses"`` is two items)."""
    items, depth, cur = [], 0, ""
    for ch in text:
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            items.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [i for i in [*items, cur.strip()] if i]


def select(table: dict, wanted: list[str]) -> dict:
    """The reference row (the first) and the rows ``wanted`` selects, in table order: an item equal to a name
    selects that row only, another item the names containing it.

    Raises:
        SystemExit: an item selects no row (exit 2, one line listing the names).
    """
    if not wanted:
        return table
    chosen = set()
    for item in wanted:
        hits = [item] if item in table else [k for k in table if item in k]
        if not hits:
            sys.stderr.write(f"--modes item {item!r} selects no mode; the modes are: {'; '.join(table)}\n")
            raise SystemExit(2)
        chosen.update(hits)
    return {k: v for i, (k, v) in enumerate(table.items()) if i == 0 or k in chosen}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="", help="comma-separated mode names (whole names, commas inside "
                        "parentheses kept: 'ulysses sp2 zero2 4x(2,2) dp2') or parts of names ('ulysses'); "
                        "default: all")
    parser.add_argument("--jobs", default=",".join(j for j in JOBS if j not in OPT_IN),
                        help=f"comma-separated subset of {list(JOBS)} (default: all but {', '.join(OPT_IN)})")
    parser.add_argument("--tolerance", type=float, default=1e-5)
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="extra config override for every mode, e.g. --set data.group_by_length=true")
    parser.add_argument("--out", default=str(ROOT / "runs" / "parity"))
    args = parser.parse_args(argv)
    # The tiny model saved as a directory: the ZeRO-3 row loading it goes through from_pretrained under zero.Init.
    table = modes(save_tiny_directory(Path(args.out) / "tiny-llama-dir"))
    table = select(table, split_modes(args.modes))
    problems = {name: launch_problem(cmds) for name, (cmds, _) in table.items()}
    worst, report = 0.0, []
    if "moe" in args.jobs.split(","):
        moe = save_tiny_moe_directory(Path(args.out) / "tiny-qwen3-moe-dir")
        JOBS["moe"] = [f"model.name_or_path={moe}", "model.tokenizer=smollm2-135m", "model.gradient_checkpointing=true"]
    for job in args.jobs.split(","):
        results = {}
        header = f"| {job + ': mode':<34} | {'loss':>9} | {'grad_norm':>9} | {'weights':>9} | {'wall s':>6} |" + (
            f" {'completions':>11} |" if job == "grpo" else "")
        lines = [header, "|" + "|".join("-" * (len(c)) for c in header.split("|")[1:-1]) + "|"]
        for i, (name, (cmds, overrides)) in enumerate(table.items()):
            if any(skip in name for skip in SKIP.get(job, ())):
                continue
            if problems[name]:
                lines.append(f"| {name:<34} | skipped: {problems[name]} |")
                sys.stdout.write(lines[-1] + "\n")
                continue
            t0 = time.perf_counter()
            res = run_mode(cmds, [*JOBS[job], *overrides, *args.set], Path(args.out) / f"{job}{i}")
            wall = time.perf_counter() - t0
            results[name] = res
            ref = next(iter(results.values()))
            loss_dev = scaled_dev if job == "grpo" else rel_dev
            devs = (loss_dev(ref["loss"], res["loss"]), rel_dev(ref["grad_norm"], res["grad_norm"]),
                    weight_dev(ref["weights"], res["weights"]))
            same = set(res["samples"]) <= set(ref["samples"])  # grpo: the completions the row logged
            worst = max(worst, *devs, 0.0 if same else float("inf"))
            extra = f" {'same' if same else 'DIFFER':>11} |" if job == "grpo" else ""
            lines.append(f"| {name:<34} | {devs[0]:9.2e} | {devs[1]:9.2e} | {devs[2]:9.2e} | {wall:6.1f} |{extra}")
            sys.stdout.write(lines[-1] + "\n")
            sys.stdout.flush()
        report += [*lines, "", f"{job}: steps {ref['steps']}, losses {[round(x, 6) for x in ref['loss']]}", ""]
        if job in ("full", "full_dpo"):  # the bounds the arithmetic allows (docs/full.md), beside the tolerance asked for
            n = sum(t.numel() for t in ref["weights"].values())
            loss = full_loss_bounds(ref["loss"], ref["lr"], ref["grad_norm"], 1.0, n)  # tiny_cpu.yaml clips at 1.0
            drift = full_drift(ref["lr"], ref["grad_norm"], 1.0, n)[-1]
            l2 = ", ".join(f"{name} {l2_dev(ref['weights'], r['weights']):.2e}" for name, r in results.items())
            report += [f"{job}: derived bounds (tests/bounds.py, first order): loss {FULL_STEP_REL:.2e} at step 1 "
                       f"(the same weights), {max(loss):.2e} by step {len(loss)}; grad_norm {full_norm_rel(n):.2e} at "
                       f"step 1; final weights ||dW||_2 {drift:.2e} (||W||_2 "
                       f"{l2_dev(ref['weights'], {k: 0 * v for k, v in ref['weights'].items()}):.1f}); measured "
                       f"||dW||_2: {l2}; tolerance {args.tolerance:.0e}", ""]
    sys.stdout.write("\n" + "\n".join(report) + "\n(windows of 8, 8, 4 examples, or pairs, per epoch)\n")
    skipped = [name for name, why in problems.items() if why]
    if skipped:
        sys.stdout.write(f"skipped on this machine ({len(skipped)}): {'; '.join(skipped)}\n")
    sys.stdout.write(f"max relative deviation: {worst:.3e}\n")
    return 0 if worst <= args.tolerance else 1


if __name__ == "__main__":
    sys.exit(main())

"""Padded vs padding-free micro-batches, side by side: real tokens per second and the padding they remove.

    python benchmarks/padding_free.py [--jobs chat,longtail,longtail-small] [--repeats 3] [--steps 7] [--threads 1]

Contestants, each the real harness run (``scale.training.job.setup`` + ``scale.train.fit``, ``train.log_every=1``) on
the same rows and weights:

- ``padded``: ``data.padding_free=false`` (left-padded ``[B, T]`` micro-batches);
- ``free (mask)``: ``data.padding_free=true`` with transformers' attention for packed rows, sdpa over the whole
  row with a block-diagonal ``[L, L]`` mask (the per-example attention switched off after set-up);
- ``free``: ``data.padding_free=true`` as a CPU run has it, attention one example at a time
  (:mod:`scale.modeling.varlen`).

Jobs:

- ``chat``: the tiny chat job of ``tests/test_sampling.py`` (configs/data/tiny_chats.jsonl, ChatML, grouped by
  length, micro-batch 8 x 2 accumulation, SGD), whose grouped batches hold little padding;
- ``longtail``: prompt/completion rows with long-tailed lengths (log-normal word counts, median ~33, up to ~900
  tokens; written to a temporary file), random batches (no grouping), on the tiny model (hidden size 64, 2 layers:
  a step is mostly the loop's fixed costs);
- ``longtail-small``: the same rows on a wider, deeper model (hidden size 256, 4 layers, MLP 768), where the
  per-token work dominates.

Runs alternate within each repeat (padded, free (mask), free, padded, ...) in this one process (the Accelerator
state reset between runs). Throughput is real (unpadded) tokens over the seconds of the steps after the first
(``train/tokens_per_s x (train/data_s + train/compute_s)``), and over process CPU seconds (stamped after each
optimizer step; a machine shared with other work distorts them less). Ratios are per repeat, then the median. The
per-step losses of every contestant are checked against padded's (``--tol``, relative): the speed is for the
same training. The load average is printed with the table.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/padding_free.py`: make `benchmarks.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "train" / "tiny_cpu.yaml"
CONTESTANTS = ("padded", "free (mask)", "free")
COMMON = ["train.log_every=1", "train.eval_every=0", "optim.name=sgd", "optim.lr=0.5", "train.save_adapter=false",
          "train.overwrite_output_dir=true", "train.save_every=0", "train.save_every_minutes=null", "data.eval_size=8",
          "data.cache=false"]


def longtail_rows(n: int, seed: int = 0) -> list[dict[str, str]]:
    """``n`` prompt/completion rows whose prompts hold ``exp(N(3.5, 1))`` words (clipped to 6..900): most rows
    short, a few long, the lengths chat and instruction data have."""
    rng = random.Random(seed)
    words = "the a movie plot was good bad long short great slow fast actor scene story end".split()
    rows = []
    for i in range(n):
        k = min(900, max(6, int(math.exp(rng.gauss(3.5, 1.0)))))
        rows.append({"prompt": "Review: " + " ".join(rng.choice(words) for _ in range(k)) + "\nVerdict:",
                     "completion": " good" if i % 2 else " bad"})
    return rows


def job_overrides(job: str, steps: int, tmp: Path) -> list[str]:
    """The config overrides of ``job`` (module docstring) for ``steps`` optimizer steps."""
    if job == "chat":
        return [f"data.path={ROOT / 'configs' / 'data' / 'tiny_chats.jsonl'}", "data.max_length=128",
                f"data.chat_template={ROOT / 'configs' / 'chat' / 'chatml.jinja'}", "data.group_by_length=true",
                f"train.max_steps={steps}", *COMMON]
    if job in ("longtail", "longtail-small"):
        path = tmp / "longtail.jsonl"
        if not path.exists():
            path.write_text("".join(json.dumps(r) + "\n" for r in longtail_rows(400)))
        small = ["model.tiny_hidden_size=256", "model.tiny_num_layers=4", "model.tiny_intermediate_size=768"]
        return [f"data.path={path}", "data.max_length=1024", f"train.max_steps={steps}", *COMMON,
                *(small if job == "longtail-small" else [])]
    raise SystemExit(f"unknown job {job!r}: choose from chat, longtail, longtail-small")


def run_one(job: str, contestant: str, steps: int, tmp: Path) -> dict:
    """Train one contestant of ``job`` in this process; return its logged rows and per-step CPU-time stamps."""
    from accelerate.state import AcceleratorState, GradientState

    from scale.config.load import load_config
    from scale.modeling.varlen import use_segment_attention
    from scale.train import fit
    from scale.training.job import setup

    out = tmp / f"{job}-{contestant.replace(' ', '').replace('(', '-').replace(')', '')}"
    free = "false" if contestant == "padded" else "true"
    cfg = load_config(str(TINY), [f"output_dir={out}", *job_overrides(job, steps, tmp), f"data.padding_free={free}"])
    job_ = setup(cfg)
    if contestant == "free (mask)":
        use_segment_attention(job_.model, on=False)
    stamps: list[float] = []
    step = job_.scheduler.step

    def stamped_step(*args, **kwargs):
        step(*args, **kwargs)
        stamps.append(time.process_time())

    job_.scheduler.step = stamped_step  # called exactly once per optimizer step by fit()
    fit(job_)
    job_.acc.end_training()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"rows": [r for r in rows if "train/tokens_per_s" in r], "stamps": stamps}


def figures(res: dict) -> dict[str, float]:
    """Real tokens per wall second and per CPU second over the steps after the first; the padding fraction of
    the positions computed; the per-step losses."""
    rows = res["rows"]
    timed = rows[1:]
    secs = [r["train/data_s"] + r["train/compute_s"] for r in timed]
    tokens = [r["train/tokens_per_s"] * s for r, s in zip(timed, secs)]
    positions = [t / (1 - r["train/pad_fraction"]) for r, t in zip(timed, tokens)]
    cpu = [b - a for a, b in zip(res["stamps"], res["stamps"][1:])]
    return {"tps": sum(tokens) / sum(secs), "tpc": sum(tokens) / sum(cpu), "pad": 1 - sum(tokens) / sum(positions),
            "first_s": rows[0]["train/data_s"] + rows[0]["train/compute_s"], "losses": [r["train/loss"] for r in rows]}


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--jobs", default="chat,longtail,longtail-small")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=7, help="optimizer steps per run (the first is not timed)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1: a shared machine's fairest figure)")
    ap.add_argument("--tol", type=float, default=1e-5, help="relative per-step loss difference allowed vs padded")
    args = ap.parse_args(argv)
    import logging

    import torch

    logging.disable(logging.WARNING)
    torch.set_num_threads(args.threads)
    table = []
    with tempfile.TemporaryDirectory() as tmp:
        for job in args.jobs.split(","):
            got: dict[str, list[dict]] = {c: [] for c in CONTESTANTS}
            for _ in range(args.repeats):
                for c in CONTESTANTS:
                    got[c].append(figures(run_one(job, c, args.steps, Path(tmp))))
            ref = got["padded"][0]["losses"]
            for c in CONTESTANTS:
                for f in got[c]:
                    worst = max(abs(a - b) / abs(a) for a, b in zip(ref, f["losses"]))
                    if len(f["losses"]) != len(ref) or worst > args.tol:
                        raise SystemExit(f"{job}/{c}: per-step losses differ from padded's by {worst:.2e} > {args.tol}")
            row = {"job": job, "pad": statistics.median(f["pad"] for f in got["padded"])}
            for c in CONTESTANTS:
                row[c] = statistics.median(f["tps"] for f in got[c])
                row[c + " cpu"] = statistics.median(f["tpc"] for f in got[c])
                row[c + " first_s"] = statistics.median(f["first_s"] for f in got[c])
            for c in CONTESTANTS[1:]:
                row[c + " x"] = statistics.median(f["tps"] / p["tps"] for f, p in zip(got[c], got["padded"]))
                row[c + " x cpu"] = statistics.median(f["tpc"] / p["tpc"] for f, p in zip(got[c], got["padded"]))
            table.append(row)
            print(json.dumps(row), flush=True)
    load = os.getloadavg()
    print(f"\n{args.repeats} repeats x {args.steps} steps, {args.threads} thread(s), load average "
          f"{load[0]:.1f} / {load[1]:.1f} / {load[2]:.1f} (1 / 5 / 15 min) on {os.cpu_count()} CPUs\n")
    print("| job | padding (padded batches) | padded tok/s | padding-free, [L, L] mask | padding-free, per example | "
          "per example / padded (wall; CPU) | mask / padded (wall; CPU) |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r['job']} | {r['pad']:.1%} | {r['padded']:,.0f} | {r['free (mask)']:,.0f} | {r['free']:,.0f} | "
              f"{r['free x']:.2f}x; {r['free x cpu']:.2f}x | "
              f"{r['free (mask) x']:.2f}x; {r['free (mask) x cpu']:.2f}x |")
    return table


if __name__ == "__main__":
    main()

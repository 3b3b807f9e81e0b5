"""Full fine-tuning speed: the harness's optimizer step vs a bare accelerate / DeepSpeed loop, 2 CPU processes.

    python benchmarks/full_speed.py                             # DDP and ZeRO-2, fp32, 5 pairs each (~8 min here)
    python benchmarks/full_speed.py --modes zero2 --repeats 3 --precision bf16

Each mode is one ``accelerate launch`` (``configs/accelerate/cpu_<mode>.yaml``, 2 processes, gloo) of this file
with ``--worker``; inside it the two contestants alternate (harness, bare, harness, bare, ...), each run starting
from the same seed's weights (``model.finetune=full``: every weight trained, AdamW, the same warmup+cosine
schedule, clipping at ``optim.max_grad_norm``, the same precision):

- harness: the real ``scale-train`` path, ``scale.training.job.setup`` then ``scale.train.fit`` on a random-weight
  ``tiny-llama`` of the ``--hidden``/``--layers`` shape (SmolLM2's 49,152-token vocabulary) over the reviews of
  ``configs/data/tiny_reviews.jsonl``, ``--join`` of them per row (longer rows: more compute per step). Its
  evaluation at step 0 and at the end and its start-up are outside the timed steps.
- bare: ``Accelerator()`` (DDP: ``cpu=True``; ZeRO-2: a ``DeepSpeedPlugin`` of the same
  ``configs/deepspeed/zero2.json``, its ``"auto"`` keys given the run's values, gloo), ``acc.prepare(model, optimizer)``, then per micro-batch
  ``accumulate()``, the model's forward with the same kept tail positions (``logits_to_keep``), the weighted
  cross-entropy sum over the window's global token weight, ``acc.backward``, on the window's last micro-batch
  ``acc.clip_grad_norm_`` (DDP; DeepSpeed clips inside its step), ``optimizer.step()``, ``zero_grad()``, and one
  scheduler step per window. Same model (``scale.modeling.build.build_model``, same seed), same AdamW.

The bare loop trains on the micro-batches (and token weights) the first harness run trained on, recorded per rank
(already collated and on the device: the bare side pays no data loading) with each window's global weight sum (the
harness all-reduces it in the step; the bare side knows it beforehand). So the bare side is, if anything, favoured.

Timed: stamps after each optimizer step's scheduler step (the harness's ``job.scheduler``, wrapped on the instance;
no hook in ``scale/``), steps ``--warmup``+1 .. ``--steps``. Reported per mode: real (unpadded) tokens per second
over both ranks of each contestant, median (min-max) over repeats, the ratio harness/bare per adjacent pair, and the
largest relative difference between the two per-step loss trajectories (rank-summed numerator / denominator, both
sides). With ``--profile`` both sides' steps are split into phases on rank 0 (forward with the loss, backward,
clip, the optimizer step; the harness's by wrapping those calls on its instances): what is left of the harness's step
time is its own (windows, the gather, the denominator's all-reduce, the non-finite check, metrics).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # `python benchmarks/full_speed.py`: make `benchmarks.common` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

ROOT = Path(__file__).resolve().parents[1]
PRECISIONS = {"fp32": "no", "bf16": "bf16"}


def make_rows(path: Path, join: int) -> None:
    """``configs/data/tiny_reviews.jsonl`` with ``join`` consecutive texts per row (the last one's label)."""
    rows = [json.loads(line) for line in (ROOT / "configs/data/tiny_reviews.jsonl").read_text().splitlines() if line]
    with open(path, "w", encoding="utf-8") as fh:
        for i, r in enumerate(rows):
            texts = [rows[(i + k) % len(rows)]["text"] for k in range(join)]
            fh.write(json.dumps({"text": " ".join(texts[1:] + texts[:1]), "label": r["label"]}) + "\n")


def overrides(a: argparse.Namespace, data: Path, out: Path) -> list[str]:
    """The harness config's overrides of ``configs/train/tiny_cpu.yaml``."""
    return [f"output_dir={out}", f"data.path={data}", "data.eval_size=16", f"data.max_length={a.max_length}",
            "model.finetune=full", "optim.name=adamw", "model.gradient_checkpointing=false",
            f"model.tiny_hidden_size={a.hidden}", f"model.tiny_num_layers={a.layers}",
            f"model.tiny_intermediate_size={3 * a.hidden}", "model.tiny_num_heads=4",
            f"train.max_steps={a.steps}", f"train.micro_batch_size={a.batch}",
            f"train.gradient_accumulation_steps={a.ga}", "train.eval_every=0", f"train.log_every={a.log_every}",
            "train.save_adapter=false", "train.save_every=0", "train.save_every_minutes=null",
            "train.eval_micro_batch_size=16", "lora.r=8",
            f"train.mixed_precision={PRECISIONS[a.precision]}", "log.trackers=[]"]


# ---------------------------------------------------------------------------------------------------------------
# the worker: one process of the launch


def reset_accelerate() -> None:
    """A fresh AcceleratorState for the next contestant; the process group stays (as tests/plan_census.py does)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state()
    GradientState._reset_state()


def harness_run(cfg: Any, record: list | None, profile: dict[str, float] | None) -> dict[str, Any]:
    """One ``setup`` + ``fit``; stamps after each scheduler step; ``record`` gets every window's micro-batches."""
    import torch

    import scale.train as T
    from scale.training.job import setup

    reset_accelerate()
    job = setup(cfg)
    stamps: list[float] = []
    step = job.scheduler.step

    def stamped(*args: Any, **kwargs: Any) -> None:
        step(*args, **kwargs)
        stamps.append(time.perf_counter())

    job.scheduler.step = stamped
    original = T.train_window
    if record is not None:
        def recording(job_, window, meter, commit):
            record.append(([(mb.batch, mb.weights, mb.real) for mb in window.micro], float(window.den)))
            return original(job_, window, meter, commit)
        T.train_window = recording
    if profile is not None:
        restore = install_profile(job, profile)
    try:
        T.fit(job)
    finally:
        T.train_window = original
        if profile is not None:
            restore()
    losses = []
    if job.acc.is_main_process:
        rows = [json.loads(line) for line in (Path(cfg.output_dir) / "metrics.jsonl").read_text().splitlines()]
        losses = [r["train/loss"] for r in rows if "train/loss" in r]
    job.acc.wait_for_everyone()
    job.acc.free_memory()
    del job
    gc.collect()
    torch.distributed.barrier()
    return {"stamps": stamps, "losses": losses}


def install_profile(job: Any, seconds: dict[str, float]) -> Any:
    """Wall-clock phases of the harness's step on this rank (forward = the objective's loss_step, backward =
    ``acc.backward``, clip = ``acc.clip_grad_norm_``, step = the commit's optimizer step, rest = everything else
    between two optimizer steps). Monkeypatched on the instances, undone by the returned function."""
    acc, objective = job.acc, job.objective
    saved = {"backward": acc.backward, "clip_grad_norm_": acc.clip_grad_norm_, "loss_step": objective.loss_step,
             "step": job.optimizer.step}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - t0
        return wrapper

    acc.backward = timed("backward", saved["backward"])
    acc.clip_grad_norm_ = timed("clip", saved["clip_grad_norm_"])
    objective.loss_step = timed("forward", saved["loss_step"])
    job.optimizer.step = timed("optimizer step", saved["step"])

    def restore() -> None:
        acc.backward, acc.clip_grad_norm_ = saved["backward"], saved["clip_grad_norm_"]
        objective.loss_step, job.optimizer.step = saved["loss_step"], saved["step"]
    return restore


def bare_run(cfg: Any, windows: list, mode: str, lr_of: Any, profile: dict[str, float] | None = None
             ) -> dict[str, Any]:
    """The bare accelerate (DDP) / accelerate + DeepSpeed (ZeRO-2) loop over the recorded ``windows``."""
    import torch
    import torch.nn.functional as F
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, InitProcessGroupKwargs

    from scale.modeling.build import build_model

    reset_accelerate()
    t, o = cfg.train, cfg.optim
    if mode == "ddp":
        acc = Accelerator(cpu=True, mixed_precision=t.mixed_precision,
                          gradient_accumulation_steps=t.gradient_accumulation_steps)
    else:
        ds = json.loads((ROOT / f"configs/deepspeed/{mode}.json").read_text())
        ds.update(gradient_accumulation_steps=t.gradient_accumulation_steps, gradient_clipping=o.max_grad_norm,
                  train_micro_batch_size_per_gpu=t.micro_batch_size)
        ds.pop("train_batch_size", None)
        if t.mixed_precision == "bf16":  # as the harness: fp32 accumulation of full weights' gradients
            ds["data_types"] = {"grad_accum_dtype": "fp32"}
        acc = Accelerator(mixed_precision=t.mixed_precision, gradient_accumulation_steps=t.gradient_accumulation_steps,
                          deepspeed_plugin=DeepSpeedPlugin(hf_ds_config=ds),
                          kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")])
    model = build_model(cfg.model, cfg.lora, 49152, t.seed)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_of)
    model, optimizer = acc.prepare(model, optimizer)
    model.train()
    ga, world = t.gradient_accumulation_steps, acc.num_processes
    stamps: list[float] = []
    sums = []
    for micro, den in windows:
        acc.step = ga - len(micro)  # the window's last micro-batch syncs (as the harness's windows end)
        step_sum = torch.zeros((), device=acc.device)
        for batch, weights, real in micro:
            with acc.accumulate(model):
                ids, mask = batch["input_ids"], batch["attention_mask"]
                B, T_ = ids.shape
                N = weights.shape[1]
                position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
                kept = torch.arange(T_ - N - 1, T_ - 1, device=ids.device)
                t0 = time.perf_counter()
                logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=kept,
                               use_cache=False).logits
                ce = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), ids[:, T_ - N:].reshape(-1),
                                     reduction="none").view(B, N)
                num = (ce * weights).sum()
                t1 = time.perf_counter()
                acc.backward(num * ((ga * world) / den if real else 0.0))
                t2 = time.perf_counter()
                if acc.sync_gradients and mode == "ddp":
                    acc.clip_grad_norm_(model.parameters(), o.max_grad_norm)
                t3 = time.perf_counter()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                if profile is not None:
                    for k, v in (("forward", t1 - t0), ("backward", t2 - t1), ("clip", t3 - t2),
                                 ("optimizer step", time.perf_counter() - t3)):
                        profile[k] = profile.get(k, 0.0) + v
                step_sum += num.detach()
        scheduler.step()
        stamps.append(time.perf_counter())
        sums.append(step_sum)
    nums = torch.stack(sums)
    torch.distributed.all_reduce(nums)
    losses = [float(n) / den for n, (_, den) in zip(nums.tolist(), windows)]
    acc.free_memory()
    del model, optimizer
    gc.collect()
    torch.distributed.barrier()
    return {"stamps": stamps, "losses": losses}


def worker(a: argparse.Namespace) -> None:
    """Alternate the contestants ``a.repeats`` times in this process; rank 0 writes ``a.out``."""
    from scale.cli import start_fast
    from scale.config.load import load_config
    from scale.training.schedule import lr_factor

    base = Path(a.workdir)
    cfgs = [load_config(ROOT / "configs/train/tiny_cpu.yaml", overrides(a, base / "rows.jsonl", base / f"run{i}"))
            for i in range(a.repeats)]
    start_fast(cfgs[0])
    import torch

    windows: list = []
    runs: dict[str, list] = {"harness": [], "bare": []}
    profile: dict[str, float] = {}
    bare_profile: dict[str, float] = {}
    for i, cfg in enumerate(cfgs):
        runs["harness"].append(harness_run(cfg, windows if i == 0 else None, profile if a.profile else None))
        runs["bare"].append(bare_run(cfg, windows, a.mode, lambda s, o=cfg.optim: lr_factor(s, o, a.steps),
                                     bare_profile if a.profile else None))
    tokens = torch.tensor([float(sum(int(b["attention_mask"].sum()) for b, _, real in micro if real))
                           for micro, _ in windows])
    torch.distributed.all_reduce(tokens)
    if int(os.environ.get("RANK", "0")) == 0:
        Path(a.out).write_text(json.dumps({"runs": runs, "tokens": tokens.tolist(), "profile": profile,
                                           "bare_profile": bare_profile,
                                           "threads": torch.get_num_threads(),
                                           "rows_per_step": a.batch * a.ga * int(os.environ["WORLD_SIZE"]),
                                           "positions": sum(int(b["input_ids"].numel()) for micro, _ in windows
                                                            for b, _, _ in micro)}))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)  # pytorch/pytorch#190489: gloo can abort at interpreter exit


# ---------------------------------------------------------------------------------------------------------------
# the driver


def launch(a: argparse.Namespace, mode: str, workdir: Path) -> dict[str, Any]:
    """One ``accelerate launch`` of the worker for ``mode``; its rank 0's results."""
    from tests.launching import free_port

    workdir = workdir / mode  # the runs' output directories and rows of this launch
    workdir.mkdir()
    make_rows(workdir / "rows.jsonl", a.join)
    out = workdir / "result.json"
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in vars(a).items() if k not in ("modes", "json", "profile")]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           str(ROOT / f"configs/accelerate/cpu_{mode}.yaml"), "--num_processes", "2", "--main_process_port",
           str(free_port()), str(Path(__file__).resolve()), "--worker", f"--mode={mode}", f"--out={out}",
           f"--workdir={workdir}", *argv, *(["--profile"] if a.profile else [])]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=False)
    if proc.returncode or not out.is_file():
        raise RuntimeError(f"{mode}: exit {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text())


def summarize(mode: str, res: dict[str, Any], warmup: int) -> dict[str, Any]:
    """tokens/s per run, pair ratios, the loss trajectories' largest relative difference."""
    from benchmarks.common import max_rel_diff, timed_span

    tokens = [int(x) for x in res["tokens"]]
    tps = {k: [] for k in res["runs"]}
    ms = {k: [] for k in res["runs"]}
    for k, runs in res["runs"].items():
        for r in runs:
            seconds, n = timed_span(r["stamps"], tokens, warmup)
            tps[k].append(n / seconds)
            ms[k].append(1e3 * seconds / (len(r["stamps"]) - warmup))
    h0 = res["runs"]["harness"][0]["losses"]
    loss = max(max_rel_diff(h0, b["losses"]) for b in res["runs"]["bare"])
    loss = max(loss, max(max_rel_diff(h0, h["losses"]) for h in res["runs"]["harness"]))
    return {"mode": mode, "tokens_per_s": tps, "step_ms": ms, "loss": loss, "profile": res["profile"],
            "ratio": [h / b for h, b in zip(tps["harness"], tps["bare"])], "losses": h0,
            "tokens_per_step": sum(tokens) / len(tokens)}


def table(rows: list[dict[str, Any]]) -> str:
    from benchmarks.common import fmt_spread

    out = [("| mode | harness tokens/s | bare tokens/s | harness ms/step | bare ms/step | **harness/bare** (pairs) | "
            "loss max rel diff |"), "|---|---|---|---|---|---|---|"]
    for r in rows:
        t, m = r["tokens_per_s"], r["step_ms"]
        out.append(f"| {r['mode']} | {fmt_spread(t['harness'])} | {fmt_spread(t['bare'])} | {fmt_spread(m['harness'])} "
                   f"| {fmt_spread(m['bare'])} | **{fmt_spread(r['ratio'])}** | {r['loss']:.1e} |")
    return "\n".join(out)


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="ddp,zero2")
    p.add_argument("--precision", default="fp32", choices=sorted(PRECISIONS))
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--join", type=int, default=4, help="reviews per row (longer rows)")
    p.add_argument("--max-length", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="micro-batch per rank")
    p.add_argument("--ga", type=int, default=2)
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per run")
    p.add_argument("--warmup", type=int, default=2, help="leading steps not timed")
    p.add_argument("--repeats", type=int, default=5, help="runs per contestant, alternating")
    p.add_argument("--log-every", type=int, default=1, help="the harness's train.log_every (1: a host read per step)")
    p.add_argument("--profile", action="store_true", help="split the harness's step into phases (rank 0)")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    p.add_argument("--workdir", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if a.worker:
        worker(a)
        return 0
    for k in ("worker", "mode", "out", "workdir"):
        delattr(a, k)
    from benchmarks.common import machine_line

    print(f"load average before: {os.getloadavg()}", flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode in a.modes.split(","):
            t0 = time.perf_counter()
            rows.append(summarize(mode, launch(a, mode, Path(tmp)), a.warmup))
            print(f"{mode}: {time.perf_counter() - t0:.0f} s, load average {os.getloadavg()}", flush=True)
            if a.profile and rows[-1]["profile"]:
                total = sum(rows[-1]["profile"].values())
                print("  harness phases, rank 0, all runs (s): " + ", ".join(
                    f"{k} {v:.2f}" for k, v in rows[-1]["profile"].items()) + f" (sum {total:.2f})")
    print(f"\nfull fine-tune (model.finetune=full), tiny-llama hidden {a.hidden} x {a.layers} layers, vocab 49,152; "
          f"{a.precision}; 2 processes (gloo); micro-batch {a.batch} x GA {a.ga} per rank, rows of {a.join} reviews "
          f"(<= {a.max_length} tokens, ~{rows[0]['tokens_per_step']:.0f} real tokens per step over both ranks); "
          f"{a.steps} steps per run ({a.warmup} not timed); {a.repeats} runs each, alternating; "
          f"log_every={a.log_every}")
    print(table(rows))
    print(f"load average after: {os.getloadavg()}; " + machine_line())
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Full fine-tuning (``model.finetune=full``): what each rank really holds against ``scale-plan``, on CPU processes.

    python benchmarks/full_memory.py                  # DDP, ZeRO-1/2/3, FSDP2, ZeRO-3 offload x N = 1, 2 x fp32, bf16
    python benchmarks/full_memory.py --modes fsdp2,zero3_offload --worlds 2 --precisions bf16

Each row is one ``accelerate launch`` (``configs/accelerate/cpu_<mode>.yaml``, ``--num_processes N``) of
``tests/plan_census.py`` on the tiny Llama of ``configs/train/tiny_cpu.yaml`` with every weight trained (AdamW, the
harness's own ``build_model``, ``build_accelerator`` and DeepSpeed config, so ``data_types.grad_accum_dtype=fp32``
under bf16 as the run sets it). It counts every storage the rank holds right before its second optimizer step
(weights, DeepSpeed's fp32 master partition, gradients and buckets, AdamW's moments; anything else alive is
``other``) and compares the sum with :func:`scale.planner.layouts.predict_mode`'s model states for the same mode,
precision, world size and rank, plus the one tensor the plan counts from this measurement under ZeRO-1/2
(:func:`scale.planner.layouts.zero12_extra_bytes`: the largest parameter's size, held at the step). One launch per row, one engine per process, as a run has.

FSDP2 runs through the test-only CPU shim (``tests/cpu_fsdp2.yaml``, ``tests/fsdp_cpu.py``; measured on 2 processes),
ZeRO-3 offload through ``configs/accelerate/zero3_offload.yaml`` (``configs/deepspeed/zero3_offload.json``: parameters
and optimizer offloaded to the CPU; DeepSpeed swaps AdamW for ``DeepSpeedCPUAdam``, whose op compiles on first use).
On a CPU machine the device *is* host memory, so an offload row splits each rank's bytes by the structure holding
them (``tests/plan_census.py`` ``offloaded``): the host part is what DeepSpeed's offload keeps there on a GPU machine
(the flat CPU buffers of the parameter partitions, the fp32 master partitions and their gradient buffers, the
gradient partitions, the optimizer's state), compared with the plan's ``host``; the device part is the rest (whole
persistent parameters, the reduce bucket), compared with the plan's model states.

Printed: a table per row (MiB) with the planned and measured totals, their relative difference (target: within
5%), and the sharded parts' ratio N=1 / N=2 (the ZeRO paper's 1/N). Activations are not part of these counts (they
are checked against saved-tensor hooks in ``tests/test_plan.py``). Exit 1 when a row is off by more than 5%.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __package__ in (None, ""):  # `python benchmarks/full_memory.py`: make `tests` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scale.config.load import load_config
from scale.planner import census as C
from scale.planner import layouts as LY
from tests.conftest import ROOT, TINY_YAML
from tests.launching import free_port
from tests.test_plan import NO_ACTS, STATES

BASE = ["log.trackers=[]", "train.gradient_accumulation_steps=1", "model.finetune=full", "optim.name=adamw"]
PRECISIONS = {"fp32": "no", "bf16": "bf16"}
# FSDP2 on CPU: accelerate's FSDP2 through the test-only shim (tests/fsdp_cpu.py, enabled by plan_census.py under this
# YAML); ZeRO-3 offload: the shipped YAML (its num_processes is overridden) and configs/deepspeed/zero3_offload.json
YAMLS = {"fsdp2": "tests/cpu_fsdp2.yaml", "zero3_offload": "configs/accelerate/zero3_offload.yaml"}
SHARDED = ("master", "optimizer")  # divided by N in ZeRO-1/2/3 (gradients too from ZeRO-2)


def measure(mode: str, world: int, precision: str, out: Path) -> list[dict]:
    """Each rank's counts for one launch."""
    overrides = [*BASE, f"train.mixed_precision={PRECISIONS[precision]}"]
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / YAMLS.get(mode,
           f"configs/accelerate/cpu_{mode}.yaml")), "--num_processes", str(world),
           "--main_process_port", str(free_port()), str(ROOT / "tests" / "plan_census.py"), str(out),
           "--config", str(TINY_YAML), *overrides]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=1200, check=False)
    if proc.returncode:
        raise RuntimeError(f"{mode} x{world} {precision}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return [json.loads(p.read_text()) for p in sorted(out.parent.glob(f"{out.name}.*"))]


def planned(mode: str, world: int, precision: str, rank: int) -> dict[str, int]:
    cfg = load_config(TINY_YAML, [*BASE, f"train.mixed_precision={PRECISIONS[precision]}"])
    hf = C.load_model_config(cfg.model)
    params = C.census(cfg, C.build_meta_model(cfg, hf))
    r = LY.predict_mode(cfg, params, NO_ACTS, mode, world, hf, rank=rank)
    out = {k: getattr(r, k) for k in STATES}
    out["host"] = r.host  # ZeRO-3 offload: what the plan puts in host memory (not in the states above)
    # the one measured tensor the plan adds to ZeRO-1/2's transient (scale.planner.layouts.zero12_extra_bytes)
    bf16_zero1 = mode == "zero1" and precision == "bf16"
    out["extra"] = (LY.zero12_extra_bytes([p for p in params if p.trainable], r_dtype(precision, mode))
                    if mode in ("zero1", "zero2") and not bf16_zero1 else 0)
    return out


def r_dtype(precision: str, mode: str):
    import torch

    return torch.bfloat16 if precision == "bf16" and mode.startswith("zero") else torch.float32


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="ddp,zero1,zero2,zero3,fsdp2,zero3_offload")
    p.add_argument("--worlds", default="1,2")
    p.add_argument("--precisions", default="fp32,bf16")
    p.add_argument("--json", default=None, help="also write the rows here")
    args = p.parse_args(argv)
    mib = 2**20
    rows, ok = [], True
    head = ("| mode | N | dtype | rank | planned MiB (weights/master/grads/optim/extra) | measured MiB (.../other) | "
            "planned | measured | diff | host planned | host measured | host diff |")
    print(head + "\n|" + "---|" * 12, flush=True)
    for mode in args.modes.split(","):
        for world in map(int, args.worlds.split(",")):
            for precision in args.precisions.split(","):
                t0 = time.perf_counter()
                with tempfile.TemporaryDirectory() as tmp:
                    counts = measure(mode, world, precision, Path(tmp) / "census.json")
                for c in counts:
                    plan = planned(mode, world, precision, c["rank"])
                    host_p = plan.pop("host")
                    # the device's bytes: what each kind holds less what DeepSpeed's offload keeps in host memory
                    host_m = c.get("host", {})
                    held = {k: c["totals"].get(k, 0) - host_m.get(k, 0) for k in STATES}
                    other = c["totals"].get("other", 0) - host_m.get("other", 0)
                    held["extra"] = other
                    total_p, total_m = sum(plan.values()), sum(held.values())
                    diff = total_m / total_p - 1
                    ok &= abs(diff) <= 0.05
                    host_cells = "- | - | -"
                    host_diff = None
                    if host_p or host_m:
                        host_diff = sum(host_m.values()) / max(host_p, 1) - 1
                        ok &= abs(host_diff) <= 0.05
                        host_cells = (f"{host_p / mib:.2f} | {sum(host_m.values()) / mib:.2f} "
                                      f"({', '.join(f'{k} {v / mib:.2f}' for k, v in sorted(host_m.items()))}) | "
                                      f"{host_diff:+.1%}")
                    cell = lambda d: "/".join(f"{(d['trainable'] + d['weights']) / mib:.2f}" if k == "w" else
                                              f"{d[k] / mib:.2f}"
                                              for k in ("w", "master", "gradients", "optimizer", "extra"))
                    print(f"| {LY.MODE_LABELS[mode]} | {world} | {precision} | {c['rank']} | {cell(plan)} | "
                          f"{cell(held)} | {total_p / mib:.2f} | {total_m / mib:.2f} | {diff:+.1%} | {host_cells} |",
                          flush=True)
                    rows.append({"mode": mode, "world": world, "precision": precision, "rank": c["rank"], "planned": plan,
                                 "measured": held, "other": other, "others": c["others"][:5], "diff": diff,
                                 "host_planned": host_p, "host_measured": host_m, "host_diff": host_diff,
                                 "seconds": time.perf_counter() - t0})
    by = {(r["mode"], r["world"], r["precision"], r["rank"]): r for r in rows}
    lines = []
    for (mode, world, precision, rank), r in by.items():
        one = by.get((mode, 1, precision, 0))
        if world == 2 and one is not None and mode != "ddp":
            if mode == "zero3_offload":  # its sharded parts are in host memory
                continue
            keys = (("trainable", "gradients", "optimizer") if mode == "fsdp2" else
                    SHARDED + (("gradients",) if mode in ("zero2", "zero3") else ()))
            ratio = ", ".join(f"{k} {one['measured'][k] / max(r['measured'][k], 1):.3f}" for k in keys)
            lines.append(f"{LY.MODE_LABELS[mode]} {precision} rank {rank}: measured N=1 / N=2: {ratio}")
    print("\nsharded parts, N = 1 over N = 2 (the paper's 1/N gives 2; ZeRO-3's gradients include its reduce bucket):")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    print(f"\nevery row within 5%: {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

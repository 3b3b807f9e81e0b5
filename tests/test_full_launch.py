"""A full fine-tune under ZeRO-2 on 2 CPU processes (gloo) through the real ``accelerate launch``: DeepSpeed's fp32
partitions checked at start-up, the numbers of one device within the derived bounds, every weight moved and equal on
both ranks, the final ``model/`` whole, and its checkpoint resumed on one device (the shards: ZeRO-2 x 2 ->
one process) to one device's final weights (one launch, ~30 s on 2 cores); FSDP2's checkpoint after an evaluation (one
launch, ~10 s). The other modes are benchmarks/parity.py's ``full`` rows."""

from __future__ import annotations

import importlib.util
import os
import subprocess

import pytest
import torch

from tests.bounds import FULL_STEP_REL, full_drift, full_loss_bounds, full_norm_rel, l2_dev
from tests.launching import JOB, ROOT, TINY, modes, read_run, run_in_process

FULL = ["model.finetune=full", "train.check_invariants=true", "eval.generate_samples=0"]

pytestmark = [pytest.mark.launch,
              pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs deepspeed")]


def test_zero2_full_weights_match_one_device_and_resume_on_one(tmp_path):
    cmds, overrides = modes()["zero2 2x(2,2)"]
    out = tmp_path / "zero2"
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, *overrides, *FULL, "train.save_every=3"]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmds[0] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    log = proc.stdout + proc.stderr
    # checked on DeepSpeed's real objects after prepare: rank 0 steps its one flat fp32 partition (half the weights)
    line = next(ln for ln in log.splitlines() if "precision: full weights under zero2" in ln)
    assert ("forward weights float32, the optimizer steps 1 float32 tensor(s) of 1613984 elements on this rank (the "
            "masters), gradients accumulate in float32, sgd state float32") in line
    got = read_run(out)
    assert got["checks"] == [{"step": 6, "check/weights_moved": True, "check/param_elements_local_fraction": 1.0,
                              "check/ranks_agree": True, "check/ranks_compared": 2}]

    single = run_in_process(["train.micro_batch_size=8", "train.gradient_accumulation_steps=1", *FULL],
                            tmp_path / "single")
    assert len(got["weights"]) == len(single["weights"]) == 20  # every weight, whole (the tied head once)
    assert all(t.dtype == torch.float32 for t in got["weights"].values())
    # step 1 runs the same weights: only the regrouped sums differ (tests/bounds.py); later steps to first order
    n = sum(t.numel() for t in single["weights"].values())
    rel = [abs(a - b) / a for a, b in zip(single["loss"], got["loss"])]
    assert rel[0] < FULL_STEP_REL
    assert all(r < b for r, b in zip(rel, full_loss_bounds(single["loss"], single["lr"], single["grad_norm"], 1.0, n)))
    assert abs(got["grad_norm"][0] / single["grad_norm"][0] - 1) < full_norm_rel(n)
    drift = full_drift(single["lr"], single["grad_norm"], 1.0, n)
    assert drift[-1] < 1e-2  # a wrong scale, a lost rank's rows or an unreduced gradient moves ||W||_2 (~40) far more
    assert l2_dev(single["weights"], got["weights"]) < drift[-1]

    # ZeRO-2's step-3 checkpoint, resumed in this process on one device (micro-batch 2 x GA 4: the global batch kept)
    resumed = run_in_process(["train.micro_batch_size=2", "train.gradient_accumulation_steps=4", *FULL,
                              f"train.resume_from={out}/checkpoints/step_000003"], tmp_path / "resumed")
    assert resumed["steps"] == [4, 5, 6]
    bounds = full_loss_bounds(single["loss"], single["lr"], single["grad_norm"], 1.0, n)[3:]
    assert all(abs(a - b) / a < bd for a, b, bd in zip(single["loss"][3:], resumed["loss"], bounds))
    assert l2_dev(single["weights"], resumed["weights"]) < drift[-1]


def test_fsdp2_full_checkpoint_after_an_evaluation_holds_the_final_weights(tmp_path):
    """An evaluation's forward (no backward after it) leaves FSDP2's root unit unsharded: its parameters are whole
    plain tensors until the next forward. The sharded save must still write each rank's dim-0 rows; read back, the
    last checkpoint's shards are the final ``model/`` directory's weights bit for bit."""
    from scale.training.checkpoint.sharded_read import ShardReader

    cmds, overrides = modes()["fsdp2 2x(2,2)"]
    out = tmp_path / "fsdp2"
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, *overrides, *FULL, "train.save_every=3",
            "train.eval_every=3"]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmds[0] + args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    ckpt = out / "checkpoints" / "step_000006"
    assert sorted(p.name for p in (ckpt / "weights").iterdir()) == [
        "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    reader = ShardReader(ckpt)
    last = {name: reader.tensor(name) for name in reader.shapes}
    reader.close()
    saved = read_run(out)["weights"]
    assert saved.keys() == last.keys() and len(saved) == 20
    assert all(saved[k].dtype == torch.float32 and torch.equal(saved[k], last[k]) for k in saved)


def test_zero3_dpo_full_weights_with_the_frozen_copy_matches_one_device(tmp_path):
    """DPO on full weights under ZeRO-3 on 2 processes with loss.reference=model (the default): the frozen copy is
    partitioned as the policy (rank 0 holds half of every tensor, and the small ones DeepSpeed keeps gathered
    whole), and the run gives one device's numbers: at step 1 the policy is its
    reference in both (rewards exactly 0, loss ln 2 within FULL_STEP_REL), at step 2 within the first-order bound."""
    from scale.training.metrics import read_jsonl
    from tests.launching import PAIRS, run_mode

    dpo = [*PAIRS, *FULL, "train.max_steps=2", "data.max_train_examples=16"]
    cmds, overrides = modes()["zero3 2x(2,2)"]
    got = run_mode(cmds, overrides + dpo, tmp_path / "zero3")
    line = next(ln for ln in got["output"].splitlines() if "reference (loss.reference=model)" in ln)
    local, whole = (int(w) for w in line.split("forward, ")[1].split(" elements")[0].split(" of its "))
    # the 3,145,728-element embedding is split in halves; DeepSpeed keeps the 82,240 elements of the tensors at or
    # below stage3_param_persistence_threshold (every other one: norms, attention, MLP) whole on every rank besides
    # their halves (tests/test_plan_full.py counts the same)
    assert whole == 3227968 and local == 3145728 // 2 + 82240 // 2 + 82240, line
    single = run_in_process(["train.micro_batch_size=8", "train.gradient_accumulation_steps=1", *dpo],
                            tmp_path / "single")
    for out in ("zero3", "single"):
        first = next(r for r in read_jsonl(tmp_path / out / "metrics.jsonl") if "train/loss" in r)
        assert first["train/rewards/chosen"] == first["train/rewards/rejected"] == 0.0
    n = 3227968
    bounds = full_loss_bounds(single["loss"], single["lr"], single["grad_norm"], 1.0, n)
    assert all(abs(a - b) / a < bd for a, b, bd in zip(single["loss"], got["loss"], bounds)), (single, got)
    assert abs(got["grad_norm"][0] / single["grad_norm"][0] - 1) < full_norm_rel(n)

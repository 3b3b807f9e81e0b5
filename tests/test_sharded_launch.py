"""Full weights' sharded checkpoint through a real launch: ZeRO-2 on 2 CPU processes (gloo) saves at step 4, one shard
per rank holding DeepSpeed's fragments; the checkpoint resumes under ZeRO-2 on 2 processes bit for bit. (The same
mode's checkpoint resumed on one device, across the cut: tests/test_full_launch.py.)"""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors import safe_open

from scale.training.checkpoint.sharded import WEIGHT, layout_ranges
from scale.training.checkpoint.sharded_read import ShardReader
from tests.launching import JOB, ROOT, TINY, modes

# The tiny job (tests/launching.py) with every weight trained by AdamW (moments and step count in the shards),
# 8 steps of G = 8, checkpoints at 4 and 8.
FULL = ["model.finetune=full", "train.max_steps=8", "train.save_every=4", "optim.name=adamw", "optim.lr=1e-3",
        "train.save_adapter=false"]


def _launch(cmds, overrides, out):
    """Start ``cmds`` together on the tiny job + ``overrides`` into ``out`` (as
    :func:`tests.launching.run_mode` does, without reading an adapter a full run does not write)."""
    args = ["--config", str(TINY), f"output_dir={out}", *JOB, *overrides]
    env = {**os.environ, "WANDB_MODE": "offline", "TOKENIZERS_PARALLELISM": "false"}
    procs = [subprocess.Popen(c + args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for c in cmds]
    outputs = [p.communicate(timeout=600)[0] for p in procs]
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-3000:]


def _losses(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["train/loss"] for r in rows if "train/loss" in r}


def _state(ckpt):
    reader = ShardReader(ckpt)
    try:
        return {(n, w): reader.tensor(n, w) for n in reader.shapes for w in (WEIGHT, *reader.whats)}, reader
    finally:
        reader.close()


@pytest.mark.launch
def test_zero2_full_checkpoint_is_one_shard_per_rank_and_resumes_bit_exact(tmp_path):
    table = modes()
    cmds, job = table["zero2 2x(2,2)"]
    _launch(cmds, [*job, *FULL], tmp_path / "ref")
    step4 = tmp_path / "ref" / "checkpoints" / "step_000004"
    # one shard per rank, each holding its ZeRO-2 fragments of the flat fp32 partition (a tensor crossing the
    # partition boundary has a piece in each), nothing of DeepSpeed's own files
    assert sorted(p.name for p in step4.iterdir()) == ["custom_checkpoint_0.pkl", "random_states_0.pkl",
                                                       "random_states_1.pkl", "trainer_state.json", "weights"]
    assert sorted(p.name for p in (step4 / "weights").iterdir()) == [
        "shard-00000-of-00002.safetensors", "shard-00001-of-00002.safetensors"]
    _, reader = _state(step4)
    assert (reader.mode, reader.world_size, reader.step, reader.whats) == ("zero2", 2, 4.0, ["exp_avg", "exp_avg_sq"])
    held = []
    for rank in range(2):  # DeepSpeed's fragments are the ranges computed from the shapes alone
        with safe_open(str(step4 / "weights" / f"shard-0000{rank}-of-00002.safetensors"), "pt") as fh:
            got = {k.split("::")[0]: (int(k.split("::")[2]), int(k.split("::")[2]) + fh.get_slice(k).get_shape()[0])
                   for k in fh.keys() if k.split("::")[1] == WEIGHT}  # noqa: SIM118
        assert got == layout_ranges("zero2", reader.shapes, rank, 2)
        held.append(set(got))
    assert len(held[0] & held[1]) == 1  # the one tensor the partition boundary cuts
    ref = _losses(tmp_path / "ref")
    # the same mode on as many processes: bit for bit
    _launch(cmds, [*job, *FULL, f"train.resume_from={step4}"], tmp_path / "same")
    assert _losses(tmp_path / "same") == {s: v for s, v in ref.items() if s > 4}
    a, b = (_state(out / "checkpoints" / "step_000008")[0] for out in (tmp_path / "ref", tmp_path / "same"))
    assert all(torch.equal(a[k], b[k]) for k in a)

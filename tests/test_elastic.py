"""Elastic restarts (issue 21, item 2): ``torchrun --max-restarts`` with the c10d rendezvous (launch/elastic.sh)
and ``train.resume_from=auto``. One worker SIGKILLed mid-run: torch elastic restarts the group, the new workers
resume from the newest complete checkpoint, and the run ends with the adapter of an uninterrupted run, bit for
bit. The 10-kill soak is ``benchmarks/elastic.py``."""

from __future__ import annotations

import pytest
import torch

from tests.launching import run_elastic

JOB = ["train.micro_batch_size=2", "train.gradient_accumulation_steps=2", "train.max_steps=6",
       "train.rendezvous_timeout_s=30"]  # a restarted group's gloo connect that hangs is retried after 30 s


@pytest.mark.launch
def test_worker_killed_mid_run_restarts_and_ends_bit_identical(tmp_path):
    ref = run_elastic(tmp_path / "ref", JOB, kill_at=[], max_restarts=0)
    assert ref["returncode"] == 0, ref["log"][-3000:]
    got = run_elastic(tmp_path / "killed", JOB, kill_at=[3], max_restarts=2)
    assert got["returncode"] == 0, got["log"][-3000:]
    assert len(got["recovery_s"]) == 1  # the kill happened while the run was training
    assert "resume" in got["log"].lower()
    assert sorted(got["losses"]) == list(range(1, 7)) and got["losses"] == ref["losses"]
    assert ref["weights"].keys() == got["weights"].keys()
    assert all(torch.equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])


@pytest.mark.launch
def test_node_lost_under_a_node_range_continues_on_the_other(tmp_path):
    """launch/elastic.sh with NNODES=1:2, 2 "nodes" of 1 process on loopback: the second node (agent and worker) is
    SIGKILLed after step 3; the first one's group restarts alone, recomputes the accumulation (G = 8 kept: 2 x 2 x 2
    ranks -> 2 x 4 x 1), resumes the newest checkpoint from the portable state and finishes within 1e-5 of the same
    job on one process."""
    from tests.launching import rel_dev, run_in_process, run_node_range, weight_dev

    job = ["train.micro_batch_size=2", "train.max_steps=24", "data.max_train_examples=40"]
    got = run_node_range(tmp_path / "killed", [*job, "train.gradient_accumulation_steps=2",
                                               "train.rendezvous_timeout_s=30"], kill_at=3)
    assert got["returncode"] == 0 and got["recovery_s"] is not None, got["log"][-3000:]
    assert "train.gradient_accumulation_steps 2 -> 4 keeps global_batch_size=8" in got["log"]
    assert "portable state: written by ddp on 2 process(es), resumed as ddp on 1" in got["log"]
    ref = run_in_process([*job, "train.gradient_accumulation_steps=4"], tmp_path / "ref")
    assert sorted(got["losses"]) == list(range(1, 25))
    assert rel_dev(ref["loss"], [got["losses"][s] for s in range(1, 25)]) <= 1e-5
    assert weight_dev(ref["weights"], got["weights"]) <= 1e-5

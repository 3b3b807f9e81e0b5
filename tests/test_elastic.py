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

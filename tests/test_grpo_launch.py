"""GRPO under several processes: the completions are seeded per prompt and completion (not per rank), a prompt's
group stays on one rank, the advantages and the normaliser come from one all-gather per round, so DDP on 2 CPU
processes trains what one device trains."""

from __future__ import annotations

import pytest

from tests.bounds import TINY_JOB_REL
from tests.launching import GRPO, modes, rel_dev, run_in_process, run_mode, scaled_dev, weight_dev


@pytest.mark.launch
def test_grpo_under_ddp_equals_one_device(tmp_path):
    """tests.launching.GRPO (6 steps: 3 rounds of 2 iterations, KL to the reference) as 1x(8,1) in this process and
    DDP 2x(2,2): every completion DDP's rank 0 logged is one the single device sampled, and the losses (against their
    scale: a round's first loss is ~0), gradient norms and weights agree within the tiny job's fp32 bound."""
    table = modes()
    one = run_in_process([*GRPO, *table["single 1x(8,1)"][1]], tmp_path / "one")
    two = run_mode(table["ddp 2x(2,2)"][0], [*GRPO, *table["ddp 2x(2,2)"][1]], tmp_path / "two")
    assert one["steps"] == two["steps"] == [1, 2, 3, 4, 5, 6]
    assert two["samples"] and set(two["samples"]) <= set(one["samples"])
    assert scaled_dev(one["loss"], two["loss"]) < TINY_JOB_REL
    assert rel_dev(one["grad_norm"], two["grad_norm"]) < TINY_JOB_REL
    assert weight_dev(one["weights"], two["weights"]) < TINY_JOB_REL
    assert min(one["grad_norm"]) > 0

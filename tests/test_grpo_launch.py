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


@pytest.mark.launch
def test_a_round_cut_on_two_processes_resumes_on_one(tmp_path):
    """tests.launching.GRPO with rounds of 2 optimizer steps trained twice (rl.steps_per_generation 4 = 2 x the
    accumulation: 4 steps a round), DDP 2x(2,2) for 6 steps with a checkpoint at step 3 (the round sampled at step 1
    has one step left: both ranks keep their part in rollouts/rank<r>.pt), resumed on one process: the accumulation
    2 -> 4 and rl.steps_per_generation 4 -> 8 keep the global batch and the round's steps, the cut round's last step
    trains the completions DDP's step 4 trained (RoundPlan.order deals them to steps alike on any number of ranks),
    then the round sampled at step 5 holds the completions and rewards DDP's ranks sampled; losses, gradient norms
    and weights within the tiny job's fp32 bound."""
    import json

    table = modes()
    job = [*GRPO, *table["ddp 2x(2,2)"][1], "rl.steps_per_generation=4", "train.max_steps=6", "train.save_every=3",
           "rl.log_completions=16", "train.save_total_limit=null"]
    ref = run_mode(table["ddp 2x(2,2)"][0], job, tmp_path / "ref")
    ckpt = tmp_path / "ref" / "checkpoints" / "step_000003"
    assert sorted(p.name for p in (ckpt / "rollouts").iterdir()) == ["rank0.pt", "rank1.pt"]
    got = run_in_process([*job, f"train.resume_from={ckpt}"], tmp_path / "res")
    assert ref["steps"] == list(range(1, 7)) and got["steps"] == [4, 5, 6]

    def rollouts(out, step):  # (row, completion, reward, advantage) of the round sampled at ``step``
        rows = map(json.loads, (out / "samples.jsonl").read_text().splitlines())
        return sorted((r["row"], r["completion"], r["reward"], round(r["advantage"], 5)) for r in rows
                      if r["split"] == "train" and r["step"] == step)

    ours = rollouts(tmp_path / "res", 5)
    assert len(ours) == 16 and set(rollouts(tmp_path / "ref", 5)) <= set(ours)  # DDP's rank 0 logs its 8
    assert scaled_dev(ref["loss"][3:], got["loss"]) < TINY_JOB_REL
    assert rel_dev(ref["grad_norm"][3:], got["grad_norm"]) < TINY_JOB_REL
    assert weight_dev(ref["weights"], got["weights"]) < TINY_JOB_REL

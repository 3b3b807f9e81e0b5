"""Preference pairs on the loop: DPO's numbers are the same whatever the split into micro-batches, accumulation and
processes (each pair's two sides stay in one micro-batch; the step's loss is the mean over the global batch's pairs),
and precomputed references train exactly as the in-step reference does."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from tests.bounds import TINY_JOB_REL
from tests.launching import PAIRS, modes, rel_dev, run_in_process, run_mode, weight_dev


def _train_metric(out, key):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def test_dpo_accumulation_equals_one_micro_batch(tmp_path):
    """(micro-batch 8 pairs, GA 1) and (2 pairs, GA 4): the same loss, rewards and weights. fp32: the two
    layouts reduce the same per-pair terms in other orders and pad the rows differently; each step's loss is a mean of
    8 terms of magnitude ~1, so round-off stays ~1e-6 relative; 1e-5 is the parity tables' bound."""
    table = modes()
    a = run_in_process([*PAIRS, *table["single 1x(8,1)"][1]], tmp_path / "a")
    b = run_in_process([*PAIRS, *table["single 1x(2,4)"][1]], tmp_path / "b")
    assert a["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(a["loss"], b["loss"]) < TINY_JOB_REL and rel_dev(a["grad_norm"], b["grad_norm"]) < TINY_JOB_REL
    assert weight_dev(a["weights"], b["weights"]) < TINY_JOB_REL
    margins = [_train_metric(tmp_path / x, "train/rewards/margins") for x in "ab"]
    assert len(margins[0]) == 6 and max(abs(x - y) for x, y in zip(*margins)) < 1e-5
    assert margins[0][-1] > margins[0][0]  # the policy learns to prefer the chosen completions


def test_precomputed_reference_trains_as_the_in_step_one(tmp_path):
    """loss.reference=precomputed (one pass before training) gives the in-step reference's run: the reference pass
    pads its batches otherwise (eval_micro_batch_size), so its logps differ by fp32 round-off (~1e-6 on logps of ~30),
    within 1e-5 on every logged loss and on the weights."""
    job = [*PAIRS, *modes()["single 1x(2,4)"][1]]
    a = run_in_process(job, tmp_path / "a")
    b = run_in_process([*job, "loss.reference=precomputed"], tmp_path / "b")
    assert (tmp_path / "b" / "reference_logps.pt").is_file()
    assert rel_dev(a["loss"], b["loss"]) < 1e-5 and weight_dev(a["weights"], b["weights"]) < 1e-5


@pytest.mark.launch
@pytest.mark.parametrize("objective, mode", [("dpo", "ddp 2x(2,2)"), ("simpo", "ddp 2x(2,2)"), ("dpo", "zero2 2x(2,2)"),
                                             ("dpo", "zero3 2x(2,2)"), ("dpo", "fsdp2 2x(2,2)")])
def test_preference_mode_equals_one_process(tmp_path, objective, mode):
    """The DPO reference (adapter disabled, no_grad) and the pair normalisation under DDP, ZeRO-2/3 (ZeRO-3: the
    reference forward gathers the same partitioned weights) and FSDP2 (tests/fsdp_cpu.py's CPU shim): the single
    device's losses, gradient norms, weights and rewards within 1e-5."""
    table = modes()
    job = [*PAIRS, f"loss.objective={objective}"]
    one = run_in_process([*job, *table["single 1x(2,4)"][1]], tmp_path / "one")
    two = run_mode(table[mode][0], [*job, *table[mode][1]], tmp_path / "two")
    assert one["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(one["loss"], two["loss"]) < 1e-5 and rel_dev(one["grad_norm"], two["grad_norm"]) < 1e-5
    assert weight_dev(one["weights"], two["weights"]) < 1e-5
    for key in ("train/rewards/accuracies", "train/rewards/margins", "train/logps/chosen"):
        x, y = _train_metric(tmp_path / "one", key), _train_metric(tmp_path / "two", key)
        assert len(x) == 6 and max(abs(p - q) / max(1.0, abs(p)) for p, q in zip(x, y)) < 1e-5, key


@pytest.mark.launch
def test_packed_pairs_under_ddp_equal_one_process(tmp_path):
    """data.packing under DDP: each rank gets whole bins of whole pairs (micro-batch 2 bins x GA 2 x 2 ranks = 8 bins
    per step, as 2 bins x GA 4 on one device), so no pair spans two ranks or two windows and the step divides by
    the same pairs: one device's losses, gradient norms and weights within 1e-5 (fp32, as the parity tables)."""
    table = modes()
    job = [*PAIRS, "data.packing=true"]
    one = run_in_process([*job, *table["single 1x(2,4)"][1]], tmp_path / "one")
    two = run_mode(table["ddp 2x(2,2)"][0], [*job, *table["ddp 2x(2,2)"][1]], tmp_path / "two")
    assert one["steps"] == two["steps"] and len(one["steps"]) == 6
    assert rel_dev(one["loss"], two["loss"]) < 1e-5 and rel_dev(one["grad_norm"], two["grad_norm"]) < 1e-5
    assert weight_dev(one["weights"], two["weights"]) < 1e-5


def test_dpo_resume_mid_epoch_is_bit_exact(tmp_path):
    """A DPO run resumed from its step-4 checkpoint (one window into the second epoch: 20 pairs at 8 per step)
    trains the same pairs in the same order as the uninterrupted run: losses and weights identical."""
    job = [*PAIRS, *modes()["single 1x(2,4)"][1], "train.max_steps=8", "train.save_every=4", "optim.name=adamw",
           "optim.lr=1e-3"]
    ref = run_in_process(job, tmp_path / "ref")
    got = run_in_process([*job, f"train.resume_from={tmp_path / 'ref' / 'checkpoints' / 'step_000004'}"],
                         tmp_path / "resumed")
    assert ref["steps"] == list(range(1, 9)) and got["steps"] == [5, 6, 7, 8]
    assert got["loss"] == ref["loss"][4:]                                       # identical, not close
    assert all(torch.equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])


def test_padding_free_pairs_train_as_padded(tmp_path):
    """data.padding_free=true (each micro-batch of pairs one packed row, position ids restarting per side) trains
    the padded run's steps: fp32, the same per-pair terms computed over other attention layouts, within
    ``TINY_JOB_REL`` (two fp32 paths of the tiny job, tests/bounds.py) on every loss and on the weights."""
    job = [*PAIRS, *modes()["single 1x(2,4)"][1]]
    a = run_in_process(job, tmp_path / "a")
    b = run_in_process([*job, "data.padding_free=true"], tmp_path / "b")
    assert rel_dev(a["loss"], b["loss"]) < TINY_JOB_REL and weight_dev(a["weights"], b["weights"]) < TINY_JOB_REL


def test_packed_pairs_train_as_padded(tmp_path, caplog):
    """data.packing=true (whole pairs in bins of 2 x data.max_length tokens, a micro-batch of bins one padding-free
    row) trains the padded run's steps. Each step is a whole epoch in both runs (padded: 2 pairs x GA 10 = the 20
    pairs; packed: 1 bin x GA 20, more than the bins there are: every bin once), so both train the same pairs in
    every step and normalise by the same 20 pairs; fp32, the same per-pair terms over other attention layouts
    (one sdpa call per side on CPU against padded rows), within ``TINY_JOB_REL`` (two fp32 paths of the tiny job,
    tests/bounds.py) on every loss, gradient norm and the weights (measured: 1e-6 on losses, 1.2e-5 on the sixth
    step's gradient norm)."""
    job = [*PAIRS, "train.micro_batch_size=2", "train.gradient_accumulation_steps=10"]
    a = run_in_process(job, tmp_path / "a")
    with caplog.at_level(logging.INFO):
        b = run_in_process([*PAIRS, "data.packing=true", "train.micro_batch_size=1",
                            "train.gradient_accumulation_steps=20"], tmp_path / "b")
    line = next(m for m in caplog.messages if "packing: " in m).split("packing: ", 1)[1]
    bins = int(line.split(" into ")[1].split()[0])
    assert line.startswith("20 train pairs into ") and "bins of up to 2 x data.max_length=64 = 128 tokens" in line
    assert bins < 20  # bins hold several pairs
    assert a["steps"] == b["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(a["loss"], b["loss"]) < TINY_JOB_REL and rel_dev(a["grad_norm"], b["grad_norm"]) < TINY_JOB_REL
    assert weight_dev(a["weights"], b["weights"]) < TINY_JOB_REL
    assert a["loss"][0] != a["loss"][-1]

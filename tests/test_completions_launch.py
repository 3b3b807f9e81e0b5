"""Prompt/completion rows (tails of 2 to 12 tokens) through a real 2-process launch: resume mid-epoch is bit-exact,
and DDP equals one process."""

from __future__ import annotations

import json

import pytest
import torch

from tests.launching import COMPLETIONS, modes, rel_dev, run_in_process, run_mode, weight_dev

# 20 rows at global batch 8: windows of 8, 8, 4 per epoch, so the step-4 checkpoint is one window into the second
# epoch (mid-epoch). AdamW and LoRA dropout 0.1: the RNG and optimizer state must be restored exactly.
RESUME = [*COMPLETIONS, "train.max_steps=8", "train.save_every=4", "lora.dropout=0.1", "optim.name=adamw",
          "optim.lr=1e-3"]


@pytest.mark.launch
def test_prompt_completion_resume_is_bit_exact_under_ddp(tmp_path):
    """Also issue 18's 2-process cache claims (formerly tests/test_data_scale.py::test_two_processes_tokenize_once_
    and_resume_reads_the_cache): the run builds the token cache on rank 0 only, its resume tokenizes nothing."""
    cmds, overrides = modes()["ddp 2x(2,2)"]
    job = [*overrides, *RESUME, f"data.cache_dir={tmp_path / 'c'}", "log.peak_flops=false"]
    ref = run_mode(cmds, job, tmp_path / "ref")
    builds = _builds(tmp_path / "c")
    assert [(b["rank"], b["splits"]["train"]["rows"]) for b in builds] == [(0, 20)]
    ckpt = tmp_path / "ref" / "checkpoints" / "step_000004"
    got = run_mode(cmds, [*job, f"train.resume_from={ckpt}"], tmp_path / "resumed")
    assert _builds(tmp_path / "c") == builds  # no process tokenized again
    assert ref["steps"] == list(range(1, 9)) and got["steps"] == [5, 6, 7, 8]
    assert got["loss"] == ref["loss"][4:]                                       # identical, not close
    assert ref["weights"].keys() == got["weights"].keys()
    assert all(torch.equal(ref["weights"][k], got["weights"][k]) for k in ref["weights"])


def _builds(cache):
    path = cache / "builds.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.launch
def test_prompt_completion_ddp_equals_one_process(tmp_path):
    table = modes()
    one = run_in_process([*COMPLETIONS, *table["single 1x(2,4)"][1]], tmp_path / "one")  # one device, accumulating 4
    two = run_mode(table["ddp 2x(2,2)"][0], [*COMPLETIONS, *table["ddp 2x(2,2)"][1]], tmp_path / "two")
    assert one["steps"] == [1, 2, 3, 4, 5, 6]
    assert rel_dev(one["loss"], two["loss"]) < 1e-5 and rel_dev(one["grad_norm"], two["grad_norm"]) < 1e-5
    assert weight_dev(one["weights"], two["weights"]) < 1e-5

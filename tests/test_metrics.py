"""In-run figures: throughput, MFU, peak memory, data vs compute time, from the meter's sums."""

from __future__ import annotations

import time

import pytest
import torch
from accelerate import Accelerator

from scale.metrics import StepMeter, peak_memory_gib


def _batch(rows, seq_len, real):
    mask = torch.zeros(rows, seq_len, dtype=torch.long)
    mask[:, -real:] = 1
    return {"input_ids": torch.zeros(rows, seq_len, dtype=torch.long), "attention_mask": mask}


def test_flush_reports_ratios_of_sums_mfu_and_time_split():
    acc = Accelerator(cpu=True)
    meter = StepMeter(acc.device, flops_fn=lambda rows, seq_len: 1000.0 * rows * seq_len, peak_flops=1e6)
    meter.add_micro(torch.tensor(6.0), torch.tensor(4.0), _batch(2, 10, 7), threshold=2)
    meter.add_micro(torch.tensor(3.0), torch.tensor(2.0), _batch(1, 12, 12), threshold=2)
    meter.steps = 1
    time.sleep(0.05)
    meter.data_s = 0.01
    out = meter.flush(acc, lr=0.1)
    tokens, flops = 2 * 7 + 12, 1000.0 * (2 * 10 + 12)
    elapsed = tokens / out["train/tokens_per_s"]
    assert out["train/loss"] == pytest.approx(9.0 / 6.0)         # ratio of sums, not a mean of ratios
    assert out["train/tail_tokens_per_s"] * elapsed == pytest.approx(3 * 2)
    assert out["train/samples_per_s"] * elapsed == pytest.approx(3)
    assert out["train/mfu"] == pytest.approx(flops / elapsed / 1e6, rel=1e-9)
    assert out["train/data_s"] == 0.01 and out["train/compute_s"] == pytest.approx(elapsed - 0.01, abs=1e-3)
    assert out["train/peak_mem_gib"] == pytest.approx(peak_memory_gib(acc.device), rel=0.05) and \
        out["train/peak_mem_gib"] > 0.05   # this Python process holds torch: > 50 MiB resident
    assert "train/loss_scale" not in out                          # no fp16 scaler


def test_paused_time_is_not_training_time():
    acc = Accelerator(cpu=True)
    meter = StepMeter(acc.device)
    meter.add_micro(torch.tensor(1.0), torch.tensor(1.0), _batch(1, 4, 4), threshold=2)
    time.sleep(0.2)
    meter.paused_s = 0.2   # e.g. an evaluation inside the interval
    out = meter.flush(acc, lr=0.1)
    assert 4 / out["train/tokens_per_s"] < 0.1 and "train/mfu" not in out

"""In-run figures: throughput, MFU, peak memory, data vs compute time, from the meter's sums."""

from __future__ import annotations

import time

import pytest
import torch
from accelerate import Accelerator

from scale.training.metrics import StepMeter, peak_memory_gib
from scale.training.precision import compute_dtype, measure_peak_flops, measured_size, resolve_peak_flops


def _batch(rows, seq_len, real):
    mask = torch.zeros(rows, seq_len, dtype=torch.long)
    mask[:, -real:] = 1
    return {"input_ids": torch.zeros(rows, seq_len, dtype=torch.long), "attention_mask": mask}


def test_flush_reports_ratios_of_sums_mfu_and_time_split():
    acc = Accelerator(cpu=True)
    meter = StepMeter(acc.device, flops_fn=lambda rows, seq_len, kept=None: 1000.0 * rows * seq_len, peak_flops=1e6)
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
    assert out["train/pad_fraction"] == pytest.approx(1 - tokens / (2 * 10 + 12))   # padded / total positions
    assert out["train/data_s"] == 0.01 and out["train/compute_s"] == pytest.approx(elapsed - 0.01, abs=1e-3)
    assert out["train/peak_mem_gib"] == pytest.approx(peak_memory_gib(acc.device), rel=0.05) and \
        out["train/peak_mem_gib"] > 0.05   # this Python process holds torch: > 50 MiB resident
    assert "train/loss_scale" not in out                          # no fp16 scaler


def test_padding_free_flops_equal_the_padded_batch_of_the_same_rows():
    """``train/mfu``'s FLOPs of a padding-free micro-batch (rows packed into ``[1, L]``, ``seq_lens``) equal those of
    the padded batch of the same rows when no row is padded: per row ``T`` positions of the body and ``N`` (the
    ``tail_mask`` width) of the LM head, not ``loss.threshold``."""
    from types import SimpleNamespace

    from scale.config.load import load_config
    from scale.training.metrics import model_flops

    shape = SimpleNamespace(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=1000)
    flops_fn = model_flops(load_config(None, ["loss.threshold=2"]), shape, 100)
    B, T, N = 3, 12, 7
    tail = torch.ones(B, N, dtype=torch.long)
    padded, packed = StepMeter(torch.device("cpu"), flops_fn, max_seq_len=T), StepMeter(torch.device("cpu"), flops_fn,
                                                                                          max_seq_len=T)
    padded.add_micro(torch.tensor(1.0), torch.tensor(1.0), {**_batch(B, T, T), "tail_mask": tail})
    packed.add_micro(torch.tensor(1.0), torch.tensor(1.0), {"input_ids": torch.zeros(1, B * T, dtype=torch.long),
                                                           "seq_lens": torch.full((B,), T), "tail_mask": tail})
    flops = StepMeter.KEYS.index("flops")
    assert packed.sums[flops].item() == pytest.approx(padded.sums[flops].item(), rel=1e-12)
    assert padded.sums[flops].item() == pytest.approx(flops_fn(B, T, N), rel=1e-12) != flops_fn(B, T, 2)


def test_paused_time_is_not_training_time():
    acc = Accelerator(cpu=True)
    meter = StepMeter(acc.device)
    meter.add_micro(torch.tensor(1.0), torch.tensor(1.0), _batch(1, 4, 4), threshold=2)
    time.sleep(0.2)
    meter.paused_s = 0.2   # e.g. an evaluation inside the interval
    out = meter.flush(acc, lr=0.1)
    assert 4 / out["train/tokens_per_s"] < 0.1 and "train/mfu" not in out


def test_peak_flops_setting_number_off_and_measured(tmp_path, monkeypatch):
    from tests.conftest import tiny_cfg

    monkeypatch.setenv("SCALE_CACHE", str(tmp_path / "cache"))  # null measures this machine once: a fresh cache

    acc = Accelerator(cpu=True)
    fixed = resolve_peak_flops(tiny_cfg(tmp_path, "log.peak_flops=2.5e11"), acc)
    assert fixed.flops == 2.5e11 and fixed.source == "250 GFLOP/s per device (log.peak_flops)"
    off = resolve_peak_flops(tiny_cfg(tmp_path, "log.peak_flops=false"), acc)
    assert off.flops is None and "no train/mfu" in off.source
    measured = resolve_peak_flops(tiny_cfg(tmp_path), acc)   # null on CPU: measured
    assert 1e8 < measured.flops < 1e14                        # any CPU of this decade, fp32 (a shared, loaded one too)
    n = measured_size(acc.device, torch.float32)
    assert n in (256, 512, 1024, 2048)                        # grown while one product takes < 50 ms
    assert f"per device (measured: float32 GEMM {n}^3 on cpu" in measured.source
    assert "; bfloat16 measures " in measured.source           # the other dtype, as a hint
    assert 1e8 < measure_peak_flops(acc.device, torch.float32, seconds=0.0, n=256) < 1e14


def test_probe_stays_small_for_a_dtype_without_a_fast_kernel(monkeypatch):
    """A dtype at 0.2 GFLOP/s (bf16 on an AVX2-only CPU) is measured at 256^3, not at 2048^3 (~80 s a product)."""
    from scale.training import precision

    monkeypatch.setattr(precision, "_MEASURED", {})
    monkeypatch.setattr(precision, "_time_gemm",
                        lambda device, dtype, seconds, n, reps=3: 0.2e9 if dtype == torch.bfloat16 else 300e9)
    cpu = torch.device("cpu")
    assert precision.measured_size(cpu, torch.bfloat16) == 256 and precision.measured_size(cpu, torch.float32) == 2048


def test_compute_dtype_follows_autocast_then_4bit_then_weights(tmp_path):
    from tests.conftest import tiny_cfg

    assert compute_dtype(tiny_cfg(tmp_path)) == torch.float32
    assert compute_dtype(tiny_cfg(tmp_path, "model.dtype=bfloat16")) == torch.bfloat16
    assert compute_dtype(tiny_cfg(tmp_path, "model.quantize_4bit=true", "model.bnb_4bit_compute_dtype=bfloat16")) \
        == torch.bfloat16
    assert compute_dtype(tiny_cfg(tmp_path, "train.mixed_precision=bf16", "model.dtype=float32")) == torch.bfloat16


def test_bad_peak_flops_setting(tmp_path):
    from scale.config.validation import ConfigError
    from tests.conftest import tiny_cfg

    for bad in ("fast", "-1", "0", "true"):
        with pytest.raises(ConfigError, match="log.peak_flops=.* must be a positive number"):
            tiny_cfg(tmp_path, f"log.peak_flops={bad}")


@pytest.mark.parametrize("bf16_rate,choice", [(2.12e12, "bf16"), (0.2e9, "no"), (0.36e12, "no")])
def test_auto_precision_follows_the_probe(monkeypatch, tmp_path, bf16_rate, choice):
    """fp32 at 290 GFLOP/s: AMX-like bf16 (2.12 TFLOP/s, 7.3x) -> bf16, 4-bit compute dtype bf16 as well; an AVX2 CPU
    (0.2 GFLOP/s) or a ratio under 1.3x (1.24x) -> fp32."""
    from scale.training import precision
    from tests.conftest import tiny_cfg

    monkeypatch.setattr(precision, "_MEASURED", {})
    monkeypatch.setattr(precision, "_time_gemm", lambda device, dtype, seconds, n, reps=3:
                        bf16_rate if dtype == torch.bfloat16 else 290e9)
    cfg = tiny_cfg(tmp_path, "train.mixed_precision=auto", "model.bnb_4bit_compute_dtype=auto")
    got = precision.resolve_mixed_precision(cfg, torch.device("cpu"))
    assert got.choice == choice and cfg.train.mixed_precision == choice
    assert cfg.model.bnb_4bit_compute_dtype == ("bfloat16" if choice == "bf16" else "float32")
    assert got.fp32_flops == 290e9 and got.bf16_flops == bf16_rate
    assert f"bf16 GEMMs measure {bf16_rate / 290e9:.2f}x fp32" in got.reason
    assert got.metrics() == {"precision/bf16": float(choice == "bf16"), "precision/fp32_gflops": 290.0,
                             "precision/bf16_gflops": bf16_rate / 1e9}


def test_auto_precision_pinned_and_qlora_fp32(tmp_path):
    from scale.training import precision
    from tests.conftest import tiny_cfg

    pinned = tiny_cfg(tmp_path)                                   # tiny_cpu pins "no": tests stay fp32 on any CPU
    assert pinned.train.mixed_precision == "no"
    assert precision.resolve_mixed_precision(pinned, torch.device("cpu")) is None
    qlora = tiny_cfg(tmp_path, "train.mixed_precision=auto", "model.quantize_4bit=true")
    got = precision.resolve_mixed_precision(qlora, torch.device("cpu"))
    assert got.choice == "no" and "bnb_4bit_compute_dtype=float32" in got.reason and got.fp32_flops is None
    from scale.config.load import load_config

    assert load_config().train.mixed_precision == "auto" and load_config().model.bnb_4bit_compute_dtype == "auto"

"""``train.micro_batch_size: auto`` (scale/planner/autobatch.py) on CPU: the resolution against a given device memory
(the GPU probe monkeypatched), the accumulation that keeps ``train.auto_global_batch_size``, the start-up line, the
hint for a run that leaves the device mostly unused, and bad values refused in one line."""

from __future__ import annotations

import logging

import pytest
import yaml

from tests.conftest import TINY_YAML, tiny_cfg
from scale.config.validation import ConfigError
from scale.planner.autobatch import AutoBatch, planned_bytes, resolve_auto_micro_batch, under_used_line
from scale.planner.census import GIB
from scale.training.metrics import read_jsonl

# The tiny model's plan: ~1.01 GiB at one row (the plan's fixed framework overhead) plus ~1.6 MiB per row, so
# 2 GiB at a fraction of 0.75 fits a few hundred rows and 1.4 GiB a few dozen.
MEMORY_GIB = 2.0


def test_auto_picks_the_largest_micro_batch_the_plan_fits(tmp_path):
    cfg = tiny_cfg(tmp_path, "train.micro_batch_size=auto", "train.gradient_accumulation_steps=3")
    auto = resolve_auto_micro_batch(cfg, 2, MEMORY_GIB)
    b, limit = auto.micro_batch_size, 0.75 * MEMORY_GIB * GIB
    assert cfg.train.micro_batch_size == b > 1
    assert planned_bytes(cfg, b, MEMORY_GIB) <= limit < planned_bytes(cfg, b + 1, MEMORY_GIB)
    # No train.auto_global_batch_size: the accumulation stays as set and the global batch grows with the micro-batch.
    assert (auto.gradient_accumulation_steps, cfg.train.gradient_accumulation_steps) == (3, 3)
    assert auto.planned_gib == planned_bytes(cfg, b, MEMORY_GIB) / GIB
    assert auto.line() == (
        f"train.micro_batch_size=auto: micro_batch_size {b} x gradient_accumulation_steps 3 x 2 data-parallel "
        f"rank(s) = global_batch_size {6 * b} (gradient_accumulation_steps as set; train.auto_global_batch_size keeps "
        f"one); planned {auto.planned_gib:.1f} GiB of 2.0 GiB per device (train.auto_memory_fraction 0.75)")


def test_auto_keeps_the_global_batch_with_accumulation(tmp_path):
    G, dp, memory = 168, 2, 1.4  # 84 rows per rank: divisors 1, 2, 3, 4, 6, 7, 12, 14, 21, 28, 42, 84
    cfg = tiny_cfg(tmp_path, "train.micro_batch_size=auto", f"train.auto_global_batch_size={G}")
    fit = resolve_auto_micro_batch(tiny_cfg(tmp_path, "train.micro_batch_size=auto"), dp, memory).micro_batch_size
    auto = resolve_auto_micro_batch(cfg, dp, memory)
    b, ga = cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps
    assert (auto.micro_batch_size, auto.gradient_accumulation_steps) == (b, ga)
    assert b * ga * dp == G and cfg.train.global_batch_size(dp) == G and cfg.train.auto_global_batch_size is None
    assert b == max(d for d in range(1, fit + 1) if (G // dp) % d == 0) and b < fit < G // dp  # the divisor fits
    assert auto.planned_gib == planned_bytes(cfg, b, memory) / GIB
    assert "= global_batch_size 168 (kept: train.auto_global_batch_size)" in auto.line()


def test_auto_line_says_when_the_plan_uses_under_a_quarter():
    auto = AutoBatch(64, 1, 1, 20.0, 141.0, 0.75, kept_global_batch=True)
    assert auto.line() == (
        "train.micro_batch_size=auto: micro_batch_size 64 x gradient_accumulation_steps 1 x 1 data-parallel rank(s) "
        "= global_batch_size 64 (kept: train.auto_global_batch_size); planned 20.0 GiB of 141.0 GiB per device "
        "(train.auto_memory_fraction 0.75); under a quarter of the device: train.auto_global_batch_size caps the "
        "micro-batch")


def test_set_micro_batch_under_a_quarter_of_the_device_names_auto(tmp_path):
    cfg = tiny_cfg(tmp_path, "train.micro_batch_size=8")
    planned = planned_bytes(cfg, 8, 141.0) / GIB
    assert planned < 141.0 / 4
    assert under_used_line(cfg, 141.0) == (
        f"memory: the plan of micro_batch_size 8 uses {planned:.1f} GiB of 141.0 GiB per device, under a quarter: "
        f"train.micro_batch_size: auto picks the largest that fits train.auto_memory_fraction")
    assert under_used_line(cfg, MEMORY_GIB) is None  # ~1.03 GiB of 2 GiB: half the device
    assert under_used_line(cfg, None) is None  # a CPU


def test_auto_run_trains_as_the_number_it_resolved_to(tmp_path, monkeypatch, caplog):
    """The start-up resolves ``auto`` (on a 2 GiB "GPU") before the accelerator, logs its line, writes the number to
    config.yaml, and trains exactly as a run given that number."""
    from scale.train import run

    steps = ["train.max_steps=2", "train.log_every=1", "train.eval_every=0", "log.trackers=[]"]
    monkeypatch.setattr("scale.planner.autobatch.device_memory_gib", lambda device: MEMORY_GIB)
    caplog.set_level(logging.INFO)
    run(tiny_cfg(tmp_path / "auto", "train.micro_batch_size=auto", "train.auto_global_batch_size=8", *steps))
    said = [r.getMessage().removeprefix("[RANK 0] ") for r in caplog.records]  # accelerate's logger adds the rank
    lines = [m for m in said if m.startswith("train.micro_batch_size=auto")]
    planned = planned_bytes(tiny_cfg(tmp_path), 8, MEMORY_GIB) / GIB
    assert lines == [f"train.micro_batch_size=auto: micro_batch_size 8 x gradient_accumulation_steps 1 x 1 "
                     f"data-parallel rank(s) = global_batch_size 8 (kept: train.auto_global_batch_size); planned "
                     f"{planned:.1f} GiB of 2.0 GiB per device (train.auto_memory_fraction 0.75)"]
    saved = yaml.safe_load((tmp_path / "auto" / "config.yaml").read_text())["train"]
    # Resolved: numbers only (a set micro-batch with train.auto_global_batch_size would be refused on reload).
    assert (saved["micro_batch_size"], saved["gradient_accumulation_steps"], saved["auto_global_batch_size"]) == (
        8, 1, None)
    run(tiny_cfg(tmp_path / "set", "train.micro_batch_size=8", "train.gradient_accumulation_steps=1", *steps))
    auto, fixed = ([(r["train/loss"], r["train/grad_norm"]) for r in read_jsonl(tmp_path / d / "metrics.jsonl")
                    if "train/loss" in r] for d in ("auto", "set"))
    assert len(auto) == 2 and auto == fixed  # the same operations on the same rows: equal, not close


def test_auto_is_refused_on_cpu_in_one_line(tmp_path, capsys):
    from scale.cli import main

    code = main(["--config", str(TINY_YAML), f"output_dir={tmp_path / 'out'}", "train.micro_batch_size=auto"])
    err = capsys.readouterr().err
    assert code == 2 and err == (
        "scale-train: error: ConfigError: train.micro_batch_size=auto plans against a GPU's memory and this run has "
        "no GPU: set a number (train.micro_batch_size=8 is the CPU default)\n")


@pytest.mark.parametrize("overrides, message", [
    (["train.micro_batch_size=big"], "train.micro_batch_size='big' must be a number >= 1 or 'auto'"),
    (["train.micro_batch_size=auto", "train.auto_memory_fraction=0"],
     "train.auto_memory_fraction=0.0 must be in (0, 1]: the share of one GPU's memory train.micro_batch_size=auto "
     "may plan for (default 0.75)"),
    (["train.micro_batch_size=auto", "train.auto_memory_fraction=1.5"],
     "train.auto_memory_fraction=1.5 must be in (0, 1]: the share of one GPU's memory train.micro_batch_size=auto "
     "may plan for (default 0.75)"),
    (["train.auto_global_batch_size=64"],
     "train.auto_global_batch_size=64 is read only with train.micro_batch_size=auto: drop it, or set "
     "train.micro_batch_size=auto"),
    (["train.micro_batch_size=auto", "train.auto_global_batch_size=0"],
     "train.auto_global_batch_size=0 must be >= 1, or null"),
])
def test_bad_auto_values_are_refused_in_one_line(tmp_path, overrides, message):
    with pytest.raises(ConfigError) as e:
        tiny_cfg(tmp_path, *overrides)
    assert str(e.value) == message


def test_auto_global_batch_not_divisible_by_the_ranks_is_refused(tmp_path):
    cfg = tiny_cfg(tmp_path, "train.micro_batch_size=auto", "train.auto_global_batch_size=9")
    with pytest.raises(ConfigError) as e:
        resolve_auto_micro_batch(cfg, 2, MEMORY_GIB)
    assert str(e.value) == ("train.auto_global_batch_size=9 is not divisible by the 2 data-parallel ranks: use a "
                            "multiple of 2")
    assert cfg.train.micro_batch_size == "auto"  # nothing was changed


def test_auto_with_no_row_fitting_is_refused(tmp_path):
    cfg = tiny_cfg(tmp_path, "train.micro_batch_size=auto")
    with pytest.raises(ConfigError) as e:
        resolve_auto_micro_batch(cfg, 1, 1.0)  # the plan's ~1.01 GiB of overhead alone exceeds 0.75 GiB
    assert str(e.value) == (f"train.micro_batch_size=auto: not even one row of data.max_length={cfg.data.max_length} "
                            f"fits 0.75 of 1.0 GiB: lower data.max_length, set model.gradient_checkpointing=true or "
                            f"raise train.auto_memory_fraction")


def test_scale_plan_resolves_auto_against_gpu_mem(capsys):
    from scale.config.load import load_config
    from scale.plan import main
    from scale.planner.autobatch import largest_micro_batch

    assert main(["--config", str(TINY_YAML), "--gpus", "1", "--gpu-mem", "2", "train.micro_batch_size=auto"]) == 0
    out = capsys.readouterr().out
    b = largest_micro_batch(load_config(TINY_YAML, ["train.micro_batch_size=auto"]), 2.0, 0.75)[0]
    assert out.startswith(f"train.micro_batch_size=auto: {b}, the largest whose single-GPU plan fits "
                          f"train.auto_memory_fraction 0.75 of --gpu-mem 2 GiB\n")
    assert f"micro-batch {b} x " in out


def test_scale_plan_keeps_the_auto_global_batch(capsys):
    """With ``train.auto_global_batch_size`` G on 2 GPUs: the largest fitting micro-batch that divides G / 2, and
    the accumulation that makes up G, as scale-train resolves it."""
    from scale.config.load import load_config
    from scale.plan import main
    from scale.planner.autobatch import largest_micro_batch

    G = 24
    assert main(["--config", str(TINY_YAML), "--gpus", "2", "--gpu-mem", "2", "train.micro_batch_size=auto",
                 f"train.auto_global_batch_size={G}"]) == 0
    out = capsys.readouterr().out
    fit = largest_micro_batch(load_config(TINY_YAML, ["train.micro_batch_size=auto"]), 2.0, 0.75, upper=G // 2)[0]
    b = max(d for d in range(1, fit + 1) if (G // 2) % d == 0)
    assert out.startswith(f"train.micro_batch_size=auto: {b}, the largest whose single-GPU plan fits "
                          f"train.auto_memory_fraction 0.75 of --gpu-mem 2 GiB and divides "
                          f"train.auto_global_batch_size {G} / 2 data-parallel ranks; gradient_accumulation_steps "
                          f"{G // 2 // b}\n")
    assert main(["--config", str(TINY_YAML), "--gpus", "2", "--gpu-mem", "2", "train.micro_batch_size=auto",
                 "train.auto_global_batch_size=25"]) == 2
    assert "train.auto_global_batch_size=25 is not divisible by the 2 data-parallel ranks" in capsys.readouterr().err

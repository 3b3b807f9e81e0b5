"""What a new user meets first: the README's first command run twice, and a one-line error for a bad path that no
library notice precedes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scale.config.load import load_config
from tests.conftest import ROOT, TINY_YAML


def test_the_main_job_resumes_when_run_again():
    """`make train` (scale-train with configs/train/default.yaml) run a second time resumes its run instead of
    refusing the directory it wrote."""
    assert load_config(None).train.resume_from == "auto"


def test_a_finished_run_started_again_with_resume_auto_exits_0_and_trains_nothing(tmp_path):
    """The second start of a finished run (train.resume_from=auto, as the main job sets it) resumes from its last
    checkpoint: exit 0, no optimizer step trained again, the adapter and the logged training steps as they were."""
    from scale.cli import main

    out = tmp_path / "out"
    args = ["--config", str(TINY_YAML), f"output_dir={out}", "train.max_steps=2", "train.log_every=1",
            "train.eval_every=0", "train.resume_from=auto"]
    assert main(args) == 0
    adapter = (out / "adapter" / "adapter_model.safetensors").read_bytes()
    steps = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert steps == [1, 2]
    assert main(args) == 0
    again = [r["step"] for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "train/loss" in r]
    assert again == [1, 2] and (out / "adapter" / "adapter_model.safetensors").read_bytes() == adapter


@pytest.mark.parametrize("override, line", [
    ("data.path={tmp}/missing.jsonl", "DataError: data.path='{tmp}/missing.jsonl' does not exist; point it at a data "
                                      "file"),
    ("model.name_or_path={tmp}/no_model", "ConfigError: model.name_or_path='{tmp}/no_model' does not exist"),
    ("train.resume_from={tmp}/no_ckpt", "CheckpointError: train.resume_from='{tmp}/no_ckpt' is not a complete "
                                        "checkpoint (no trainer_state.json)"),
])
def test_a_bad_path_in_the_main_job_is_the_only_line_on_stderr(tmp_path, override, line):
    """The main job is QLoRA, so bitsandbytes is imported, and it logs a kernel notice at import: the paths are
    checked before that, and the error is all stderr holds."""
    tmp = str(tmp_path)
    proc = subprocess.run([sys.executable, "-m", "scale.cli", f"output_dir={tmp}/out", "log.trackers=[]",
                           override.format(tmp=tmp)], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 2
    err = proc.stderr.splitlines()
    assert len(err) == 1 and err[0].startswith(f"scale-train: error: {line.format(tmp=tmp)}"), proc.stderr
    assert "bitsandbytes" not in proc.stdout + proc.stderr and not (tmp_path / "out").exists()


# ---- train/mfu divides by one peak per machine ----

def test_machine_peak_is_the_best_probe_ever_measured(tmp_path):
    """Injected probe timings: the first call keeps the best of 3 probes (a busy neighbour lowers a probe, not the
    best of three); a later call on a busier machine probes once and returns the cached figure unchanged; a later
    probe above it raises the cached figure (a figure cached while the machine was busy is not kept); another key
    (another dtype, CPU, torch or thread count) is measured on its own."""
    from scale.training.precision import machine_peak

    key = "cpu A | torch 2.13.0 | float32 | 2 threads"
    path = tmp_path / "peak_flops.json"
    idle = iter([(150e9, 1024), (340e9, 1024), (290e9, 1024)])
    entry, cached = machine_peak(key, lambda: next(idle), path)
    assert (entry["flops"], entry["n"], entry["probes"], cached) == (340e9, 1024, 3, False)
    assert json.loads(path.read_text())[key]["flops"] == 340e9

    calls = []
    again, cached = machine_peak(key, lambda: calls.append(1) or (170e9, 1024), path)  # twice as busy
    assert again == entry and cached and calls == [1]
    assert json.loads(path.read_text())[key]["flops"] == 340e9
    higher, cached = machine_peak(key, lambda: (400e9, 2048), path)
    assert (higher["flops"], higher["n"], higher["probes"], cached) == (400e9, 2048, 4, False)
    assert json.loads(path.read_text())[key]["flops"] == 400e9
    other, cached = machine_peak("cpu A | torch 2.13.0 | bfloat16 | 2 threads", lambda: (2.1e12, 2048), path)
    assert other["flops"] == 2.1e12 and not cached and len(json.loads(path.read_text())) == 2
    path.write_text("not json")  # a damaged cache is measured again, not an error
    assert machine_peak(key, lambda: (1e9, 256), path)[0]["flops"] == 1e9


def test_two_identical_runs_divide_by_the_same_peak_on_a_busier_machine(tmp_path, monkeypatch):
    """resolve_peak_flops (log.peak_flops: null) on an idle machine, then on one where every GEMM takes twice as
    long: the same peak both times, and the start-up line says it was measured once and cached. log.peak_flops=measure
    still measures now."""
    import torch
    from accelerate import Accelerator

    from scale.training import precision
    from scale.training.precision import resolve_peak_flops
    from tests.conftest import tiny_cfg

    monkeypatch.setenv("SCALE_CACHE", str(tmp_path / "cache"))
    rate = {"now": 300e9}
    monkeypatch.setattr(precision, "_MEASURED", {})
    monkeypatch.setattr(precision, "_time_gemm", lambda device, dtype, seconds, n, reps=3:
                        rate["now"] * (7 if dtype == torch.bfloat16 else 1))
    acc = Accelerator(cpu=True)
    first = resolve_peak_flops(tiny_cfg(tmp_path), acc)
    rate["now"] = 150e9  # a busy machine
    monkeypatch.setattr(precision, "_MEASURED", {})
    second = resolve_peak_flops(tiny_cfg(tmp_path), acc)
    assert first.flops == second.flops == 300e9
    assert "best of 3 probes now, cached in " in first.source and "best of 3 probes of 20" in second.source
    assert "; bfloat16 measures 2.1 TFLOP/s (faster on this CPU)" in second.source
    now = resolve_peak_flops(tiny_cfg(tmp_path, "log.peak_flops=measure"), acc)
    assert now.flops == 150e9 and "measured now" in now.source


def test_the_dtype_probe_line_says_its_figures_are_not_the_mfu_peak(tmp_path, monkeypatch, caplog):
    """Two fp32 figures in consecutive start-up lines: the dtype probe of this start (a busy machine: half the rate)
    and the machine's cached best, which train/mfu divides by. The first line says which is which."""
    import logging

    import torch
    from accelerate import Accelerator

    from scale.training import precision
    from scale.training.precision import peak_cache_path, resolve_mixed_precision, resolve_peak_flops
    from scale.training.startup import report_peak, report_precision
    from tests.conftest import tiny_cfg

    monkeypatch.setenv("SCALE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(precision, "_MEASURED", {})
    rate = {"fp32": 182e9}
    monkeypatch.setattr(precision, "_time_gemm", lambda device, dtype, seconds, n, reps=3:
                        rate["fp32"] * (0.5 if dtype == torch.bfloat16 else 1))
    acc = Accelerator(cpu=True)
    resolve_peak_flops(tiny_cfg(tmp_path), acc)  # an idle start: the machine's best is cached
    rate["fp32"] = 93.1e9                        # this start: a busy machine
    monkeypatch.setattr(precision, "_MEASURED", {})
    cfg = tiny_cfg(tmp_path, "train.mixed_precision=auto")
    choice = resolve_mixed_precision(cfg, torch.device("cpu"))
    peak = resolve_peak_flops(cfg, acc)
    caplog.set_level(logging.INFO, logger="scale.training.startup")
    report_precision(choice, acc)
    report_peak(peak, acc)
    lines = [r.getMessage().removeprefix("[RANK 0] ") for r in caplog.records if r.name == "scale.training.startup"]
    assert lines[0] == ("train.mixed_precision=auto -> no: bf16 GEMMs measure 0.50x fp32 on this cpu (< 1.3x) "
                        "(this start's probes, one short GEMM each, for their ratio only: fp32 93.1 GFLOP/s, bf16 "
                        "46.5 GFLOP/s; train/mfu divides by the MFU peak below)")
    assert lines[1].startswith("MFU peak: 182 GFLOP/s per device (measured: float32 GEMM ")
    assert "best of 3 probes of 20" in lines[1] and peak.flops == 182e9 and peak_cache_path().is_file()


def test_the_main_jobs_first_warning_is_the_line_the_readme_quotes(caplog):
    """The main job's split holds 2 of its 400 eval rows among the training rows too: the warning it logs at start-up
    is quoted in the README, word for word, with what it means for the figures."""
    import logging

    from accelerate import PartialState

    from scale.data.mixing import read_rows
    from scale.data.split import count_copies
    from scale.training.startup import log_data_stats
    from scale.utils.assets import resolve_data

    cfg = load_config(None)
    mix = read_rows(cfg.data, resolve_data(cfg.data.path), cfg.train.seed)
    stats = {"data/eval_rows": len(mix.eval), "data/eval_rows_in_train": count_copies(mix.eval, mix.train)}
    assert (stats["data/eval_rows_in_train"], stats["data/eval_rows"]) == (2, 400)
    PartialState()  # accelerate's logger needs its state
    caplog.set_level(logging.WARNING, logger="scale.training.startup")
    log_data_stats(stats, None, "rows")
    [line] = [r.getMessage().removeprefix("[RANK 0] ") for r in caplog.records if r.levelno == logging.WARNING]
    assert line == ("2 of 400 eval rows are exact copies of training rows: eval figures are not fully held out. Set "
                    "data.deduplicate=true to drop duplicates before the split.")
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert f"the job's first WARNING is its own: `{line}`" in readme

"""What a new user meets first: the README's first command run twice, and a one-line error for a bad path that no
library notice precedes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scale.config import load_config
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

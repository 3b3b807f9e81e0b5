"""W&B across requeues (scale/training/tracking.py): one run per job, its history equal to metrics.jsonl, artifacts,
sweeps.

W&B runs offline (tests/conftest.py); the ``.wandb`` files are read back with tests/wandb_records.py.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from scale.cli import override_form
from scale.config.validation import ConfigError
from scale.training.checkpoint import list_checkpoints
from scale.training.metrics import read_jsonl
from scale.training.tracking import RUN_FILE, job_run_id, supersede_offline
from scale.utils.signals import EXIT_PREEMPTED
from tests.conftest import ROOT, TINY_DATA, TINY_YAML, tiny_cfg
from tests.wandb_records import read_run

ENV = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="offline")
ENV.pop("WANDB_RUN_ID", None)
# 12 steps, a row per step, a checkpoint every 4; no MFU timing (start-up speed under a loaded CI machine).
JOB = ["--config", str(TINY_YAML), f"data.path={TINY_DATA}", "log.trackers=[wandb]", "train.max_steps=12",
       "train.log_every=1", "train.eval_every=6", "train.save_every=4", "train.save_every_minutes=null",
       "log.peak_flops=false", "log.wandb_log_model=end", "log.tags=[requeue,test]", "log.group=g1"]


def test_override_forms():
    assert override_form(["--optim.lr=1e-3", "optim.lr=2e-3", "--config=tiny_cpu", "--config", "x",
                          "--accelerate-config=cpu_ddp", "--local_rank=0"]) == [
        "optim.lr=1e-3", "optim.lr=2e-3", "--config=tiny_cpu", "--config", "x", "--accelerate-config=cpu_ddp",
        "--local_rank=0"]


def test_run_id_precedence(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_RUN_ID", raising=False)
    fresh = job_run_id(tmp_path)
    assert len(fresh) == 8 and fresh.isalnum() and fresh != job_run_id(tmp_path)
    (tmp_path / RUN_FILE).write_text(json.dumps({"id": "fromfile"}))
    assert job_run_id(tmp_path) == "fromfile"               # an attempt that died before its first checkpoint
    assert job_run_id(tmp_path, "fromckpt") == "fromckpt"   # the checkpoint's wins
    monkeypatch.setenv("WANDB_RUN_ID", "agent01")
    assert job_run_id(tmp_path, "fromckpt") == "agent01"    # a sweep agent's wins


def test_wandb_log_model_values(tmp_path):
    assert tiny_cfg(tmp_path, "log.wandb_log_model=checkpoint").log.wandb_log_model == "checkpoint"
    assert tiny_cfg(tmp_path, "log.wandb_log_model=false").log.wandb_log_model is False
    with pytest.raises(ConfigError, match=r"log.wandb_log_model='always' must be false, 'end' or 'checkpoint'"):
        tiny_cfg(tmp_path, "log.wandb_log_model=always")


def test_supersede_moves_only_this_runs_other_attempts(tmp_path):
    for name in ("offline-run-20260101_000000-abc", "offline-run-20260102_000000-abc",
                 "offline-run-20260103_000000-abc", "offline-run-20260101_000000-other"):
        (tmp_path / name).mkdir()
    moved = supersede_offline(tmp_path / "offline-run-20260103_000000-abc", "abc")
    assert [p.name for p in moved] == ["offline-run-20260101_000000-abc", "offline-run-20260102_000000-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "offline-run-20260101_000000-other", "offline-run-20260103_000000-abc", "superseded"]


def _start(out, *extra):
    return subprocess.Popen([sys.executable, "-m", "scale.train", *JOB, f"output_dir={out}", *extra], env=ENV,
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _wait_for_step(proc, out, step, timeout=300):
    deadline = time.time() + timeout
    while time.time() < deadline and proc.poll() is None:
        path = out / "metrics.jsonl"
        if path.exists() and any(r.get("step", 0) >= step and "train/loss" in r for r in read_jsonl(path)):
            return
        time.sleep(0.05)
    raise AssertionError(f"step {step} not reached: {proc.poll()} {proc.stderr.read()[-2000:] if proc.poll() else ''}")


@pytest.mark.slow
def test_one_wandb_run_across_sigterm_and_sigkill(tmp_path):
    """SIGTERM mid-run, resume, SIGKILL after a checkpoint (rows logged past it), resume: one run id in every
    offline directory, the complete one alone at the top; its steps equal metrics.jsonl's, each once."""
    out = tmp_path / "run"
    first = _start(out)
    _wait_for_step(first, out, 2)
    first.send_signal(signal.SIGTERM)
    assert first.wait(timeout=300) == EXIT_PREEMPTED, first.stderr.read()[-2000:]
    second = _start(out, "train.resume_from=latest")
    _wait_for_step(second, out, 6)  # the step-4 checkpoint is written; steps 5-6 are logged past it
    second.kill()
    second.wait(timeout=60)
    assert [p.name for p in list_checkpoints(out)][-1] == "step_000004"
    third = _start(out, "train.resume_from=latest")
    assert third.wait(timeout=600) == 0, third.stderr.read()[-2000:]

    run_id = json.loads((out / RUN_FILE).read_text())["id"]
    assert json.loads((list_checkpoints(out)[-1] / "trainer_state.json").read_text())["wandb_run_id"] == run_id
    top = sorted((out / "wandb").glob("offline-run-*"))
    old = sorted((out / "wandb" / "superseded").glob("offline-run-*"))
    assert len(top) == 1 and len(old) == 2 and all(p.name.endswith(f"-{run_id}") for p in top + old)
    runs = [read_run(p) for p in top + old]  # read_run raises on a step logged twice
    # (the SIGKILLed attempt's file may end before its run record: its directory name carries the id)
    assert runs[0]["id"] == run_id and {r["id"] for r in runs} - {None} == {run_id}
    final = runs[0]
    rows = read_jsonl(out / "metrics.jsonl")
    assert sorted(final["history"]) == sorted({r["step"] for r in rows}) == list(range(13))
    for r in rows:  # every figure of metrics.jsonl is in W&B at its step, with its value
        logged = final["history"][r["step"]]
        assert {k: logged[k] for k in r if k != "step"} == {k: v for k, v in r.items() if k != "step"}
    assert f"adapter-{run_id}" in final["artifacts"]
    # the final evaluation's generated samples are a W&B table at its step, row for row samples.jsonl's (issue 20)
    table = final["history"][12]
    assert table["eval/samples/_type"] == "table-file" and table["eval/samples/nrows"] == 4
    data = json.loads((top[0] / "files" / table["eval/samples/path"]).read_text())["data"]
    assert data == [[r["step"], r["row"], r["prompt"], r["reference"], r["completion"], r["exact"]]
                    for r in read_jsonl(out / "samples.jsonl") if r["step"] == 12]
    evals = [r for r in rows if "eval/loss" in r]
    assert [r["step"] for r in evals] == [0, 6, 12] and final["summary"]["eval/loss"] == evals[-1]["eval/loss"]


@pytest.mark.slow
def test_sweep_program_with_wandb_agents_default_command(tmp_path):
    """configs/sweeps/tiny_lr.yaml run as `wandb agent` runs it: ${interpreter} ${program} ${args}."""
    from wandb.sdk.launch.sweeps.utils import create_sweep_command_args
    from wandb.wandb_agent import Agent

    sweep = yaml.safe_load((ROOT / "configs" / "sweeps" / "tiny_lr.yaml").read_text())
    params = {k: {"value": v["value"] if "value" in v else v["values"][1]} for k, v in sweep["parameters"].items()}
    params["train.max_steps"] = {"value": 2}
    params["output_dir"] = {"value": str(tmp_path / "trial")}
    args = create_sweep_command_args({"args": params})["args"]
    assert "--optim.lr=0.001" in args
    macros = {"${env}": [], "${interpreter}": [sys.executable], "${program}": [sweep["program"]], "${args}": args}
    cmd = [part for chunk in Agent.DEFAULT_SWEEP_COMMAND for part in macros.get(chunk, [chunk])]
    env = dict(ENV, WANDB_RUN_ID="sweep0001")
    proc = subprocess.run(cmd + ["log.peak_flops=false"], env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = yaml.safe_load((tmp_path / "trial" / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 1e-3 and saved["lora"]["r"] == 16 and saved["log"]["trackers"] == ["wandb"]
    assert [r["step"] for r in read_jsonl(tmp_path / "trial" / "metrics.jsonl") if "train/loss" in r] == [2]
    [trial] = (tmp_path / "trial" / "wandb").glob("offline-run-*")
    assert read_run(trial)["id"] == "sweep0001"


@pytest.mark.slow
@pytest.mark.parametrize("finetune", ["full", "lora"])
def test_checkpoint_artifact_holds_what_the_checkpoint_trained(tmp_path, finetune):
    """log.wandb_log_model=checkpoint, offline: each checkpoint's artifact holds the files that carry its weights (a
    full run's every shard, a LoRA run's peft adapter) beside trainer_state.json, named as in the checkpoint. In a
    process of its own: wandb keeps one session per process, and a session an earlier test started in this one
    would put the run's files under that test's directory."""
    proc = subprocess.run([sys.executable, "-m", "scale.train", "--config", str(TINY_YAML), f"data.path={TINY_DATA}",
                           f"output_dir={tmp_path}", f"model.finetune={finetune}", "log.trackers=[wandb]",
                           "log.wandb_log_model=checkpoint", "train.max_steps=2", "train.save_every=2",
                           "train.eval_every=0", "log.peak_flops=false", "eval.generate_samples=0",
                           "train.save_adapter=false"], env=ENV, cwd=ROOT, capture_output=True, text=True,
                          timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (top,) = (tmp_path / "wandb").glob("offline-run-*")
    (name, aliases, files), = read_run(top)["artifact_files"]
    trained = (["weights/shard-00000-of-00001.safetensors"] if finetune == "full"
               else ["adapter_config.json", "adapter_model.safetensors"])
    assert name.startswith("model-" if finetune == "full" else "adapter-") and "step_000002" in aliases
    assert files == sorted([*trained, "trainer_state.json"])
    assert all((tmp_path / "checkpoints" / "step_000002" / f).is_file() for f in files)

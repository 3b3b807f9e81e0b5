"""A pending evaluation survives the signal: SIGTERM as an evaluation starts checkpoints the step with its
evaluation marked due (``eval_pending``), and the resumed run evaluates it first, so its eval lines, samples,
``best.json``, early stop, checkpoints and final adapter are the uninterrupted run's. One process here (in this
process); 2 processes (real ``accelerate launch``) in the launch tier below."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file

from scale.train import run
from scale.training.checkpoint import list_checkpoints
from scale.training.metrics import read_jsonl
from scale.utils.signals import Preempted, Preemption
from tests.conftest import tiny_cfg

# eval every 4 steps of 12, samples generated at each evaluation
PLAIN = ["data.max_train_examples=24", "train.micro_batch_size=2", "train.gradient_accumulation_steps=2",
         "train.max_steps=12", "train.eval_every=4", "train.log_every=1", "train.save_every=0",
         "train.save_every_minutes=null", "eval.generate_samples=2", "eval.max_new_tokens=4", "data.eval_size=16",
         "model.gradient_checkpointing=false", "log.peak_flops=false", "lora.dropout=0.1"]
# tests/test_best.py's early stop: eval/accuracy best at step 1, patience 2: the run stops at step 3 of 12
BEST = ["train.eval_every=1", "train.save_every=0", "train.save_total_limit=1", "train.keep_best=eval/accuracy",
        "train.early_stopping_patience=2", "data.eval_size=16", "eval.generate_samples=0",
        "data.max_train_examples=32", "train.gradient_accumulation_steps=1", "model.gradient_checkpointing=false",
        "log.peak_flops=false", "train.log_every=1", "lora.dropout=0.1"]


def _reset():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def outcome(out):
    """What an uninterrupted run and an interrupted + resumed one must share."""
    rows = read_jsonl(out / "metrics.jsonl")
    evals = {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")} for r in rows if "eval/loss" in r}
    samples = out / "samples.jsonl"
    best = out / "best.json"  # its checkpoint path is checked to be under output_dir, then compared by name
    if best.exists():
        assert json.loads(best.read_text())["checkpoint"].startswith(str(out / "checkpoints"))
    return {"evals": evals, "stops": [r for r in rows if "train/early_stopped" in r],
            "train": {r["step"]: r["train/loss"] for r in rows if "train/loss" in r},
            "samples": [(r["step"], r["row"], r["completion"]) for r in map(json.loads, samples.read_text().splitlines())]
            if samples.exists() else [],
            "best": {**json.loads(best.read_text()), "checkpoint": "under output_dir"} if best.exists() else None,
            "checkpoints": [(p.name, reason) for p in list_checkpoints(out)  # the pre-empted one aside
                            if (reason := json.loads((p / "trainer_state.json").read_text())["reason"]) != "preempted"]}


def same_adapter(a, b):
    x, y = load_file(a / "adapter" / "adapter_model.safetensors"), load_file(b / "adapter" / "adapter_model.safetensors")
    return x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    refs = {}
    for name, job in (("plain", PLAIN), ("best", BEST)):
        out = tmp_path_factory.mktemp(f"ref-{name}")
        run(tiny_cfg(out, *job))
        _reset()
        refs[name] = out
    return refs


@pytest.mark.parametrize("job, at", [("plain", 8), ("plain", 12), ("best", 2), ("best", 3)],
                         ids=["mid-run", "final", "mid-run-keep-best-patience", "early-stop-keep-best-patience"])
def test_sigterm_at_an_evaluation_then_resume_equals_the_uninterrupted_run(references, tmp_path, job, at,
                                                                            monkeypatch):
    import scale.train
    from tests.sigterm_eval import enable

    overrides = PLAIN if job == "plain" else BEST
    out = tmp_path / "run"
    monkeypatch.setattr(scale.train, "evaluate_and_log", scale.train.evaluate_and_log)  # restored after the test
    enable(at, target=os.getpid())
    preemption = Preemption()
    preemption.install()
    try:
        with pytest.raises(Preempted, match=f"pre-empted at step {at}"):
            run(tiny_cfg(out, *overrides), preemption)
    finally:
        preemption.uninstall()
    _reset()
    saved = json.loads((out / "checkpoints" / f"step_{at:06d}" / "trainer_state.json").read_text())
    assert (saved["reason"], saved["eval_pending"]) == ("preempted", True)
    assert at not in outcome(out)["evals"]  # the interrupted evaluation was not logged
    monkeypatch.undo()
    run(tiny_cfg(out, *overrides, "train.resume_from=latest"))
    ref, got = outcome(references[job]), outcome(out)
    assert got["evals"] == ref["evals"] and at in got["evals"]
    assert got == ref  # train losses, samples, best.json, the early stop, the checkpoints kept and their reasons
    assert same_adapter(references[job], out)


@pytest.mark.launch
def test_two_processes_sigterm_at_a_mid_run_then_at_the_final_evaluation(tmp_path):
    """DDP on 2 processes with keep_best and patience: SIGTERM as step 8's evaluation starts, resumed; SIGTERM as
    the final (step 12) one starts, resumed again: the eval lines, best.json, checkpoints and adapter are the
    uninterrupted run's."""
    from tests.launching import ROOT, TINY, accelerate_cmd

    job = ["--config", str(TINY), *PLAIN, "eval.generate_samples=0", "train.keep_best=eval/loss",
           "train.early_stopping_patience=3", "train.save_total_limit=1", "log.trackers=[]",
           f"data.path={ROOT / 'configs' / 'data' / 'tiny_reviews.jsonl'}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}

    def launch(out, *extra, at=None):
        cmd = accelerate_cmd("cpu_ddp.yaml")
        if at is not None:
            cmd[cmd.index("scale.train")] = "tests.sigterm_eval"
        log = (out.parent / f"{out.name}-{at}.log")
        with open(log, "w") as fh:
            code = subprocess.run(cmd + job + [f"output_dir={out}", *extra], cwd=ROOT, stdout=fh,
                                  stderr=subprocess.STDOUT, env={**env, "SCALE_TEST_SIGTERM_EVAL": str(at or 0)},
                                  timeout=600, check=False).returncode
        return code, log.read_text(errors="replace")

    ref, out = tmp_path / "ref", tmp_path / "run"
    code, log = launch(ref)
    assert code == 0, log[-3000:]
    for at in (8, 12):
        code, log = launch(out, *(["train.resume_from=latest"] if at == 12 else []), at=at)
        assert code != 0 and "exit code 75" in log, log[-3000:]
        saved = json.loads((out / "checkpoints" / f"step_{at:06d}" / "trainer_state.json").read_text())
        assert (saved["step"], saved["eval_pending"]) == (at, True)
    code, log = launch(out, "train.resume_from=latest")
    assert code == 0, log[-3000:]
    a, b = outcome(ref), outcome(out)
    assert sorted(b["evals"]) == [0, 4, 8, 12] and b == a
    assert same_adapter(ref, out)

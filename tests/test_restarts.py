"""Restarts that recover (issue 21, item 2): a signal during start-up stops at once, ``train.resume_from=auto``,
and a failed process-group rendezvous retried within the attempt."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from scale.config.load import dump_config
from scale.distributed.rendezvous import is_rendezvous_failure, with_rendezvous_retries
from scale.train import run
from scale.training.checkpoint import CheckpointError, check_fresh_start, list_checkpoints
from scale.utils.signals import EXIT_PREEMPTED, Preempted, Preemption
from tests.conftest import tiny_cfg
from tests.launching import ROOT

FAST = ["train.max_steps=2", "train.log_every=1", "train.eval_every=0", "data.max_train_examples=32",
        "data.eval_size=16", "log.peak_flops=1e12", "train.save_every=1"]


def test_sigterm_one_second_after_start_exits_within_two_seconds(tmp_path):
    """A worker still importing torch/transformers leaves with the pre-emption code at once: no evaluation, no
    checkpoint, no file in output_dir (torch elastic would otherwise wait 30 s for it)."""
    out = tmp_path / "run"
    cmd = [str(ROOT / ".venv" / "bin" / "scale-train") if (ROOT / ".venv" / "bin" / "scale-train").exists()
           else sys.executable, *([] if (ROOT / ".venv" / "bin" / "scale-train").exists() else ["-m", "scale.train"]),
           "--config", "tiny_cpu", f"output_dir={out}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "WANDB_MODE": "offline"})
    time.sleep(1.0)
    sent = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=30)
    took = time.monotonic() - sent
    assert proc.returncode == EXIT_PREEMPTED, err[-2000:]
    assert took < 2.0, took
    assert "while starting up" in err
    assert not out.exists() or not any(out.iterdir())  # no checkpoint, no metrics, no config.yaml


def test_signal_during_start_up_raises_at_once_then_waits_for_the_step_boundary():
    p = Preemption()
    p.install()
    try:
        with pytest.raises(Preempted, match="while starting up"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(1)  # the handler raises at the next bytecode, long before this ends
        p.signum = None
        p.defer()  # training starts: the next signal is only recorded
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
        assert p.requested and p.signum == signal.SIGTERM
    finally:
        p.uninstall()
    q = Preemption()
    q.immediate, q.signum = True, signal.SIGTERM  # recorded where the handler's exception was swallowed
    with pytest.raises(Preempted, match="before training started"):
        q.defer()


def test_rendezvous_failures_are_retried_with_backoff_then_given_up():
    calls, waits = [], []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:144] connect [127.0.0.1]:29500: "
                               "Connection refused")
        return "acc"

    assert with_rendezvous_retries(flaky, retries=3, backoff_s=0.5, sleep=waits.append) == "acc"
    assert len(calls) == 3 and waits == [0.5, 1.0]
    calls.clear()
    waits.clear()
    with pytest.raises(RuntimeError, match="Connection refused"):
        with_rendezvous_retries(lambda: flaky() if False else (_ for _ in ()).throw(
            RuntimeError("Connection refused")), retries=2, backoff_s=1, sleep=waits.append)
    assert waits == [1, 2]
    with pytest.raises(ValueError):  # any other error is not retried
        with_rendezvous_retries(lambda: (_ for _ in ()).throw(ValueError("bad")), retries=3, sleep=waits.append)
    assert waits == [1, 2]
    assert not is_rendezvous_failure(RuntimeError("CUDA out of memory"))


def test_resume_auto_refuses_a_foreign_config_yaml_in_one_line(tmp_path):
    from accelerate import PartialState

    PartialState(cpu=True)  # check_fresh_start logs through accelerate's logger
    out = tmp_path / "run"
    other = tiny_cfg(out, "optim.lr=0.1")
    out.mkdir()
    dump_config(other, out / "config.yaml")
    (out / "metrics.jsonl").write_text('{"step": 0, "data/train_rows": 1}\n')  # an attempt that died early
    with pytest.raises(CheckpointError) as e:
        check_fresh_start(tiny_cfg(out, "train.resume_from=auto"))
    assert "\n" not in str(e.value) and "holds another run" in str(e.value) and "optim.lr" in str(e.value)
    check_fresh_start(tiny_cfg(out, "train.resume_from=auto", "optim.lr=0.1"))  # the same run: starts again


@pytest.mark.slow
def test_resume_auto_starts_fresh_resumes_its_own_and_refuses_another_run(tmp_path):
    from accelerate.state import AcceleratorState, GradientState

    def reset():
        AcceleratorState._reset_state(True)
        GradientState._reset_state()

    out = tmp_path / "run"
    run(tiny_cfg(out, *FAST, "train.resume_from=auto", "train.max_steps=1", "optim.schedule=constant"))  # fresh
    reset()
    assert [p.name for p in list_checkpoints(out)] == ["step_000001"]
    run(tiny_cfg(out, *FAST, "train.resume_from=auto", "optim.schedule=constant"))  # 2 steps: harmless change
    reset()
    assert [p.name for p in list_checkpoints(out)] == ["step_000001", "step_000002"]  # resumed at 1, not refused
    with pytest.raises(CheckpointError) as e:
        run(tiny_cfg(out, *FAST, "train.resume_from=auto", "optim.lr=0.5", "optim.schedule=constant"))
    reset()
    assert "\n" not in str(e.value) and "holds another run" in str(e.value) and "optim.lr" in str(e.value)

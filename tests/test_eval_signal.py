"""A SIGTERM during a long evaluation (issue 20): the evaluation stops at the next eval batch and the checkpoint
of the last finished optimizer step is written within seconds, not after the whole evaluation."""

from __future__ import annotations

import json
import os
import signal
import time

import pytest

from scale.train import fit
from scale.training.job import setup
from scale.training.metrics import read_jsonl
from scale.utils.signals import Preempted, Preemption
from tests.conftest import tiny_cfg

BATCH_S = 0.25   # each eval batch (1 row) made this slow: the step-1 evaluation of 32 rows would take >= 8 s


def test_sigterm_during_evaluation_checkpoints_within_seconds(tmp_path):
    out = tmp_path / "run"
    job = setup(tiny_cfg(out, "train.max_steps=4", "train.eval_every=1", "train.save_every=0",
                         "train.save_every_minutes=null", "data.eval_size=32", "train.eval_micro_batch_size=1",
                         "eval.generate_samples=2", "data.max_train_examples=16",
                         "train.gradient_accumulation_steps=1", "model.gradient_checkpointing=false",
                         "log.peak_flops=false", "train.log_every=1"))
    loader, sent, seen = job.eval_dl, [], []

    class SlowEval:
        """The real eval loader; during the step-1 evaluation each batch takes BATCH_S and SIGTERM arrives
        (from the OS, to this process) while the third batch is being evaluated."""

        def __iter__(self):
            for i, batch in enumerate(loader):
                if job.state.step == 1:
                    seen.append(i)
                    time.sleep(BATCH_S)
                    if i == 2:
                        sent.append(time.time())
                        os.kill(os.getpid(), signal.SIGTERM)
                yield batch

    job.eval_dl = SlowEval()
    preemption = Preemption()
    preemption.install()
    try:
        with pytest.raises(Preempted, match="pre-empted at step 1"):
            fit(job, preemption)
    finally:
        preemption.uninstall()
        job.acc.end_training()
    state = json.loads((out / "checkpoints" / "step_000001" / "trainer_state.json").read_text())
    delay = state["saved_at"] - sent[0]
    assert state["reason"] == "preempted" and state["step"] == 1
    assert delay < 5.0, f"checkpoint {delay:.2f} s after the signal"
    print(f"checkpoint written {delay:.2f} s after SIGTERM; the evaluation alone would take >= {32 * BATCH_S} s")
    assert seen == [0, 1, 2]                   # the evaluation stopped after the batch in flight, of 32
    rows = read_jsonl(out / "metrics.jsonl")
    assert [r["step"] for r in rows if "eval/loss" in r] == [0]   # the interrupted evaluation is not logged
    assert [r["step"] for r in rows if "train/loss" in r] == [1]

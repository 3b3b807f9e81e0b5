"""Test-only entry point: ``scale.train`` with a SIGTERM that arrives as the evaluation of one optimizer step starts.
Never imported by ``scale/``.

    SCALE_TEST_SIGTERM_EVAL=8 accelerate launch --config_file configs/accelerate/cpu_ddp.yaml -m tests.sigterm_eval ...

:func:`enable` wraps ``scale.train.evaluate_and_log``: the first time it is called for that step during training, the
main process sends SIGTERM (to the launcher, which forwards it to every rank, as SLURM's does; in-process: to
itself) and every rank waits until its own handler recorded the signal, so the evaluation stops at its first batch,
on every rank together (the stop rides in the gathered table).
"""

from __future__ import annotations

import os
import signal
import time


def enable(step: int, target: int | None = None) -> None:
    """Send SIGTERM to ``target`` (default: the launcher, this process's parent) when step ``step``'s evaluation
    starts, once per process."""
    from scale import train

    original = train.evaluate_and_log
    fired: list[bool] = []

    def evaluate_and_log(job, preemption=None):
        if job.state.step == step and preemption is not None and not fired:
            fired.append(True)
            if job.acc.is_main_process:
                os.kill(os.getppid() if target is None else target, signal.SIGTERM)
            deadline = time.time() + 60
            while not preemption.requested and time.time() < deadline:
                time.sleep(0.01)
        return original(job, preemption)

    train.evaluate_and_log = evaluate_and_log


if __name__ == "__main__":  # the training entry point, as `python -m scale.train`, with the signal
    import runpy

    enable(int(os.environ["SCALE_TEST_SIGTERM_EVAL"]))
    runpy.run_module("scale.cli", run_name="__main__", alter_sys=True)

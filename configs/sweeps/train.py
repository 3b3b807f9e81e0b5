"""The program of a W&B sweep (``program:`` in ``configs/sweeps/*.yaml``), run by ``wandb agent``'s default command
``${env} ${interpreter} ${program} ${args}``: ``python configs/sweeps/train.py --optim.lr=0.001 ...``.

It is ``scale-train`` with two defaults a sweep needs: each trial trains into its own
``output_dir=runs/sweeps/<W&B run id>`` and logs to W&B (``log.trackers=[wandb]``); the agent's ``WANDB_RUN_ID`` is
the run id (:mod:`scale.training.tracking`), so a requeued trial resumed with ``train.resume_from=latest`` continues it.
Either default gives way to an argument that sets it.
"""

import os
import sys

from scale.cli import cli, override_form

if __name__ == "__main__":
    given = {a.split("=", 1)[0] for a in override_form(sys.argv[1:]) if "=" in a}
    if "output_dir" not in given:
        sys.argv.append(f"output_dir=runs/sweeps/{os.environ.get('WANDB_RUN_ID', 'no-agent')}")
    if "log.trackers" not in given:
        sys.argv.append("log.trackers=[wandb]")
    cli()

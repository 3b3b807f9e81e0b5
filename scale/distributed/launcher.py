"""``scale-train --accelerate-config NAME``: the job under ``accelerate launch`` with a shipped (or own) accelerate
config, one process per visible GPU (2 CPU processes without one, or ``--num-processes``), signals forwarded, and the
job's own exit code and one-line message passed through (:func:`launch_with_accelerate`). The ranks leave their
outcome in :data:`OUTCOME_DIR` (:func:`scale.cli._error`).

No torch, no accelerate import: the wrapper starts the launcher without either.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from scale.config.load import configs_dir, named_config, yaml_load
from scale.distributed.topology import processes_for, usable_cores, visible_gpus

OUTCOME_DIR = "SCALE_OUTCOME_DIR"  # set by --accelerate-config: ranks leave their exit code and message there


def without_accelerate_config(argv: list[str]) -> list[str]:
    """``argv`` without the wrapper's own options (``--accelerate-config``, ``--num-processes``): the job's."""
    own = ("--accelerate-config", "--num-processes", "--num_processes")
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in own:
            skip = True
        elif not arg.startswith(tuple(f"{o}=" for o in own)):
            out.append(arg)
    return out


# `accelerate launch` (accelerate.commands.launch's main) run so that a job that reported its outcome (every bad-input
# error: one line, printed by launch_with_accelerate) ends without torch elastic's ChildFailedError traceback and
# summary, which repeat that line; any other failure (a crash, no report) keeps both.
_LAUNCHER = f"""
import os, sys
from accelerate.commands.launch import main
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
sys.argv[0] = "accelerate launch"
try:
    main()
except ChildFailedError:
    if not any(n.startswith("rank_") for n in os.listdir(os.environ["{OUTCOME_DIR}"])):
        raise
    sys.exit(1)
"""


def launch_with_accelerate(name_or_path: str, job_args: list[str], num_processes: int | None = None) -> int:
    """Run ``scale-train job_args`` under ``accelerate launch`` with a (shipped or own) accelerate config.

    The process count is ``num_processes``, else one per visible GPU for a shipped GPU topology (2 CPU processes
    without a GPU), else the YAML's (:func:`scale.distributed.topology.processes_for`), passed as ``--num_processes``; a
    count this machine cannot hold is refused before anything starts. The config's relative ``deepspeed_config_file``
    is read relative to the YAML and passed on as an absolute ``--deepspeed_config_file``, so the launch works from
    any directory. SIGTERM/SIGINT are forwarded to the launcher (which forwards them to the ranks: pre-emption
    works as without the wrapper). When a rank reported an outcome (:func:`scale.cli._error`), its message is printed
    last and its exit code is returned, whatever the launcher's own code (torch elastic turns every failure into 1), and
    the launcher's ``ChildFailedError`` traceback and summary, which repeat it, are left out (:data:`_LAUNCHER`).

    Returns:
        The job's exit code.

    Raises:
        ConfigError: the accelerate config is neither a file nor a shipped name; the process count does not fit.
    """
    yaml_path = named_config(name_or_path, kind="accelerate").resolve()
    tree = yaml_load(yaml_path.read_text(encoding="utf-8")) or {}
    shipped = yaml_path.parent == (configs_dir() / "accelerate").resolve()
    count, why = processes_for(tree, yaml_path.stem, num_processes, visible_gpus(), usable_cores(), shipped)
    sys.stderr.write(f"scale-train: accelerate launch --config_file {yaml_path.name} --num_processes {count} "
                     f"({why})\n")
    cmd = [sys.executable, "-c", _LAUNCHER, "--config_file", str(yaml_path), "--num_processes", str(count)]
    ds = (tree.get("deepspeed_config") or {}).get("deepspeed_config_file")
    if isinstance(ds, str) and ds != "none" and not Path(ds).is_absolute() and (yaml_path.parent / ds).is_file():
        cmd += ["--deepspeed_config_file", str((yaml_path.parent / ds).resolve())]
    with tempfile.TemporaryDirectory(prefix="scale-outcome-") as outcome:
        proc = subprocess.Popen([*cmd, "-m", "scale.train", *job_args], env={**os.environ, OUTCOME_DIR: outcome})
        forward = {s: signal.signal(s, lambda signum, frame: proc.send_signal(signum))
                   for s in (signal.SIGTERM, signal.SIGINT)}
        try:
            code = proc.wait()
        finally:
            for s, handler in forward.items():
                signal.signal(s, handler)
        reports = sorted((json.loads(p.read_text()) for p in Path(outcome).glob("rank_*.json")),
                         key=lambda r: r["rank"])
    if code != 0 and reports:
        sys.stderr.write(reports[0]["line"] + "\n")
        return int(reports[0]["code"])
    return code

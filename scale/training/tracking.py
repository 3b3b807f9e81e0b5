"""Trackers across requeues: one W&B run per job, whatever number of attempts (pre-emptions, crashes) it took.

The run id is chosen once per job and kept in ``<output_dir>/wandb_run.json`` and in every checkpoint
(``trainer_state.json``: ``wandb_run_id``); each attempt calls ``wandb.init(id=..., resume="allow")``. A sweep
agent's ``WANDB_RUN_ID`` wins over both. ``metrics.jsonl`` is the record of the run; the tracker is made equal
to it at start-up:

- **online**: the server knows what it holds (``run.starting_step``: the step after its last row). Rows of
  ``metrics.jsonl`` up to the checkpoint that it lacks (lost in a crash before they were flushed) are logged at
  start-up; steps re-trained after the checkpoint that it already holds are *not* logged again (W&B steps are
  monotonic): their values are the first attempt's, equal in loss, gradient norm and lr because resume is
  bit-exact; only throughput figures may differ from ``metrics.jsonl``;
- **offline**: each attempt writes its own ``wandb/offline-run-*-<id>`` directory, and ``wandb sync`` does not
  join directories: the one synced last replaces the run's history (wandb#3841, wandb#5865). So every attempt
  logs the whole history (the rows of ``metrics.jsonl`` up to its checkpoint, then its own steps) and moves the
  earlier attempts' directories of the same run to ``wandb/superseded/`` (kept, never deleted): ``wandb sync
  wandb/offline-run-*`` then uploads one complete run.

A tracker failure never stops training (one warning; ``metrics.jsonl`` goes on).
"""

from __future__ import annotations

import json
import logging
import os
import random
import shutil
import string
from pathlib import Path
from typing import TYPE_CHECKING, Any

from scale.config.load import redact, to_dict
from scale.config.schema import Config
from scale.training.metrics import drop_trackers, read_jsonl
from scale.utils.fileio import write_text_atomic

if TYPE_CHECKING:
    from accelerate import Accelerator

logger = logging.getLogger(__name__)

RUN_FILE = "wandb_run.json"  # {"id": ..., "project": ...}: the job's W&B run, kept across attempts


def new_run_id() -> str:
    """A fresh W&B-style run id: 8 characters of ``[a-z0-9]``."""
    return "".join(random.SystemRandom().choice(string.ascii_lowercase + string.digits) for _ in range(8))


def job_run_id(output_dir: str | Path, saved: str = "") -> str:
    """The W&B run id of this job: a sweep agent's ``WANDB_RUN_ID``, else the checkpoint's (``saved``), else
    ``<output_dir>/wandb_run.json``'s (an attempt that died before its first checkpoint), else a new one."""
    if os.environ.get("WANDB_RUN_ID"):
        return os.environ["WANDB_RUN_ID"]
    if saved:
        return saved
    try:
        return json.loads((Path(output_dir) / RUN_FILE).read_text(encoding="utf-8"))["id"]
    except (OSError, ValueError, KeyError, TypeError):
        return new_run_id()


def start_trackers(cfg: Config, acc: Accelerator, state: Any) -> int:
    """Start the trackers on the main process, continuing this job's W&B run, and log the rows of
    ``metrics.jsonl`` it lacks (module docstring). W&B without an API key runs offline (one-line notice).

    Args:
        cfg: the run's config (``log.*``, ``output_dir``).
        acc: the run's Accelerator.
        state: the :class:`scale.training.checkpoint.TrainerState` of this attempt; its ``wandb_run_id`` is read (a
            resumed checkpoint's) and set (so that the next checkpoint keeps it).

    Returns:
        ``skip_below``: steps below it are not sent to the trackers (an online run that already holds them).
    """
    trackers = [t for t in cfg.log.trackers if t != "none"]
    if not trackers:
        return 0
    init_kwargs: dict[str, Any] = {}
    out = Path(cfg.output_dir)
    if "wandb" in trackers:
        if not os.environ.get("WANDB_API_KEY") and not os.environ.get("WANDB_MODE"):
            os.environ["WANDB_MODE"] = "offline"
            if acc.is_main_process:
                logger.info("W&B: no API key configured, logging offline to %s/wandb (upload later with "
                            "`wandb sync`)", cfg.output_dir)
        state.wandb_run_id = job_run_id(out, getattr(state, "wandb_run_id", ""))
        if acc.is_main_process:
            out.mkdir(parents=True, exist_ok=True)
            write_text_atomic(out / RUN_FILE, json.dumps({"id": state.wandb_run_id, "project": cfg.log.project}))
        name = redact(cfg.log.run_name) if cfg.log.run_name else None  # a secret pasted into the name stays out
        init_kwargs["wandb"] = {"dir": cfg.output_dir, "name": name, "id": state.wandb_run_id,
                                "resume": "allow", "tags": list(cfg.log.tags) or None, "group": cfg.log.group,
                                "entity": cfg.log.entity}
    try:
        acc.init_trackers(cfg.log.project, config=to_dict(cfg), init_kwargs=init_kwargs)  # main process only
    except Exception as e:  # noqa: BLE001 - any tracker failure must not stop training
        drop_trackers(acc, e, trackers)
        return 0
    if "wandb" not in trackers or not acc.is_main_process:
        return 0
    try:
        return catch_up(acc, out / "metrics.jsonl")
    except Exception as e:  # noqa: BLE001
        drop_trackers(acc, e)
        return 0


def wandb_run(acc: Accelerator) -> Any:
    """The live ``wandb.Run`` of the main process, or ``None`` (no W&B tracker, another rank, dropped)."""
    if not acc.is_main_process or not any(getattr(t, "name", "") == "wandb" for t in acc.trackers):
        return None
    return acc.get_tracker("wandb", unwrap=True)


def catch_up(acc: Accelerator, metrics_path: Path) -> int:
    """Log the rows of ``metrics_path`` (already cut to the checkpoint's step) that the W&B run lacks; move
    earlier offline attempts of this run to ``wandb/superseded/``. Main process.

    Returns:
        ``skip_below`` (see :func:`start_trackers`).
    """
    run = wandb_run(acc)
    if run is None:
        return 0
    first = 0 if run.offline else int(run.starting_step or 0)
    rows = read_jsonl(metrics_path) if metrics_path.exists() else []
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        step = int(row.get("step", 0))
        if step >= first:
            by_step.setdefault(step, {}).update({k: v for k, v in row.items() if k != "step"})
    for step in sorted(by_step):
        run.log(by_step[step], step=step)
    if run.offline:
        supersede_offline(Path(run.settings.sync_dir), run.id)
    if by_step:
        logger.info("W&B run %s: logged %d step(s) of metrics.jsonl it lacked (%d..%d)%s", run.id, len(by_step),
                    min(by_step), max(by_step), "" if run.offline else f"; it holds steps < {first}")
    return first


def supersede_offline(current: Path, run_id: str) -> list[Path]:
    """Move the other ``offline-run-*-<run_id>`` directories beside ``current`` to ``<wandb dir>/superseded/``:
    ``current`` holds the whole history, and a later ``wandb sync`` of an older one would replace it."""
    moved = []
    for old in sorted(current.parent.glob(f"offline-run-*-{run_id}")):
        if old.resolve() != current.resolve() and old.is_dir():
            dest = current.parent / "superseded" / old.name
            dest.parent.mkdir(exist_ok=True)
            shutil.move(str(old), str(dest))
            moved.append(dest)
    if moved:
        logger.info("W&B offline: this attempt holds run %s's whole history; earlier attempts moved to %s "
                    "(sync only %s)", run_id, current.parent / "superseded", current)
    return moved


def finish_trackers(acc: Accelerator, final: dict[str, Any]) -> None:
    """Set the W&B run summary to the final evaluation (main process; a failure costs one warning)."""
    run = wandb_run(acc)
    if run is None or not final:
        return
    try:
        run.summary.update(dict(final))
    except Exception as e:  # noqa: BLE001
        drop_trackers(acc, e)


def log_model(acc: Accelerator, cfg: Config, path: Path, kind: str, step: int, aliases: list[str],
              files: tuple[str, ...] | None = None) -> None:
    """Log ``path`` (a directory; only ``files`` of it when given) as a W&B artifact of type ``model`` named
    ``<kind>-<run id>``, with ``aliases`` and the step in its metadata. Main process; no-op without W&B; a
    failure costs one warning."""
    run = wandb_run(acc)
    if run is None:
        return
    try:
        import wandb

        artifact = wandb.Artifact(f"{kind}-{run.id}", type="model", metadata={"step": step, "kind": kind})
        for name in files or ():
            if (path / name).exists():
                artifact.add_file(str(path / name), name=name)
        if files is None:
            artifact.add_dir(str(path))
        run.log_artifact(artifact, aliases=aliases)
    except Exception as e:  # noqa: BLE001 - an artifact upload must not stop training
        logger.warning("W&B: could not log %s as an artifact (%s: %s); training goes on", path, type(e).__name__, e)

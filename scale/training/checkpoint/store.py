"""The checkpoints of a run on disk: where they are (``<output_dir>/checkpoints/step_NNNNNN/``), which are
complete, whether their files still match what was recorded at save, which one a resume takes, which are rotated
out, and a previous run's artefacts cleared on ``train.overwrite_output_dir``.

Layout of one checkpoint ``<output_dir>/checkpoints/step_000040/``:

    trainer_state.json          our counters (step, epoch, windows done in the epoch), the launch mode, world size,
                                data-parallel ranks and global batch G that wrote it, the config, and every other
                                file's size and sha256; written last: a directory without it is not a checkpoint
    adapter_model.safetensors   the trainable (LoRA) tensors, whole; the frozen base is rebuilt from the config
    optimizer_state.safetensors their optimizer state, whole, by tensor name (:mod:`scale.training.checkpoint.portable`)
    custom_checkpoint_0.pkl     the LR scheduler (registered for checkpointing: it is not ``prepare``d)
    random_states_<rank>.pkl    Python, NumPy and torch RNG states of every rank
    optimizer.bin               one device / DDP: accelerate's optimizer file (read back with ``weights_only=True``)
    pytorch_model/              DeepSpeed only: its own files (frozen parameters excluded), read by DeepSpeed
    pytorch_model_fsdp_0/ optimizer_0/   FSDP2 only: accelerate's sharded DCP files (the whole model; read back)

A full fine-tune's checkpoint (``model.finetune=full``) holds ``trainer_state.json``, ``custom_checkpoint_0.pkl``,
``random_states_<rank>.pkl`` and ``weights/shard-<rank>-of-<world>.safetensors`` (every rank's ranges of the fp32
weights and optimizer state, :mod:`scale.training.checkpoint.sharded`) and nothing else: any launch mode on any
number of processes reads them.

The first four files are the portable state (:mod:`scale.training.checkpoint.portable`): any launch mode on any number
of processes loads them, as long as the global batch ``G`` is the same (:func:`scale.training.state.resume_accumulation`
recomputes ``gradient_accumulation_steps``). A resume in the same mode on the same processes reads the mode's own files
(``accelerate.load_state``), bit-exact as before.

Atomicity: every rank writes into ``step_000040.tmp/``; after a barrier the writer records every file's size and
sha256 in ``trainer_state.json`` and the directory is renamed (one ``os.replace``). A crash before the rename
leaves ``*.tmp``, which :func:`list_checkpoints` ignores. ``resume_from=latest|auto`` takes the newest checkpoint
whose files still match what was recorded (:func:`pick_resume`): one damaged after it was written (a copy cut
short, a file system that lost a file's tail) is skipped, named in the log, and left in place.

Security: weights are safetensors; accelerate reads its ``.bin``/``.pkl`` files with ``weights_only=True``.
DeepSpeed reads its own ``pytorch_model/`` files with full pickle: resume only from checkpoints you wrote.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object

from scale.config.schema import Config
from scale.training.state import STATE_FILE, read_state
from scale.utils.fileio import sha256_file

logger = get_logger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable on some rank, or does not match the run."""


def model_files(path: Path, full: bool) -> tuple[str, ...]:
    """The files of checkpoint ``path`` that hold what it trained, relative to it, for a W&B model artifact
    (``log.wandb_log_model=checkpoint``): a LoRA checkpoint's peft adapter (``adapter_config.json``,
    ``adapter_model.safetensors``), a full fine-tune's every shard (``weights/shard-*.safetensors``: the fp32 weights
    with their optimizer state, :mod:`scale.training.checkpoint.sharded`), and ``trainer_state.json``."""
    trained = (sorted(p.relative_to(path).as_posix() for p in (path / "weights").glob("*.safetensors")) if full
               else ["adapter_config.json", "adapter_model.safetensors"])
    return (*trained, STATE_FILE)


def checkpoint_root(output_dir: str | Path) -> Path:
    return Path(output_dir) / "checkpoints"


def list_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints under ``<output_dir>/checkpoints``, oldest first (by step)."""
    return _complete_in(checkpoint_root(output_dir))


def _complete_in(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def step_of(path: Path) -> int:
    """The optimizer step a checkpoint directory ``step_XXXXXX`` holds (-1 for another name)."""
    m = _STEP_DIR.match(path.name)
    return int(m.group(1)) if m else -1


def resolve_resume(resume_from: str | None, output_dir: str | Path) -> Path | None:
    """The checkpoint directory ``train.resume_from`` names, or ``None`` for a fresh start, without verifying its
    files (:func:`pick_resume` does, collectively).

    ``latest`` with no checkpoint yet is a fresh start (a requeued job's first attempt). ``auto`` resolves as
    ``latest``; :func:`check_resume` then also refuses, in one line, a checkpoint (or a ``config.yaml``) of
    another run: the mode for launchers that restart a job (SLURM requeue, torchrun ``--max-restarts``).

    Raises:
        CheckpointError: a path that is not a complete checkpoint.
    """
    if resume_from is None:
        return None
    if resume_from in ("latest", "auto"):
        found = list_checkpoints(output_dir)
        return found[-1] if found else None
    path = Path(resume_from)
    if not (path / STATE_FILE).is_file():
        raise CheckpointError(f"train.resume_from={resume_from!r} is not a complete checkpoint (no {STATE_FILE}); "
                              f"complete ones: {[str(p) for p in list_checkpoints(output_dir)] or 'none'}")
    return path


def record_files(directory: Path) -> dict[str, list[Any]]:
    """``{relative path: [bytes, sha256]}`` of every file under ``directory`` but ``trainer_state.json``."""
    files = sorted(f for f in directory.rglob("*") if f.is_file() and f.name != STATE_FILE)
    return {f.relative_to(directory).as_posix(): [f.stat().st_size, sha256_file(f)] for f in files}


def verify(path: Path) -> str | None:
    """Why checkpoint ``path`` cannot be trusted, in words, or ``None`` when every file it recorded at save has
    the same size and sha256 now (sizes first: a cut file is found without reading it). A checkpoint written
    before files were recorded is only checked for a readable ``trainer_state.json``."""
    try:
        state = read_state(path)
        files = sorted((str(rel), int(size), str(digest)) for rel, (size, digest) in state.files.items())
    except (OSError, ValueError, TypeError, AttributeError) as e:
        return f"{STATE_FILE} cannot be read ({type(e).__name__}: {str(e)[:120]})"
    for rel, size, _ in files:
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} is {f.stat().st_size} bytes, {size} when it was written"
    for rel, _, digest in files:
        now = sha256_file(path / rel)
        if now != digest:
            return f"{rel} has changed since it was written (sha256 {digest[:12]}... -> {now[:12]}...)"
    return None


def pick_resume(acc: Accelerator, cfg: Config) -> Path | None:
    """The checkpoint ``train.resume_from`` resumes from: ``latest``/``auto`` take the newest one whose files
    verify (:func:`verify`; each one skipped is logged with the reason and left in place), a path is taken as
    given (:func:`check_resume` verifies it). ``None``: a fresh start. Collective.

    Each node's main process verifies what its storage holds; the nodes then agree on the newest checkpoint that
    verifies on all of them. A node without the checkpoints (no shared storage) is left to :func:`check_resume`,
    which names it.

    Raises:
        CheckpointError: a path that is not a complete checkpoint; or checkpoints exist and none verifies.
    """
    r = cfg.train.resume_from
    if r not in ("latest", "auto"):
        return resolve_resume(r, cfg.output_dir)
    found = list_checkpoints(cfg.output_dir)[::-1]  # newest first
    verdicts: dict[Path, str | None] = {}
    bound = None
    host = os.uname().nodename
    while True:
        mine = None
        if acc.is_local_main_process:
            for c in found:
                if bound is not None and step_of(c) > bound:
                    continue
                if c not in verdicts:
                    verdicts[c] = verify(c)
                if verdicts[c] is None:
                    mine = c
                    break
        skipped = [(c.name, why) for c, why in verdicts.items() if why is not None]
        mine_entry = (acc.is_local_main_process, host, str(mine) if mine else None, skipped)
        # collective: every rank reaches this, once per round
        report = gather_object([mine_entry]) if acc.num_processes > 1 else [mine_entry]
        picks = {p for main, _, p, _ in report if main}
        if len(picks) <= 1 or None in picks:
            break
        bound = min(step_of(Path(p)) for p in picks)  # the newest one every node holds intact
    mains = [e for e in report if e[0]]
    node = next((e for e in mains if e[1] == host), mains[0])
    chosen, skipped = (Path(node[2]) if node[2] else None), mains[0][3]
    for name, why in skipped:
        logger.warning("resume_from=%s: skipping checkpoint %s: %s (left in place)", r,
                       checkpoint_root(cfg.output_dir) / name, why, main_process_only=True)
    if chosen is None and found and all(e[2] is None for e in mains) and skipped:
        listing = "; ".join(f"{name}: {why}" for name, why in skipped)
        raise CheckpointError(f"train.resume_from={r}: no checkpoint in {checkpoint_root(cfg.output_dir)} verifies "
                              f"({listing}). They are left in place: restore the damaged files, or start a new "
                              f"run in another output_dir.")
    return chosen


def _is_writer(acc: Accelerator) -> bool:
    """The process that writes shared files: the main one, or each node's with ``save_on_each_node``."""
    return acc.is_main_process or (acc.project_configuration.save_on_each_node and acc.is_local_main_process)


def rotate(output_dir: str | Path, limit: int | None, keep: int | None = None, upto: int | None = None) -> list[Path]:
    """Delete all but the ``limit`` newest complete checkpoints, never step ``keep`` (``train.keep_best``'s
    checkpoint, which does not count against ``limit``); ``limit=None`` keeps all. With ``upto`` (the step just
    written) checkpoints of later steps are neither counted nor deleted: they belong to an attempt this run
    resumed before (one skipped as damaged, or an explicit older ``resume_from``), and a save of the same step
    replaces them. Returns the deleted ones."""
    found = [p for p in list_checkpoints(output_dir)
             if (keep is None or p.name != f"step_{keep:06d}") and (upto is None or step_of(p) <= upto)]
    gone = found[:-limit] if limit else []
    for old in gone:
        shutil.rmtree(old, ignore_errors=True)
    return gone


RUN_ARTEFACTS = ("adapter", "metrics.jsonl", "config.yaml", "wandb_run.json")  # what a run writes besides checkpoints/


SIDE_FILES = ("samples.jsonl", "best.json")  # written beside metrics.jsonl: deleted with the run, not named


def clear_previous_run(acc: Accelerator, cfg: Config, resume: Path | None) -> None:
    """``train.overwrite_output_dir=true`` on a fresh start: delete the previous run's artefacts (checkpoints/,
    adapter/, metrics.jsonl, config.yaml; nothing else) before this run writes its own. Collective."""
    out = Path(cfg.output_dir)
    if resume is not None or not cfg.train.overwrite_output_dir:
        return
    if _is_writer(acc):
        shutil.rmtree(checkpoint_root(out), ignore_errors=True)
    if acc.is_main_process:
        found = [name for name in RUN_ARTEFACTS + SIDE_FILES if (out / name).exists()]
        for path in (out / name for name in found):
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        if found:
            logger.warning("train.overwrite_output_dir=true: deleted the previous run's %s in %s", found, out)
    acc.wait_for_everyone()  # collective: nobody writes before the old files are gone


def check_intact(acc: Accelerator, path: Path) -> None:
    """An explicitly named checkpoint verifies on every node (:func:`verify`), or one line names the damaged file
    and the newest intact checkpoint beside it. Collective.

    Raises:
        CheckpointError: a file differs from what was recorded at save.
    """
    message = None
    if acc.is_local_main_process:
        problem = verify(path)
        if problem is not None:
            siblings = [c for c in _complete_in(path.parent)[::-1] if c != path]
            intact = next((c for c in siblings if verify(c) is None), None)
            message = (f"checkpoint {path} is damaged: {problem}; the newest intact checkpoint is "
                       + (f"{intact} (train.resume_from={intact}, or latest)" if intact else
                          "none (restore the damaged file, or start a new run in another output_dir)"))
    found = [m for m in (gather_object([message]) if acc.num_processes > 1 else [message]) if m]  # collective
    if found:
        raise CheckpointError(found[0])

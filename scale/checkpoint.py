"""Resumable checkpoints: written atomically, verified, found again, checked against the config, loaded in any
launch mode.

Layout of one checkpoint ``<output_dir>/checkpoints/step_000040/``:

    trainer_state.json          our counters (step, epoch, windows done in the epoch), the launch mode, world size,
                                data-parallel ranks and global batch G that wrote it, the config, and every other
                                file's size and sha256; written last: a directory without it is not a checkpoint
    adapter_model.safetensors   the trainable (LoRA) tensors, whole; the frozen base is rebuilt from the config
    optimizer_state.safetensors their optimizer state, whole, by tensor name (scale.portable)
    custom_checkpoint_0.pkl     the LR scheduler (registered for checkpointing: it is not ``prepare``d)
    random_states_<rank>.pkl    Python, NumPy and torch RNG states of every rank
    optimizer.bin               one device / DDP: accelerate's optimizer file (read back with ``weights_only=True``)
    pytorch_model/              DeepSpeed only: its own files (frozen parameters excluded), read by DeepSpeed
    pytorch_model_fsdp_0/ optimizer_0/   FSDP2 only: accelerate's sharded DCP files (the whole model; read back)

The first four files are the portable state (:mod:`scale.portable`): any launch mode on any number of processes
loads them, as long as the global batch ``G`` is the same (:func:`scale.state.resume_accumulation` recomputes
``gradient_accumulation_steps``). A resume in the same mode on the same processes reads the mode's own files
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

import json
import os
import re
import shutil
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, gather_object
from safetensors.torch import load_file

from scale.config import Config, ConfigError, redact_field, to_dict, yaml_load
from scale.fileio import replace_dir, sha256_file, temp_dir_for
from scale.launch import ModePlan
from scale.modeling import restore_inference_config
from scale.portable import (ADAPTER_FILE, OPTIMIZER_FILE, SCHEDULER_FILE, PortableStateError, load_portable,
                            restore_rng, write_portable)
from scale.state import (STATE_FILE, SaveTimer, TrainerState, read_state, resume_accumulation,  # noqa: F401
                         saved_global_batch)

logger = get_logger(__name__)

_STEP_DIR = re.compile(r"^step_(\d{6,})$")

# Config keys whose change does not alter the training maths (everything else does, and is an error).
HARMLESS = ("output_dir", "log.", "train.log_every", "train.eval_every", "train.eval_micro_batch_size",
            "train.save_every", "train.save_total_limit", "train.save_on_each_node",
            "train.check_invariants", "train.save_adapter", "train.collective_timeout_s", "data.num_workers",
            "train.on_nonfinite", "train.save_every_minutes", "train.overwrite_output_dir", "train.rendezvous_",
            "data.cache", "data.num_proc",  # data.cache*: where the same tokens are kept (scale.data.cache)
            "eval.", "train.keep_best", "train.early_stopping_patience",  # what is evaluated/kept, not trained
            "train.deepspeed_config")  # the launch mode: every mode computes the same maths (benchmarks/parity.py)
# Keys that may change on a resume when the global batch stays the same (another number of processes).
BATCH_KEYS = ("train.micro_batch_size", "train.gradient_accumulation_steps")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, unreadable on some rank, or does not match the run."""


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


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare_configs(saved: dict[str, Any], current: dict[str, Any], same_global_batch: bool = False
                    ) -> tuple[list[str], list[str]]:
    """``(errors, warnings)``: keys whose values differ between the checkpoint's config and this run's.

    ``current`` is this run's unredacted config (``to_dict(cfg, redacted=False)``); ``saved`` was redacted when
    written, so a secret matches when this run's value redacts to the saved text.

    Differences in :data:`HARMLESS` keys are warnings; any other difference changes the maths (model,
    LoRA, data, loss, optimizer, batch sizes, seed, precision) and is an error. ``train.max_steps`` is an
    error unless ``optim.schedule`` is constant (the schedule's curve depends on it). ``same_global_batch``: the
    run keeps the checkpoint's global batch (another number of processes), so :data:`BATCH_KEYS` are warnings.
    """
    a, b = _flat(saved), _flat(current)
    errors, warnings = [], []
    for key in sorted(set(a) | set(b)):
        # The checkpoint holds the redacted config; a secret there equals this run's value redacted.
        same = a.get(key) == b.get(key) or a.get(key) == redact_field(key, b.get(key))
        if key != "train.resume_from" and not same:
            line = f"{key}: checkpoint {a.get(key)!r} -> now {b.get(key)!r}"
            harmless = key.startswith(HARMLESS) or (same_global_batch and key in BATCH_KEYS)
            if key in ("train.max_steps", "train.num_epochs"):  # a longer (or shorter) run: same maths per step
                harmless = b.get("optim.schedule") == "constant"
                if not harmless:
                    line += (f" (the {b.get('optim.schedule')} LR schedule is a function of {key.split('.')[1]}: the "
                             f"remaining steps would follow another curve; a run trained with optim.schedule="
                             f"constant can be extended by train.max_steps or train.num_epochs)")
            (warnings if harmless else errors).append(line)
    return errors, warnings


def _is_writer(acc: Accelerator) -> bool:
    """The process that writes shared files: the main one, or each node's with ``save_on_each_node``."""
    return acc.is_main_process or (acc.project_configuration.save_on_each_node and acc.is_local_main_process)


def unwrap(acc: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``acc.unwrap_model(model)`` without importing DeepSpeed outside DeepSpeed runs.

    accelerate's ``extract_model_from_parallel`` imports ``deepspeed`` (and through it ``wandb``) whenever it
    is installed, ~2 s for a run that uses neither (accelerate 1.15, utils/other.py). One device and DDP
    peel the DDP wrapper here, keeping the mixed-precision forward as ``unwrap_model`` does by default
    (``keep_fp32_wrapper=True``); every other mode (DeepSpeed, FSDP) goes through accelerate.
    """
    if acc.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
        return acc.unwrap_model(model)
    while isinstance(model, torch.nn.parallel.DistributedDataParallel):
        model = model.module
    return model


def _trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Full trainable tensors on CPU; an FSDP2 shard (``DTensor``) is gathered first: a collective, every rank calls."""
    full = lambda p: p.full_tensor() if hasattr(p, "full_tensor") else p  # noqa: E731
    return {n: full(p.detach()).cpu().contiguous() for n, p in model.named_parameters() if p.requires_grad}


def register_hooks(acc: Accelerator) -> None:
    """Make ``save_state``/``load_state`` skip the model's full state dict in one device and DDP modes: the
    trainable tensors are written by :func:`scale.portable.write_portable` (``adapter_model.safetensors``) and read
    back here, and the frozen (possibly 4-bit) base is rebuilt from the config, not written every checkpoint.
    The pattern follows accelerate's ``register_save_state_pre_hook`` docs (as diffusers uses it)."""

    def save_hook(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        weights.clear()  # accelerate would write the full state dict, 4-bit base included

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        for model in models:
            unwrapped = unwrap(acc, model)
            state = load_file(os.path.join(input_dir, ADAPTER_FILE))  # on CPU; load_state_dict copies
            expected = {n for n, p in unwrapped.named_parameters() if p.requires_grad}
            if set(state) != expected:
                raise CheckpointError(f"{input_dir}/{ADAPTER_FILE} holds other tensors than this model trains: "
                                      f"missing {sorted(expected - set(state))[:3]}, "
                                      f"unexpected {sorted(set(state) - expected)[:3]}")
            unwrapped.load_state_dict(state, strict=False)
        models.clear()  # loaded above; accelerate must not load a full state dict

    acc.register_save_state_pre_hook(save_hook)
    acc.register_load_state_pre_hook(load_hook)


def save_checkpoint(acc: Accelerator, cfg: Config, plan: ModePlan, state: TrainerState, model: torch.nn.Module,
                    optimizer: Any) -> Path:
    """Write a complete checkpoint for ``state.step`` atomically and prune old ones. Collective.

    The launch mode's own files (``accelerate.save_state``), then the portable state (:mod:`scale.portable`),
    then, once every rank's files are in, each file's size and sha256 and the counters in ``trainer_state.json``,
    then the rename.

    Returns:
        The checkpoint directory.
    """
    final = checkpoint_root(cfg.output_dir) / f"step_{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    writer = _is_writer(acc)
    if writer:
        temp_dir_for(final)  # removes debris of an interrupted save
    acc.wait_for_everyone()  # collective: the directory exists before anyone writes into it
    acc.save_state(str(tmp), **plan.save_state_kwargs)  # collective under DeepSpeed (ZeRO shards)
    write_portable(acc, plan, model, optimizer, tmp, writer)  # collective: shards gathered
    acc.wait_for_everyone()  # collective: every rank's files are in tmp
    if writer:
        state.config, state.saved_at = to_dict(cfg), time.time()
        state.mode, state.world_size, state.data_parallel_size = plan.mode, acc.num_processes, plan.data_parallel_size
        state.global_batch_size = cfg.train.global_batch_size(plan.data_parallel_size)
        state.files = record_files(tmp)
        (tmp / STATE_FILE).write_text(json.dumps(asdict(state), indent=1), encoding="utf-8")  # last: marks it whole
        replace_dir(tmp, final)  # the same step may be saved again (pre-empted right after an interval save)
        rotate(cfg.output_dir, cfg.train.save_total_limit, keep=state.best_step, upto=state.step)
    acc.wait_for_everyone()  # collective: nobody runs ahead of the rename
    logger.info("checkpoint %s written (%s)", final, state.reason, main_process_only=True)
    return final


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
_REPLACE = "use another output_dir, or set train.overwrite_output_dir=true to replace it"


def _last_logged_step(path: Path) -> int:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
        return max((json.loads(line).get("step", 0) for line in lines if line.strip()), default=0)
    except (OSError, ValueError, AttributeError):
        return 0


def check_fresh_start(cfg: Config) -> None:
    """Refuse a fresh start into an ``output_dir`` that holds another run, unless ``train.overwrite_output_dir``.

    A fresh run (``resume_from`` null) refuses complete ``checkpoints/``, ``adapter/`` or ``metrics.jsonl``
    (every run writes it at start-up; a lone ``config.yaml`` is not a run). ``resume_from=latest`` without a
    checkpoint refuses a *finished* run (``adapter/``, or ``metrics.jsonl`` logged up to ``train.max_steps``;
    with ``train.num_epochs`` only ``adapter/`` tells, as the step count needs the data) and restarts an attempt
    that died before its first checkpoint (a requeued job), with a warning.

    Raises:
        CheckpointError: the directory holds a run that a fresh start would replace.
    """
    out = Path(cfg.output_dir)
    if cfg.train.overwrite_output_dir:
        return
    existing = list_checkpoints(out)
    if existing:  # resume_from=latest would have found them
        raise CheckpointError(f"output_dir={cfg.output_dir} already holds checkpoints of a run (newest "
                              f"{existing[-1].name}); a fresh run there would mix its checkpoints and metrics "
                              f"with them. Resume it with train.resume_from=latest, {_REPLACE}.")
    found = [name + ("/" if (out / name).is_dir() else "") for name in RUN_ARTEFACTS if (out / name).exists()]
    if not (out / "adapter").exists() and not (out / "metrics.jsonl").exists():
        return  # every run writes metrics.jsonl at start-up: a lone config.yaml is not a run
    if cfg.train.resume_from not in ("latest", "auto"):
        raise CheckpointError(f"output_dir={cfg.output_dir} already holds another run ({', '.join(found)}); a "
                              f"fresh run would replace it: {_REPLACE}.")
    limit = cfg.train.max_steps  # null with train.num_epochs: the step count needs the data, not read yet here
    if (out / "adapter").exists() or (limit is not None and _last_logged_step(out / "metrics.jsonl") >= limit):
        raise CheckpointError(f"train.resume_from={cfg.train.resume_from}: output_dir={cfg.output_dir} holds a "
                              f"finished run ({', '.join(found)}) and no checkpoint to resume from; a fresh start "
                              f"would replace it: {_REPLACE}.")
    if cfg.train.resume_from == "auto" and (out / "config.yaml").is_file():
        check_same_run(cfg, yaml_load((out / "config.yaml").read_text(encoding="utf-8")) or {}, out / "config.yaml")
    logger.warning("resume_from=%s: %s holds an earlier attempt (%s) that left no checkpoint; starting "
                   "again from step 0", cfg.train.resume_from, out, ", ".join(found), main_process_only=True)


def check_same_run(cfg: Config, saved: dict[str, Any], source: Path, same_global_batch: bool = False) -> None:
    """``train.resume_from=auto``: the run saved in ``output_dir`` (its checkpoint's or ``config.yaml``'s config)
    is this run, or the start is refused in one line.

    Raises:
        CheckpointError: the saved config differs in keys that change the maths (:func:`compare_configs`).
    """
    errors, _ = compare_configs(saved, to_dict(cfg, redacted=False), same_global_batch)
    if errors:
        keys = ", ".join(line.split(":", 1)[0] for line in errors)
        raise CheckpointError(f"train.resume_from=auto: output_dir={cfg.output_dir} holds another run ({source} "
                              f"differs in {keys}); use another output_dir, or train.resume_from=latest to see "
                              f"every difference")


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


def native(state: TrainerState, plan: ModePlan, acc: Accelerator) -> bool:
    """Whether a resume from ``state`` reads the launch mode's own files (``accelerate.load_state``): written in
    this mode by as many processes with as many data-parallel ranks. Else the portable state is read
    (:func:`scale.portable.load_portable`). A checkpoint written before the mode was recorded is native when the
    process count matches (it has no portable state)."""
    if not state.mode:
        return state.world_size == acc.num_processes
    return (state.mode, state.world_size, state.data_parallel_size or state.world_size) == (
        plan.mode, acc.num_processes, plan.data_parallel_size)


def _needed_files(acc: Accelerator, plan: ModePlan, path: Path, state: TrainerState | None) -> list[Path]:
    """The files this rank reads to resume from ``path``: the mode's own (:func:`native`) or the portable state,
    and this rank's RNG state when the process count is the checkpoint's."""
    files = [path / STATE_FILE, path / SCHEDULER_FILE]
    if state is None or state.world_size == acc.num_processes:
        files.append(path / f"random_states_{acc.process_index}.pkl")
    if state is not None and not native(state, plan, acc):
        return files + [path / ADAPTER_FILE, path / OPTIMIZER_FILE]
    if plan.deepspeed:
        files.append(path / "pytorch_model")
    elif plan.mode == "fsdp":  # accelerate's DCP directories (the whole sharded model, and the optimizer)
        files += [path / ADAPTER_FILE, path / "pytorch_model_fsdp_0", path / "optimizer_0"]
    else:
        files += [path / ADAPTER_FILE, path / "optimizer.bin"]
    return files


def check_resume(acc: Accelerator, cfg: Config, plan: ModePlan, path: Path | None,
                 regrouped: bool = False) -> TrainerState | None:
    """Before anything is built or written: every rank resumes from the same complete checkpoint, can read
    the files it needs, an explicitly named checkpoint verifies, the global batch is the checkpoint's, and the
    config agrees with the checkpoint's. Collective.

    Keys that differ without changing the maths are warnings, except ``train.gradient_accumulation_steps`` when
    ``regrouped``: :func:`adapt_to_checkpoint` set it to keep the checkpoint's global batch and logged that.

    Returns:
        The checkpoint's :class:`TrainerState`, or ``None`` for a fresh start.

    Raises:
        CheckpointError: ranks resolved different checkpoints (``latest`` without shared storage); some rank
            cannot read the checkpoint (set ``train.save_on_each_node=true`` or copy it to every node); a file of
            it differs from what was recorded at save (names the newest intact one); it was written before
            portable state existed and this run has another mode or number of processes; or a fresh run would
            reuse an ``output_dir`` that holds another run's checkpoints.
        ConfigError: the config differs from the checkpoint's in a key that changes the maths, or the global
            batch cannot be kept (:func:`scale.state.resume_accumulation`).
    """
    try:
        here = read_state(path) if path is not None else None
    except (OSError, ValueError, TypeError):
        here = None  # named below: damaged (verify)
    missing = [str(f) for f in _needed_files(acc, plan, path, here) if not f.exists()] if path is not None else []
    # One collective for both checks: which checkpoint each rank resolved, and which files it lacks.
    report = gather_object([(acc.process_index, os.uname().nodename, str(path) if path else None, missing)])
    if len({p for _, _, p, _ in report}) > 1:
        listing = "; ".join(f"rank {r} on {h}: {p or 'no checkpoint'}" for r, h, p, _ in report)
        raise CheckpointError(f"the ranks do not agree on the checkpoint to resume from ({listing}). Put "
                              f"output_dir on shared storage or set train.save_on_each_node=true.")
    if path is None:
        check_fresh_start(cfg)
        return None
    bad = [r for r in report if r[3]]
    shared = [f for f in (bad[0][3] if bad else []) if "random_states_" not in f]  # files every rank reads
    if shared and len(bad) == len(report) and len({h for _, h, _, _ in report}) == 1:  # damaged, not unshared
        others = [str(p) for p in list_checkpoints(cfg.output_dir) if p != path]
        raise CheckpointError(f"checkpoint {path} is incomplete: missing {[Path(f).name for f in shared]} "
                              f"(half deleted by a killed rotation, or copied in part); resume from a complete one "
                              f"({others[-1] if others else 'none left'}), e.g. train.resume_from=latest")
    if bad:
        rank, host, _, files = bad[0]
        raise CheckpointError(f"rank {rank} on {host} cannot read checkpoint {path}: missing {files[:3]}. "
                              f"Without shared storage set train.save_on_each_node=true (then each node "
                              f"writes its own copy) or copy the checkpoint to every node before resuming.")
    if cfg.train.resume_from not in ("latest", "auto"):  # latest/auto: pick_resume verified it
        check_intact(acc, path)
    state = read_state(path)
    G = cfg.train.global_batch_size(plan.data_parallel_size)
    saved_G = saved_global_batch(state)
    t = state.config.get("train", {})
    if G != saved_G:  # not adapted before the launch (adapt_to_checkpoint read another checkpoint), or impossible
        ga = resume_accumulation(saved_G, t.get("micro_batch_size", 0), t.get("gradient_accumulation_steps", 0),
                                 cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps,
                                 plan.data_parallel_size, f"checkpoint {path}")  # raises with the valid choices
        raise ConfigError(f"checkpoint {path} was trained with global_batch_size={saved_G}, this run has {G}: set "
                          f"train.gradient_accumulation_steps={ga}")
    if cfg.train.resume_from == "auto":
        check_same_run(cfg, state.config, path / STATE_FILE, same_global_batch=True)
    errors, warnings = compare_configs(state.config, to_dict(cfg, redacted=False), same_global_batch=True)
    if errors:
        raise ConfigError(f"the config differs from checkpoint {path} in keys that change the maths: "
                          + "; ".join(errors) + ". Resume with the checkpoint's config (" + str(path / STATE_FILE)
                          + ") or start a new run in another output_dir.")
    for line in warnings:
        if not (regrouped and line.startswith("train.gradient_accumulation_steps:")):
            logger.warning("resume: %s (does not change the maths)", line, main_process_only=True)
    if not native(state, plan, acc) and not (path / OPTIMIZER_FILE).is_file():
        raise CheckpointError(f"checkpoint {path} was written by {state.world_size} process(es) before checkpoints "
                              f"held a portable state: it resumes only as it was written. Launch with "
                              f"num_processes={state.world_size}.")
    return state


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


def adapt_to_checkpoint(cfg: Config, data_parallel_size: int) -> str | None:
    """Before the accelerator is built: when ``train.resume_from`` names a checkpoint written with another
    number of data-parallel ranks, set ``train.gradient_accumulation_steps`` (in place) so that this run on
    ``data_parallel_size`` ranks keeps its global batch (:func:`scale.state.resume_accumulation`). Reads the
    newest readable ``trainer_state.json`` (every checkpoint of a run has the same global batch); which checkpoint
    is resumed is decided later (:func:`pick_resume`), and :func:`check_resume` checks the batch again.

    Returns:
        The change in words, for the log, or ``None``.

    Raises:
        ConfigError: the global batch cannot be kept; the message lists the valid choices.
    """
    r = cfg.train.resume_from
    if r is None:
        return None
    candidates = list_checkpoints(cfg.output_dir)[::-1] if r in ("latest", "auto") else [Path(r)]
    for path in candidates:
        try:
            state = read_state(path)
        except (OSError, ValueError, TypeError):
            continue
        if r == "auto" and compare_configs(state.config, to_dict(cfg, redacted=False), same_global_batch=True)[0]:
            return None  # another run's checkpoint: check_resume refuses it in its own words
        t, saved_G = state.config.get("train", {}), saved_global_batch(state)
        before = cfg.train.gradient_accumulation_steps
        ga = resume_accumulation(saved_G, t.get("micro_batch_size", 0), t.get("gradient_accumulation_steps", 0),
                                 cfg.train.micro_batch_size, before, data_parallel_size, f"checkpoint {path}")
        if ga == before:
            return None
        cfg.train.gradient_accumulation_steps = ga
        return (f"resume on {data_parallel_size} data-parallel rank(s), checkpoint written on "
                f"{state.data_parallel_size or state.world_size}: train.gradient_accumulation_steps {before} -> {ga} "
                f"keeps global_batch_size={saved_G} (micro_batch_size {cfg.train.micro_batch_size} x {ga} x "
                f"{data_parallel_size})")
    return None


def load_checkpoint(acc: Accelerator, cfg: Config, plan: ModePlan, path: Path, state: TrainerState,
                    model: torch.nn.Module, optimizer: Any, scheduler: Any, data_sha256: str,
                    template_sha256: str = "", rows_sha256: str = "") -> TrainerState:
    """Restore model (trainable tensors), optimizer, scheduler and RNG states from ``path`` (already checked
    by :func:`check_resume`): the mode's own files when it was written in this mode on these processes, else the
    portable state, in any mode (:func:`native`). Collective.

    Raises:
        ConfigError: the data file's bytes differ from the checkpoint's (same path, edited file); the chat
            template's text or variables differ; the tokenized rows differ (a template that renders the date,
            another tokenizer): the resumed steps would train other tokens.
        CheckpointError: the portable state does not fit this model.
    """
    if state.data_sha256 and state.data_sha256 != data_sha256:
        raise ConfigError(f"the data file changed since checkpoint {path} was written (sha256 "
                          f"{state.data_sha256[:12]}... -> {data_sha256[:12]}...): the split and the sample order "
                          f"would differ. Restore the file, or start a new run in another output_dir.")
    if state.template_sha256 and state.template_sha256 != template_sha256:
        raise ConfigError(f"data.chat_template changed since checkpoint {path} was written (its text or "
                          f"data.chat_template_kwargs; sha256 {state.template_sha256[:12]}... -> "
                          f"{template_sha256[:12]}...): the resumed steps would train other tokens. Restore the "
                          f"template, or start a new run in another output_dir.")
    if state.rows_sha256 and state.rows_sha256 != rows_sha256:
        raise ConfigError(f"the tokenized rows changed since checkpoint {path} was written (sha256 "
                          f"{state.rows_sha256[:12]}... -> {rows_sha256[:12]}...) with the same data file and "
                          f"config: something the tokens depend on differs (the tokenizer files, or what the chat "
                          f"template renders). Restore it, or start a new run in another output_dir.")
    if native(state, plan, acc):
        acc.load_state(str(path), **plan.load_state_kwargs)  # collective under DeepSpeed
        how, rng = f"{plan.mode} on {acc.num_processes} process(es), as written", None
    else:
        try:
            load_portable(acc, plan, model, optimizer, scheduler, path)  # collective
        except PortableStateError as e:
            raise CheckpointError(str(e)) from e
        rng = restore_rng(acc, path, state.world_size, cfg.train.seed, state.step)
        how = (f"portable state: written by {state.mode or 'an older version'} on {state.world_size} process(es), "
               f"resumed as {plan.mode} on {acc.num_processes}")
    for line in resume_lines(path, state, how, rng):
        logger.info(line, main_process_only=True)
    return state


def resume_lines(path: Path, state: TrainerState, how: str, rng: str | None) -> list[str]:
    """The log lines of a resume: where it continues (step, epoch, windows into the epoch) and how the state was
    read (``how``), then how the RNG was restored (``rng``, :func:`scale.portable.restore_rng`; None: with the
    mode's own files). Two lines, so that each stays under the 300 characters of a log file's line."""
    return ([f"resumed from {path} at step {state.step} (epoch {state.epoch}, {state.windows_in_epoch} windows into "
             f"it): {how}"] + ([f"resume RNG: {rng}"] if rng else []))


def save_adapter(acc: Accelerator, plan: ModePlan, model: torch.nn.Module, out: Path) -> None:
    """Write the final PEFT adapter (``adapter_config.json``, ``adapter_model.safetensors``) to ``out``
    atomically: built in ``<out>.tmp``, then renamed.

    Under ZeRO-3/FSDP (``plan.partitioned``) the LoRA weights are gathered from every rank first; saving the
    local shards instead writes empty adapters (peft#453, peft#2892). Collective: every rank calls.
    """
    # Collective when partitioned: ZeRO-3 gathers the whole model on rank 0; FSDP2 only the trainable tensors.
    state_dict = None if not plan.partitioned else (_trainable_state(unwrap(acc, model)) if plan.mode == "fsdp"
                                                    else acc.get_state_dict(model))
    if acc.is_main_process:
        unwrapped = unwrap(acc, model)
        restore_inference_config(unwrapped)
        tmp = temp_dir_for(out)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
        replace_dir(tmp, out)
    acc.wait_for_everyone()  # collective: every rank must reach this

"""The resume rules, checked before anything is built or written: the config agrees with the checkpoint's
(:func:`compare_configs`), the global batch is kept on another number of ranks (:func:`adapt_to_checkpoint`), every
rank can read what it needs, and a fresh start does not replace another run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import gather_object

from scale.config.load import redact_field, to_dict, yaml_load
from scale.config.schema import Config
from scale.config.validation import ConfigError
from scale.distributed.launch import ModePlan
from scale.training.checkpoint.portable import ADAPTER_FILE, OPTIMIZER_FILE, SCHEDULER_FILE
from scale.training.checkpoint.sharded import shard_files
from scale.training.checkpoint.store import (RUN_ARTEFACTS, CheckpointError, check_intact, list_checkpoints,
                                             resolve_resume)
from scale.training.state import STATE_FILE, TrainerState, read_state, resume_accumulation, saved_global_batch

logger = get_logger(__name__)

# Config keys whose change does not alter the training maths (everything else does, and is an error).
HARMLESS = ("output_dir", "log.", "train.log_every", "train.eval_every", "train.eval_micro_batch_size",
            "train.save_every", "train.save_total_limit", "train.save_on_each_node",
            "train.check_invariants", "train.save_adapter", "train.max_shard_size", "train.collective_timeout_s",
            "data.num_workers",
            "train.on_nonfinite", "train.save_every_minutes", "train.overwrite_output_dir", "train.rendezvous_",
            "data.cache", "data.num_proc",  # data.cache*: where the same tokens are kept (scale.data.cache)
            "eval.", "train.keep_best", "train.early_stopping_patience",  # what is evaluated/kept, not trained
            "train.deepspeed_config")  # the launch mode: every mode computes the same maths (benchmarks/parity.py)


# Keys added after checkpoints were first written, with the value every run had before: a checkpoint without
# the key compares as if it held it.
ADDED_KEYS = {"loss.objective": "sft", "model.finetune": "lora", "train.max_shard_size": "5GB", "model.new_tokens": [],
              "model.new_special_tokens": [], "lora.modules_to_save": None}
# Keys that may change on a resume when the global batch stays the same (another number of processes).
BATCH_KEYS = ("train.micro_batch_size", "train.gradient_accumulation_steps")


# rl.steps_per_generation scales with the accumulation on such a resume (:func:`adapt_to_checkpoint`).
ROUND_KEY = "rl.steps_per_generation"


def _round_steps(flat: dict[str, Any]) -> float | None:
    """A round's optimizer steps per iteration (``rl.steps_per_generation / train.gradient_accumulation_steps``)."""
    spg, ga = flat.get(ROUND_KEY), flat.get("train.gradient_accumulation_steps")
    return None if spg is None or not ga else spg / ga


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
    for key, before in ADDED_KEYS.items():
        if key in b:
            a.setdefault(key, before)
    errors, warnings = [], []
    for key in sorted(set(a) | set(b)):
        # The checkpoint holds the redacted config; a secret there equals this run's value redacted.
        same = a.get(key) == b.get(key) or a.get(key) == redact_field(key, b.get(key))
        if key != "train.resume_from" and not same:
            line = f"{key}: checkpoint {a.get(key)!r} -> now {b.get(key)!r}"
            harmless = key.startswith(HARMLESS) or (same_global_batch and key in BATCH_KEYS)
            if key == ROUND_KEY:  # regrouped with the accumulation: a round of rollouts keeps its optimizer steps
                harmless = same_global_batch and _round_steps(a) == _round_steps(b)
            if key in ("train.max_steps", "train.num_epochs"):  # a longer (or shorter) run: same maths per step
                harmless = b.get("optim.schedule") == "constant"
                if not harmless:
                    line += (f" (the {b.get('optim.schedule')} LR schedule is a function of {key.split('.')[1]}: the "
                             f"remaining steps would follow another curve; a run trained with optim.schedule="
                             f"constant can be extended by train.max_steps or train.num_epochs)")
            (warnings if harmless else errors).append(line)
    return errors, warnings


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


def native(state: TrainerState, plan: ModePlan, acc: Accelerator) -> bool:
    """Whether a resume from ``state`` reads the launch mode's own files (``accelerate.load_state``): written in
    this mode by as many processes with as many data-parallel ranks. Else the portable state is read
    (:func:`scale.training.checkpoint.portable.load_portable`). A checkpoint written before the mode was recorded is
    native when the process count matches (it has no portable state)."""
    if not state.mode:
        return state.world_size == acc.num_processes
    return (state.mode, state.world_size, state.data_parallel_size or state.world_size) == (
        plan.mode, acc.num_processes, plan.data_parallel_size)


def trains_full(state: TrainerState) -> bool:
    """Whether the checkpoint of ``state`` trained every weight (``model.finetune=full`` in its config; a checkpoint
    written before the key existed trained a LoRA adapter)."""
    return (state.config.get("model") or {}).get("finetune", ADDED_KEYS["model.finetune"]) == "full"


def check_same_finetune(cfg: Config, path: Path, state: TrainerState) -> None:
    """A LoRA checkpoint resumes only into a LoRA run, a full one only into a full run.

    Raises:
        CheckpointError: ``model.finetune`` differs from the checkpoint's (one line: what each trained, the fix).
    """
    saved = "full" if trains_full(state) else "lora"
    if saved != cfg.model.finetune:
        what = {"lora": "a LoRA adapter", "full": "every weight"}
        raise CheckpointError(f"checkpoint {path} trained {what[saved]} (model.finetune={saved}); this run has "
                              f"model.finetune={cfg.model.finetune}: resume with model.finetune={saved}, or start a "
                              f"new run in another output_dir (train.resume_from=null)")


def _needed_files(acc: Accelerator, plan: ModePlan, path: Path, state: TrainerState | None) -> list[Path]:
    """The files this rank reads to resume from ``path``: the mode's own (:func:`native`) or the portable state
    (full weights: every rank's shard), and this rank's RNG state when the process count is the checkpoint's."""
    files = [path / STATE_FILE, path / SCHEDULER_FILE]
    if state is None or state.world_size == acc.num_processes:
        files.append(path / f"random_states_{acc.process_index}.pkl")
    if state is not None and trains_full(state):
        return files + shard_files(path, state.world_size)
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
        CheckpointError: the checkpoint trained LoRA and this run full weights, or back
            (:func:`check_same_finetune`); ranks resolved different checkpoints (``latest`` without shared
            storage); some rank cannot read the checkpoint (set ``train.save_on_each_node=true`` or copy it to
            every node); a file of it differs from what was recorded at save (names the newest intact one); it
            was written before portable state existed and this run has another mode or number of processes; or a
            fresh run would reuse an ``output_dir`` that holds another run's checkpoints.
        ConfigError: the config differs from the checkpoint's in a key that changes the maths, or the global
            batch cannot be kept (:func:`scale.training.state.resume_accumulation`).
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
    if here is not None:
        check_same_finetune(cfg, path, here)
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
        if not (regrouped and line.startswith(("train.gradient_accumulation_steps:", f"{ROUND_KEY}:"))):
            logger.warning("resume: %s (does not change the maths)", line, main_process_only=True)
    if not native(state, plan, acc) and not trains_full(state) and not (path / OPTIMIZER_FILE).is_file():
        raise CheckpointError(f"checkpoint {path} was written by {state.world_size} process(es) before checkpoints "
                              f"held a portable state: it resumes only as it was written. Launch with "
                              f"num_processes={state.world_size}.")
    return state


def adapt_to_checkpoint(cfg: Config, data_parallel_size: int) -> str | None:
    """Before the accelerator is built: when ``train.resume_from`` names a checkpoint written with another
    number of data-parallel ranks, set ``train.gradient_accumulation_steps`` (in place) so that this run on
    ``data_parallel_size`` ranks keeps its global batch (:func:`scale.training.state.resume_accumulation`). Reads the
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
        spg = cfg.rl.steps_per_generation
        rounds = ""
        if spg and (spg * ga) % before == 0:  # a round of rollouts keeps its completions and its optimizer steps
            cfg.rl.steps_per_generation = spg * ga // before
            rounds = f"; rl.steps_per_generation {spg} -> {cfg.rl.steps_per_generation} keeps a round's steps"
        return (f"resume on {data_parallel_size} data-parallel rank(s), checkpoint written on "
                f"{state.data_parallel_size or state.world_size}: train.gradient_accumulation_steps {before} -> {ga} "
                f"keeps global_batch_size={saved_G} (micro_batch_size {cfg.train.micro_batch_size} x {ga} x "
                f"{data_parallel_size}){rounds}")
    return None


# What each digest of TrainerState covers, for check_same_tokens's message: (what changed, a note inside the
# parenthesis, what follows it).
DIGESTS = {
    "data_sha256": ("the data file", "", ": the split and the sample order would differ. Restore the file"),
    "template_sha256": ("data.chat_template", "its text or data.chat_template_kwargs; ",
                        ": the resumed steps would train other tokens. Restore the template"),
    "rows_sha256": ("the tokenized rows", "", " with the same data file and config: something the tokens depend on "
                    "differs (the tokenizer files, or what the chat template renders). Restore it"),
}


def check_same_tokens(path: Path, saved: TrainerState, progress: TrainerState) -> None:
    """The checkpoint ``path`` (progress ``saved``) trained the tokens this run (progress ``progress``) would:
    the same data file bytes, chat template and tokenized rows (:meth:`scale.training.state.TrainerState.state_dict`'s
    ``data_sha256``, ``template_sha256``, ``rows_sha256``; an empty digest in the checkpoint is not compared).

    Raises:
        ConfigError: the data file's bytes differ from the checkpoint's (same path, edited file); the chat
            template's text or variables differ; the tokenized rows differ (a template that renders the date,
            another tokenizer): the resumed steps would train other tokens.
    """
    was, now = saved.state_dict(), progress.state_dict()
    for key, (what, note, then) in DIGESTS.items():  # the first that differs
        if was[key] and was[key] != now[key]:
            raise ConfigError(f"{what} changed since checkpoint {path} was written ({note}sha256 {was[key][:12]}... -> "
                              f"{now[key][:12]}...){then}, or start a new run in another output_dir.")


def saved_precision(resume_from: str | None, output_dir: Path) -> str | None:
    """The autocast the checkpoint ``train.resume_from`` names trained in (``bf16``, ``fp16``, ``no``), or None: a
    fresh start, or a checkpoint that cannot be read (:func:`check_resume` then says why, on every
    rank). Read from its :class:`TrainerState` (``mixed_precision``), else from the config it saved (checkpoints
    written before the field existed hold the resolved value there)."""
    try:
        path = resolve_resume(resume_from, output_dir)
        if path is None:
            return None
        state = json.loads((path / STATE_FILE).read_text(encoding="utf-8"))
        value = state.get("mixed_precision") or state.get("config", {}).get("train", {}).get("mixed_precision")
    except Exception:  # noqa: BLE001 - reported by check_resume, collectively
        return None
    return value if value in ("bf16", "fp16", "no") else None

"""Save and load: a checkpoint written atomically in the launch mode's own files plus the portable state, read
back in the same mode (``accelerate.load_state``) or in any other (:mod:`scale.training.checkpoint.portable`); the final
adapter, or a full fine-tune's final model (:func:`save_model`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger
from accelerate.utils import DistributedType, gather_object
from safetensors.torch import load_file

from scale.config.load import to_dict
from scale.config.schema import Config
from scale.distributed.launch import ModePlan
from scale.modeling.build import restore_inference_config
from scale.modeling.dropout import dropout_census
from scale.training.checkpoint.portable import (ADAPTER_FILE, PortableStateError, load_portable, parameter_names,
                                                restore_rng, write_portable)
from scale.training.checkpoint.rules import check_same_tokens, native, trains_full
from scale.training.checkpoint.sharded import write_sharded
from scale.training.checkpoint.sharded_read import load_sharded
from scale.training.checkpoint.store import (CheckpointError, _complete_in, _is_writer, checkpoint_root, record_files,
                                             rotate)
from scale.training.state import STATE_FILE, TrainerState
from scale.utils.fileio import replace_dir, temp_dir_for

logger = get_logger(__name__)

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
    # remove_duplicate=False: a tied head's lora.modules_to_save copy under its second name too, as peft saves it
    return {n: full(p.detach()).cpu().contiguous() for n, p in model.named_parameters(remove_duplicate=False)
            if p.requires_grad}


def register_hooks(acc: Accelerator) -> None:
    """Make ``save_state``/``load_state`` skip the model's full state dict in one device and DDP modes: the
    trainable tensors are written by :func:`scale.training.checkpoint.portable.write_portable`
    (``adapter_model.safetensors``) and read back here, and the frozen (possibly 4-bit) base is rebuilt from the config,
    not written every checkpoint. The pattern follows accelerate's ``register_save_state_pre_hook`` docs (as diffusers
    uses it)."""

    def save_hook(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        weights.clear()  # accelerate would write the full state dict, 4-bit base included

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        for model in models:
            unwrapped = unwrap(acc, model)
            state = parameter_names(unwrapped, load_file(os.path.join(input_dir, ADAPTER_FILE)))  # on CPU
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
                    optimizer: Any, extra: Callable[[Path, int], None] | None = None) -> Path:
    """Write a complete checkpoint for ``state.step`` atomically and prune old ones. Collective.

    LoRA: the launch mode's own files (``accelerate.save_state``), then the portable state
    (:mod:`scale.training.checkpoint.portable`). Full weights (``model.finetune=full``): every rank writes its shard
    of the fp32 weights and optimizer state, its RNG states and (the writer) the LR scheduler
    (:func:`scale.training.checkpoint.sharded.write_sharded`), no collective while writing. Both: what
    ``extra(directory, rank)`` writes on every rank (a round of rollouts cut in the middle:
    :mod:`scale.training.parts.rl`). Then, once every rank's files are in, each file's size and sha256 and the
    counters in ``trainer_state.json``, then the rename.

    A write that fails on any rank (a full disk: ``ENOSPC``; full weights' shards, or the writer's records in both
    forms) is agreed on by every rank before anyone waits on another: each raises the same
    :class:`CheckpointError`, ``<checkpoint>.tmp`` is removed, and the newest complete checkpoint stays the one a
    resume takes (nothing was replaced or rotated).

    Returns:
        The checkpoint directory.

    Raises:
        CheckpointError: a rank could not write its files (the message names the rank, the error and the newest
            complete checkpoint).
    """
    final = checkpoint_root(cfg.output_dir) / f"step_{state.step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    writer = _is_writer(acc)
    if writer:
        temp_dir_for(final)  # removes debris of an interrupted save
    acc.wait_for_everyone()  # collective: the directory exists before anyone writes into it
    if cfg.model.finetune == "full":
        problem = _attempt(lambda: write_sharded(acc, plan, model, optimizer, tmp))
        _agree(acc, final, problem)  # collective: every rank's shard is in tmp, or every rank raises
    else:
        acc.save_state(str(tmp), **plan.save_state_kwargs)  # collective under DeepSpeed (ZeRO shards)
        write_portable(acc, plan, model, optimizer, tmp, writer)  # collective: shards gathered
    if extra is not None:
        extra(tmp, acc.process_index)
    acc.wait_for_everyone()  # collective: every rank's files are in tmp
    problem = None
    if writer:
        def finish() -> None:
            state.config, state.saved_at = to_dict(cfg), time.time()
            state.mode, state.world_size, state.data_parallel_size = (plan.mode, acc.num_processes,
                                                                      plan.data_parallel_size)
            state.global_batch_size = cfg.train.global_batch_size(plan.data_parallel_size)
            state.files = record_files(tmp)
            # written last: a directory with trainer_state.json is whole
            (tmp / STATE_FILE).write_text(json.dumps(state.state_dict(), indent=1), encoding="utf-8")
            replace_dir(tmp, final)  # the same step may be saved again (pre-empted right after an interval save)

        problem = _attempt(finish)
        if problem is None:
            rotate(cfg.output_dir, cfg.train.save_total_limit, keep=state.best_step, upto=state.step)
    _agree(acc, final, problem)  # collective: nobody runs ahead of the rename
    logger.info("checkpoint %s written (%s)", final, state.reason, main_process_only=True)
    return final


def _attempt(write: Any) -> str | None:
    """Run ``write()``; the OSError it raised (a full disk, a lost mount), in words, or None."""
    try:
        write()
    except OSError as e:
        return f"{type(e).__name__}: {e}" if e.errno is None else str(e)
    return None


def _agree(acc: Accelerator, final: Path, problem: str | None) -> None:
    """Every rank learns whether any rank failed to write its part of checkpoint ``final`` (one gather, in place of
    a barrier that a failed rank would otherwise leave the others waiting on); if one did, the writer removes
    ``<final>.tmp`` (best effort; :func:`scale.training.checkpoint.store.list_checkpoints` never takes a ``.tmp``)
    and every rank raises the same error. Collective.

    Raises:
        CheckpointError: ``checkpoint step_N not written: rank r: <error>; the newest complete checkpoint is still
            step_M (nothing was replaced): free space and resume with train.resume_from=latest``.
    """
    report = gather_object([(acc.process_index, problem)]) if acc.num_processes > 1 else [(acc.process_index, problem)]
    failed = [(rank, why) for rank, why in report if why]
    if not failed:
        return
    if _is_writer(acc):
        shutil.rmtree(final.with_name(final.name + ".tmp"), ignore_errors=True)
    newest = [p for p in _complete_in(final.parent) if p != final]
    rank, why = failed[0]
    more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    then = (f"the newest complete checkpoint is still {newest[-1].name} (nothing was replaced): free space and resume "
            f"with train.resume_from=latest" if newest else "no complete checkpoint exists yet: free space and start "
            "again")
    raise CheckpointError(f"checkpoint {final.name} not written: rank {rank}{more}: {why}; {then}")


def load_checkpoint(acc: Accelerator, cfg: Config, plan: ModePlan, path: Path, state: TrainerState,
                    model: torch.nn.Module, optimizer: Any, scheduler: Any, progress: TrainerState) -> TrainerState:
    """Restore model (trainable tensors), optimizer, scheduler and RNG states from ``path`` (already checked
    by :func:`scale.training.checkpoint.rules.check_resume`). LoRA: the mode's own files when it was written in this
    mode on these processes, else the portable state, in any mode (:func:`scale.training.checkpoint.rules.native`).
    Full weights: the shards, in any mode on any number of processes
    (:func:`scale.training.checkpoint.sharded_read.load_sharded`), each rank its own RNG states when the process count is
    the checkpoint's. Collective.

    Args:
        state: the checkpoint's progress (its ``trainer_state.json``).
        progress: this run's progress before the resume: its data, template and rows digests must be the
            checkpoint's (:func:`scale.training.checkpoint.rules.check_same_tokens`).

    Returns:
        ``state``: the progress the run continues from.

    Raises:
        ConfigError: what :func:`scale.training.checkpoint.rules.check_same_tokens` raises.
        CheckpointError: the portable state or the shards do not fit this model (the shards: a range uncovered, named).
    """
    check_same_tokens(path, state, progress)
    if trains_full(state):
        load_sharded(acc, plan, model, optimizer, scheduler, path)
        draws = dropout_census(acc.unwrap_model(model)).text()
        rng = restore_rng(acc, path, state.world_size, cfg.train.seed, state.step, draws)
        how = (f"full weights' shards: written by {state.mode} on {state.world_size} process(es), resumed as "
               f"{plan.mode} on {acc.num_processes}")
        if (state.mode, state.world_size) == (plan.mode, acc.num_processes):
            rng = None  # each rank's own RNG states, as written
    elif native(state, plan, acc):
        acc.load_state(str(path), **plan.load_state_kwargs)  # collective under DeepSpeed
        how, rng = f"{plan.mode} on {acc.num_processes} process(es), as written", None
    else:
        try:
            load_portable(acc, plan, model, optimizer, scheduler, path)  # collective
        except PortableStateError as e:
            raise CheckpointError(str(e)) from e
        draws = dropout_census(acc.unwrap_model(model)).text()
        rng = restore_rng(acc, path, state.world_size, cfg.train.seed, state.step, draws)
        how = (f"portable state: written by {state.mode or 'an older version'} on {state.world_size} process(es), "
               f"resumed as {plan.mode} on {acc.num_processes}")
    for line in resume_lines(path, state, how, rng):
        logger.info(line, main_process_only=True)
    return state


def resume_lines(path: Path, state: TrainerState, how: str, rng: str | None) -> list[str]:
    """The log lines of a resume: where it continues (step, epoch, windows into the epoch) and how the state was
    read (``how``), then how the RNG was restored (``rng``, :func:`scale.training.checkpoint.portable.restore_rng`;
    None: with the mode's own files). Two lines, so that each stays under the 300 characters of a log file's line."""
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
        # save_embedding_layers=False: peft's "auto" saves the grown base embeddings whole (original rows, wrapper
        # and all) once they were resized; what trained of them is lora.modules_to_save's copy, saved anyway, and a
        # loader grows the base to the saved tokenizer's length first (docs/full.md)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
        replace_dir(tmp, out)
    acc.wait_for_everyone()  # collective: every rank must reach this


def _master_weights(acc: Accelerator, plan: ModePlan, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight of a full fine-tune as the optimizer steps it (the fp32 masters), whole, on CPU, by the names of
    the transformers model. Collective: every rank calls, in the same order.

    ZeRO-1/2/3: DeepSpeed's ``safe_get_full_fp32_param`` (the fp32 partitions gathered; under bf16 the module's own
    weights are the bf16 copies); FSDP2: ``DTensor.full_tensor()``; one device and DDP: the parameters themselves.
    """
    module = model.module if plan.deepspeed else unwrap(acc, model)
    out = {}
    for name, p in module.named_parameters():
        if plan.deepspeed:
            from deepspeed.utils import safe_get_full_fp32_param

            t = safe_get_full_fp32_param(p).reshape(tuple(getattr(p, "ds_shape", p.shape)))
        else:
            t = p.full_tensor() if hasattr(p, "full_tensor") else p
        out[name] = t.detach().cpu().contiguous()
    return out


def save_model(acc: Accelerator, plan: ModePlan, model: torch.nn.Module, out: Path, max_shard_size: str) -> None:
    """Write a full fine-tune's final model to ``out`` as a plain transformers directory (``config.json``,
    ``model.safetensors`` or shards of at most ``max_shard_size`` with ``model.safetensors.index.json``,
    ``generation_config.json``), loadable by ``AutoModelForCausalLM.from_pretrained`` with no scale import.
    The weights are the fp32 masters (:func:`_master_weights`), not a bf16 module's copies, and ``config.json``
    says float32; transformers' ``save_pretrained(state_dict=...)`` shards and drops tied copies. Atomic: built in
    ``<out>.tmp`` on the main process, then renamed. Collective: every rank calls.
    """
    state_dict = _master_weights(acc, plan, model)  # collective under DeepSpeed and FSDP2
    if acc.is_main_process:
        unwrapped = model.module if plan.deepspeed else unwrap(acc, model)
        restore_inference_config(unwrapped)
        tmp = temp_dir_for(out)
        unwrapped.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True, max_shard_size=max_shard_size)
        # save_pretrained writes the module's dtype (bf16 under DeepSpeed bf16); the files hold the fp32 masters, and
        # from_pretrained's dtype="auto" must load them as such
        config = json.loads((tmp / "config.json").read_text(encoding="utf-8"))
        config.update({k: "float32" for k in ("dtype", "torch_dtype") if k in config} or {"dtype": "float32"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        replace_dir(tmp, out)
    acc.wait_for_everyone()  # collective: every rank must reach this

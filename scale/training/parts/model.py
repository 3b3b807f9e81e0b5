"""The model part: the base model with LoRA (or every weight trainable, ``model.finetune=full``), loaded on the
ranks in the order the launch mode needs, checked against the packing and sequence-parallel settings, with
``model.kernels`` and the mixed-precision paths (fewer casts) where they pay; its matmul shape for the FLOPs count.
Collective.
"""

from __future__ import annotations

from typing import Any

import torch
from accelerate import Accelerator
from accelerate.logging import get_logger

from scale.config.schema import Config
from scale.distributed.collective import main_process_first, on_every_rank
from scale.distributed.launch import ModePlan
from scale.modeling.attention import check_packing, check_sequence_parallel
from scale.modeling.build import build_model
from scale.modeling.dropout import disable_dropout, dropout_census
from scale.modeling.finetune import ignored_lora_line, weights_plan
from scale.modeling.kernels import apply_kernels
from scale.modeling.mixed_paths import paths_for, use_mixed_paths
from scale.modeling.moe_counts import model_shape
from scale.modeling.varlen import use_segment_attention
from scale.training.parts.data import on_this_machine
from scale.training.parts.launch import Launch

logger = get_logger(__name__)


def build_run_model(launch: Launch, cfg: Config, vocab_size: int) -> tuple[torch.nn.Module, list[str]]:
    """The model on every rank, and the mixed-precision paths switched on for it (their names). Collective.

    Under ZeRO-3 every rank loads at once (:func:`build_model_on_every_rank`); a model on this machine is loaded by
    every rank at once, a hub id on the main process first. Under bf16 autocast the casts and the 4-bit
    dequantization take the paths with fewer casts on any device, and on the CPU the attention of short rows runs in
    float32 (:mod:`scale.modeling.mixed_paths`, :func:`~scale.modeling.mixed_paths.paths_for`); under sequence
    parallelism the attention stays the one Ulysses wraps (its name is what :mod:`scale.distributed.ulysses` registers).
    ``model.kernels`` patches its kernels in first (:mod:`scale.modeling.kernels`).

    Raises:
        ConfigError: the model does not fit ``data.padding_free``/``data.packing`` or the sequence-parallel size;
            ``model.kernels`` has no kernels for its family.
    """
    plan, sp = launch.plan, cfg.train.sequence_parallel_size
    model = load_run_model(launch, cfg, vocab_size)  # collective
    check_sequence_parallel(model, cfg.model, sp, cfg.data.packing or cfg.data.padding_free, cfg.data.max_length)
    ignored = ignored_lora_line(cfg)
    if ignored:
        logger.warning(ignored, main_process_only=True)
    for line in weights_plan(cfg, plan.mode).notes:
        logger.info(line, main_process_only=True)
    line = set_dropout(cfg, model)
    if line:
        logger.info(line, main_process_only=True)
    kernels, switched = shape_forward(launch, cfg, model)
    if kernels:
        logger.info("model.kernels=%s: %s", cfg.model.kernels, ", ".join(kernels), main_process_only=True)
    return model, switched


def load_run_model(launch: Launch, cfg: Config, vocab_size: int) -> torch.nn.Module:
    """:func:`scale.modeling.build.build_model` on the ranks in the order the launch mode needs (every rank at once
    under ZeRO-3 or for a model on this machine, a hub id on the main process first), checked against the packing
    settings. Collective. The frozen DPO/GRPO reference of a full run is loaded here too, by the same path."""
    plan = launch.plan

    def prepare_model() -> torch.nn.Module:
        model = build_model(cfg.model, cfg.lora, vocab_size, cfg.train.seed, device_map=plan.device_map)
        check_packing(model, cfg.data.padding_free, cfg.data.packing)  # before anything is written
        return model

    if plan.mode == "zero3":  # from_pretrained under ZeRO-3 runs collectives
        return build_model_on_every_rank(launch.acc, cfg, plan, vocab_size)  # collective
    return (on_every_rank if on_this_machine(cfg.model.name_or_path) else main_process_first)(
        launch.acc, prepare_model)  # collective


def shape_forward(launch: Launch, cfg: Config, model: torch.nn.Module) -> tuple[list[str], list[str]]:
    """What changes how ``model``'s forward computes, applied in place: ``model.kernels``, the mixed-precision
    paths under bf16 (not partitioned), the per-example attention of packed rows on the CPU. The policy and the
    frozen reference get the same, so that at step 0 they compute the same numbers bit for bit.

    Returns:
        ``(kernels, switched)``: the kernels patched in and the mixed-precision paths switched on (their names).
    """
    kernels = apply_kernels(model, cfg.model.kernels)
    paths = [n for n in paths_for(launch.device.type)
             if not (launch.sequence is not None and n == "attention_fp32_short")]
    switched = (use_mixed_paths(model, paths) if cfg.train.mixed_precision == "bf16" and not launch.plan.partitioned
                else [])
    if launch.device.type == "cpu" and (cfg.data.padding_free or cfg.data.packing) and launch.sequence is None:
        use_segment_attention(model)  # packed rows: one causal sdpa call per example instead of an [L, L] mask
    return kernels, switched


def set_dropout(cfg: Config, model: torch.nn.Module) -> str | None:
    """Apply ``model.disable_dropout`` (:meth:`scale.config.schema.Config.dropout_off`: null is true under a preference
    objective, false under sft) to ``model`` in place (:func:`scale.modeling.dropout.disable_dropout`), and return the
    start-up line that says what draws dropout masks in training: always under a preference objective or when
    dropout is turned off; under sft only when the model itself has dropout (``lora.dropout`` is the run's own key).
    """
    off, setting, dpo = cfg.dropout_off(), cfg.model.disable_dropout, cfg.loss.objective == "dpo"
    how = (f"model.disable_dropout={str(setting).lower()}" if setting is not None else
           f"model.disable_dropout=null: {str(off).lower()} under loss.objective={cfg.loss.objective}")
    if off:
        what = disable_dropout(model).text()
        return (f"dropout off ({how}, as TRL's disable_dropout): " + (f"{what} -> 0" if what else "none was on")
                + ("; the policy and its in-step reference forward are one network" if dpo else ""))
    found = dropout_census(model)
    what = found.text() or "none"
    if dpo:
        return (f"dropout on ({how}): {what}; the policy's forward draws masks, the reference's runs without them "
                f"(eval mode), so each step's rewards carry the policy's dropout noise")
    if cfg.loss.trains_pairs():
        return f"dropout on ({how}): {what}; the policy's log-probabilities, and its rewards, carry dropout noise"
    if found.model_has:
        return f"dropout on ({how}): {what} draw masks in training; model.disable_dropout=true turns them off"
    return None


def build_model_on_every_rank(acc: Accelerator, cfg: Config, plan: ModePlan, vocab_size: int) -> torch.nn.Module:
    """Build the model on every rank at the same time, as DeepSpeed ZeRO-3 needs. Collective.

    Under ZeRO-3, transformers' ``from_pretrained`` creates the weights inside ``deepspeed.zero.Init`` and
    loads the checkpoint into the partitioned parameters through ``GatheredParameters``: both are collectives
    every rank must enter together. Built on the main process first (as the assets are), rank 0 waited in
    ``from_pretrained``'s broadcast while rank 1 waited in ``main_process_first``'s, and gloo aborted with "Is
    there a distributed collective mismatch". The ranks then agree on the outcome, so that an error
    on one rank (a missing file on one node) stops all of them with its message instead of a hang.

    Raises:
        Whatever :func:`scale.modeling.build.build_model` raises, on every rank (``rank_local`` when only this one).
    """
    return on_every_rank(acc, lambda: build_model(cfg.model, cfg.lora, vocab_size, cfg.train.seed,
                                                  device_map=plan.device_map))


def flops_shape(model: torch.nn.Module) -> Any:
    """The model's matmul shape for the FLOPs count (:func:`scale.modeling.moe_counts.model_shape`: a mixture of experts counts
    the experts a token uses), or ``None`` with one
    warning: an optional metric must never stop training."""
    try:
        return model_shape(model)
    except Exception as e:  # noqa: BLE001 - any family the count does not understand
        logger.warning("no FLOPs count (train/mfu) for this model: %s: %s", type(e).__name__, e,
                       main_process_only=True)
        return None

"""What a run trains and in which precision: a LoRA adapter over a frozen base (``model.finetune: lora``) or every
weight of the base (``full``). No accelerate.

    plan = weights_plan(cfg, "zero2")      # the decisions the run logs and scale-plan counts bytes from
    model = make_full(base, checkpointing) # every weight trains (they are the fp32 masters), checkpointing on

:class:`WeightsPlan` is the one place the full-weight decisions live: the dtype of the weights the forward reads, what
the optimizer steps (the fp32 master), where gradients accumulate, the optimizer state's dtype and the DPO reference,
for a launch mode. The run reads it (start-up line, the DeepSpeed config's ``data_types``) and so may the planner.
The refusals that need only the config (``full`` with 4-bit, an adapter, bf16 weights, ...) are
:func:`scale.config.validation.validate`'s.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from scale.config.schema import Config, LoraConfig
from scale.utils.compat import enable_checkpointing

FINETUNES = ("lora", "full")


@dataclass(frozen=True)
class WeightsPlan:
    """What trains, and in which dtypes, in one launch mode (bytes per parameter follow from it: ZeRO paper,
    Rajbhandari et al. 2020, arXiv:1910.02054, Figure 1).

    Attributes:
        trains: ``lora`` (an adapter over a frozen base) or ``full`` (every weight).
        module_dtype: the dtype of the weights the forward reads: ``bfloat16`` where DeepSpeed's bf16 casts the module
            (ZeRO + ``train.mixed_precision=bf16``), else ``model.dtype`` (``float32`` for full weights: one device,
            DDP and FSDP2 compute bf16 through autocast over fp32 weights).
        master_dtype: the dtype the optimizer steps (``float32`` for full weights in every mode).
        separate_master: the fp32 master is a copy beside the module's bf16 weights (ZeRO + bf16: 4 more bytes per
            trained parameter, partitioned as the optimizer state), not the parameters themselves.
        grad_accum_dtype: the dtype gradients are accumulated and reduced in (``float32`` for full weights; under
            ZeRO + bf16 the harness sets DeepSpeed's ``data_types.grad_accum_dtype``).
        optimizer_state_dtype: the optimizer's moments (``float32``).
        reference: DPO's reference (``loss.reference``): ``adapter`` (LoRA: the adapter disabled), ``model`` (full
            weights: a frozen copy of the starting weights, :func:`frozen_reference_key`) or ``precomputed`` (one
            pass of the starting weights before training); None without DPO.
        notes: the decisions in words, for the start-up log.
    """

    trains: str
    module_dtype: str
    master_dtype: str
    separate_master: bool
    grad_accum_dtype: str
    optimizer_state_dtype: str
    reference: str | None
    notes: tuple[str, ...] = ()


def weights_plan(cfg: Config, mode: str) -> WeightsPlan:
    """The :class:`WeightsPlan` of ``cfg`` in launch ``mode`` (``single``, ``ddp``, ``zero1``/``zero2``/``zero3``,
    ``fsdp``), with ``train.mixed_precision`` resolved (``auto`` counts as ``no``).

    LoRA keeps what it always did: the adapter's tensors are fp32 (peft), DeepSpeed bf16 casts them and accumulates
    gradients in bf16 (DeepSpeed's default ``grad_accum_dtype``: the module's dtype, ``engine.get_data_types``).
    """
    full = cfg.model.finetune == "full"
    bf16 = cfg.train.mixed_precision == "bf16"
    zero = mode.startswith("zero")
    reference = cfg.loss.reference if cfg.loss.objective == "dpo" else None
    if not full:
        module = "bfloat16" if zero and bf16 else cfg.model.dtype
        return WeightsPlan("lora", module, "float32", zero and bf16, module, "float32", reference)
    module = "bfloat16" if zero and bf16 else "float32"
    how = (" (DeepSpeed bf16), fp32 master partitions" if zero and bf16 else
           " under bf16 autocast, they are the fp32 masters" if bf16 else ", they are the fp32 masters")
    notes = (f"full weights: {module} weights in the forward{how}, fp32 gradient accumulation, fp32 "
             f"{cfg.optim.name} state",)
    return WeightsPlan("full", module, "float32", zero and bf16, "float32", "float32", reference, notes)


def frozen_reference_key(cfg: Config) -> str | None:
    """The key that makes a run keep a frozen copy of its starting weights as its reference (a full fine-tune has
    no adapter to switch off): ``loss.reference`` (dpo with ``model``) or ``rl.beta`` (grpo with beta > 0); None
    when the run keeps none."""
    if cfg.model.finetune != "full":
        return None
    if cfg.loss.objective == "dpo" and cfg.loss.reference == "model":
        return "loss.reference=model"
    if cfg.loss.samples_online() and cfg.rl.beta > 0:
        return f"rl.beta={cfg.rl.beta}"
    return None


def make_full(model: torch.nn.Module, checkpointing: dict[str, Any] | None) -> torch.nn.Module:
    """Every parameter of ``model`` trains (``requires_grad=True``), gradient checkpointing on with ``checkpointing``
    (:func:`scale.modeling.build.checkpointing_kwargs`; None: off; no input-gradient hook is needed, the embeddings
    themselves train), train mode. The weights stay in their load dtype (``model.dtype=float32`` is what the config
    allows for full weights: they are the fp32 masters). Returns ``model``, changed in place."""
    for p in model.parameters():
        p.requires_grad_(True)
    if checkpointing is not None:
        enable_checkpointing(model, **checkpointing)
    model.train()
    return model


def ignored_lora_keys(cfg: Config) -> list[str]:
    """The ``lora.*`` keys set away from their defaults in a ``model.finetune=full`` run (which trains no adapter and
    reads none of them), e.g. ``["lora.r=8", "lora.alpha=16.0"]``; empty for a LoRA run."""
    if cfg.model.finetune != "full":
        return []
    default = LoraConfig()
    return [f"lora.{f.name}={getattr(cfg.lora, f.name)!r}" for f in dataclasses.fields(LoraConfig)
            if getattr(cfg.lora, f.name) != getattr(default, f.name)]


def ignored_lora_line(cfg: Config) -> str | None:
    """The one warning line for :func:`ignored_lora_keys` (a warning, not a refusal: every shipped YAML sets some
    ``lora.*`` key, and ``model.finetune=full`` on the command line must run it), or None."""
    keys = ignored_lora_keys(cfg)
    if not keys:
        return None
    return f"ignored: {', '.join(keys)}: model.finetune=full trains every weight and no LoRA adapter"

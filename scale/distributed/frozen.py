"""A frozen model wrapped as the policy is wrapped in each launch mode: the reference of a full fine-tune's DPO
(``loss.reference: model``) and GRPO KL term (``rl.beta`` > 0), a second copy of the starting weights that never
trains, is never saved and is sharded like the policy where the policy is sharded.

    ref = wrap_frozen(acc, model)        # after acc.prepare(policy, ...): the DeepSpeed config is filled then
    local, whole = frozen_elements(ref)  # its elements held on this rank, and in all

Per mode (TRL's ``prepare_deepspeed`` / ``prepare_fsdp``, ``trl/models/utils.py``, do the same):

- **ZeRO-3**: ``deepspeed.initialize(model=ref, config=<the run's DeepSpeed config without optimizer, scheduler and
  optimizer offload>)``: DeepSpeed's inference engine keeps each weight partitioned 1/N and gathers a layer's for
  its forward, as it does the policy's.
- **ZeRO-1/2**: the same at stage 0: the whole weights on every rank (as the policy's module weights are in those
  modes), cast as the policy's are (bf16 under DeepSpeed bf16).
- **FSDP2**: accelerate's ``fsdp2_prepare_model`` (``fully_shard`` with the policy's mesh, mixed-precision policy
  and wrapping); every unit is resharded after each forward (FSDP2 keeps the root's and the head's gathered after a
  forward until a backward, and a frozen model has none).
- **DDP / one device**: ``acc.prepare_model(ref, evaluation_mode=True)``: on the device, its forward under
  accelerate's autocast (the policy's mixed precision); no DDP wrapper (nothing to reduce), and taken back out of
  the models accelerate saves (``acc._models``).
"""

from __future__ import annotations

import copy
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType


def deepspeed_inference_config(config: dict[str, Any]) -> dict[str, Any]:
    """The run's DeepSpeed config (filled by accelerate) for a frozen model: no ``optimizer``, ``scheduler`` or
    ``zero_optimization.offload_optimizer`` (no optimizer steps it), and stage 0 below ZeRO-3 (whole weights). A
    copy; ``config`` is untouched."""
    out = copy.deepcopy(config)
    out.pop("optimizer", None)
    out.pop("scheduler", None)
    zero = out.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if int(zero.get("stage", 0)) != 3:
        zero["stage"] = 0
    return out


def wrap_frozen(acc: Accelerator, model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (every parameter ``requires_grad=False``, eval mode) wrapped for the run's launch mode (module
    docstring), in eval mode. Collective under DeepSpeed and FSDP2: every rank calls it at the same point.

    Raises:
        ValueError: a parameter of ``model`` still trains (it would be wrapped as trainable).
    """
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("wrap_frozen needs a frozen model (requires_grad=False on every parameter)")
    if acc.distributed_type == DistributedType.DEEPSPEED:
        import deepspeed

        engine, *_ = deepspeed.initialize(model=model, config=deepspeed_inference_config(
            acc.state.deepspeed_plugin.deepspeed_config))
        engine.eval()
        return engine
    if acc.distributed_type == DistributedType.FSDP:
        from accelerate.utils.fsdp_utils import fsdp2_prepare_model
        from torch.distributed.fsdp import FSDPModule

        wrapped = fsdp2_prepare_model(acc, model)
        units = [m for m in wrapped.modules() if isinstance(m, FSDPModule)]

        def reshard(*_: Any) -> None:
            for unit in units:
                unit.reshard()

        wrapped.register_forward_hook(reshard)
        wrapped.eval()
        return wrapped
    prepared = acc.prepare_model(model, evaluation_mode=True)
    acc._models[:] = [m for m in acc._models if m is not prepared]  # never saved: rebuilt from model.name_or_path
    prepared.eval()
    return prepared


def frozen_elements(model: torch.nn.Module) -> tuple[int, int]:
    """``(local, whole)``: the parameter elements of a (wrapped) model held on this rank, and its full size
    (ZeRO-3: each partition ``ds_tensor`` against ``ds_numel``, plus the whole of a parameter ZeRO-3 keeps
    gathered, ``ds_persist``: those below ``stage3_param_persistence_threshold``; FSDP2: each DTensor's local
    shard against its global shape; otherwise both the plain count). Shared tensors count once."""
    local = whole = 0
    seen: set[int] = set()
    for p in model.parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if hasattr(p, "ds_tensor"):
            kept = p.ds_numel if getattr(p, "ds_persist", False) else 0
            local, whole = local + p.ds_tensor.numel() + kept, whole + p.ds_numel
        elif hasattr(p, "to_local"):
            local, whole = local + p.to_local().numel(), whole + p.numel()
        else:
            local, whole = local + p.numel(), whole + p.numel()
    return local, whole

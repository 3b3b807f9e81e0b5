"""Post-training invariants and the dtype census: what a LoRA run must leave true, checked on the real model.

    train.check_invariants=true    # writes check/* to metrics.jsonl after the last step

- the frozen base is bit-identical to what was loaded (sha256 over every base tensor; ``lora.modules_to_save``'s
  trained copies count with the adapter, the originals they were copied from with the base);
- every rank that holds a full copy has the same LoRA weights (ranks did not fork);
- every ``lora_B`` is non-zero (an adapter that never moved, or was saved empty under ZeRO-3, shows here).

A full fine-tune (``model.finetune=full``) checks instead that its weights moved and are equal on every rank that
holds a full copy.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import gather_object

from scale.modeling.build import full_numel


def dtype_census(model: torch.nn.Module) -> dict[str, int]:
    """Parameter elements per ``dtype/trainable|frozen`` (catches a bf16 run silently upcast to fp32)."""
    census: dict[str, int] = {}
    for p in model.parameters():
        key = f"{str(p.dtype).replace('torch.', '')}/{'trainable' if p.requires_grad else 'frozen'}"
        census[key] = census.get(key, 0) + full_numel(p)
    return census


def fingerprints(acc: Accelerator, model: torch.nn.Module) -> dict[str, Any] | None:
    """sha256 of the full (gathered) LoRA weights and of the base weights, and how many ``lora_B`` tensors
    are non-zero. ``None`` on ranks that get no full copy (ZeRO-3 gathers onto rank 0 only).

    Collective: every rank calls (``get_state_dict`` gathers partitioned weights).
    """
    state = acc.get_state_dict(model, unwrap=True)  # collective: gathers ZeRO-3 shards
    if not state:
        return None
    digests = {"lora": hashlib.sha256(), "base": hashlib.sha256()}
    lora_b = []
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        raw = t.view(-1).view(torch.uint8).numpy().tobytes()
        trained = "lora_" in name or ".modules_to_save." in name  # lora.modules_to_save: peft's trained copies
        digests["lora" if trained else "base"].update(name.encode() + raw)
        if "lora_B" in name:
            lora_b.append(t.numel() > 0 and bool(t.abs().max() > 0))
    return {"lora": digests["lora"].hexdigest(), "base": digests["base"].hexdigest(),
            "lora_B": len(lora_b), "lora_B_nonzero": sum(lora_b)}


def check_invariants(acc: Accelerator, model: torch.nn.Module, before: dict[str, Any] | None,
                     full: bool = False) -> dict[str, Any]:
    """After training: base weights bit-identical to ``before``; LoRA weights equal on every rank that holds
    a full copy; every ``lora_B`` non-zero. A full fine-tune (``full``) trains the base itself: its weights moved
    from ``before`` and are equal on every rank that holds a full copy.

    Args:
        acc: the run's Accelerator.
        model: the prepared model after training.
        before: :func:`fingerprints` taken before training (``None`` on ranks without a full copy).
        full: ``model.finetune=full``.

    Returns:
        ``check/*`` metrics, the same on every rank.

    Collective: every rank calls.
    """
    after = fingerprints(acc, model)
    pairs = [p for p in gather_object([(before, after)]) if p[1] is not None]  # collective: every rank
    local = sum(p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.to_local().numel() if hasattr(p, "to_local")
                else p.numel() for p in model.parameters())  # ZeRO-3's partition; FSDP2's DTensor shard
    whole = sum(full_numel(p) for p in model.parameters())
    if full:
        return {"check/weights_moved": all(b is not None and b["base"] != a["base"] for b, a in pairs),
                "check/param_elements_local_fraction": local / whole,
                "check/ranks_agree": len({a["base"] for _, a in pairs}) == 1,
                "check/ranks_compared": len(pairs)}
    return {"check/base_unchanged": all(b is not None and b["base"] == a["base"] for b, a in pairs),
            "check/param_elements_local_fraction": local / whole,  # < 1 where ZeRO-3/FSDP2 partition weights
            "check/ranks_agree": len({a["lora"] for _, a in pairs}) == 1,
            "check/ranks_compared": len(pairs),
            "check/lora_B_nonzero": all(a["lora_B_nonzero"] == a["lora_B"] for _, a in pairs),
            "check/lora_B_tensors": pairs[0][1]["lora_B"]}

"""The transformers model a run's wrappers hold: the one whose config and modules the model-side patches
(:mod:`scale.modeling.mixed_paths`, :mod:`scale.modeling.varlen`, :mod:`scale.modeling.kernels`,
:func:`scale.loss.tail.packed_kwargs`) read or change. Plain attribute walking: no accelerate, no torch.distributed
(:func:`scale.training.checkpoint.unwrap` is the loop side's, through accelerate).
"""

from __future__ import annotations

import torch


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model under DDP / DeepSpeed / FSDP wrappers (``.module``) and a peft wrapper
    (``get_base_model()``); ``model`` itself when it wears none."""
    while hasattr(model, "module") and not hasattr(model, "get_base_model"):
        model = model.module
    return model.get_base_model() if hasattr(model, "get_base_model") else model

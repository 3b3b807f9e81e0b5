"""``model.kernels``: other kernels patched into a built model. ``liger``: Liger-Kernel's RMSNorm, SwiGLU and RoPE.

Liger-Kernel (https://github.com/linkedin/Liger-Kernel, Hsu et al. 2024, arXiv:2410.10989) ships one
``apply_liger_kernel_to_<family>`` function per model family in ``liger_kernel.transformers``; called with
``model=``, it rebinds the ``forward`` of the instance's RMSNorm and MLP modules to Triton kernels (fused
normalisation, fused ``silu(gate) * up``) and replaces the family module's ``apply_rotary_pos_emb`` (process-wide: any
model of that family built later in the process uses it too). The LoRA layers under the MLP stay peft's: Liger's
SwiGLU forward calls ``gate_proj``/``up_proj``/``down_proj`` as modules. Its cross-entropy patches are not applied:
the loss is this harness's tail loss (``loss.fused: liger`` is the fused linear cross-entropy,
:mod:`scale.loss.chunked`).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from scale.config.validation import ConfigError
from scale.utils.wrapped import base_model

LIGER_APPLY = {
    "llama": "apply_liger_kernel_to_llama",
    "mistral": "apply_liger_kernel_to_mistral",
    "qwen2": "apply_liger_kernel_to_qwen2",
    "qwen3": "apply_liger_kernel_to_qwen3",
    "gemma": "apply_liger_kernel_to_gemma",
    "gemma2": "apply_liger_kernel_to_gemma2",
    "phi3": "apply_liger_kernel_to_phi3",
    "granite": "apply_liger_kernel_to_granite",
    "olmo2": "apply_liger_kernel_to_olmo2",
    "smollm3": "apply_liger_kernel_to_smollm3",
}
"""``config.model_type`` -> the ``liger_kernel.transformers`` function that patches an instance of that family (the
same pairs as Liger's own ``MODEL_TYPE_TO_APPLY_LIGER_FN``, dense families only: Liger's mixture-of-experts patches
replace the experts' forward, which would bypass the LoRA on fused experts of :mod:`scale.modeling.moe`)."""

LIGER_KERNELS = {"rope": True, "rms_norm": True, "swiglu": True, "geglu": True,
                 "cross_entropy": False, "fused_linear_cross_entropy": False}
"""The keyword arguments the apply functions get, each passed where the function takes it (Gemma's MLP is a GeGLU,
``geglu``; the others' ``swiglu``): the norm, MLP and rotary kernels, no loss patch."""


def liger_apply_name(model: torch.nn.Module) -> str:
    """The name of the ``liger_kernel.transformers`` function that patches ``model``'s family (:data:`LIGER_APPLY`).

    Raises:
        ConfigError: a family that :data:`LIGER_APPLY` does not list, naming ``model.kernels`` and the families.
    """
    family = getattr(getattr(base_model(model), "config", None), "model_type", None)
    if family not in LIGER_APPLY:
        raise ConfigError(f"model.kernels=liger has no kernels for model type {family!r} (it patches "
                          f"{', '.join(sorted(LIGER_APPLY))}); set model.kernels=null")
    return LIGER_APPLY[family]


def liger_kwargs(fn: Any) -> dict[str, bool]:
    """:data:`LIGER_KERNELS` restricted to the parameters ``fn`` takes (as Liger's own instance dispatch does)."""
    params = inspect.signature(fn).parameters
    return {k: v for k, v in LIGER_KERNELS.items() if k in params}


def apply_kernels(model: torch.nn.Module, kernels: str | None) -> list[str]:
    """Patch ``model`` (a transformers model, or one wrapped by peft) with ``model.kernels``; return the names of the
    patches applied (``[]`` for None). Call it before the model is wrapped for a launch mode.

    Raises:
        ConfigError: the family has no Liger kernels (:func:`liger_apply_name`).
        ImportError: liger-kernel is not installed (``scale.distributed.inputs.check_liger`` refuses that earlier).
    """
    if kernels is None:
        return []
    name = liger_apply_name(model)
    import liger_kernel.transformers as liger

    fn = getattr(liger, name)
    kwargs = liger_kwargs(fn)
    fn(model=base_model(model), **kwargs)
    return [f"liger {k}" for k, v in kwargs.items() if v]

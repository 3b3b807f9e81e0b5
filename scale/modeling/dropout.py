"""The dropout a model trains with: every probability it draws masks from (its config's, its ``nn.Dropout``
modules', the float rates its layers pass to functional dropout, LoRA's: :func:`dropout_census`), and all of it
turned off for ``model.disable_dropout`` (:func:`disable_dropout`, TRL's ``disable_dropout``). No Accelerator.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch


def _is_rate(name: str, value: Any) -> bool:
    """Whether attribute ``name`` holds a dropout probability in use: a float in (0, 1] named like one
    (``attention_dropout``, ``resid_pdrop``, ``dropout_p``, ``layerdrop``...)."""
    return "drop" in name.lower() and isinstance(value, float) and 0.0 < value <= 1.0


@dataclass
class Dropouts:
    """The dropout a model trains with (:func:`dropout_census`).

    Attributes:
        config: the model config's dropout probabilities above 0, by key (a sub-config's as ``text_config.<key>``).
        modules: ``nn.Dropout`` modules of the model with ``p > 0`` (LoRA's excepted).
        rates: probabilities above 0 that modules keep as plain floats and pass to functional dropout in
            training (transformers' attention ``attention_dropout``, read as ``dropout_p`` of
            ``F.scaled_dot_product_attention`` when ``self.training``; ``nn.Dropout`` modules are not counted here).
        lora: LoRA's dropout on its input (``lora_dropout``; the largest of its adapters), 0 when none.
        lora_modules: LoRA dropout modules with ``p > 0``.
    """

    config: dict[str, float]
    modules: int
    rates: int
    lora: float
    lora_modules: int

    @property
    def model_has(self) -> bool:
        """Whether the base model (not LoRA) draws dropout masks in training."""
        return bool(self.config or self.modules or self.rates)

    def text(self) -> str:
        """What draws masks, in words: ``the model's attention_dropout=0.3 (2 functional rates in layers),
        lora.dropout=0.05 (14 adapters)``; ``''`` when nothing does."""
        model = ", ".join(f"{k}={v:g}" for k, v in self.config.items())
        counts = [f"{n} {what}" for n, what in ((self.modules, "Dropout modules"),
                                                (self.rates, "functional rates in layers")) if n]
        parts = ([f"the model's {model or 'layers'}" + (f" ({', '.join(counts)})" if counts else "")]
                 if self.model_has else [])
        if self.lora_modules:
            parts.append(f"lora.dropout={self.lora:g} ({self.lora_modules} adapters)")
        return ", ".join(parts)


def _configs(model: torch.nn.Module) -> Iterator[tuple[str, Any]]:
    """The model's config and its sub-configs (``text_config``...), each with its key prefix."""
    from transformers import PretrainedConfig

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    todo = [("", getattr(base, "config", None))]
    while todo:
        prefix, config = todo.pop()
        if isinstance(config, PretrainedConfig):
            yield prefix, config
            todo += [(f"{prefix}{k}.", v) for k, v in vars(config).items() if isinstance(v, PretrainedConfig)]


def dropout_census(model: torch.nn.Module) -> Dropouts:
    """Every dropout ``model`` draws masks from in training: its config's probabilities, its ``nn.Dropout``
    modules, the float rates its layers pass to functional dropout, and LoRA's."""
    config = {f"{prefix}{k}": v for prefix, c in _configs(model) for k, v in sorted(vars(c).items()) if _is_rate(k, v)}
    modules = rates = lora_modules = 0
    lora = 0.0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p > 0:
            if "lora_dropout" in name:
                lora_modules, lora = lora_modules + 1, max(lora, module.p)
            else:
                modules += 1
        rates += sum(_is_rate(k, v) for k, v in vars(module).items())
    return Dropouts(config, modules, rates, lora, lora_modules)


def disable_dropout(model: torch.nn.Module) -> Dropouts:
    """Turn off every dropout of ``model``, in place: ``model.disable_dropout`` (TRL's ``disable_dropout``).

    TRL's ``disable_dropout_in_model`` sets ``p = 0`` on every ``nn.Dropout`` (its DPO, CPO/SimPO, ORPO, KTO and
    reward trainers do by default, huggingface/trl#2042: "the added dropout causes fluctuations ... compared to the
    reference model"). That misses the probabilities transformers' layers keep as floats and pass to functional
    dropout while ``self.training`` (Llama, Qwen2/3, Mistral, Gemma: ``self.attention_dropout`` as
    ``F.scaled_dot_product_attention``'s ``dropout_p``; Persimmon and GPT-Neo's flash path read
    ``self.config.attention_dropout``): here those floats, on the modules and in the configs, become 0 too, and
    LoRA's dropout with them (peft's ``lora_dropout`` modules, and the adapters' ``lora_dropout`` in their
    ``peft_config``, so a saved ``adapter_config.json`` says what trained and an adapter added later (the DPO
    reference's frozen copy) has none). A module with ``p = 0`` draws no random numbers.

    Returns:
        :class:`Dropouts`: what was on before.
    """
    found = dropout_census(model)
    for _, config in _configs(model):
        for k, v in list(vars(config).items()):
            if _is_rate(k, v):
                setattr(config, k, 0.0)
    for module in model.modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd):
            module.p = 0.0
        for k, v in list(vars(module).items()):
            if _is_rate(k, v):
                setattr(module, k, 0.0)
    for peft_cfg in (getattr(model, "peft_config", None) or {}).values():
        if getattr(peft_cfg, "lora_dropout", 0):
            peft_cfg.lora_dropout = 0.0
    return found

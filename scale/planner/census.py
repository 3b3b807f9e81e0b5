"""What a model holds for training, counted from its config alone: its parameters, LoRA and 4-bit included. The
counting side of ``scale-plan`` (:mod:`scale.plan`), with the saved activations (:mod:`scale.planner.activations`).

The model is built on the ``meta`` device from its config (``AutoModelForCausalLM.from_config``; no memory) and
wrapped with LoRA by the harness's own :func:`scale.modeling.build.add_lora`, so parameters are counted exactly for
any architecture transformers knows. 4-bit storage cannot be built on ``meta``; it is computed from the shapes of the
linear layers transformers would quantize (its own ``get_keys_to_not_convert`` decides which), with bitsandbytes'
layout (:func:`nf4_bytes`).

No weights are loaded and no process group is started (no ``accelerate`` or ``torch.distributed`` import).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from scale.config.load import configs_dir
from scale.config.schema import Config, ModelConfig
from scale.modeling.build import TINY, add_lora, checkpointing_kwargs, tiny_llama_config
from scale.modeling.finetune import make_full
from scale.modeling.moe import moe_layout

GIB = 2**30
TINY_VOCAB = 49152  # `tiny-llama` borrows SmolLM2's tokenizer: len(tokenizer) == 49,152
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.uint8: 1}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


def nbytes(dtype: torch.dtype) -> int:
    """Bytes of one element of ``dtype`` (the dtypes a plan meets)."""
    return _BYTES[dtype]


class PlanError(ValueError):
    """The inputs cannot be planned (unknown model type, missing sizes, impossible GPU counts); says the fix."""


# ---------------------------------------------------------------------------------------------------------------
# The model, from its config only


def model_config_path(cfg: ModelConfig, override: str | None = None) -> Path | None:
    """The ``config.json`` to plan with: ``override`` (``--model-config``: a file, a directory, or the name of one
    shipped in ``configs/models/``), a ``.json`` file or a directory in ``model.name_or_path``, the shipped copy
    for ``smollm2-135m``; None for ``tiny-llama``.

    Raises:
        PlanError: the path does not exist, or the name is a hub id (no hub here).
    """
    shipped = configs_dir() / "models"
    if override is not None:
        path = Path(override)
        if not path.exists() and len(path.parts) == 1 and (shipped / f"{path.name.removesuffix('.json')}.json").is_file():
            path = shipped / f"{path.name.removesuffix('.json')}.json"
        elif not path.exists():
            names = sorted(p.stem for p in shipped.glob("*.json"))
            raise PlanError(f"--model-config {override}: neither a file or directory nor a shipped model config {names}")
    elif cfg.name_or_path == TINY:
        return None
    elif cfg.name_or_path == "smollm2-135m":
        path = shipped / "smollm2-135m.json"
    else:
        path = Path(cfg.name_or_path)
        if not path.exists():
            raise PlanError(f"model.name_or_path={cfg.name_or_path!r} is not a local directory or config.json (there "
                            f"is no model hub here); pass --model-config PATH/config.json, e.g. "
                            f"configs/models/llama-3.1-8b.json")
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanError(f"model config {str(path)!r} does not exist; pass a config.json file or a directory with one")
    return path


def load_model_config(cfg: ModelConfig, override: str | None = None) -> Any:
    """The transformers config of the model to plan (no weights read).

    Raises:
        PlanError: unreadable JSON, no ``model_type``, a model type transformers does not know, or a config
            without the sizes (``hidden_size``, ``num_hidden_layers``, ``num_attention_heads``, ``vocab_size``):
            transformers would silently fill its class defaults, a different model.
    """
    path = model_config_path(cfg, override)
    if path is None:
        return tiny_llama_config(cfg, TINY_VOCAB)
    from transformers import AutoConfig

    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"model config {str(path)!r} is not readable JSON: {e}") from e
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise PlanError(f"model config {str(path)!r} has no model_type; it must be a transformers config.json")
    model_type = raw["model_type"]
    try:
        hf = AutoConfig.for_model(model_type, **{k: v for k, v in raw.items() if k != "model_type"})
    except (KeyError, ValueError) as e:
        if cfg.trust_remote_code and "auto_map" in raw:
            hf = AutoConfig.from_pretrained(str(path.parent), trust_remote_code=True)
        else:
            raise PlanError(f"model config {str(path)!r} has an unknown model type {model_type!r} (transformers knows "
                            f"e.g. llama, mistral, qwen2, gemma2; remote-code models need their directory and "
                            f"model.trust_remote_code=true)") from e
    aliases = getattr(hf, "attribute_map", {})  # hidden_size -> n_embd, ... (GPT-2 style names)
    text = raw.get("text_config", raw)
    missing = [k for k in SIZE_KEYS if k not in text and aliases.get(k) not in text]
    if missing:
        raise PlanError(f"model config {str(path)!r} lacks {', '.join(missing)}: the planner needs the model's sizes "
                        f"(transformers would fill {type(hf).__name__}'s defaults, a different model)")
    return hf


@dataclass(frozen=True)
class ParamInfo:
    """One parameter of the LoRA-wrapped model, as the harness builds it.

    Attributes:
        name: dotted name (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight``).
        shape: shape of the logical (unquantized) tensor.
        dtype: dtype the harness trains with before any launcher cast (peft keeps LoRA fp32; QLoRA's
            ``prepare_model_for_kbit_training`` casts the unquantized fp16/bf16 weights to fp32).
        trainable: requires grad (the LoRA matrices).
        quantized: stored as bitsandbytes 4-bit (QLoRA base linear weights).
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    trainable: bool
    quantized: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def build_meta_model(cfg: Config, hf_config: Any, checkpointing: bool | None = None) -> torch.nn.Module:
    """The harness's model on the ``meta`` device (no memory): base + LoRA (:func:`scale.modeling.build.add_lora`),
    or with ``model.finetune: full`` the base alone with every parameter trainable
    (:func:`scale.modeling.finetune.make_full`).

    4-bit quantization is not applied (bitsandbytes cannot quantize meta tensors): see :func:`census`.
    """
    from transformers import AutoModelForCausalLM

    m = cfg.model
    gc = m.gradient_checkpointing if checkpointing is None else checkpointing
    dtype = DTYPES[m.dtype]
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=m.trust_remote_code)
        base.config.use_cache = False
        if m.finetune == "full":  # as scale.modeling.build.build_model builds it
            model = make_full(base, checkpointing_kwargs(replace(m, gradient_checkpointing=gc)) if gc else None)
        else:
            model = add_lora(base, replace(m, quantize_4bit=False, gradient_checkpointing=gc), cfg.lora)
    model.train()
    return model


def base_of(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model inside a peft wrapper; ``model`` itself when it has none (full weights)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def quantized_linear_names(base: torch.nn.Module) -> set[str]:
    """Module names of the ``nn.Linear`` layers transformers' bitsandbytes integration turns into ``Linear4bit``:
    every linear except the output embedding, tied and last modules, and ``_keep_in_fp32_modules``
    (transformers ``get_keys_to_not_convert`` / ``replace_with_bnb_linear``)."""
    from transformers.quantizers.base import get_keys_to_not_convert
    from transformers.quantizers.quantizers_utils import should_convert_module

    skip = list(get_keys_to_not_convert(base)) + list(getattr(base, "_keep_in_fp32_modules", None) or [])
    return {name for name, mod in base.named_modules()  # a LoRA-wrapped layer's weight is in its `base_layer`
            if type(mod) is torch.nn.Linear and ".lora_" not in name and should_convert_module(name, skip)}


def census(cfg: Config, model: torch.nn.Module) -> list[ParamInfo]:
    """Every distinct parameter of the meta-built model (tied weights once), with its training dtype.

    With ``model.quantize_4bit`` the weights of the linear layers transformers quantizes are marked
    ``quantized``; the other fp16/bf16 parameters become fp32, as ``prepare_model_for_kbit_training`` does (unless
    ``model.qlora_residual_dtype: compute`` keeps them in ``model.dtype``), except
    the fused expert weights of a mixture-of-experts model, which bitsandbytes does not quantize and the harness
    keeps in ``model.dtype`` (:func:`scale.modeling.moe.restore_expert_dtype`).
    """
    base = base_of(model)
    quantized: set[int] = set()
    if cfg.model.quantize_4bit:
        names = quantized_linear_names(base)
        quantized = {id(mod.weight) for name, mod in base.named_modules() if name in names}
    layout = moe_layout(model)
    experts = set(layout.expert_params) if layout is not None else set()
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        q = id(p) in quantized
        dtype = p.dtype
        expert = name.removeprefix("base_model.model.").replace(".base_layer", "") in experts
        if (cfg.model.quantize_4bit and cfg.model.qlora_residual_dtype == "float32" and not q and not expert
                and dtype in (torch.float16, torch.bfloat16)):
            dtype = torch.float32
        out.append(ParamInfo(name, tuple(p.shape), dtype, p.requires_grad, q))
    return out


def nf4_bytes(numel: int, double_quant: bool = True, blocksize: int = 64, nested_blocksize: int = 256) -> tuple[int, int]:
    """Bytes of one bitsandbytes 4-bit weight: ``(packed, quant_state)``.

    bitsandbytes 0.50 (``functional.quantize_4bit``): two 4-bit codes per byte, ``ceil(numel / 2)`` bytes (in
    ``bnb_4bit_quant_storage`` elements: the same bytes, viewed as uint8/bf16/fp32); one absmax per ``blocksize``
    elements, fp32, or with double quantization uint8 plus one fp32 absmax per ``nested_blocksize`` of those, an
    fp32 offset and the nested 256-entry fp32 code; the 16-entry fp32 NF4 code. ``quant_storage`` changes only
    the dtype the packed bytes are viewed as, so that ZeRO-3/FSDP can shard them like other float weights.
    """
    packed = (numel + 1) // 2
    blocks = math.ceil(numel / blocksize)
    state = 16 * 4  # NF4 code
    if double_quant:
        state += blocks + 4 * math.ceil(blocks / nested_blocksize) + 4 + 256 * 4
    else:
        state += 4 * blocks
    return packed, state

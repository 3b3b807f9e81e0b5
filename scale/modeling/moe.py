"""Mixture-of-experts models: what LoRA trains in them, and how the tokens spread over their experts. No Accelerator.

In transformers 5 a mixture-of-experts block holds its experts as *fused 3-D parameters* of one ``...Experts``
module (Qwen3-MoE, Qwen2-MoE, Mixtral, DeepSeek-V3, OLMoE: ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``;
gpt-oss the transposed ``[E, H, 2I]`` / ``[E, I, H]``) beside a router module (``mlp.gate`` / ``mlp.router``, a
``...TopKRouter`` holding a ``weight [E, H]``), not as ``nn.Linear`` layers. ``lora.target_modules: all-linear``
alone would adapt the attention only; peft's transformers-4 compatibility conversion
(``peft.utils.transformers_weight_conversion``) instead turns ``all-linear`` into LoRA on the experts *and on the
router*, doubles the rank of ``gate_up_proj`` and warns that its own ``rank_pattern`` matched nothing. Here the
targets are chosen from the model's structure (:func:`moe_layout`), passed to peft as explicit module names and
parameter names (``target_parameters``, peft's ``ParamWrapper``: one LoRA pair per expert), and peft's conversion is
kept out of it (:func:`explicit_targets`):

- ``all-linear``: every linear layer but the LM head and the routers (attention, shared experts, the dense MLPs of
  dense layers) + every expert's projections (per expert, rank ``lora.r``);
- the routers stay frozen (no adapter) unless ``lora.train_router: true``, which gives their ``weight`` a LoRA pair;
- ``lora.dropout`` applies to the adapters of linear layers; the expert adapters run without it, since LoRA on a
  parameter adds ``B A`` to the weight and cannot drop the input of the adapter alone (peft's ``ParamWrapper``
  raises for ``lora_dropout != 0``; https://github.com/huggingface/peft/blob/main/src/peft/tuners/lora/layer.py).

:mod:`scale.modeling.moe_counts` counts what a token uses (active parameters, FLOPs) for the planner and the meter;
:mod:`scale.training.parts.experts` counts the tokens each router sends to each expert during training
(``train/expert_load/*``) and adds the load-balancing loss while the routers train.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from scale.config.validation import ConfigError
from scale.utils.compat import installed, peft_adapts_parameters

# Class-name markers of the router modules (Qwen3MoeTopKRouter, MixtralTopKRouter, GptOssTopKRouter,
# DeepseekV3TopkRouter) and the leaf names of a shared expert's scalar gate (Qwen2-MoE's shared_expert_gate).
ROUTER_CLASS = re.compile(r"router", re.IGNORECASE)
ROUTER_LEAVES = ("shared_expert_gate",)


@dataclass
class MoeLayout:
    """Where a mixture-of-experts model keeps its experts and routers (full module / parameter names).

    Attributes:
        family: ``config.model_type`` (``qwen3_moe``, ``mixtral``, ``gpt_oss``, ``deepseek_v3`` ...).
        num_experts: routed experts per MoE layer, ``E``.
        top_k: experts each token is sent to.
        experts: the ``...Experts`` modules, one per MoE layer (``model.layers.0.mlp.experts``).
        expert_params: their fused 3-D weights (``model.layers.0.mlp.experts.gate_up_proj``), biases excepted.
        routers: the router modules (``model.layers.0.mlp.gate``), one per MoE layer, in layer order.
        router_params: the routers' weights (``model.layers.0.mlp.gate.weight``) and linear shared-expert gates.
        router_linears: router-like ``nn.Linear`` layers (a shared expert's scalar gate): never in ``all-linear``.
    """

    family: str
    num_experts: int
    top_k: int
    experts: list[str] = field(default_factory=list)
    expert_params: list[str] = field(default_factory=list)
    routers: list[str] = field(default_factory=list)
    router_params: list[str] = field(default_factory=list)
    router_linears: list[str] = field(default_factory=list)


def text_config(config: Any) -> Any:
    """The text model's config of ``config`` (a multimodal model's ``get_text_config()``), else ``config``."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def expert_count(config: Any) -> tuple[int, int] | None:
    """``(routed experts E, experts per token k)`` named by a model config, or None for a dense model.

    Reads the keys the families use: ``num_experts`` (Qwen-MoE, OLMoE), ``num_local_experts`` (Mixtral, gpt-oss),
    ``n_routed_experts`` (DeepSeek-V2/V3, GLM-4-MoE); ``num_experts_per_tok`` (all of them; gpt-oss also
    ``experts_per_token``).
    """
    text = text_config(config)
    e = next((getattr(text, k) for k in ("num_experts", "num_local_experts", "n_routed_experts")
              if isinstance(getattr(text, k, None), int) and getattr(text, k) > 1), None)
    k = next((getattr(text, a) for a in ("num_experts_per_tok", "experts_per_token")
              if isinstance(getattr(text, a, None), int)), None)
    return (e, k or 1) if e else None


def moe_layout(model: torch.nn.Module) -> MoeLayout | None:
    """The experts and routers of a transformers mixture-of-experts model, or None for a dense one.

    An experts module is a module holding 3-D parameters whose first dimension is the config's ``E``; a router is a
    module whose class name says router (``...TopKRouter``) or a shared expert's gate (:data:`ROUTER_LEAVES`).

    Args:
        model: the base model, or a peft model around it (the names are then the base model's).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    counts = expert_count(getattr(base, "config", None)) if hasattr(base, "config") else None
    if counts is None:
        return None
    layout = MoeLayout(family=getattr(base.config, "model_type", "?"), num_experts=counts[0], top_k=counts[1])
    for full, module in base.named_modules():
        if ".lora_" in f".{full}":
            continue
        name = full.replace(".base_layer", "")  # under a peft wrapper the model's own module is its base_layer
        if is_parameter_adapter(module) or name in layout.experts or name in layout.routers:
            continue
        shapes = {p: tuple(getattr(t, "ds_shape", t.shape)) for p, t in module.named_parameters(recurse=False)}
        fused = [p for p, shape in shapes.items() if len(shape) == 3 and shape[0] == layout.num_experts]
        if fused:
            layout.experts.append(name)
            layout.expert_params.extend(f"{name}.{p}" for p in fused)
        elif ROUTER_CLASS.search(type(module).__name__):
            layout.routers.append(name)
            layout.router_params.extend(f"{name}.{p}" for p, shape in shapes.items() if len(shape) == 2)
        elif name.rsplit(".", 1)[-1] in ROUTER_LEAVES and isinstance(module, torch.nn.Linear):
            layout.router_linears.append(name)
            layout.router_params.append(f"{name}.weight")
    return layout if layout.experts else None


@dataclass
class Targets:
    """What LoRA adapts in a mixture-of-experts model: full names for peft.

    Attributes:
        modules: linear layers (``target_modules``): attention, shared experts, dense MLPs.
        parameters: fused expert weights (and, with ``lora.train_router``, router weights) (``target_parameters``).
    """

    modules: list[str]
    parameters: list[str]


def lora_targets(layout: MoeLayout, target_modules: list[str] | str, train_router: bool,
                 linear: list[str]) -> Targets:
    """Resolve ``lora.target_modules`` on a mixture-of-experts model to full module and parameter names.

    ``all-linear``: every linear layer in ``linear`` (the model's, LM head excluded:
    :func:`scale.modeling.build.linear_names`) except router-like ones, and every expert weight. A list: a name matches
    a linear layer by peft's suffix rule (``q_proj`` matches ``model.layers.0.self_attn.q_proj``) or an expert weight
    by its leaf (``gate_up_proj``, ``down_proj``; ``experts`` takes all of them). A string other than ``all-linear``:
    a regular expression full-matched against linear layer names and expert weight names (peft's rule for a string).
    ``train_router`` adds the routers' weights.

    Raises:
        ConfigError: a listed name matches nothing (the message lists the model's names); a peft without
            ``target_parameters``.
    """
    if not peft_adapts_parameters():
        raise ConfigError(f"model.name_or_path is a mixture-of-experts model ({layout.family}) whose experts are fused "
                          f"3-D parameters: LoRA on them needs peft's target_parameters, which peft "
                          f"{installed('peft')} lacks; pip install -U peft")
    routers = set(layout.router_linears)
    linear = [n for n in linear if n not in routers]
    experts = list(layout.expert_params)
    if isinstance(target_modules, str) and target_modules.lower() == "all-linear":
        modules, params = linear, experts
    elif isinstance(target_modules, str):
        pattern = re.compile(target_modules)
        modules = [n for n in linear if pattern.fullmatch(n)]
        params = [n for n in experts if pattern.fullmatch(n)]
    else:
        wanted = set(target_modules)
        modules = [n for n in linear if any(n == t or n.endswith(f".{t}") for t in wanted)]
        params = [n for n in experts if n.rsplit(".", 1)[-1] in wanted or "experts" in wanted]
        known = {n.rsplit(".", 1)[-1] for n in linear} | {n.rsplit(".", 1)[-1] for n in experts} | {"experts"}
        unknown = sorted(t for t in wanted if t.rsplit(".", 1)[-1] not in known)
        router_leaves = {n.rsplit(".", 1)[-1] for n in layout.routers + layout.router_linears}
        if unknown:
            routers = " (routers train with lora.train_router=true)" if set(unknown) & router_leaves else ""
            raise ConfigError(f"lora.target_modules: {unknown} match no linear layer or expert weight of this "
                              f"{layout.family} model{routers}; its names are {sorted(known)} (or use all-linear)")
    if train_router:
        params = params + [p for p in layout.router_params if p.rsplit(".", 2)[-2] not in ROUTER_LEAVES]
        modules = modules + [n for n in layout.router_linears if n not in modules]
    if not modules and not params:
        raise ConfigError(f"lora.target_modules={target_modules!r} selects nothing in this {layout.family} model")
    return Targets(modules=modules, parameters=params)


@contextlib.contextmanager
def explicit_targets() -> Iterator[None]:
    """Keep peft's transformers-4 compatibility conversion of a LoRA config out of an adapter built (or loaded) with
    explicit target names.

    peft 0.18+ rewrites the config of Qwen2/3-MoE-, DeepSeek-, OLMoE- and Mixtral-type models so that adapters
    trained on transformers 4 (experts as ``nn.Linear``) load into transformers 5 (fused experts)
    (``peft/utils/transformers_weight_conversion.py``, ``convert_peft_config_for_transformers``): ``all-linear``
    then adapts the router, and any listed name ending ``.gate_proj``/``.up_proj``/``.down_proj`` (a shared
    expert's linear layers) is moved to the routed experts' fused weight with twice the rank. Our adapters name
    their targets in full for transformers 5, so the conversion has nothing to do and is switched off while peft
    builds or loads them.
    """
    try:
        import peft.utils.transformers_weight_conversion as conversion
    except Exception:  # noqa: BLE001 - peft without the conversion (or transformers 4): nothing to switch off
        yield
        return
    original = conversion.convert_peft_config_for_transformers
    conversion.convert_peft_config_for_transformers = lambda *args, **kwargs: None
    try:
        yield
    finally:
        conversion.convert_peft_config_for_transformers = original


def load_rewrites(model: torch.nn.Module, adapter: str = "default") -> str | None:
    """What the installed peft would change in this adapter's saved config when plain peft
    (``PeftModel.from_pretrained``) or transformers (``model.load_adapter``) loads it; None when nothing.

    Both run peft's transformers-4 compatibility conversion (:func:`explicit_targets`) on the saved config. peft
    0.22 keeps a listed linear layer a linear target (huggingface/peft#3945); peft 0.18-0.21 move every listed name
    ending ``.gate_proj``/``.up_proj``/``.down_proj`` (DeepSeek's shared experts and dense first layers, Qwen3-MoE's
    ``mlp_only_layers``) onto the routed experts' fused weights with twice the rank, so such an adapter loads there
    with a size mismatch. The conversion is run here on a copy of the config against the base model built on the
    meta device from its config (what a user loads: no LoRA layers in it), and the targets, ranks and alphas are
    compared.

    Returns:
        The start-up warning (under 240 characters): what moves, and the fix; None when the saved config loads as
        it is.

    Args:
        model: the peft model (its ``peft_config[adapter]`` is what ``save_pretrained`` writes).
    """
    try:
        from peft.utils.transformers_weight_conversion import convert_peft_config_for_transformers
    except Exception:  # noqa: BLE001 - a peft without the conversion (< 0.18) or transformers 4: nothing is rewritten
        return None
    import copy

    config = copy.deepcopy(model.peft_config[adapter])
    base = model.get_base_model()

    def seen(c: Any) -> tuple:
        names = lambda v: sorted(v) if isinstance(v, (list, set, tuple)) else v
        return (names(c.target_modules), names(getattr(c, "target_parameters", None) or []),
                dict(c.rank_pattern or {}), dict(c.alpha_pattern or {}))

    before = seen(config)
    with torch.device("meta"):  # the class itself, not from_config: no DeepSpeed ZeRO-3 init around it
        fresh = type(base)(copy.deepcopy(base.config))
    convert_peft_config_for_transformers(config, model=fresh, conversions=None)
    after = seen(config)
    if after == before:
        return None
    moved = sorted(set(before[0]) - set(after[0])) if isinstance(before[0], list) else [before[0]]
    added = sorted(set(after[1]) - set(before[1]))
    ranks = {k: v for k, v in after[2].items() if before[2].get(k) != v}
    leaves = ", ".join(sorted({m.rsplit(".", 1)[-1] for m in moved}))
    changes = ([f"{len(moved)} linear targets ({leaves}) moved"] if moved else []) + (
        [f"{', '.join(added)} added"] if added and not moved else []) + [
        f"{k.rsplit('.', 1)[-1]} at rank {v}" for k, v in ranks.items()]
    return (f"peft {installed('peft')} rewrites this adapter's targets in PeftModel.from_pretrained/load_adapter "
            f"({'; '.join(changes)}): load it with peft >= 0.22 (huggingface/peft#3945), or scale-generate")


def set_linear_dropout(model: torch.nn.Module, p: float) -> int:
    """Give the LoRA adapters of linear layers dropout ``p`` on their input (peft's ``lora_dropout``), leaving the
    parameter adapters (``ParamWrapper``) without; return how many layers got it.

    peft builds every layer of a config with one dropout and refuses a non-zero one for parameter adapters, so the
    adapter is built with ``lora_dropout=0`` and the linear layers get theirs here: the same ``nn.Dropout(p)`` on
    the same input peft's ``lora.Linear`` would apply. The saved ``adapter_config.json`` then says 0, which is what
    a reload needs (dropout does nothing at inference).
    """
    from peft.tuners.lora import LoraLayer

    count = 0
    if p <= 0:
        return 0
    for module in model.modules():
        if isinstance(module, LoraLayer) and not is_parameter_adapter(module):
            for name in list(module.lora_dropout.keys()):
                module.lora_dropout[name] = torch.nn.Dropout(p=p)
                count += 1
    return count


def is_parameter_adapter(module: torch.nn.Module) -> bool:
    """Whether ``module`` is peft's LoRA on a parameter (``ParamWrapper``, or the split path's subclass of it,
    :mod:`scale.modeling.moe_lora`), not on a layer's input."""
    return any(c.__name__ == "ParamWrapper" for c in type(module).__mro__)


def parameter_adapters(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """peft's ``ParamWrapper`` modules by the full name of the parameter they adapt
    (``model.layers.0.mlp.experts.gate_up_proj``, without peft's ``base_model.model.`` prefix)."""
    out: dict[str, torch.nn.Module] = {}
    for name, module in model.named_modules():
        if is_parameter_adapter(module):
            owner = re.sub(r"(^|\.)base_model\.model\.", r"\1", name)
            owner = re.sub(r"(\.base_layer)+$", "", owner)
            owner = owner.replace(".base_layer.", ".")
            out[f"{owner}.{module.parameter_name}"] = module
    return out


def expert_factors(wrapper: torch.nn.Module, adapter: str = "default") -> tuple[torch.Tensor, torch.Tensor]:
    """The LoRA factors of every expert of a ``ParamWrapper`` on a fused ``[E, ., .]`` weight, as views.

    peft stores ``lora_A`` as ``[r * E, in]`` (expert ``e`` owns rows ``e*r .. e*r + r - 1``) and ``lora_B`` as
    ``[out, r * E]`` with the expert index varying fastest (column ``j * E + e`` is expert ``e``'s ``j``-th)
    (``ParamWrapper.get_delta_weight``).

    Returns:
        ``(A [E, r, in], B [E, out, r])``; expert ``e``'s update of its weight is ``scaling * B[e] @ A[e]``
        (``[out, in]``, transposed when the fused weight stores ``[E, in, out]``).
    """
    e = wrapper.num_experts
    a = wrapper.lora_A[adapter].weight
    b = wrapper.lora_B[adapter].weight
    return a.reshape(e, -1, a.shape[-1]), b.reshape(b.shape[0], -1, e).permute(2, 0, 1)


def targets_line(model: torch.nn.Module, layout: MoeLayout, dropout: float, quantized: bool) -> list[str]:
    """The start-up line saying what trains in a mixture-of-experts model, as parts to join with ``"; "`` (each
    under 240 characters: :func:`scale.training.job.lines_within` wraps them).

    ``LoRA on qwen3_moe (top-2 of 8): attention 4 x 2 layers, experts 8 x 2 layers (gate_up_proj, down_proj; a LoRA
    pair per expert), router frozen (lora.train_router=false); lora.dropout=0.05 on the linear layers' adapters
    only (...)``: ``attention 4 x 2 layers`` is 4 adapted projections in each of 2 layers.
    """
    from peft.tuners.lora import LoraLayer

    kinds: dict[str, tuple[set[str], set[str]]] = {}  # kind -> (leaf names, layers)
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and not is_parameter_adapter(module):
            owner, _, leaf = name.rpartition(".")
            kind = ("router" if leaf in ROUTER_LEAVES else "shared experts" if "shared_expert" in owner else
                    "attention" if "attn" in owner or "attention" in owner else "MLP" if "mlp" in owner else "other")
            layer = re.search(r"\.(\d+)\.", f".{name}.")
            leaves, layers = kinds.setdefault(kind, (set(), set()))
            leaves.add(leaf)
            layers.add(layer.group(1) if layer else name)
    adapted = parameter_adapters(model)
    routers = [n for n in adapted if n in layout.router_params]
    experts = [n for n in adapted if n in layout.expert_params]
    layers = len(layout.experts)
    parts = [f"{kind} {len(leaves)} x {len(layers)} layers" for kind, (leaves, layers) in kinds.items()
             if kind != "router"]
    if experts:
        leaves = sorted({n.rsplit(".", 1)[-1] for n in experts}, reverse=True)
        per_layer = len({n.rsplit(".", 1)[0] for n in experts})
        parts.append(f"experts {layout.num_experts} x {per_layer} layers ({', '.join(leaves)}; a LoRA pair per "
                     f"expert)")
    else:
        parts.append(f"experts frozen ({layout.num_experts} x {layers} MoE layers: lora.target_modules names none "
                     f"of their weights)")
    parts.append(f"router trained (LoRA on {len(routers)} router weights)" if routers or "router" in kinds else
                 "router frozen (lora.train_router=false)")
    lines = [f"LoRA on {layout.family} (top-{layout.top_k} of {layout.num_experts}): " + ", ".join(parts)]
    if dropout > 0 and experts:
        lines.append(f"lora.dropout={dropout:g} on the linear layers' adapters only (the expert adapters run without "
                     f"it on both lora.expert_impl paths: peft's adds B A to the fused weight, it cannot drop its "
                     f"input)")
    if quantized:
        lines.append("model.quantize_4bit quantizes the linear layers only: the fused expert weights stay in "
                     "model.dtype (bitsandbytes 4-bit covers nn.Linear)")
    return lines


def restore_expert_dtype(model: torch.nn.Module, layout: MoeLayout, dtypes: dict[str, torch.dtype]) -> int:
    """Put the fused expert weights back in the dtype they were loaded in (``dtypes``: name -> dtype); return how
    many changed. peft's ``prepare_model_for_kbit_training`` casts every 16-bit parameter that is not 4-bit to
    float32, which doubles the largest frozen tensors of a mixture-of-experts model; its purpose (norms and head in
    float32) does not concern them."""
    params = dict(model.named_parameters())
    count = 0
    for name in layout.expert_params:
        p = params.get(name)
        if p is not None and name in dtypes and p.dtype != dtypes[name]:
            p.data = p.data.to(dtypes[name])
            count += 1
    return count

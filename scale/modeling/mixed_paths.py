"""Mixed precision with fewer casts: the paths that make a bf16 (or fp16) autocast run cast, copy and round less.

Under ``torch.autocast`` only the GEMMs gain; a LoRA model on a half-precision (or 4-bit) base paid for casts around
them: float32 adapter inputs cast per layer and per adapter, the base output cast back to float32, peft's
``base + lora_B(h) * scaling`` as three passes over ``[rows, out_features]``, a frozen float32 head cast in every
forward, and bitsandbytes dequantizing to float32 before casting to the compute dtype. Each path below removes one
of those, on any device (:data:`DEVICE_PATHS`); :func:`mixed_sdpa` (attention in float32 for short keys) pays on
the CPU only (:data:`CPU_PATHS`). Each is measured alone by ``benchmarks/bf16_paths.py`` (CPU: time and
LoRA-gradient difference against the fp32 model, docs/benchmarks.md) and on a GPU by ``benchmarks/gpu_check.py``
(casts per step and tokens/s with the paths on and off). :func:`use_mixed_paths` switches on those of a device for a
run under autocast (``scale.training.parts.model``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from typing import Any

import torch

from scale.utils.wrapped import base_model

ATTENTION_FP32_BELOW = 256
"""Key length (tokens) below which :func:`mixed_sdpa` computes attention in float32 on CPU although autocast asks
for bf16/fp16. torch's CPU flash-attention kernel runs its bf16 backward as 4 small ``cpublas::gemm`` calls per
(row, head) and query/key block (aten/src/ATen/native/cpu/FlashAttentionKernel.cpp), each paying oneDNN's
per-call overhead where fp32 calls MKL's SGEMM: at 42 tokens (8 rows, 9 heads, head size 64) bf16 forward +
backward measured 11.0 ms against 3.1 ms in fp32 (inputs cast included); at 256 tokens they were even, at 1,024
tokens bf16 was 1.6x faster (50 vs 82 ms)."""

MIXED_SDPA = "sdpa_cpu_mixed"
"""The name :func:`use_mixed_sdpa` registers :func:`mixed_sdpa` under with transformers' ``AttentionInterface``."""


def mixed_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
    """transformers' ``sdpa_attention_forward``, in float32 on CPU for keys shorter than
    :data:`ATTENTION_FP32_BELOW` where it would compute in bf16/fp16 (autocast, or half-precision inputs).

    Args:
        module: the attention layer (transformers passes it).
        query: ``[B, heads, Tq, D]``.
        key: ``[B, kv_heads, Tk, D]``.
        value: ``[B, kv_heads, Tk, D]``.
        attention_mask: boolean or additive ``[B, 1, Tq, Tk]`` mask, or None (causal).
        **kwargs: passed on (``dropout``, ``scaling``, ``is_causal``...).

    Returns:
        ``(output [B, Tq, heads, D], None)`` in the dtype sdpa would have returned (the autocast dtype under
        autocast): the result differs from the bf16 kernel's by bf16 round-off only, the fp32 one being closer to
        an fp32 run.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    half = (torch.bfloat16, torch.float16)
    dev = query.device.type
    autocast = torch.is_autocast_enabled(dev) and torch.get_autocast_dtype(dev) in half
    if dev != "cpu" or key.shape[-2] >= ATTENTION_FP32_BELOW or not (autocast or query.dtype in half):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    out_dtype = torch.get_autocast_dtype(dev) if autocast else query.dtype
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    with torch.autocast(dev, enabled=False):
        out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask,
                                              **kwargs)
    return out.to(out_dtype), weights


def use_mixed_sdpa(model: torch.nn.Module, on: bool = True) -> bool:
    """Switch a model attending with ``sdpa`` to :func:`mixed_sdpa` (``on``) or back; return whether it changed.

    Registered with transformers' ``AttentionInterface`` (and sdpa's mask function with ``AttentionMaskInterface``)
    as https://huggingface.co/docs/transformers/attention_interface shows. The name lives in the config's
    ``_attn_implementation``, which ``save_pretrained`` does not write: saved configs and adapters are unchanged.
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(MIXED_SDPA, mixed_sdpa)
    AttentionMaskInterface.register(MIXED_SDPA, sdpa_mask)
    config = base_model(model).config
    now, want = ("sdpa", MIXED_SDPA) if on else (MIXED_SDPA, "sdpa")
    if getattr(config, "_attn_implementation", None) != now:
        return False
    config._attn_implementation = want
    return True


# The last cast made by _adapter_input_hook: (input, its version, grad mode, cast). q/k/v (and gate/up) read the same
# normed hidden states; they share one cast instead of making three (two).
_LAST_CAST: list[Any] = [None]


def _adapter_input_hook(_module: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
    x = args[0] if args else None
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32:
        return None
    dev = x.device.type
    if not torch.is_autocast_enabled(dev):
        return None
    dtype, grad = torch.get_autocast_dtype(dev), torch.is_grad_enabled()
    last = _LAST_CAST[0]
    if last is not None and last[0]() is x and last[1] == x._version and last[2] == grad and last[3].dtype == dtype:
        return (last[3], *args[1:])
    cast = x.to(dtype)
    _LAST_CAST[0] = (weakref.ref(x), x._version, grad, cast)
    return (cast, *args[1:])


def _input_lora_layers(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """peft's LoRA layers of ``model`` that adapt an input (a layer's ``lora_A`` reads it): every ``LoraLayer``
    module but ``ParamWrapper`` (LoRA on a fused expert weight, peft >= 0.17)."""
    import peft.tuners.lora as peft_lora

    LoraLayer, ParamWrapper = peft_lora.LoraLayer, getattr(peft_lora, "ParamWrapper", ())  # () before peft 0.17
    for module in model.modules():
        if isinstance(module, LoraLayer) and isinstance(module, torch.nn.Module) \
                and not isinstance(module, ParamWrapper):
            yield module


def cast_adapter_inputs_once(model: torch.nn.Module, on: bool = True) -> int:
    """Under autocast (any device), cast each LoRA layer's float32 input to the autocast dtype once, at the layer's
    entry, so that the base layer and the adapter read the same copy (and layers reading the same input, q/k/v, share
    it); return how many layers it touched.

    Without it, a LoRA layer on a bitsandbytes 4-bit base casts its input twice (``Linear4bit`` to its compute
    dtype, autocast again for ``lora_A``) and casts the base's output back to float32; peft skips its own input cast
    only under CUDA autocast (``torch.is_autocast_enabled()`` without a device is CUDA's), so on CPU it also casts a
    half input up to the adapter's float32 (peft's ``cast_input_dtype_enabled``, switched off here as peft's
    ``disable_input_dtype_casting`` does). With it the layer's output stays in the autocast dtype (base + adapter
    summed in bf16, as on a GPU); the residual stream stays float32 (it adds bf16 outputs to float32 embeddings).
    The maths of the matmuls is unchanged (autocast cast the same input to the same dtype); the sums and the
    elementwise ops between layers round to bf16 (gradient difference: docs/benchmarks.md).
    """
    count = 0
    for module in _input_lora_layers(model):
        handle = getattr(module, "_scale_input_hook", None)
        if on and handle is None:
            module._scale_input_hook = module.register_forward_pre_hook(_adapter_input_hook)
            module.cast_input_dtype_enabled = False
            count += 1
        elif not on and handle is not None:
            _LAST_CAST[0] = None
            handle.remove()
            del module._scale_input_hook
            module.cast_input_dtype_enabled = True
            count += 1
    return count


def _addmm_adapter_forward(layer: torch.nn.Module, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    name = layer.active_adapters[0] if len(layer.active_adapters) == 1 else None
    dev = x.device.type
    if (name is None or layer.disable_adapters or layer.merged or kwargs.get("adapter_names") is not None
            or name not in layer.lora_A or name in getattr(layer, "lora_variant", {})
            or layer.lora_B[name].bias is not None or not torch.is_autocast_enabled(dev)):
        return type(layer).forward(layer, x, *args, **kwargs)  # peft's own forward
    result = layer.base_layer(x, *args, **kwargs)
    h = layer.lora_A[name](layer.lora_dropout[name](x))                            # [..., r]
    out = torch.addmm(result.reshape(-1, result.shape[-1]), h.reshape(-1, h.shape[-1]),
                      layer.lora_B[name].weight.t(), alpha=layer.scaling[name])   # base + scaling * h @ B^T
    return out.view(result.shape)


def fuse_adapter_sum(model: torch.nn.Module, on: bool = True) -> int:
    """Under autocast, add each LoRA adapter's output to the base layer's in the adapter's second matmul: one
    ``addmm(base, h, B^T, alpha=scaling)`` instead of peft's ``base + lora_B(h) * scaling`` (a product, a scaling
    pass and a sum over ``[rows, out_features]``); return how many layers it touched.

    For one active plain adapter (no variant such as DoRA, no ``lora_B`` bias, not merged); anything else, and any
    forward outside autocast, runs peft's own forward. The sum is rounded once (oneDNN accumulates the product in
    float32 and adds the base in the same kernel) instead of three times; the gradients are autograd's of ``addmm``.
    """
    import types

    count = 0
    for module in _input_lora_layers(model):
        installed = "forward" in vars(module)
        if on and not installed:
            module.forward = types.MethodType(_addmm_adapter_forward, module)
            count += 1
        elif not on and installed:
            del module.forward
            count += 1
    return count


def _cached_cast_forward(head: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    dev = x.device.type
    w = head.weight
    if torch.is_autocast_enabled(dev) and not w.requires_grad and w.dtype == torch.float32:
        dtype = torch.get_autocast_dtype(dev)
        key = (w.data_ptr(), w._version, dtype)
        cached = getattr(head, "_scale_cast", None)
        if cached is None or cached[0] != key:
            cached = (key, w.detach().to(dtype))
            head._scale_cast = cached
        w = cached[1]
    return torch.nn.functional.linear(x, w, head.bias)


def cache_head_cast(model: torch.nn.Module, on: bool = True) -> bool:
    """Keep the autocast copy of a frozen ``nn.Linear`` LM head between forwards; return whether it changed.

    Autocast caches casts of leaf tensors that require grad only, so a frozen float32 head (tied to the embedding:
    ``[V, H]``, 28 M elements for SmolLM2) was cast to bf16 again in every forward (77 ms per micro-step on one
    thread). The copy is made once and made again when the weight changes (its data pointer or version); the
    product is bit-identical (autocast casts the same weight to the same dtype). Costs one bf16 copy of the head
    (56 MiB for SmolLM2). A head with LoRA or a trainable head is left alone.
    """
    import types

    base = base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    if type(head) is not torch.nn.Linear or head.weight.requires_grad:
        return False
    installed = "forward" in vars(head)
    if on and not installed:
        head.forward = types.MethodType(_cached_cast_forward, head)
        return True
    if not on and installed:
        del head.forward
        head.__dict__.pop("_scale_cast", None)
        return True
    return False


def dequantize_in_compute_dtype(model: torch.nn.Module, on: bool = True) -> int:
    """Make bitsandbytes' 4-bit backward dequantize straight to the layer's compute dtype; return how many layers.

    ``MatMul4Bit.backward`` dequantizes the weight to its quantization state's dtype (the dtype the model was loaded
    in, float32) and casts the result to the gradient's dtype: a float32 ``[N, K]`` weight and a copy per layer and
    step. The forward already dequantizes straight to the compute dtype (``gemm_4bit``). Setting the state's dtype
    to the compute dtype gives bit-identical weights (the same kernel rounds the same float32 products; checked on
    the NF4 double-quantized ``[1536, 576]`` of SmolLM2: 0.24 instead of 0.57 ms per weight on one thread).
    ``on=False`` puts the load dtype back. Export dequantizes its own freshly loaded base (scale.generation.export).
    """
    count = 0
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        compute = getattr(module, "compute_dtype", None)
        if state is None or compute is None:
            continue
        if on and not hasattr(module, "_scale_load_dtype"):
            module._scale_load_dtype = state.dtype
            state.dtype = compute
            count += 1
        elif not on and hasattr(module, "_scale_load_dtype"):
            state.dtype = module._scale_load_dtype
            del module._scale_load_dtype
            count += 1
    return count


MIXED_PATHS = {"attention_fp32_short": use_mixed_sdpa, "adapter_inputs_cast_once": cast_adapter_inputs_once,
               "adapter_sum_in_addmm": fuse_adapter_sum, "head_cast_cached": cache_head_cast,
               "dequantize_to_compute_dtype": dequantize_in_compute_dtype}
"""The mixed-precision paths by name (each ``fn(model, on) -> changed``), for :func:`use_mixed_paths` and
``benchmarks/bf16_paths.py``, which switches them one at a time."""

CPU_PATHS = tuple(MIXED_PATHS)
"""The paths a CPU run under bf16 autocast takes: all of them."""

DEVICE_PATHS = ("adapter_inputs_cast_once", "adapter_sum_in_addmm", "head_cast_cached", "dequantize_to_compute_dtype")
"""The paths that pay on any device, CUDA included: they remove casts and passes that autocast makes on every
device. ``attention_fp32_short`` is left out: on a GPU the bf16 flash/cuDNN attention kernels are the fast ones
(:func:`mixed_sdpa` would do nothing there anyway: it acts on CPU tensors only)."""


def paths_for(device_type: str) -> tuple[str, ...]:
    """The names of the paths a run under bf16 autocast on ``device_type`` (``"cpu"``, ``"cuda"``, ...) takes:
    :data:`CPU_PATHS` on the CPU, :data:`DEVICE_PATHS` elsewhere."""
    return CPU_PATHS if device_type == "cpu" else DEVICE_PATHS


def use_mixed_paths(model: torch.nn.Module, names: Any = None, on: bool = True) -> list[str]:
    """Switch the mixed-precision paths (:data:`MIXED_PATHS`, all when ``names`` is None) on or off; return the
    names of those that changed something on this model. Call it for a run that trains under bf16 autocast, before
    ``prepare`` (``scale.training.parts.model``), with ``names=paths_for(device.type)``.

    Raises:
        KeyError: a name that is not in :data:`MIXED_PATHS`.
    """
    chosen = MIXED_PATHS if names is None else {n: MIXED_PATHS[n] for n in names}
    return [name for name, fn in chosen.items() if fn(model, on)]

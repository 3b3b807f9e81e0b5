"""Which attention a run may use, checked before anything is written: ``model.attn_implementation`` can run
on this machine (:func:`check_attention`), packed rows stay apart in this model family (:func:`check_packing`), and
sequence parallelism can be exact for it (:func:`check_sequence_parallel`). Plain tensors: no Accelerator.
"""

from __future__ import annotations

from typing import Any

import torch

from scale.config.schema import ModelConfig
from scale.config.validation import ConfigError


def check_attention(cfg: ModelConfig) -> None:
    """``model.attn_implementation`` can run on this machine, checked before anything is loaded or written.

    transformers raises an ``ImportError`` from inside ``from_pretrained`` for ``flash_attention_2`` without the
    ``flash-attn`` package or a CUDA device (``is_flash_attn_2_available``, which also accepts the hub kernel
    fallback when the ``kernels`` package is installed).

    Raises:
        ConfigError: the kernel cannot run here; the message names the missing piece and the kernels that run.
    """
    if cfg.attn_implementation != "flash_attention_2":
        return
    import importlib.util

    from transformers.utils import is_flash_attn_2_available, is_torch_flex_attn_available

    try:
        available = is_flash_attn_2_available(kernels_fallback_ok=True)
    except TypeError:  # transformers without the hub kernel fallback
        available = is_flash_attn_2_available()
    if available:
        return
    missing = ("the flash-attn package is not installed (pip install flash-attn, on a CUDA machine)"
               if importlib.util.find_spec("flash_attn") is None else "flash-attn needs a CUDA GPU and none is visible")
    runs = ["sdpa (null: transformers' default)", "eager"] + (["flex_attention"] if is_torch_flex_attn_available()
                                                              else [])
    raise ConfigError(f"model.attn_implementation=flash_attention_2 cannot run here: {missing}; kernels that run "
                      f"here: {', '.join(runs)}; set model.attn_implementation=sdpa (or null)")


# Layer types (transformers' ``config.layer_types``) that attend only within a packed example: every mask-based
# attention honours the position ids that restart per example; convolutions, linear attention and SSM scans run
# along the whole packed row.
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")


def packing_leak(config: Any) -> str | None:
    """Why packed rows would leak into each other in this model family, or None when they cannot.

    Reads ``layer_types`` (and Jamba-style ``layers_block_type``) of the (text) config: a layer that is no
    attention (Qwen3.5/Qwen3-Next ``linear_attention``: Gated DeltaNet + causal conv1d; LFM2 ``conv``; Falcon-H1
    ``hybrid``: a Mamba-2 mixer beside attention; Mamba ``linear_attention``) mixes each example with the end
    of the one before it, whatever the position ids say. Measured on tiny Qwen3.5: step-1 loss off by 2.1e-3
    (../shared/cases/turn3/C44). The boundary-aware kernels (flash-linear-attention with ``cu_seqlens``,
    ``causal_conv1d`` with ``seq_idx``) are not wired into the harness's packed forward, so these families are
    refused rather than trained on another loss.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    found: list[str] = []
    for c in (config, text):
        for attr in ("layer_types", "layers_block_type"):
            for t in getattr(c, attr, None) or []:
                if t not in ATTENTION_LAYER_TYPES and t not in found:
                    found.append(t)
    if not found:
        return None
    return (f"model type {getattr(config, 'model_type', '?')!r} has {', '.join(repr(t) for t in found)} layers "
            f"(convolution / linear attention / state-space), which run along the whole packed row: each example "
            f"would see the end of the previous one")


def check_packing(model: torch.nn.Module, padding_free: bool, packing: bool = False) -> None:
    """Refuse ``data.padding_free`` (or ``data.packing``) on a model family whose layers leak across packed examples.

    Raises:
        ConfigError: one line naming the family and the layer types (:func:`packing_leak`).
    """
    if not (padding_free or packing):
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    why = packing_leak(base.config)
    if why:
        key = "data.padding_free" if padding_free else "data.packing"
        raise ConfigError(f"{key}=true cannot be exact here: {why}. Set {key}=false "
                          f"(padded batches; data.group_by_length=true keeps padding low)")


# Attention kernels the sequence-parallel attention (DeepSpeed Ulysses) can wrap; eager needs a [T, T] mask, which
# Ulysses drops (deepspeed/runtime/sequence_parallel/ulysses_sp.py refuses it).
SEQUENCE_PARALLEL_ATTENTION = ("sdpa", "flash_attention_2", "flex_attention")
# Kernels that keep several examples of one row apart from the restarting position ids alone (varlen), once Ulysses
# has dropped the mask; sdpa and flex then attend causally across the whole row.
VARLEN_ATTENTION = ("flash_attention_2",)


def sequence_parallel_attention_problem(attn_implementation: str) -> str | None:
    """Why ``model.attn_implementation`` cannot run under sequence parallelism (:data:`SEQUENCE_PARALLEL_ATTENTION`),
    or None: the part of :func:`sequence_parallel_problem` the config alone decides, so it is checked before a
    process group, an Accelerator or a model exists (:func:`check_sequence_parallel_config`)."""
    if attn_implementation in SEQUENCE_PARALLEL_ATTENTION:
        return None
    return (f"model.attn_implementation={attn_implementation} is not an attention the sequence-parallel attention can "
            f"wrap (Ulysses drops the [T, T] mask eager needs); set model.attn_implementation=sdpa (or null), or "
            f"flash_attention_2 on a GPU")


def check_sequence_parallel_config(cfg: ModelConfig, sp_size: int) -> None:
    """Refuse ``train.sequence_parallel_size > 1`` with an attention it cannot wrap, from the config alone: before
    the Accelerator is built (accelerate's own check of the attention, ``DeepSpeedSequenceParallelConfig``, would
    otherwise stop every rank with a ``ValueError`` traceback while it is built).

    Raises:
        ConfigError: one line naming ``model.attn_implementation`` and the fix.
    """
    why = sequence_parallel_attention_problem(cfg.attn_implementation or "sdpa") if sp_size > 1 else None
    if why:
        raise ConfigError(f"train.sequence_parallel_size={sp_size} cannot be exact here: {why}")


def sequence_parallel_problem(config: Any, attn_implementation: str, sp_size: int, packed: bool,
                              max_length: int) -> str | None:
    """Why ``train.sequence_parallel_size=sp_size`` cannot be exact for this model, or None when it can.

    Ulysses (:mod:`scale.distributed.ulysses`) shards the sequence between the attention calls and, around each
    attention call, trades the shards for a share of the heads (all-to-all), runs the whole sequence's attention on
    ``heads / N`` heads with *no mask* (causal), and trades back. So:

    - the attention must be a kernel it wraps (:data:`SEQUENCE_PARALLEL_ATTENTION`; eager needs a mask);
    - every layer must be full causal attention: a sliding window or a chunked layer would silently attend
      further than trained (its mask is dropped), and convolution / linear-attention / state-space layers run along
      the shard alone, restarting their state on every rank (:func:`packing_leak`; accelerate's
      ``_refuse_recurrent_layers_under_sequence_parallelism``);
    - the query heads and the key/value heads must divide among the ``N`` ranks (key/value heads may also be
      fewer, dividing ``N``: they are then replicated), with one head size for queries, keys and values;
    - several examples in one row (``data.packing``, ``data.padding_free``) stay apart only under varlen attention
      (:data:`VARLEN_ATTENTION`), which reads the restarting position ids.
    """
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    family = getattr(config, "model_type", "?")
    why = sequence_parallel_attention_problem(attn_implementation)
    if why:
        return why
    types = {t for c in (config, text) for a in ("layer_types", "layers_block_type") for t in getattr(c, a, None) or []}
    recurrent = sorted(t for t in types if t not in ATTENTION_LAYER_TYPES)
    if recurrent:
        return (f"model type {family!r} has {', '.join(repr(t) for t in recurrent)} layers (convolution / linear "
                f"attention / state-space), which run along the sequence outside the attention: each rank would "
                f"restart their state on its own shard")
    masked = sorted(t for t in types if t not in ("full_attention", "attention"))
    window = getattr(text, "sliding_window", None)
    if masked or (window and window < max_length and getattr(text, "use_sliding_window", True) is not False):
        kinds = ", ".join(repr(t) for t in masked) or f"sliding_window={window} (< data.max_length={max_length})"
        return (f"model type {family!r} has {kinds} attention: its mask is stricter than causal and the "
                f"sequence-parallel attention drops masks, so it would attend beyond the window")
    heads, kv = getattr(text, "num_attention_heads", None), getattr(text, "num_key_value_heads", None)
    if not isinstance(heads, int) or not isinstance(kv, int):
        return (f"model type {family!r} does not name num_attention_heads and num_key_value_heads in its config: the "
                f"sequence-parallel attention cannot split its heads")
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    if any(getattr(text, k, None) not in (None, head_dim) for k in ("v_head_dim", "qk_head_dim")) \
            or getattr(text, "kv_lora_rank", None):
        return (f"model type {family!r} uses latent or unequal query/value heads (MLA), which the sequence-parallel "
                f"attention cannot split")
    if heads % sp_size:
        return (f"its {heads} attention heads do not divide among train.sequence_parallel_size={sp_size} ranks; "
                f"choose a divisor of {heads}")
    if kv % sp_size and sp_size % kv:
        return (f"its {kv} key/value heads neither divide among train.sequence_parallel_size={sp_size} ranks nor "
                f"divide {sp_size}; choose a size that does")
    if packed and attn_implementation not in VARLEN_ATTENTION:
        return (f"several examples share a row (data.packing or data.padding_free) and "
                f"model.attn_implementation={attn_implementation} cannot keep them apart once the sequence-parallel "
                f"attention drops the mask; set data.packing=false and data.padding_free=false (each example gets "
                f"its own row) or use flash_attention_2")
    return None


def check_sequence_parallel(model: torch.nn.Module, model_cfg: ModelConfig, sp_size: int, packed: bool,
                            max_length: int) -> None:
    """Refuse ``train.sequence_parallel_size > 1`` where it cannot be exact (:func:`sequence_parallel_problem`).

    Raises:
        ConfigError: one line naming the reason and the fix.
    """
    if sp_size == 1:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    attn = model_cfg.attn_implementation or getattr(base.config, "_attn_implementation", None) or "sdpa"
    why = sequence_parallel_problem(base.config, attn, sp_size, packed, max_length)
    if why:
        raise ConfigError(f"train.sequence_parallel_size={sp_size} cannot be exact here: {why}")

"""Variable-length attention for packed rows on kernels without a varlen mode: one causal sdpa call per example.

A padding-free or packed micro-batch (:class:`scale.data.collate.PaddingFreeCollator`) is one row of ``L`` tokens
holding ``B`` examples. transformers keeps them apart with a block-diagonal ``[1, 1, L, L]`` mask built from the
restarting position ids (``masking_utils.find_packed_sequence_indices``); flash-attention's varlen kernel skips the
off-diagonal blocks, but sdpa (torch's CPU flash kernel, or the math/efficient kernels) computes the scores of all
``L^2`` pairs and masks them, so attention costs ``L^2`` where the padded batch paid ``B x T^2`` and the examples
alone need ``sum(l_b^2)``. Measured on one thread (forward + backward, 8 rows, lengths 75-115, 9 heads of 64):
padded 24 ms, packed with the mask 96 ms, per-example calls 36 ms; 8 rows of 512: 349 / 1902 / 390 ms
(docs/benchmarks.md, padding-free section).

:func:`segment_attention` wraps an sdpa-style attention function: given the examples' lengths
(:data:`PACKED_SEQ_LENS`, a tuple of ints passed as a model keyword argument, which transformers hands down to
every attention call, also when a checkpointed layer recomputes), it runs the inner function once per example,
causal, without a mask, and concatenates the outputs. Anything it cannot do exactly (a batch of more than one row,
a sliding window shorter than an example, attention sinks, soft-capping, a position bias) runs the inner function
on the whole row with transformers' mask, so the results are the same either way up to float round-off.
:func:`use_segment_attention` switches a model's attention to it (the name lives in ``_attn_implementation``,
which ``save_pretrained`` does not write), as ``scale.modeling.mixed_paths.use_mixed_sdpa`` does. Plain tensors: no
accelerate, no torch.distributed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from scale.loss.tail import PACKED_SEQ_LENS, SEGMENTS_SUFFIX
from scale.modeling.mixed_paths import mixed_sdpa
from scale.utils.wrapped import base_model

SEGMENT_INNER = ("sdpa", "sdpa_cpu_mixed")
"""Attention implementations :func:`use_segment_attention` wraps: transformers' sdpa and the CPU bf16 path's
(``scale.modeling.mixed_paths.MIXED_SDPA``); the wrapped name is the inner one plus
:data:`scale.loss.tail.SEGMENTS_SUFFIX`."""

_NOT_SEGMENTABLE = ("s_aux", "softcap", "position_bias")


def segment_attention(inner: Callable[..., tuple[torch.Tensor, Any]]) -> Callable[..., tuple[torch.Tensor, Any]]:
    """An attention function (transformers' ``AttentionInterface`` signature) that runs ``inner`` once per packed
    example when the call carries :data:`PACKED_SEQ_LENS`, and ``inner`` on the whole input otherwise.

    Args:
        inner: ``inner(module, query [1, H, L, D], key [1, Hkv, L, D], value, attention_mask, **kwargs)`` returning
            ``(output [1, L, H, D], weights)``, as ``transformers.integrations.sdpa_attention.sdpa_attention_forward``.

    Returns:
        ``forward(module, query, key, value, attention_mask, **kwargs) -> (output [1, L, H, D], None)``: with
        ``kwargs[PACKED_SEQ_LENS] = (l_1, ..., l_B)`` (``sum = L``) example ``b``'s queries attend causally to its
        own keys only, one ``inner`` call each without a mask (``is_causal``): the block-diagonal causal mask
        transformers built for the packed row, without its ``L^2`` scores.

    Raises:
        ValueError: the lengths do not sum to the row's length.
    """

    def forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        lens = kwargs.pop(PACKED_SEQ_LENS, None)
        if lens is None or not segmentable(module, query, key, lens, kwargs):
            return inner(module, query, key, value, attention_mask, **kwargs)
        outs, start = [], 0
        for n in lens:
            end = start + n
            out, _ = inner(module, query[:, :, start:end], key[:, :, start:end], value[:, :, start:end], None,
                           **kwargs)
            outs.append(out)
            start = end
        return torch.cat(outs, dim=1), None

    return forward


def segmentable(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, lens: tuple[int, ...],
                kwargs: dict[str, Any]) -> bool:
    """Whether one causal call per example computes what the masked call over the packed row computes.

    False for a batch of several rows, keys longer than the queries (a cache), attention sinks, soft-capping or a
    position bias, and a sliding window shorter than the longest example (the mask carries the window; the
    per-example call would not).

    Raises:
        ValueError: the lengths do not sum to the row's length.
    """
    if query.shape[0] != 1 or key.shape[2] != query.shape[2]:
        return False
    if sum(lens) != query.shape[2]:
        raise ValueError(f"{PACKED_SEQ_LENS} sum to {sum(lens)} tokens but the packed row holds {query.shape[2]}")
    if any(kwargs.get(k) is not None for k in _NOT_SEGMENTABLE):
        return False
    window = kwargs.get("sliding_window") or getattr(module, "sliding_window", None)
    return not (isinstance(window, int) and window > 0 and max(lens) > window)


def use_segment_attention(model: torch.nn.Module, on: bool = True) -> bool:
    """Switch a model attending with sdpa (or ``scale.modeling.mixed_paths``'s CPU bf16 sdpa) to
    :func:`segment_attention` around it (``on``), or back; return whether it changed.

    Registered with transformers' ``AttentionInterface`` under the inner name plus :data:`SEGMENTS_SUFFIX`, with
    sdpa's mask function under the same name (``AttentionMaskInterface``), so padded batches get sdpa's mask and
    call the inner function unchanged (https://huggingface.co/docs/transformers/attention_interface).
    """
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def sdpa(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(*args, **kwargs)

    for name, inner in zip(SEGMENT_INNER, (sdpa, mixed_sdpa)):
        AttentionInterface.register(name + SEGMENTS_SUFFIX, segment_attention(inner))
        AttentionMaskInterface.register(name + SEGMENTS_SUFFIX, sdpa_mask)
    config = base_model(model).config
    now = getattr(config, "_attn_implementation", None)
    if on and now in SEGMENT_INNER:
        config._attn_implementation = now + SEGMENTS_SUFFIX
        return True
    if not on and isinstance(now, str) and now.endswith(SEGMENTS_SUFFIX):
        config._attn_implementation = now[: -len(SEGMENTS_SUFFIX)]
        return True
    return False

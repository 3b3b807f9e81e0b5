"""Model FLOPs per trained token and peak accelerator FLOP/s, for model FLOPs utilisation (MFU). Pure Python.

    from scale.flops import flops_per_token, peak_flops
    fpt = flops_per_token(model.config, seq_len=T, lora_params=trainable, logits_fraction=threshold / T)
    mfu = positions_per_s * fpt / peak_flops(torch.cuda.get_device_name())

The count follows PaLM (Chowdhery et al. 2022, appendix B: ``6N + 12 L H Q T`` training FLOPs per token)
and Kaplan et al. 2020 (table 1: forward ``2N + 2 n_layer n_ctx d_attn``): a matmul with a weight of ``n``
elements costs ``2n`` FLOPs per token forward, ``2n`` for the gradient of its input and ``2n`` for the
gradient of its weight. Elementwise work (norms, activations, softmax, the loss) and the embedding lookup
are not counted. ``T`` is the padded sequence length: attention is counted over all ``T`` keys for every
query (no causal halving, as PaLM), and "token" means a position the model computes, padding included.

- full fine-tuning: ``6 (N + f N_head) + 12 L T d_attn``;
- LoRA / QLoRA (frozen base): the base's weights get no gradient, so ``4 (N + f N_head)`` (forward and input
  gradient), plus ``6 N_lora`` for the adapters (forward, input and weight gradients), plus the same attention
  term ``12 L T d_attn`` (score and value matmuls have no weights: both operands need gradients, so backward
  is twice forward whether or not the base is frozen).

``N`` counts the decoder layers' linear weights (q, k, v, o, gate, up, down), ``N_head = V d`` the LM head,
``f`` the fraction of positions whose logits are computed (1 for a standard LM loss; ``threshold / T`` for the
tail loss with ``logits_to_keep``), ``d_attn = heads x head_dim``. Activation recomputation (gradient
checkpointing) is *not* counted: these are model FLOPs, so checkpointing lowers MFU (hardware FLOPs, HFU,
would add one more forward). 4-bit weights are counted like any other: the FLOPs are those of the bf16
matmuls they are dequantized into.

No torch, accelerate or transformers import: ``config`` is any object with Llama-style attributes
(``hidden_size``, ``intermediate_size``, ``num_hidden_layers``, ``num_attention_heads``, optional
``num_key_value_heads`` and ``head_dim``, ``vocab_size``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

# Dense (no structured sparsity) bf16 tensor-core peak per GPU, FLOP/s, from NVIDIA's datasheets (which quote
# twice these figures "with sparsity").
PEAK_BF16_FLOPS: dict[str, float] = {
    "A100": 312e12,       # SXM and PCIe
    "A10": 125e12,
    "L4": 121e12,
    "H100 SXM": 989e12,   # 989.4e12
    "H100 PCIe": 756e12,
    "H200": 989e12,       # H200 SXM: same tensor cores as H100 SXM, more memory
}

# torch.cuda.get_device_name() -> table key; first match wins (e.g. "NVIDIA H100 80GB HBM3" is the SXM part).
_NAME_RULES: list[tuple[str, str]] = [
    (r"\bH200\b(?!\s*NVL)", "H200"),
    (r"\bH100\b.*\bPCIe\b", "H100 PCIe"),
    (r"\bH100\b(?!.*\bNVL\b)", "H100 SXM"),
    (r"\bA100\b", "A100"),
    (r"\bA10\b", "A10"),
    (r"\bL4\b", "L4"),
]


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name such as ``torch.cuda.get_device_name()``; None if unknown.

    NVL variants and parts not in :data:`PEAK_BF16_FLOPS` return None: pass the figure yourself.
    """
    for pattern, key in _NAME_RULES:
        if re.search(pattern, device_name, flags=re.IGNORECASE):
            return PEAK_BF16_FLOPS[key]
    return None


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a Llama-style decoder, by role (elements).

    Attributes:
        layers: linear weights of all decoder layers (attention q/k/v/o and the gated MLP).
        head: the LM head ``vocab x hidden`` (counted as a matmul even when tied to the embedding).
        embedding: the input embedding (a lookup: no FLOPs).
        norms: RMSNorm weights (elementwise: no matmul FLOPs).
    """

    layers: int
    head: int
    embedding: int
    norms: int


def _dims(config: Any) -> tuple[int, int, int, int, int, int, int]:
    d = config.hidden_size
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or d // heads
    return d, config.intermediate_size, config.num_hidden_layers, heads, kv, head_dim, config.vocab_size


def param_counts(config: Any) -> ParamCounts:
    """Count a Llama-style model's parameters by role from its config (no bias terms)."""
    d, ff, L, heads, kv, hd, V = _dims(config)
    per_layer = d * heads * hd + 2 * d * kv * hd + heads * hd * d + 3 * d * ff
    return ParamCounts(layers=L * per_layer, head=V * d, embedding=V * d, norms=(2 * L + 1) * d)


def lora_params(config: Any, r: int, targets: tuple[str, ...] | str = "all-linear") -> int:
    """Adapter parameters of LoRA rank ``r`` on the named projections of every layer.

    ``"all-linear"`` (peft's meaning: every linear layer except the LM head) is q, k, v, o, gate, up, down.
    Each adapted ``in -> out`` projection adds ``r (in + out)`` parameters.
    """
    d, ff, _, heads, kv, hd, _ = _dims(config)
    shapes = {"q_proj": (d, heads * hd), "k_proj": (d, kv * hd), "v_proj": (d, kv * hd), "o_proj": (heads * hd, d),
              "gate_proj": (d, ff), "up_proj": (d, ff), "down_proj": (ff, d)}
    names = tuple(shapes) if targets == "all-linear" else tuple(targets)
    unknown = set(names) - set(shapes)
    if unknown:
        raise ValueError(f"unknown LoRA targets {sorted(unknown)}; known: {sorted(shapes)}")
    return config.num_hidden_layers * sum(r * (shapes[n][0] + shapes[n][1]) for n in names)


def flops_per_token(config: Any, seq_len: int, *, lora_params: int | None = None,
                    logits_fraction: float = 1.0) -> float:
    """Training FLOPs (forward + backward, no recomputation) per computed position; see the module docstring.

    Args:
        config: Llama-style model config.
        seq_len: ``T``, padded sequence length (attention term).
        lora_params: ``None`` for full fine-tuning (every weight trained); otherwise the number of trainable
            adapter parameters with a frozen base (0 allowed), e.g. the model's trainable parameter count.
        logits_fraction: fraction of positions whose logits the LM head computes (``threshold / T`` with the
            tail loss and ``logits_to_keep``; 1 for a loss over every position).

    Returns:
        FLOPs per position.
    """
    if not 0.0 <= logits_fraction <= 1.0:
        raise ValueError(f"logits_fraction={logits_fraction} must lie in [0, 1]")
    _, _, L, heads, _, hd, _ = _dims(config)
    counts = param_counts(config)
    matmul_params = counts.layers + logits_fraction * counts.head
    attention = 12 * L * seq_len * heads * hd
    if lora_params is None:
        return 6 * matmul_params + attention
    return 4 * matmul_params + 6 * lora_params + attention


def mfu(positions_per_s: float, flops_per_position: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``peak`` (a fraction, not a percentage)."""
    return positions_per_s * flops_per_position / peak

"""Model FLOPs per trained token and peak accelerator FLOP/s, for model FLOPs utilisation (MFU). Pure Python.

    from scale.utils.flops import flops_per_token, peak_flops
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

Any model family: :func:`model_shape` reads ``N`` and ``N_head`` off the model's own matmul layers (every
``nn.Linear``, bitsandbytes 4-bit linear and GPT-2 ``Conv1D``; fused projections such as Phi-3's ``qkv_proj``
count as what they are) and the attention dimensions off its config, so no family's attribute names are
assumed. :func:`param_counts` and :func:`lora_params` are the hand count of a Llama-style config, kept as the
reference the generic count is tested against.

No torch, accelerate or transformers import: models and configs are read by duck typing.
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


@dataclass(frozen=True)
class ModelShape:
    """What the FLOPs count needs to know about a model, whatever its family.

    Attributes:
        layers: elements of every matmul weight except the LM head (``N``: attention and MLP projections).
        head: elements of the LM head (``N_head = V x d``; counted even when tied to the embedding).
        num_layers: decoder layers ``L``.
        attention_width: ``d_attn = heads x head_dim`` (query heads).
        inactive_lora: adapter elements a token does not use: in a mixture-of-experts model, ``1 - k/E`` of the
            LoRA on the routed experts (0 for a dense model).
    """

    layers: int
    head: int
    num_layers: int
    attention_width: int
    inactive_lora: int = 0


def _matmul_elements(module: Any) -> int:
    """Weight elements of a matmul layer (``nn.Linear`` and subclasses, GPT-2's ``Conv1D``), else 0."""
    if hasattr(module, "base_layer"):  # a peft wrapper: its base layer is visited on its own
        return 0
    if isinstance(getattr(module, "in_features", None), int) and isinstance(getattr(module, "out_features", None),
                                                                             int):
        return module.in_features * module.out_features
    if type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "nx"):
        return module.nf * module.nx
    return 0


def model_shape(model: Any) -> ModelShape:
    """Read a model's :class:`ModelShape` off its modules (plain, PEFT-wrapped, 4-bit or ZeRO-3 partitioned).

    LoRA adapter matrices are left out (they are ``lora_params``); the fused 3-D experts of a mixture-of-experts
    model are not matmul layers here (:func:`scale.modeling.moe_counts.model_shape` adds them); the LM head is
    ``model.get_output_embeddings()``. The attention dimensions come from the (text) config through the
    standard names, which transformers maps per family (GPT-2's ``n_layer``/``n_head`` included).
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    layers = sum(_matmul_elements(m) for name, m in base.named_modules()
                 if m is not head and ".lora_" not in f".{name}")
    config = base.config.get_text_config() if hasattr(base.config, "get_text_config") else base.config
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    head_elements = _matmul_elements(head) if head is not None else 0
    return ModelShape(layers=layers, head=head_elements or config.vocab_size * config.hidden_size,
                      num_layers=config.num_hidden_layers, attention_width=heads * head_dim)


def shape_from_config(config: Any) -> ModelShape:
    """The :class:`ModelShape` of a Llama-style config by hand count (:func:`param_counts`)."""
    _, _, L, heads, _, hd, _ = _dims(config)
    counts = param_counts(config)
    return ModelShape(layers=counts.layers, head=counts.head, num_layers=L, attention_width=heads * hd)


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
        config: a :class:`ModelShape` (:func:`model_shape`: any family), or a Llama-style model config.
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
    shape = config if isinstance(config, ModelShape) else shape_from_config(config)
    matmul_params = shape.layers + logits_fraction * shape.head
    attention = 12 * shape.num_layers * seq_len * shape.attention_width
    if lora_params is None:
        return 6 * matmul_params + attention
    return 4 * matmul_params + 6 * max(lora_params - shape.inactive_lora, 0) + attention


def reference_flops_per_token(config: Any, seq_len: int, logits_fraction: float, adapter_params: int = 0
                              ) -> float:
    """Forward FLOPs per position of the DPO reference (no backward): ``2 (N + f N_head) + 4 L T d_attn``, a third of
    :func:`flops_per_token`'s full fine-tuning count (Kaplan et al. 2020, table 1: forward ``2N +
    2 n_layer n_ctx d_attn``, attention counted over all ``T`` keys as there), plus ``2 x adapter_params`` when the
    reference is a frozen starting adapter (``model.adapter``) rather than the base with its adapter disabled.
    ``config``: a :class:`ModelShape` or a Llama-style model config, as :func:`flops_per_token` takes."""
    shape = config if isinstance(config, ModelShape) else shape_from_config(config)
    return (2 * (shape.layers + logits_fraction * shape.head) + 4 * shape.num_layers * seq_len * shape.attention_width
            + 2 * adapter_params)


def mfu(positions_per_s: float, flops_per_position: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over ``peak`` (a fraction, not a percentage)."""
    return positions_per_s * flops_per_position / peak

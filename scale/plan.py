"""``scale-plan``: which launch mode fits, before the job is launched. Predicted bytes per rank, from configs only.

    scale-plan --config configs/train/default.yaml --gpus 8 --gpu-mem 80
    scale-plan --config configs/train/default.yaml model.name_or_path=configs/models/llama-3.1-70b.json \\
        model.dtype=bfloat16 train.mixed_precision=bf16 model.bnb_4bit_compute_dtype=bfloat16 --gpus 16 --nodes 2
    scale-plan --gpus 2 --gpu-mem 24 --model-config configs/models/llama-3.1-8b.json --json

It reads the training config (the same YAML and dotted overrides as ``scale-train``) and the model's
``config.json`` only: no weights are loaded, so it answers for a 70B model on a laptop and for node counts that
do not exist here. For every launch mode (single, DDP, ZeRO-1/2/3, ZeRO-3 + CPU offload, FSDP2) it prints the
bytes one rank holds, by kind, and the total against ``--gpu-mem`` (GiB; a mode fits when it leaves
:data:`HEADROOM` of it free); it recommends the cheapest mode (fewest bytes moved between ranks per step) that
fits, a data-parallel one when there are several GPUs.

How each number is obtained:

- **Parameters** are counted exactly for any architecture transformers knows: the model is built on the ``meta``
  device from its config (``AutoModelForCausalLM.from_config``; no memory) and wrapped with LoRA by the harness's
  own :func:`scale.modeling.add_lora`. 4-bit storage cannot be built on ``meta``; it is computed from the shapes
  of the linear layers transformers would quantize (its own ``get_keys_to_not_convert`` decides which), with
  bitsandbytes' layout (:func:`nf4_bytes`).
- **Where a mode keeps them** follows the libraries' code (DeepSpeed 0.19, torch DDP, accelerate): ZeRO-1/2
  flatten the trainable parameters into one buffer padded to a multiple of ``2 x world`` elements and keep an
  fp32 master partition; ZeRO-3 pads every parameter to a multiple of ``world`` and keeps parameters of at most
  ``stage3_param_persistence_threshold`` elements whole on every rank; DDP keeps a second copy of the gradients
  in its buckets; DeepSpeed allocates a ``reduce_bucket_size``-element gradient bucket. The DeepSpeed settings
  come from the JSON the accelerate config names (``configs/deepspeed/*.json``), DeepSpeed's defaults otherwise.
- **Saved activations** are counted, not modelled: one forward of the harness's tail loss
  (:func:`scale.loss.forward_tail`) runs on fake tensors (``torch._subclasses.FakeTensorMode``: shapes and
  dtypes, no data, no memory) at ``train.micro_batch_size`` x ``data.max_length``, and
  ``torch.autograd.graph.saved_tensors_hooks`` adds up the distinct storages autograd keeps for backward
  (parameters excluded), with gradient checkpointing on and off. The fake forward dispatches like a CPU one
  (a fake CUDA device needs a CUDA build of torch), which saves the same tensors as CUDA's memory-efficient
  attention (query, key, value, output, log-sum-exp, the additive mask); under CUDA autocast a few elementwise
  ops keep fp32 inputs that CPU autocast would not, so bf16 runs can differ by a few per cent.
- **Logits**: the part of the saved bytes from the LM head on (``logits_to_keep``: ``loss.threshold`` positions
  per row), and what the full ``[B, T, V]`` logits would have cost instead.
- **Transient** bytes (alive for part of the step) are estimates: the larger of the loss's backward (three
  ``[B x N, V]`` fp32 gradients) and the layer checkpointing recomputes, plus what is alive through all of
  backward: DeepSpeed's ZeRO-1/2 gradient bucket (allocated at each backward), ZeRO-3/FSDP2's gathered
  parameters, a 4-bit layer dequantized for its matmul. Checked on CPU: the single-device total without overhead
  is within 10% of the peak of live tensor bytes over a real optimizer step (``tests/test_plan.py``).
- **Framework overhead** is an assumption (:data:`OVERHEAD_FIXED_BYTES`, :data:`OVERHEAD_FRACTION`), stated in
  the output.

Architectures: any causal LM transformers builds from a config (checked: llama, mistral, qwen2, qwen3, gemma2,
phi3, olmo2, granite, gpt2). Mixture-of-experts models (mixtral) plan their parameters exactly; their
activations depend on the routing, which fake tensors cannot know (in fp32 their CPU expert matmul refuses to run
and the plan stops with a one-line error).

Shapes: ``B`` = ``train.micro_batch_size``, ``T`` = ``data.max_length``, ``N`` = ``loss.threshold``, ``V`` vocab.
No ``accelerate`` or ``torch.distributed`` import (``tests/test_layering.py``): planning never starts a process
group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from scale.config import Config, ConfigError, ModelConfig, configs_dir, load_config
from scale.modeling import TINY, tiny_llama_config

GIB = 2**30

# Launch modes, cheapest first: bytes moved between ranks per optimizer step (W = all weights, G = trainable
# gradients): single 0; DDP all-reduce of G; ZeRO-1/2 reduce-scatter of G + all-gather of the updated trainable
# weights (the same volume as DDP, two collectives); ZeRO-3 and FSDP2 also all-gather W in forward and in
# backward (with a frozen base, W >> G); FSDP2 moves what ZeRO-3 moves and comes after it because the harness's
# FSDP2 path runs on GPUs only and is not covered by the CPU tests; ZeRO-3 offload adds host<->device copies.
MODES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp2", "zero3_offload")
MODE_LABELS = {"single": "single", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
               "zero3_offload": "ZeRO-3 offload", "fsdp2": "FSDP2"}
DEEPSPEED_JSON = {"zero1": "zero1.json", "zero2": "zero2.json", "zero3": "zero3.json",
                  "zero3_offload": "zero3_offload.json"}

# DeepSpeed 0.19 defaults (deepspeed/runtime/zero/config.py), used where the JSON leaves a key out.
DS_DEFAULTS = {"reduce_bucket_size": 500_000_000, "contiguous_gradients": True,
               "stage3_param_persistence_threshold": 100_000, "stage3_model_persistence_threshold": sys.maxsize,
               "stage3_prefetch_bucket_size": 50_000_000}

# Framework overhead, an assumption (not counted): the CUDA context, cuBLAS and NCCL workspaces per process,
# which torch.cuda.max_memory_allocated does not see, plus caching-allocator fragmentation as a fraction of
# everything counted.
OVERHEAD_FIXED_BYTES = 1 * GIB
OVERHEAD_FRACTION = 0.05
# A mode "fits" when its total leaves this fraction of the GPU free: the predictions are checked to within 10% on
# CPU, not on every GPU stack. Between that and 100% the plan says "tight".
HEADROOM = 0.05

TINY_VOCAB = 49152  # `tiny-llama` borrows SmolLM2's tokenizer: len(tokenizer) == 49,152
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
_BYTES = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2, torch.uint8: 1}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "uint8": torch.uint8}


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
    """The harness's model (base + LoRA, :func:`scale.modeling.add_lora`) on the ``meta`` device: no memory.

    4-bit quantization is not applied (bitsandbytes cannot quantize meta tensors): see :func:`census`.
    """
    from transformers import AutoModelForCausalLM

    m = cfg.model
    gc = m.gradient_checkpointing if checkpointing is None else checkpointing
    dtype = _DTYPES[m.dtype]
    with torch.device("meta"):
        base = AutoModelForCausalLM.from_config(hf_config, dtype=dtype, trust_remote_code=m.trust_remote_code)
        base.config.use_cache = False
        from scale.modeling import add_lora

        model = add_lora(base, replace(m, quantize_4bit=False, gradient_checkpointing=gc), cfg.lora)
    model.train()
    return model


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
    ``quantized``; the other fp16/bf16 parameters become fp32, as ``prepare_model_for_kbit_training`` does.
    """
    base = model.get_base_model()
    quantized: set[int] = set()
    if cfg.model.quantize_4bit:
        names = quantized_linear_names(base)
        quantized = {id(mod.weight) for name, mod in base.named_modules() if name in names}
    out, seen = [], set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            continue
        seen.add(id(p))
        q = id(p) in quantized
        dtype = p.dtype
        if cfg.model.quantize_4bit and not q and dtype in (torch.float16, torch.bfloat16):
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


# ---------------------------------------------------------------------------------------------------------------
# Saved activations: one fake forward


@dataclass
class Activations:
    """Bytes autograd keeps for backward after one micro-batch's forward (distinct storages, parameters excluded).

    Attributes:
        decoder: embedding and decoder layers (up to the LM head).
        head: from the LM head on: the LM head's saved inputs (under autocast, the low-precision copy of an fp32
            head weight, as QLoRA keeps it) and the loss's ``[B x N, V]`` fp32 log-softmax.
        per_layer: largest single decoder layer's share.
        layers: decoder layers seen.
        vocab: ``V``, the LM head's output width.
        recompute: under checkpointing, what one layer saves when backward recomputes it (the largest
            ``per_layer`` of a count without checkpointing); 0 without checkpointing.
    """

    decoder: int
    head: int
    per_layer: int
    layers: int
    vocab: int = 0
    recompute: int = 0

    @property
    def total(self) -> int:
        return self.decoder + self.head


def _decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder stack: the longest ``nn.ModuleList`` in the model."""
    lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


@contextmanager
def _fake_parameters(model: torch.nn.Module, mode: Any, dtype_of: Callable[[torch.nn.Parameter], torch.dtype]
                     ) -> Iterator[None]:
    """Swap the meta model's parameters and buffers for CPU fake tensors (tied ones stay tied); restore after."""
    from torch._subclasses.fake_tensor import FakeTensor

    cpu = torch.device("cpu")
    memo: dict[int, torch.Tensor] = {}
    saved: list[tuple[dict, str, Any]] = []

    def fake(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if id(t) not in memo:
            meta = t.detach().to(dtype) if t.is_floating_point() else t.detach()
            f = FakeTensor(mode, meta, cpu)
            memo[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return memo[id(t)]

    for mod in model.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None:
                    saved.append((store, name, t))
                    store[name] = fake(t, dtype_of(t) if isinstance(t, torch.nn.Parameter) else t.dtype)
    try:
        yield
    finally:
        for store, name, t in saved:
            store[name] = t


def count_activations(cfg: Config, model: torch.nn.Module, params: list[ParamInfo], cast: torch.dtype | None = None,
                      padded: bool = True) -> Activations:
    """Count what autograd saves in one forward of the tail loss at ``micro_batch_size x max_length``.

    Args:
        cfg: the training config (micro-batch, length, threshold, mixed precision, 4-bit).
        model: from :func:`build_meta_model` (its checkpointing setting is the one counted).
        params: :func:`census` of that model (dtypes as trained).
        cast: every floating parameter held in this dtype (DeepSpeed with bf16/fp16 casts the module), or None.
        padded: the batch has padding, so attention gets a ``[B, 1, T, T]`` mask (each layer keeps its additive
            copy) and key/value are repeated to every query head; False: every row fills ``max_length``, the mask
            is skipped and SDPA attends with grouped key/value heads.

    Returns:
        :class:`Activations` in bytes.

    Raises:
        PlanError: the architecture's forward cannot run on fake tensors (data-dependent shapes, e.g. some
            mixture-of-experts routers).
    """
    from torch._subclasses.fake_tensor import FakeTensorMode

    from scale import loss as L

    dtypes = {p.name: p.dtype for p in params}
    quantized = {p.name for p in params if p.quantized}
    by_id: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(p), n)  # a tied weight goes by its first name, as in the census

    def dtype_of(p: torch.nn.Parameter) -> torch.dtype:
        name = by_id.get(id(p))
        if cast is not None and p.is_floating_point():
            return cast
        if name in quantized:  # a 4-bit layer computes in compute dtype and returns its input's dtype
            return torch.float32
        return dtypes.get(name, p.dtype)

    B, T, N = cfg.train.micro_batch_size, cfg.data.max_length, cfg.loss.threshold
    mode = FakeTensorMode()
    layers = _decoder_layers(model)
    head_module = model.get_base_model().get_output_embeddings()
    phase = {"now": "embed"}
    per_phase: dict[str, int] = {}
    hooks = [m.register_forward_pre_hook(lambda mod, args, i=i: phase.__setitem__("now", f"layer{i}"))
             for i, m in enumerate(layers)]
    if head_module is not None:
        hooks.append(head_module.register_forward_pre_hook(lambda mod, args: phase.__setitem__("now", "head")))
    seen: dict[int, tuple[str, int]] = {}
    autocast = cfg.train.mixed_precision != "no" and cast is None
    amp_dtype = torch.bfloat16 if cfg.train.mixed_precision == "bf16" else torch.float16
    try:
        with _fake_parameters(model, mode, dtype_of), mode:
            param_storages = {p.untyped_storage()._cdata for p in model.parameters()}

            def pack(t: torch.Tensor) -> torch.Tensor:
                key = t.untyped_storage()._cdata
                if key not in param_storages and key not in seen:
                    seen[key] = (phase["now"], t.untyped_storage().nbytes())
                return t

            ids = torch.zeros(B, T, dtype=torch.long)
            batch = {"input_ids": ids, "attention_mask": torch.ones(B, T, dtype=torch.long)}
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
                    torch.autocast("cpu", dtype=amp_dtype, enabled=autocast):
                if padded:
                    tail, targets = L.forward_tail(model, batch, N, padding_side="left")
                else:  # forward_tail's call; transformers drops an all-ones mask, so none is passed. On fake
                    # tensors it cannot read the positions to rule out packed rows (which would add a mask): full
                    # rows are not packed, so that check answers "not packed".
                    from unittest import mock

                    keep = torch.arange(T - N - 1, T - 1)
                    with mock.patch("transformers.masking_utils.find_packed_sequence_indices", lambda *a, **k: None):
                        tail = model(input_ids=ids, logits_to_keep=keep, use_cache=False).logits
                    targets = ids[:, T - N:]
                L.tail_loss(tail, targets, torch.ones(B, N))
    except (RuntimeError, NotImplementedError, TypeError, ValueError) as e:
        raise PlanError(f"cannot count activations of model type {model.config.model_type!r} on fake tensors "
                        f"({type(e).__name__}: {str(e).splitlines()[0][:200]})") from e
    finally:
        for h in hooks:
            h.remove()
    for ph, nbytes in seen.values():
        per_phase[ph] = per_phase.get(ph, 0) + nbytes
    head = per_phase.pop("head", 0)
    layer_bytes = [v for k, v in per_phase.items() if k.startswith("layer")]
    vocab = head_module.weight.shape[0] if head_module is not None else 0
    return Activations(decoder=sum(per_phase.values()), head=head, per_layer=max(layer_bytes, default=0),
                       layers=len(layers), vocab=vocab)


# ---------------------------------------------------------------------------------------------------------------
# Per-mode accounting


@dataclass
class Rank:
    """Predicted bytes held by one rank in one launch mode.

    Attributes:
        mode: one of :data:`MODES`.
        weights: frozen base weights as stored (4-bit: packed weights and quant state).
        trainable: LoRA weights as the model holds them (ZeRO-1/2: the padded flat buffer).
        master: fp32 master copy of the trainable weights (DeepSpeed's optimizer partition).
        gradients: the most gradient bytes held at once (DDP: gradients plus its bucket copy; ZeRO-1: whole
            gradients until the end of backward; ZeRO-2/3: the gradient partition, plus ZeRO-3's persistent
            reduce bucket).
        optimizer: optimizer state (AdamW ``exp_avg`` and ``exp_avg_sq``; its ``step`` counters are host scalars).
        activations: saved for backward, one micro-batch (checkpointing as configured).
        logits: saved from the LM head on (its inputs, the loss's fp32 log-probabilities), one micro-batch.
        transient: short-lived buffers at the step's peak (see the module docstring).
        overhead: the framework-overhead assumption.
        host: bytes this rank keeps in host memory (offload).
        refused: why the harness refuses this mode with this config (``scale.launch.plan_for_mode``), or "".
        notes: how the numbers were made for this mode.
    """

    mode: str
    weights: int = 0
    trainable: int = 0
    master: int = 0
    gradients: int = 0
    optimizer: int = 0
    activations: int = 0
    logits: int = 0
    transient: int = 0
    overhead: int = 0
    host: int = 0
    refused: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        return self.weights + self.trainable + self.master + self.gradients + self.optimizer

    @property
    def allocated(self) -> int:
        """What ``torch.cuda.max_memory_allocated`` should see at the step's peak (no CUDA context)."""
        return self.model_states + self.activations + self.logits + self.transient

    @property
    def total(self) -> int:
        return self.allocated + self.overhead


def deepspeed_settings(mode: str, hf_config: Any, root: Path | None = None) -> dict[str, Any]:
    """``zero_optimization`` of the DeepSpeed JSON this mode launches with, DeepSpeed's defaults filled in and
    ``"auto"`` resolved as accelerate resolves it (``reduce_bucket_size = hidden^2``, ``prefetch = 0.9 hidden^2``,
    ``persistence threshold = 10 hidden``)."""
    path = (root or configs_dir()) / "deepspeed" / DEEPSPEED_JSON[mode]
    zero = json.loads(path.read_text(encoding="utf-8")).get("zero_optimization", {}) if path.is_file() else {}
    zero["source"] = f"configs/deepspeed/{path.name}" if path.is_file() else "DeepSpeed defaults"
    h = getattr(hf_config, "hidden_size", 0)
    auto = {"reduce_bucket_size": h * h, "stage3_prefetch_bucket_size": int(0.9 * h * h),
            "stage3_param_persistence_threshold": 10 * h}
    for key, default in DS_DEFAULTS.items():
        value = zero.get(key, default)
        zero[key] = auto.get(key, default) if value == "auto" else int(value) if not isinstance(value, bool) else value
    zero.setdefault("overlap_comm", zero.get("stage", 0) == 3)
    return zero


def _nbytes(dtype: torch.dtype) -> int:
    return _BYTES[dtype]


def _weight_bytes(p: ParamInfo, cfg: Config, cast: torch.dtype | None) -> tuple[int, int, torch.dtype]:
    """(shardable bytes, unshardable bytes, dtype held) of one parameter."""
    if p.quantized:
        packed, state = nf4_bytes(p.numel, cfg.model.bnb_4bit_use_double_quant)
        return packed, state, _DTYPES[cfg.model.bnb_4bit_quant_storage]
    dtype = cast if cast is not None else p.dtype
    return p.numel * _nbytes(dtype), 0, dtype


def _shard_elems(elems: int, world: int) -> int:
    return math.ceil(elems / world)


def zero12_gradient_elems(trainable: list[ParamInfo], aligned: int, part: int, rank: int) -> int:
    """Gradient elements ZeRO-1/2 rank ``rank`` holds at the step: DeepSpeed 0.19 keeps the whole gradient of every
    parameter that overlaps its partition of the flat group (a narrowed view keeps the full storage alive) plus
    zeros for the alignment padding that falls in it (``get_flat_partition``, ``copy_grads_in_partition``)."""
    lo, hi = rank * part, (rank + 1) * part
    held, offset = 0, 0
    for p in trainable:  # the flat buffer's order: the optimizer's parameter order (no round-robin reordering)
        if offset < hi and offset + p.numel > lo:
            held += p.numel
        offset += p.numel
    return held + max(0, hi - max(lo, offset)) if aligned > offset else held


def predict_mode(cfg: Config, params: list[ParamInfo], acts: dict[bool, Activations], mode: str, world: int,
                 hf_config: Any, root: Path | None = None, rank: int = 0) -> Rank:
    """Bytes one rank holds in ``mode`` on ``world`` processes.

    Args:
        cfg: the training config.
        params: :func:`census` of the model.
        acts: activations by precision regime: ``acts[False]`` with the dtypes as trained, ``acts[True]`` with every
            floating parameter in the mixed-precision dtype (DeepSpeed with bf16/fp16 casts the module).
        mode: one of :data:`MODES`.
        world: processes in all (``--gpus``); ``single`` uses one.
        hf_config: the model's transformers config (for DeepSpeed's ``"auto"`` sizes).
        root: the configs directory whose ``deepspeed/*.json`` are read (default: the shipped configs).
        rank: matters only where ranks differ (ZeRO-1/2's gradients at a partition boundary, a few elements);
            the plan reports rank 0.

    Returns:
        A :class:`Rank` in bytes.
    """
    r = Rank(mode)
    m = cfg.model
    deepspeed = mode in DEEPSPEED_JSON
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision) if deepspeed else None
    if deepspeed and cast is not None:
        r.notes.append(f"DeepSpeed casts every floating parameter to {cast} (LoRA too); fp32 master partition")
    adam = cfg.optim.name == "adamw"
    trainable = [p for p in params if p.trainable]
    frozen = [p for p in params if not p.trainable]
    w = world if mode != "single" else 1

    # refusals, as scale.launch.plan_for_mode decides them
    partitioned = mode in ("zero3", "zero3_offload", "fsdp2")
    if m.gradient_checkpointing and m.use_reentrant and mode in ("ddp", "zero1", "zero2") and w > 1:
        r.refused = "model.use_reentrant=true with LoRA under data parallelism fails (peft#313)"
    if m.quantize_4bit and partitioned and m.bnb_4bit_quant_storage != m.bnb_4bit_compute_dtype:
        r.refused = (f"shards 4-bit weights only with model.bnb_4bit_quant_storage={m.bnb_4bit_compute_dtype} "
                     f"(now {m.bnb_4bit_quant_storage})")
    if cfg.train.on_nonfinite == "skip" and deepspeed:
        r.refused = "train.on_nonfinite=skip cannot work under DeepSpeed"

    act = acts[cast is not None]
    r.activations, r.logits = act.decoder, act.head
    # Backward begins at the loss: its gradient, the log-softmax gradient and the logits' gradient, each
    # [B x N, V] fp32, are alive at once on top of every saved tensor (measured: the CPU peak of a tiny Llama's
    # step is there). Later, under checkpointing, one layer is recomputed. They never overlap: the larger counts.
    B, N = cfg.train.micro_batch_size, cfg.loss.threshold
    transient = max(act.recompute, 3 * B * N * act.vocab * 4)
    if m.quantize_4bit:  # one 4-bit weight dequantized to the compute dtype for its matmul (forward and backward)
        transient += max((p.numel for p in params if p.quantized), default=0) * _nbytes(_DTYPES[m.bnb_4bit_compute_dtype])

    if mode in ("single", "ddp"):
        r.weights = sum(sum(_weight_bytes(p, cfg, None)[:2]) for p in frozen)
        r.trainable = sum(p.numel * _nbytes(p.dtype) for p in trainable)
        r.gradients = r.trainable * (2 if mode == "ddp" else 1)
        r.optimizer = 2 * r.trainable if adam else 0
        if mode == "ddp":
            r.notes.append("gradients + its bucket copy (gradient_as_bucket_view=False, accelerate's default)")
    elif mode in ("zero1", "zero2"):
        ds = deepspeed_settings(mode, hf_config, root)
        r.weights = sum(sum(_weight_bytes(p, cfg, cast)[:2]) for p in frozen)
        tdtype = cast or trainable[0].dtype
        n = sum(p.numel for p in trainable)
        aligned = math.ceil(n / (2 * w)) * 2 * w  # nccl_start_alignment_factor (2) x world
        part = aligned // w
        r.trainable = aligned * _nbytes(tdtype)
        r.master = part * 4
        if mode == "zero1":  # gradients are not partitioned: every parameter's gradient lives until the epilogue
            r.gradients = n * _nbytes(tdtype)
            r.notes.append("whole gradients until the end of backward, then the partition")
        else:
            r.gradients = zero12_gradient_elems(trainable, aligned, part, rank) * _nbytes(tdtype)
        r.optimizer = 2 * part * 4 if adam else 0
        if ds["contiguous_gradients"]:
            bucket = ds["reduce_bucket_size"] * _nbytes(tdtype) * (2 if ds["overlap_comm"] else 1)
            transient += bucket
            r.notes.append(f"reduce bucket {ds['reduce_bucket_size']:,} elements allocated at each backward "
                           f"({ds['source']}); set zero_optimization.reduce_bucket_size to shrink it")
    elif mode in ("zero3", "zero3_offload"):
        ds = deepspeed_settings(mode, hf_config, root)
        offload_param = ds.get("offload_param", {}).get("device", "none") == "cpu"
        offload_opt = ds.get("offload_optimizer", {}).get("device", "none") == "cpu"
        persisted = host = 0
        for p in params:  # transformers' order, which is DeepSpeed's module walk order
            shardable, unshardable, dtype = _weight_bytes(p, cfg, cast)
            elems = shardable // _nbytes(dtype)
            persistent = (p.numel <= ds["stage3_param_persistence_threshold"]
                          and persisted + p.numel <= ds["stage3_model_persistence_threshold"])
            persisted += p.numel if persistent else 0
            part = _shard_elems(elems, w) * _nbytes(dtype)
            if persistent:  # kept whole (gathered at the padded size) on every rank besides its partition
                held = part + _shard_elems(elems, w) * w * _nbytes(dtype)
                device_part = held
            else:
                held = part
                device_part = 0 if offload_param else part
            host += held - device_part
            if p.trainable:
                r.trainable += device_part
            else:
                r.weights += device_part + unshardable
        tpart = sum(_shard_elems(p.numel, w) for p in trainable)
        gdtype = cast or trainable[0].dtype
        master, grads, opt = tpart * 4, tpart * _nbytes(gdtype), (2 * tpart * 4 if adam else 0)
        bucket = ds["reduce_bucket_size"] * _nbytes(gdtype) if ds["contiguous_gradients"] else 0
        if offload_opt:
            host += master + grads + opt
            r.gradients = bucket
        else:
            r.master, r.gradients, r.optimizer = master, grads + bucket, opt
        r.host = host
        layer_bytes = max((sum(_weight_bytes(p, cfg, cast)[0] for p in params if f".{i}." in p.name)
                           for i in range(act.layers)), default=0)
        gathered = min(ds["stage3_prefetch_bucket_size"] * _nbytes(cast or _DTYPES[m.dtype]) + layer_bytes,
                       sum(_weight_bytes(p, cfg, cast)[0] for p in params))
        transient += gathered
        r.notes.append(f"parameters of <= {ds['stage3_param_persistence_threshold']:,} elements stay whole on "
                       f"every rank; reduce bucket {ds['reduce_bucket_size']:,} elements ({ds['source']})")
        if offload_param or offload_opt:
            r.notes.append("offloaded partitions, fp32 master, gradients and optimizer state are in host memory")
    elif mode == "fsdp2":
        for p in params:
            shardable, unshardable, dtype = _weight_bytes(p, cfg, None)
            if p.quantized:  # packed 4-bit storage is one flat column: sharded by elements
                part = _shard_elems(shardable // _nbytes(dtype), w) * _nbytes(dtype)
            else:  # dim-0 shards, padded to a multiple of the world size
                rows = p.shape[0] if p.shape else 1
                part = _shard_elems(rows, w) * (p.numel // max(rows, 1)) * _nbytes(dtype)
            if p.trainable:
                r.trainable += part
                r.gradients += part
                r.optimizer += 2 * part if adam else 0
            else:
                r.weights += part + unshardable
        layer_bytes = max((sum(_weight_bytes(p, cfg, None)[0] for p in params if f".{i}." in p.name)
                           for i in range(act.layers)), default=0)
        transient += 2 * layer_bytes  # one decoder layer gathered, the next prefetched
        r.notes.append("dim-0 shards of every parameter; not checked against a count (GPU only here)")
    r.transient = transient
    r.overhead = OVERHEAD_FIXED_BYTES + int(OVERHEAD_FRACTION * r.allocated)
    return r


# ---------------------------------------------------------------------------------------------------------------
# The plan


@dataclass
class Plan:
    """The whole answer: model facts, every mode per rank, which fit, the recommendation and the assumptions."""

    model: str
    model_type: str
    parameters: int
    trainable_parameters: int
    gpus: int
    nodes: int
    gpu_mem_gib: float
    micro_batch_size: int
    max_length: int
    checkpointing: bool
    activations: dict[str, int]
    logits_tail_bytes: int
    logits_full_bytes: int
    ranks: list[Rank]
    fits: dict[str, bool]
    recommended: str | None
    assumptions: list[str]

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for r, d in zip(self.ranks, out["ranks"]):
            d.update(model_states=r.model_states, allocated=r.allocated, total=r.total)
        return out


def make_plan(cfg: Config, gpus: int, gpu_mem_gib: float = 80.0, nodes: int = 1, model_config: str | None = None,
              root: Path | None = None, padded: bool = True) -> Plan:
    """Predict every launch mode's bytes per rank for ``cfg`` on ``gpus`` devices over ``nodes`` nodes.

    ``padded=False`` counts activations for rows that all fill ``data.max_length`` (no attention mask), see
    :func:`count_activations`; the harness pads each batch to its longest row, so True is the usual case.

    Raises:
        PlanError: impossible counts (``gpus < 1``, ``nodes < 1``, ``gpus`` not divisible by ``nodes``,
            ``gpu_mem_gib <= 0``), or a model config that cannot be planned (:func:`load_model_config`).
    """
    if gpus < 1:
        raise PlanError(f"--gpus {gpus}: at least 1 GPU is needed")
    if nodes < 1:
        raise PlanError(f"--nodes {nodes}: at least 1 node is needed")
    if gpus % nodes:
        raise PlanError(f"--gpus {gpus} is not divisible by --nodes {nodes}: every node runs the same number of "
                        f"processes (num_processes = gpus per node x nodes)")
    if gpu_mem_gib <= 0:
        raise PlanError(f"--gpu-mem {gpu_mem_gib}: GiB per GPU must be > 0")
    hf_config = load_model_config(cfg.model, model_config)
    models = {cfg.model.gradient_checkpointing: build_meta_model(cfg, hf_config)}
    params = census(cfg, models[cfg.model.gradient_checkpointing])
    other = not cfg.model.gradient_checkpointing
    models[other] = build_meta_model(cfg, hf_config, checkpointing=other)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    acts_by_gc = {gc: {False: count_activations(cfg, mdl, params, padded=padded)} for gc, mdl in models.items()}
    for gc, mdl in models.items():  # the DeepSpeed regime: every floating parameter cast
        acts_by_gc[gc][True] = (count_activations(cfg, mdl, params, cast, padded=padded) if cast
                                else acts_by_gc[gc][False])
    for regime in (False, True):
        acts_by_gc[True][regime].recompute = acts_by_gc[False][regime].per_layer
    acts = acts_by_gc[cfg.model.gradient_checkpointing]
    ranks = [predict_mode(cfg, params, acts, mode, gpus, hf_config, root) for mode in MODES]
    limit = gpu_mem_gib * GIB
    # One GPU runs only the single-process mode; with several, one process would leave all but one idle, so the
    # single mode is shown for reference and the recommendation is a data-parallel mode.
    fits = {r.mode: not r.refused and r.total <= (1 - HEADROOM) * limit and (gpus > 1 or r.mode == "single")
            for r in ranks}
    candidates = ("single",) if gpus == 1 else MODES[1:]
    recommended = next((mode for mode in candidates if fits[mode]), None)
    a_off, a_on = acts_by_gc[False][False], acts_by_gc[True][False]
    N, T = cfg.loss.threshold, cfg.data.max_length
    name = str(model_config or cfg.model.name_or_path)
    n_params = sum(p.numel for p in params)
    return Plan(
        model=name, model_type=hf_config.model_type, parameters=n_params,
        trainable_parameters=sum(p.numel for p in params if p.trainable), gpus=gpus, nodes=nodes,
        gpu_mem_gib=gpu_mem_gib, micro_batch_size=cfg.train.micro_batch_size, max_length=T,
        checkpointing=cfg.model.gradient_checkpointing,
        activations={"checkpointing_off": a_off.decoder, "checkpointing_on": a_on.decoder, "lm_head_and_loss": a_on.head},
        logits_tail_bytes=cfg.train.micro_batch_size * N * a_on.vocab * 4,
        logits_full_bytes=cfg.train.micro_batch_size * T * a_on.vocab * 4, ranks=ranks, fits=fits,
        recommended=recommended,
        assumptions=assumptions(cfg, gpus, nodes, padded))


def assumptions(cfg: Config, gpus: int, nodes: int, padded: bool = True) -> list[str]:
    """What the numbers assume, in words (printed under the table)."""
    m, t = cfg.model, cfg.train
    rows = ("the longest row fills data.max_length and the others are padded to it (an attention mask)" if padded
            else "every row fills data.max_length (no padding, no attention mask: --full-rows)")
    return [
        (f"one micro-batch of {t.micro_batch_size} rows x {cfg.data.max_length} tokens: {rows}; tail loss over "
        f"loss.threshold={cfg.loss.threshold} positions with logits_to_keep"),
        (f"activations counted on fake tensors dispatched like CPU kernels (SDPA memory-efficient attention); "
        f"gradient accumulation ({t.gradient_accumulation_steps}) adds nothing: one micro-batch is alive at a time"),
        f"weights {m.dtype}" + (f", 4-bit {m.bnb_4bit_quant_type} (double quant {m.bnb_4bit_use_double_quant}, "
                                f"storage {m.bnb_4bit_quant_storage}, compute {m.bnb_4bit_compute_dtype}), the other "
                                f"weights fp32 (prepare_model_for_kbit_training)" if m.quantize_4bit else "")
        + f"; LoRA r={cfg.lora.r} on {cfg.lora.target_modules} in fp32 (peft); optimizer {cfg.optim.name}"
        + f"; mixed precision {t.mixed_precision}",
        (f"framework overhead = {OVERHEAD_FIXED_BYTES / GIB:.0f} GiB per process (CUDA context, cuBLAS/NCCL "
        f"workspaces) + {OVERHEAD_FRACTION:.0%} of the counted bytes (allocator fragmentation): an assumption; a mode "
        f"fits when its total leaves {HEADROOM:.0%} of --gpu-mem free ('tight': within the memory, not the margin)"),
        ("transient = max(loss backward: 3 x [B x N, V] fp32, one recomputed layer under checkpointing) + DeepSpeed "
        "reduce bucket (ZeRO-1/2) + gathered parameters (ZeRO-3: prefetch bucket + one layer; FSDP2: two layers) + "
        "one dequantized 4-bit weight: estimates"),
        (f"{gpus} GPU(s) on {nodes} node(s): per-rank bytes do not depend on the node count; recommended = the first "
        f"mode that fits in the order {', '.join(MODE_LABELS[m] for m in MODES)} (fewest bytes moved between ranks;"
        f" with several GPUs the single-process mode is shown for reference, not recommended)"),
    ]


# ---------------------------------------------------------------------------------------------------------------
# Output


def _gib(n: int) -> str:
    return f"{n / GIB:.2f}"


ROWS = (("base weights", "weights"), ("trainable (LoRA)", "trainable"), ("fp32 master", "master"),
        ("gradients", "gradients"), ("optimizer state", "optimizer"), ("saved activations", "activations"),
        ("LM head + loss", "logits"), ("transient", "transient"), ("overhead (assumed)", "overhead"),
        ("TOTAL per rank", "total"), ("host memory per rank", "host"))


def format_plan(plan: Plan) -> str:
    """The plan as a text table (GiB per rank), fits, recommendation and assumptions."""
    a = plan.activations
    head = [
        (f"scale-plan: {plan.model} ({plan.model_type}), {plan.parameters:,} parameters, "
        f"{plan.trainable_parameters:,} trainable; {plan.gpus} GPU(s) x {plan.gpu_mem_gib:g} GiB on "
        f"{plan.nodes} node(s); micro-batch {plan.micro_batch_size} x {plan.max_length} tokens, checkpointing "
        f"{'on' if plan.checkpointing else 'off'}"),
        (f"saved activations per micro-batch: checkpointing off {_gib(a['checkpointing_off'])} GiB, on "
        f"{_gib(a['checkpointing_on'])} GiB; fp32 log-probabilities the loss keeps: tail [B, N, V] "
        f"{plan.logits_tail_bytes / 2**20:.2f} MiB vs full [B, T, V] {_gib(plan.logits_full_bytes)} GiB"),
        "",
    ]
    labels = [MODE_LABELS[r.mode] for r in plan.ranks]
    width = max(12, *(len(x) + 2 for x in labels))
    lines = [f"{'GiB per rank':<22}" + "".join(f"{x:>{width}}" for x in labels)]
    for title, attr in ROWS:
        lines.append(f"{title:<22}" + "".join(f"{_gib(getattr(r, attr)):>{width}}" for r in plan.ranks))
    fit_cells = []
    for r in plan.ranks:
        if r.refused:
            fit_cells.append("refused")
        elif r.mode != "single" and plan.gpus == 1:
            fit_cells.append("n/a")
        elif plan.fits[r.mode]:
            fit_cells.append("yes")
        else:
            fit_cells.append("tight" if r.total <= plan.gpu_mem_gib * GIB else "no")
    lines.append(f"{f'fits in {plan.gpu_mem_gib:g} GiB':<22}" + "".join(f"{x:>{width}}" for x in fit_cells))
    rec = (f"recommended: {MODE_LABELS[plan.recommended]} (cheapest that fits)" if plan.recommended
           else "recommended: none fits; lower train.micro_batch_size or data.max_length, turn on "
                "model.gradient_checkpointing, use model.quantize_4bit, or add GPUs")
    notes = [f"  {MODE_LABELS[r.mode]}: {n}" for r in plan.ranks for n in r.notes]
    notes += [f"  {MODE_LABELS[r.mode]} refused: {r.refused}" for r in plan.ranks if r.refused]
    return "\n".join([*head, *lines, "", rec, "", "notes:", *notes, "", "assumptions:",
                      *(f"  - {x}" for x in plan.assumptions)])


def main(argv: list[str] | None = None) -> int:
    """``scale-plan [--config PATH] [key=value ...] --gpus N [--gpu-mem GiB] [--nodes K] [--full-rows] [--json]``."""
    parser = argparse.ArgumentParser(prog="scale-plan", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=None, help="training YAML, or a shipped config's name such as tiny_cpu "
                                                       "(default: configs/train/default.yaml)")
    parser.add_argument("overrides", nargs="*", help="dotted overrides such as train.micro_batch_size=4")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs (processes) in all, over all nodes")
    parser.add_argument("--gpu-mem", type=float, default=80.0, help="memory per GPU, GiB (default 80)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the GPUs are spread over (default 1)")
    parser.add_argument("--model-config", default=None,
                        help="a model config.json (or its directory), or a shipped name such as llama-3.1-8b, to "
                             "plan instead of model.name_or_path")
    parser.add_argument("--full-rows", action="store_true",
                        help="every row fills data.max_length (no padding): attention keeps no mask")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    args = parser.parse_intermixed_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        cfg = load_config(args.config, args.overrides)
        plan = make_plan(cfg, args.gpus, args.gpu_mem, args.nodes, args.model_config, padded=not args.full_rows)
    except (ConfigError, PlanError, FileNotFoundError) as e:
        sys.stderr.write(f"scale-plan: error: {type(e).__name__}: {e}\n")
        return 2
    sys.stdout.write((json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan)) + "\n")
    return 0


def cli() -> None:
    """Console entry point."""
    sys.exit(main())


if __name__ == "__main__":
    cli()

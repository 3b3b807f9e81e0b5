"""Where each launch mode keeps a model's bytes, per rank: the layouts of DDP, DeepSpeed ZeRO-1/2/3 (+ offload)
and FSDP2, as their code does it. The placing side of ``scale-plan`` (:mod:`scale.plan`); the counts come from
:mod:`scale.planner.census`.

They follow the libraries' code (DeepSpeed 0.19, torch DDP, accelerate): ZeRO-1/2
  flatten the trainable parameters into one buffer padded to a multiple of ``2 x world`` elements and keep an
  fp32 master partition; ZeRO-3 pads every parameter to a multiple of ``world`` and keeps parameters of at most
  ``stage3_param_persistence_threshold`` elements whole on every rank; DDP keeps a second copy of the gradients
  in its buckets; DeepSpeed allocates a ``reduce_bucket_size``-element gradient bucket. The DeepSpeed settings
  come from the JSON the accelerate config names (``configs/deepspeed/*.json``), DeepSpeed's defaults otherwise.

No ``accelerate``, ``deepspeed`` or ``torch.distributed`` import: the layouts are arithmetic on the counts.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from scale.config.load import configs_dir
from scale.config.schema import Config
from scale.modeling.attention import sequence_parallel_problem
from scale.modeling.finetune import frozen_reference_key, weights_plan
from scale.planner.activations import Activations
from scale.planner.census import DTYPES, GIB, ParamInfo, nbytes, nf4_bytes
from scale.planner.pairs import frozen_reference_bytes

# Launch modes, cheapest first: bytes moved between ranks per optimizer step (W = all weights, G = trainable
# gradients): single 0; DDP all-reduce of G; ZeRO-1/2 reduce-scatter of G + all-gather of the updated trainable
# weights (the same volume as DDP, two collectives); ZeRO-3 and FSDP2 also all-gather W in forward and in
# backward (with a frozen base, W >> G); FSDP2 moves what ZeRO-3 moves and comes after it because on CPU its path
# is proven only through a test shim (tests/fsdp_cpu.py), not on GPUs; ZeRO-3 offload adds host<->device copies.
MODES = ("single", "ddp", "zero1", "zero2", "zero3", "fsdp2", "zero3_offload")
# With train.sequence_parallel_size = N > 1 the plan adds these (scale.distributed.ulysses): ZeRO-2/3 whose N ranks per
# group share every row; they move each layer's attention inputs and outputs between the group's ranks (all-to-all, 1/N
# of a layer's activations per rank, 4 exchanges per layer), less than offload's host copies and more than ZeRO-3: they
# come between FSDP2 and ZeRO-3 offload.
SP_MODES = ("zero2_sp", "zero3_sp")
MODE_LABELS = {"single": "single", "ddp": "DDP", "zero1": "ZeRO-1", "zero2": "ZeRO-2", "zero3": "ZeRO-3",
               "zero3_offload": "ZeRO-3 offload", "fsdp2": "FSDP2", "zero2_sp": "ZeRO-2 + SP", "zero3_sp": "ZeRO-3 + SP"}
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
        reference: a full run's frozen reference (DPO ``loss.reference: model``, GRPO ``rl.beta`` > 0): a second copy
            of every weight in the forward's dtype, whole under one device, DDP and ZeRO-1/2, 1/N under ZeRO-3
            (with the parameters it keeps whole) and FSDP2 (:func:`frozen_reference_bytes`).
        activations: saved for backward, one micro-batch (checkpointing as configured).
        logits: saved from the LM head on (its inputs, the loss's fp32 log-probabilities), one micro-batch.
        transient: short-lived buffers at the step's peak (see the module docstring).
        overhead: the framework-overhead assumption.
        host: bytes this rank keeps in host memory (offload).
        refused: why the harness refuses this mode with this config (``scale.distributed.launch.plan_for_mode``), or "".
        notes: how the numbers were made for this mode.
    """

    mode: str
    weights: int = 0
    trainable: int = 0
    master: int = 0
    gradients: int = 0
    optimizer: int = 0
    reference: int = 0
    activations: int = 0
    logits: int = 0
    transient: int = 0
    overhead: int = 0
    host: int = 0
    refused: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> int:
        return self.weights + self.trainable + self.master + self.gradients + self.optimizer + self.reference

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


# The ZeRO paper's model states per rank for mixed-precision Adam (Rajbhandari et al. 2020, arXiv:1910.02054,
# Figure 1): 2 bytes of 16-bit weights + 2 of 16-bit gradients + K = 12 of fp32 master, momentum and variance per
# parameter, of which each stage partitions more over the N ranks: (bytes whole, bytes divided by N).
ZERO_PAPER = {"ddp": (16, 0), "zero1": (4, 12), "zero2": (2, 14), "zero3": (0, 16), "fsdp2": (0, 16)}
ZERO_PAPER_TEXT = {"ddp": "16Ψ", "zero1": "4Ψ + 12Ψ/N", "zero2": "2Ψ + 14Ψ/N", "zero3": "16Ψ/N", "fsdp2": "16Ψ/N"}


def zero_paper_bytes(mode: str, psi: int, world: int) -> int | None:
    """Model-state bytes per rank the ZeRO paper gives for ``mode`` (Figure 1, 16-bit weights and gradients + Adam):
    DDP 16Ψ, ZeRO-1 4Ψ + 12Ψ/N, ZeRO-2 2Ψ + 14Ψ/N, ZeRO-3 (and FSDP2, the same partitioning) 16Ψ/N, for ``psi`` = Ψ
    parameters on ``world`` = N ranks; None for a mode the paper does not cover (single, offload)."""
    if mode not in ZERO_PAPER:
        return None
    whole, divided = ZERO_PAPER[mode]
    return whole * psi + divided * psi // world


def full_weights_note(r: Rank, cfg: Config, psi: int, world: int, cast: torch.dtype | None) -> str | None:
    """One line for a full fine-tune: the paper's figure for ``r.mode`` beside what the harness keeps, and why they
    differ (fp32 parameters under autocast, DeepSpeed's fp32 gradient accumulation, DDP's bucket copy)."""
    paper = zero_paper_bytes(r.mode, psi, world)
    if paper is None:
        return None
    deepspeed = r.mode in DEEPSPEED_JSON
    if cfg.train.mixed_precision == "no":
        why = "fp32 training: 4-byte weights and gradients where the paper counts 2" + (
            ", and DeepSpeed's fp32 master is a second copy" if deepspeed else "")
    elif not deepspeed:
        why = ("accelerate's autocast keeps fp32 parameters and fp32 gradients (4 + 4 bytes where the paper counts "
               "2 + 2; the fp32 parameters are the masters)")
    elif r.mode == "zero1":
        why = (f"fp32 gradient accumulation is DeepSpeed's BF16_Optimizer: whole {cast} gradients and a whole fp32 "
               f"gradient buffer (2 + 4 bytes whole where the paper counts 2)")
    else:
        why = "gradients accumulate in fp32 (data_types.grad_accum_dtype): a 4-byte partition where the paper has 2"
    if r.mode == "ddp":
        why += "; DDP keeps a bucket copy of the gradients (+4 bytes)"
    if r.mode == "zero3":
        why += "; parameters under the persistence threshold stay whole, and the reduce bucket is held throughout"
    elif r.mode == "fsdp2":
        why += "; dim-0 shards padded to equal rows"
    return (f"ZeRO paper (Figure 1, 16-bit + Adam) {ZERO_PAPER_TEXT[r.mode]} = {paper / GIB:.2f} GiB for Ψ = "
            f"{psi:,}, N = {world}; the harness keeps {r.model_states / GIB:.2f} GiB: {why}")


def _weight_bytes(p: ParamInfo, cfg: Config, cast: torch.dtype | None) -> tuple[int, int, torch.dtype]:
    """(shardable bytes, unshardable bytes, dtype held) of one parameter."""
    if p.quantized:
        packed, state = nf4_bytes(p.numel, cfg.model.bnb_4bit_use_double_quant)
        return packed, state, DTYPES[cfg.model.bnb_4bit_quant_storage]
    dtype = cast if cast is not None else p.dtype
    return p.numel * nbytes(dtype), 0, dtype


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


def zero12_extra_bytes(trainable: list[ParamInfo], dtype: torch.dtype) -> int:
    """A measured term of a full fine-tune under DeepSpeed's ZeRO-1/2 optimizer (``DeepSpeedZeroOptimizer``, not
    ``BF16_Optimizer``): each rank holds, at the optimizer step, one tensor beyond its parameters, master, gradient
    partition and buckets, of the largest trained parameter's shape (the input embeddings, tied to the head or not)
    in the module's dtype. Seen by ``benchmarks/full_memory.py`` (DeepSpeed 0.19.8, CPU, fp32 and bf16, 1 and 2
    ranks); which DeepSpeed structure keeps it was not identified, so it is counted as measured, in ``transient``."""
    return max((p.numel for p in trainable), default=0) * nbytes(dtype)


def sequence_parallel_mode(cfg: Config, params: list[ParamInfo], acts: dict[bool, Activations], mode: str,
                           world: int, hf_config: Any, root: Path | None = None, rank: int = 0) -> Rank:
    """Bytes one rank holds in ``zero2_sp``/``zero3_sp``: ZeRO-2/3 with ``train.sequence_parallel_size = N``.

    Model states are ZeRO's over all ``world`` ranks (DeepSpeed partitions over the sequence-and-data-parallel group,
    every rank: the same bytes as without sequence parallelism). Activations and the LM head/loss are ``acts`` as
    counted for one rank's shard (:func:`scale.planner.activations.count_activations` with ``sp = N``). Transient: the
    recomputed layer and the loss backward of the shard, plus the all-to-all buffers of one attention call: a send and a
    receive copy of query, key, value and output, each ``[B, T / N, heads x head size]`` (an estimate).
    """
    n = cfg.train.sequence_parallel_size
    r = predict_mode(cfg, params, acts, mode.removesuffix("_sp"), world, hf_config, root, rank)
    r.mode = mode
    text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    heads = getattr(text, "num_attention_heads", 0)
    kv = max(getattr(text, "num_key_value_heads", heads) or heads, n)
    d = getattr(text, "head_dim", None) or text.hidden_size // max(heads, 1)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    C = -(-cfg.data.max_length // n)
    exchanged = 2 * cfg.train.micro_batch_size * C * d * (2 * heads + 2 * kv) * nbytes(cast or DTYPES[cfg.model.dtype])
    r.transient += exchanged
    r.overhead = OVERHEAD_FIXED_BYTES + int(OVERHEAD_FRACTION * r.allocated)
    r.notes.append(f"sequence parallel {n}: every row shared by {n} ranks ({C} positions each), Ulysses all-to-all "
                   f"buffers {exchanged / 2**20:.1f} MiB per attention call")
    attn = cfg.model.attn_implementation or "sdpa"
    why = (f"train.sequence_parallel_size={n} does not divide --gpus {world}" if world % n else
           sequence_parallel_problem(hf_config, attn, n, cfg.data.packing or cfg.data.padding_free,
                                     cfg.data.max_length))
    r.refused = r.refused or (why or "")
    return r


def predict_mode(cfg: Config, params: list[ParamInfo], acts: dict[bool, Activations], mode: str, world: int,
                 hf_config: Any, root: Path | None = None, rank: int = 0) -> Rank:
    """Bytes one rank holds in ``mode`` on ``world`` processes.

    Args:
        cfg: the training config.
        params: :func:`scale.planner.census.census` of the model.
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
    if mode in SP_MODES:  # acts: the counts of one rank's shard
        return sequence_parallel_mode(cfg, params, acts, mode, world, hf_config, root, rank)
    r = Rank(mode)
    m = cfg.model
    deepspeed = mode in DEEPSPEED_JSON
    # What trains and in which dtypes (scale.modeling.finetune): with every weight trained, DeepSpeed accumulates
    # gradients in fp32 (data_types.grad_accum_dtype, set by the harness); a LoRA run keeps DeepSpeed's default, the
    # module's dtype.
    weights = weights_plan(cfg, "fsdp" if mode == "fsdp2" else mode)
    full = weights.trains == "full"
    accum = DTYPES[weights.grad_accum_dtype] if full else None
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision) if deepspeed else None
    if deepspeed and cast is not None:
        r.notes.append(f"DeepSpeed casts every floating parameter to {cast} ({'every weight' if full else 'LoRA too'}); "
                       f"fp32 master partition")
    adam = cfg.optim.name == "adamw"
    trainable = [p for p in params if p.trainable]
    frozen = [p for p in params if not p.trainable]
    w = world if mode != "single" else 1

    # refusals, as scale.distributed.launch.plan_for_mode decides them
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
    transient = max(act.recompute, 3 * (act.loss_positions or B * N) * act.vocab * 4)  # one chunk when chunked
    transient = max(transient, act.reference)  # DPO's in-step reference forward, after the policy's, before backward
    transient = max(transient, act.moe_layer)  # a MoE layer's backward (peft's path: W + B A and its gradient)
    if m.quantize_4bit:  # one 4-bit weight dequantized to the compute dtype for its matmul (forward and backward)
        transient += max((p.numel for p in params if p.quantized), default=0) * nbytes(DTYPES[m.bnb_4bit_compute_dtype])

    if mode in ("single", "ddp"):
        r.weights = sum(sum(_weight_bytes(p, cfg, None)[:2]) for p in frozen)
        r.trainable = sum(p.numel * nbytes(p.dtype) for p in trainable)
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
        r.trainable = aligned * nbytes(tdtype)
        r.master = part * 4
        if mode == "zero1" and full and cast is not None:
            # fp32 accumulation under ZeRO-1 is DeepSpeed's BF16_Optimizer (engine._do_optimizer_sanity_check): the
            # module's gradients in its dtype plus one whole flat fp32 gradient buffer (fp32_groups_gradients_flat)
            r.gradients = n * nbytes(tdtype) + aligned * 4
            r.notes.append(f"BF16_Optimizer (fp32 gradient accumulation): whole {cast} gradients + a whole fp32 "
                           f"gradient buffer, fp32 master partition")
        elif mode == "zero1":  # gradients are not partitioned: every parameter's gradient lives until the epilogue
            r.gradients = n * nbytes(tdtype)
            r.notes.append("whole gradients until the end of backward, then the partition")
        elif full and cast is not None:  # the fp32 accumulation partition; the module's gradients are freed into it
            r.gradients = part * 4
            r.notes.append("gradients accumulated in an fp32 partition (data_types.grad_accum_dtype=fp32)")
        else:
            r.gradients = zero12_gradient_elems(trainable, aligned, part, rank) * nbytes(tdtype)
        r.optimizer = 2 * part * 4 if adam else 0
        if ds["contiguous_gradients"] and not (mode == "zero1" and full and cast is not None):  # BF16_Optimizer: none
            bucket = ds["reduce_bucket_size"] * nbytes(tdtype) * (2 if ds["overlap_comm"] else 1)
            transient += bucket
            r.notes.append(f"reduce bucket {ds['reduce_bucket_size']:,} elements allocated at each backward "
                           f"({ds['source']}); set zero_optimization.reduce_bucket_size to shrink it")
        if full and not (mode == "zero1" and cast is not None):
            extra = zero12_extra_bytes(trainable, tdtype)
            transient += extra
            r.notes.append(f"+ {extra / 2**20:,.1f} MiB: one more tensor the size of the largest trained parameter "
                           f"in {tdtype}, held at the step (measured, benchmarks/full_memory.py)")
    elif mode in ("zero3", "zero3_offload"):
        ds = deepspeed_settings(mode, hf_config, root)
        offload_param = ds.get("offload_param", {}).get("device", "none") == "cpu"
        offload_opt = ds.get("offload_optimizer", {}).get("device", "none") == "cpu"
        persisted = host = 0
        for p in params:  # transformers' order, which is DeepSpeed's module walk order
            shardable, unshardable, dtype = _weight_bytes(p, cfg, cast)
            elems = shardable // nbytes(dtype)
            # DeepSpeed compares the stored tensor's elements (ds_numel): a packed 4-bit weight stores
            # ceil(numel / 2) bytes, i.e. fewer elements than its logical numel (counting it as numel under-predicted
            # 1.156x).
            persistent = (elems <= ds["stage3_param_persistence_threshold"]
                          and persisted + elems <= ds["stage3_model_persistence_threshold"])
            persisted += elems if persistent else 0
            part = _shard_elems(elems, w) * nbytes(dtype)
            if persistent and offload_param:  # whole on the device; its partition, like every other, in the host's
                whole = _shard_elems(elems, w) * w * nbytes(dtype)  # flat buffer (measured: full_memory.py, N = 2)
                held, device_part = part + whole, whole
            elif persistent:  # kept whole (gathered at the padded size) on every rank besides its partition; on one
                held = part + (_shard_elems(elems, w) * w * nbytes(dtype) if w > 1 else 0)  # rank they are one
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
        gdtype = cast or trainable[0].dtype  # the reduce bucket's; the partition is fp32 for full weights
        master, grads, opt = tpart * 4, tpart * nbytes(accum or gdtype), (2 * tpart * 4 if adam else 0)
        bucket = ds["reduce_bucket_size"] * nbytes(gdtype) if ds["contiguous_gradients"] else 0
        if offload_opt:  # DeepSpeed 0.19 also gives each fp32 master sub-group its own fp32 gradient buffer
            host += master + grads + tpart * 4 + opt  # (stage3.py initialize_optimizer_states), beside the partition
            r.gradients = bucket
        else:
            r.master, r.gradients, r.optimizer = master, grads + bucket, opt
        r.host = host
        layer_bytes = max((sum(_weight_bytes(p, cfg, cast)[0] for p in params if f".{i}." in p.name)
                           for i in range(act.layers)), default=0)
        gathered = min(ds["stage3_prefetch_bucket_size"] * nbytes(cast or DTYPES[m.dtype]) + layer_bytes,
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
                part = _shard_elems(shardable // nbytes(dtype), w) * nbytes(dtype)
                own = part
            else:  # torch.chunk of dim 0: rank r holds rows [r*c, (r+1)*c), c = ceil(rows / world)
                rows = p.shape[0] if p.shape else 1
                c, row_bytes = _shard_elems(rows, w), (p.numel // max(rows, 1)) * nbytes(dtype)
                part = c * row_bytes  # the parameter and its gradient live in storage padded to c rows
                own = max(0, min(c, rows - rank * c)) * row_bytes  # the optimizer's zeros_like: unpadded
            if p.trainable:
                r.trainable += part
                r.gradients += part
                r.optimizer += 2 * own if adam else 0
            else:
                r.weights += part + unshardable
        layer_bytes = max((sum(_weight_bytes(p, cfg, None)[0] for p in params if f".{i}." in p.name)
                           for i in range(act.layers)), default=0)
        transient += 2 * layer_bytes  # one decoder layer gathered, the next prefetched
        r.notes.append("dim-0 shards of every parameter (padded to equal rows; optimizer state unpadded)")
    if frozen_reference_key(cfg) is not None:
        ds = deepspeed_settings(mode, hf_config, root) if mode in ("zero3", "zero3_offload") else None
        r.reference, ref_host = frozen_reference_bytes(params, mode, world, cast, ds)
        r.host += ref_host
        r.notes.append(f"{frozen_reference_key(cfg)}: a frozen copy of every weight, "
                       f"{'1/N' if partitioned else 'whole'} ({r.reference / 2**30:.2f} GiB)")
    r.transient = transient
    r.overhead = OVERHEAD_FIXED_BYTES + int(OVERHEAD_FRACTION * r.allocated)
    if full and (note := full_weights_note(r, cfg, sum(p.numel for p in params), w, cast)):
        r.notes.append(note)
    return r


# ---------------------------------------------------------------------------------------------------------------
# The plan

"""The plan: the bytes one rank holds in every launch mode for a config on some GPUs (:func:`make_plan`), which modes
fit and which is recommended, what the numbers assume, and what would make a mode fit when none does. The counts
are :mod:`scale.planner.census`'s (parameters) and :mod:`scale.planner.activations`'s (saved activations), the
layouts :mod:`scale.planner.layouts`'s; a preference job's lines are :mod:`scale.planner.pairs`'s, a
mixture-of-experts model's :mod:`scale.planner.moe`'s. ``scale-plan`` (:mod:`scale.plan`) prints it; the micro-batch
search (:mod:`scale.planner.autobatch`) probes it.

No ``accelerate`` or ``torch.distributed`` import: planning never starts a process group.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from scale.config.schema import Config, ModelConfig
from scale.data.tokenize import build_splits
from scale.modeling.build import load_tokenizer
from scale.planner.activations import Activations, count_activations
from scale.planner.census import GIB, PlanError, build_meta_model, census, load_model_config
from scale.planner.layouts import (
    MODE_LABELS,
    MODES,
    OVERHEAD_FIXED_BYTES,
    OVERHEAD_FRACTION,
    SP_MODES,
    Rank,
    predict_mode,
)
from scale.planner.moe import count_moe_layer, experts_path, moe_text
from scale.planner.pairs import pair_rows, plan_pairs
from scale.planner.rl import plan_rl, rl_rows, rl_tail
from scale.utils.assets import resolve_data

# A mode "fits" when its total leaves this fraction of the GPU free: the predictions are checked to within 10% on
# CPU, not on every GPU stack. Between that and 100% the plan says "tight".
HEADROOM = 0.05



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
    checkpointing: bool | str
    activations: dict[str, int]
    logits_tail_bytes: int
    logits_full_bytes: int
    ranks: list[Rank]
    fits: dict[str, bool]
    recommended: str | None
    assumptions: list[str]
    resume: str | None = None  # --resume: the accumulation that keeps the checkpoint's global batch, in words
    advice: str = ""  # no mode fits: what would make one fit, in words (:func:`none_fits_advice`)
    # a mixture-of-experts model: total vs active parameters and FLOPs per token (:func:`scale.planner.moe.moe_text`)
    experts: str = ""
    preference: dict[str, Any] = field(default_factory=dict)  # pairs: scale.planner.pairs.plan_pairs; else empty
    finetune: str = "lora"  # model.finetune: what the trainable parameters are (a LoRA adapter, or every weight)
    rl: dict[str, Any] = field(default_factory=dict)  # loss.objective=grpo: scale.planner.rl.plan_rl; else empty

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for r, d in zip(self.ranks, out["ranks"]):
            d.update(model_states=r.model_states, allocated=r.allocated, total=r.total)
        return out


def make_plan(cfg: Config, gpus: int, gpu_mem_gib: float = 80.0, nodes: int = 1, model_config: str | None = None,
              root: Path | None = None, padded: bool = True, single_only: bool = False) -> Plan:
    """Predict every launch mode's bytes per rank for ``cfg`` on ``gpus`` devices over ``nodes`` nodes.

    ``padded=False`` counts activations for rows that all fill ``data.max_length`` (no attention mask), see
    :func:`scale.planner.activations.count_activations`; the harness pads each batch to its longest row, so True is the
    usual case. ``single_only=True`` plans the single-device mode alone (``ranks`` holds it only, no advice): the same
    :class:`scale.planner.layouts.Rank` as the full plan's first, at half the fake forwards (DeepSpeed's all-cast regime
    is not counted); what :func:`scale.planner.autobatch.largest_micro_batch` probes with.

    Raises:
        PlanError: impossible counts (``gpus < 1``, ``nodes < 1``, ``gpus`` not divisible by ``nodes``,
            ``gpu_mem_gib <= 0``), or a model config that cannot be planned
            (:func:`scale.planner.census.load_model_config`).
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
    if cfg.train.micro_batch_size == "auto":
        raise PlanError("train.micro_batch_size=auto: plan a number (scale.planner.autobatch resolves auto at "
                        "start-up; scale-plan resolves it against --gpu-mem)")
    hf_config = load_model_config(cfg.model, model_config)
    counts: dict[str, int] = {}
    tail, tail_note = rl_tail(cfg) if cfg.loss.samples_online() else data_tail(cfg, counts)
    if cfg.data.packing:  # bins of data.max_length tokens (pairs: 2 x), any of which may be trained
        bins = (f"{cfg.train.micro_batch_size} bins of pairs x 2 x {cfg.data.max_length} tokens (planned as "
                f"{2 * cfg.train.micro_batch_size} rows x {cfg.data.max_length})" if cfg.loss.trains_pairs() else
                f"{cfg.train.micro_batch_size} bins x {cfg.data.max_length} tokens")
        tail, tail_note = cfg.data.max_length, (
            f"tail: data.packing: each micro-batch is one padding-free row of {bins} "
            f"(bins assumed full) with a block-diagonal attention mask over the whole "
            f"row; the LM head and loss are planned for every position trained (N = data.max_length per bin, the "
            f"worst case; the data's longest trained span is {tail})")
    user_cfg, cfg = cfg, with_tail(cfg, tail)  # the counts below see the data's tail as loss.threshold
    if cfg.loss.trains_pairs():  # P pairs are 2P rows: everything below counts rows
        cfg = pair_rows(cfg)
    if cfg.loss.samples_online():  # completions, their tail's logits unchunked
        cfg = rl_rows(cfg)
    gc_setting, on = cfg.model.gradient_checkpointing, bool(cfg.model.gradient_checkpointing)
    models = {on: build_meta_model(cfg, hf_config, checkpointing=on)}
    params = census(cfg, models[on])
    other = not on
    models[other] = build_meta_model(cfg, hf_config, checkpointing=other)
    cast = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.mixed_precision)
    packed = cfg.data.packing
    acts_by_gc = {gc: {False: count_activations(cfg, mdl, params, padded=padded, packed=packed)}
                  for gc, mdl in models.items()}
    regimes = (False,) if single_only else (False, True)
    for gc, mdl in models.items():  # the DeepSpeed regime: every floating parameter cast
        if not single_only:
            acts_by_gc[gc][True] = (count_activations(cfg, mdl, params, cast, padded=padded, packed=packed) if cast
                                    else acts_by_gc[gc][False])
    for regime in regimes:
        acts_by_gc[True][regime].recompute = acts_by_gc[False][regime].per_layer
    acts = {regime: checkpoint_variant(acts_by_gc[True][regime], acts_by_gc[False][regime], cfg.model)
            for regime in regimes} if gc_setting in ("every_n", "offload") else acts_by_gc[on]
    moe_layer = {regime: count_moe_layer(cfg, models[on], params, cast if regime else None) for regime in regimes}
    path = experts_path(models[on])  # the experts' LoRA path the run takes (None: dense, or no expert LoRA)
    for regime, act in acts.items():
        act.moe_layer = moe_layer[regime].get(path, 0)
    preference = plan_pairs(user_cfg, cfg, models[on], params, acts, cast, counts) if cfg.loss.trains_pairs() else {}
    rl = plan_rl(cfg, models[on], hf_config, params, acts, cast) if cfg.loss.samples_online() else {}
    order, acts_sp = (("single",) if single_only else modes_in_order(cfg)), None
    # One rank's shard of every row (scale.distributed.ulysses), DeepSpeed's regime.
    if cfg.train.sequence_parallel_size > 1 and not single_only:
        sp = cfg.train.sequence_parallel_size
        sp_by_gc = {gc: count_activations(cfg, mdl, params, cast, sp=sp) for gc, mdl in models.items()}
        sp_by_gc[True].recompute = sp_by_gc[False].per_layer
        acts_sp = (checkpoint_variant(sp_by_gc[True], sp_by_gc[False], cfg.model)
                   if gc_setting in ("every_n", "offload") else sp_by_gc[on])
        acts_sp = {False: acts_sp, True: acts_sp}
    ranks = [predict_mode(cfg, params, acts_sp if mode in SP_MODES else acts, mode, gpus, hf_config, root)
             for mode in order]
    limit = gpu_mem_gib * GIB
    # One GPU runs only the single-process mode; with several, one process would leave all but one idle, so the
    # single mode is shown for reference and the recommendation is a data-parallel mode.
    fits = {r.mode: not r.refused and r.total <= (1 - HEADROOM) * limit and (gpus > 1 or r.mode == "single")
            for r in ranks}
    candidates = ("single",) if gpus == 1 else order[1:]
    recommended = next((mode for mode in candidates if fits[mode]), None)
    advice = "" if recommended is not None or single_only else none_fits_advice(
        user_cfg, cfg.model.bnb_4bit_compute_dtype, ranks,
        lambda c: make_plan(c, gpus, gpu_mem_gib, nodes, model_config, root, padded))
    a_off, a_on = acts_by_gc[False][False], acts_by_gc[True][False]
    N, T = cfg.loss.threshold, cfg.data.max_length
    experts = moe_text(models[on], params, T, N, moe_layer[False])
    name = str(model_config or cfg.model.name_or_path)
    n_params = sum(p.numel for p in params)
    return Plan(
        model=name, model_type=hf_config.model_type, parameters=n_params,
        trainable_parameters=sum(p.numel for p in params if p.trainable), gpus=gpus, nodes=nodes,
        gpu_mem_gib=gpu_mem_gib, micro_batch_size=cfg.train.micro_batch_size, max_length=T,
        checkpointing=gc_setting,
        activations={"checkpointing_off": a_off.decoder, "checkpointing_on": a_on.decoder, "lm_head_and_loss": a_on.head},
        logits_tail_bytes=cfg.train.micro_batch_size * N * a_on.vocab * 4,
        logits_full_bytes=cfg.train.micro_batch_size * T * a_on.vocab * 4, ranks=ranks, fits=fits,
        recommended=recommended, advice=advice, experts=experts, preference=preference, finetune=cfg.model.finetune,
        rl=rl,
        assumptions=[tail_note, *assumptions(replace(user_cfg, train=cfg.train), gpus, nodes, padded),
                     loss_note(cfg, a_on)])


def modes_in_order(cfg: Config) -> tuple[str, ...]:
    """The plan's columns, cheapest first: :data:`scale.planner.layouts.MODES`, with the sequence-parallel ones
    (:data:`scale.planner.layouts.SP_MODES`) before ZeRO-3 offload when ``train.sequence_parallel_size > 1``."""
    if cfg.train.sequence_parallel_size == 1:
        return MODES
    return (*MODES[:-1], *SP_MODES, MODES[-1])


def data_tail(cfg: Config, counts: dict[str, int] | None = None) -> tuple[int, str]:
    """``N``, the tail positions per row to plan the LM head and loss for, and the assumption in words.

    Every format's tails are read from the data (the harness's own tokenizer and
    :func:`scale.data.tokenize.build_splits`): the ``text`` format's is ``loss.threshold`` tokens, or the whole row
    but its first token with ``loss.threshold: all``; classification, prompt/completion and chat tails vary. ``N``
    is the longest trained span of the train split, since a micro-batch's tail is padded to its longest row and the
    peak step is the one holding it (ORPO under ``data.pair_conventions: trl``: the longest row but one, its NLL
    scoring whole rows). When the data cannot be read, ``loss.threshold`` (``all``:
    ``data.max_length - 1``) with a note saying so. ``counts``, when given, receives the examples of each split
    (``train``, ``eval``; a preference pair is two).
    """
    whole_rows = cfg.loss.objective == "orpo" and cfg.data.pair_conventions == "trl"  # TRL's NLL: every token
    try:
        tok = load_tokenizer(cfg.model)
        splits = build_splits(cfg.data, cfg.loss, tok, resolve_data(cfg.data.path), cfg.train.seed)
    except Exception as e:  # noqa: BLE001 - a plan without the data still answers, and says so
        n = cfg.data.max_length - 1 if cfg.loss.threshold == "all" or whole_rows else cfg.loss.threshold
        return n, (f"tail: loss.threshold={cfg.loss.threshold}: {n} positions per row (the data could not be read "
                   f"for its tail lengths: {type(e).__name__}: {str(e)[:160]})")
    if counts is not None:  # examples per split (a preference pair is two)
        counts.update(train=len(splits.train), eval=len(splits.eval))
    if whole_rows:
        n = max((len(e.input_ids) for e in splits.train), default=2) - 1
        return n, (f"tail: N = {n} positions per row: loss.objective=orpo with data.pair_conventions=trl scores "
                   f"every token of a row but its first (TRL's NLL term), and the longest train row holds {n + 1}")
    tails = sorted(e.tail_len for e in splits.train) or [1]
    return tails[-1], (f"tail: N = {tails[-1]} positions per row, the longest trained span of the {splits.format} "
                       f"train split ({len(tails)} rows, median {tails[len(tails) // 2]}): every micro-batch's tail "
                       f"is as wide as its longest row, and the peak step holds the longest")


def with_tail(cfg: Config, tail: int) -> Config:
    """``cfg`` with ``loss.threshold = tail`` (the counts' ``N``; the target position stays inside it), and
    ``train.mixed_precision: auto`` as it resolves on a bf16-capable GPU: bf16 (no for QLoRA computing in fp32)."""
    precision = cfg.train.mixed_precision
    if precision == "auto":
        m = cfg.model
        precision = "no" if m.quantize_4bit and m.bnb_4bit_compute_dtype == "float32" else "bf16"  # "auto": bf16
    compute = cfg.model.bnb_4bit_compute_dtype
    if compute == "auto":
        compute = "bfloat16" if precision == "bf16" else "float32"
    return replace(cfg, loss=replace(cfg.loss, threshold=max(tail, -cfg.loss.target_position)),
                   train=replace(cfg.train, mixed_precision=precision),
                   model=replace(cfg.model, bnb_4bit_compute_dtype=compute))


def checkpoint_variant(on: Activations, off: Activations, m: ModelConfig) -> Activations:
    """Saved activations under ``model.gradient_checkpointing: every_n | offload`` from the all-on/all-off counts.

    ``every_n``: transformers checkpoints layers ``0, n, 2n, ...``; each of those saves what a checkpointed layer
    saves, the others what an unchecked one does. ``offload``: every layer checkpointed and its saved input moved
    to host memory (on a GPU), so the device keeps only the embedding and LM-head side.
    """
    if m.gradient_checkpointing == "every_n":
        k = len(range(0, on.layers, m.checkpoint_every_n_layers))
        saved_per_layer = (off.decoder - on.decoder) / max(on.layers, 1)  # what checkpointing one layer saves
        return replace(on, decoder=int(off.decoder - k * saved_per_layer))
    return replace(on, decoder=max(0, on.decoder - on.per_layer * on.layers))


def none_fits_advice(cfg: Config, compute_dtype: str, ranks: list[Rank], replan: Any) -> str:
    """What would make a mode fit when none does, naming only changes the config has not made yet.

    A 4-bit base refused by ZeRO-3/FSDP2 for its storage dtype (``model.bnb_4bit_quant_storage`` must be the compute
    dtype for the packed weights to be sharded) is planned again with that storage (``replan``): when a mode then
    fits, the advice names the key and the mode.

    Args:
        cfg: the config as given.
        compute_dtype: ``model.bnb_4bit_compute_dtype`` as resolved for the plan (``auto`` decided).
        ranks: the plan's modes.
        replan: ``cfg -> Plan`` for another config on the same GPUs.
    """
    m = cfg.model
    first = []
    if m.quantize_4bit and any("bnb_4bit_quant_storage" in r.refused for r in ranks):
        key = f"model.bnb_4bit_quant_storage={compute_dtype}"
        other = replan(replace(cfg, model=replace(m, bnb_4bit_quant_storage=compute_dtype)))
        if other.recommended is not None:
            total = next(r.total for r in other.ranks if r.mode == other.recommended)
            return (f"set {key}: then {MODE_LABELS[other.recommended]} fits ({total / GIB:.2f} GiB per rank; ZeRO-3 "
                    f"and FSDP2 shard 4-bit weights only stored in the compute dtype)")
        first.append(f"set {key} (ZeRO-3 and FSDP2 shard 4-bit weights only stored in the compute dtype)")
    rest = ["lower train.micro_batch_size or data.max_length"]
    if not m.gradient_checkpointing:
        rest.append("turn on model.gradient_checkpointing")
    if not m.quantize_4bit:
        rest.append("use model.quantize_4bit")
    return ", ".join(first + rest) + ", or add GPUs"


def loss_note(cfg: Config, act: Activations) -> str:
    """The loss's chunking in words (:mod:`scale.loss.chunked`)."""
    B, N = cfg.train.micro_batch_size, cfg.loss.threshold
    if act.loss_positions < B * N:
        return (f"loss.chunk_size={cfg.loss.chunk_size}: the tail loss runs in chunks of {act.loss_positions} "
                f"positions (fp32 logits of one chunk at a time, not [{B} x {N}, V])")
    return f"loss.chunk_size={cfg.loss.chunk_size}: unchunked tail loss ([{B} x {N}, V] fp32 logits at once)"


def assumptions(cfg: Config, gpus: int, nodes: int, padded: bool = True) -> list[str]:
    """What the numbers assume, in words (printed under the table)."""
    t = cfg.train
    rows = ("the longest row fills data.max_length and the others are padded to it (an attention mask)" if padded
            else "every row fills data.max_length (no padding, no attention mask: --full-rows)")
    if cfg.data.packing:
        rows = "the bins packed into one padding-free row with a block-diagonal mask (data.packing)"
    n = t.sequence_parallel_size
    sp = [(f"ZeRO-2/3 + SP (train.sequence_parallel_size={n}): each row padded on the right to a multiple of {n} and "
           f"split in {n} shards of {-(-cfg.data.max_length // n)} positions, no attention mask (Ulysses: causal over "
           f"the whole row on heads/{n} per rank); the LM head and loss over min(tail, shard) positions per row, "
           f"the rank holding most of the tail; model states as ZeRO-2/3 over all {gpus} ranks")] if n > 1 else []
    return [*_core_assumptions(cfg, gpus, nodes, rows), *sp]


def _core_assumptions(cfg: Config, gpus: int, nodes: int, rows: str) -> list[str]:
    m, t = cfg.model, cfg.train
    return [
        (f"one micro-batch of {t.micro_batch_size} rows x {cfg.data.max_length} tokens: {rows}; tail loss over "
        f"loss.threshold={cfg.loss.threshold} positions with logits_to_keep"),
        (f"activations counted on fake tensors dispatched like CPU kernels (SDPA memory-efficient attention); "
        f"gradient accumulation ({t.gradient_accumulation_steps}) adds nothing: one micro-batch is alive at a time"),
        f"weights {m.dtype}" + (f", 4-bit {m.bnb_4bit_quant_type} (double quant {m.bnb_4bit_use_double_quant}, "
                                f"storage {m.bnb_4bit_quant_storage}, compute {m.bnb_4bit_compute_dtype}), the other "
                                + ("weights fp32 (prepare_model_for_kbit_training)"
                                   if m.qlora_residual_dtype == "float32"
                                   else f"weights {m.dtype} (model.qlora_residual_dtype=compute)")
                                if m.quantize_4bit else "")
        + (f"; every weight trained (model.finetune=full): fp32 masters, fp32 gradient accumulation, fp32 optimizer "
           f"state in every mode (scale.modeling.finetune.weights_plan)" if m.finetune == "full" else
           f"; LoRA r={cfg.lora.r} on {cfg.lora.target_modules} in fp32 (peft)") + f"; optimizer {cfg.optim.name}"
        + f"; mixed precision {t.mixed_precision}",
        (f"framework overhead = {OVERHEAD_FIXED_BYTES / GIB:.0f} GiB per process (CUDA context, cuBLAS/NCCL "
        f"workspaces) + {OVERHEAD_FRACTION:.0%} of the counted bytes (allocator fragmentation): an assumption; a mode "
        f"fits when its total leaves {HEADROOM:.0%} of --gpu-mem free ('tight': within the memory, not the margin)"),
        ("transient = max(loss backward: 3 x [B x N, V] fp32, one recomputed layer under checkpointing, a MoE layer's "
        "forward + backward) + DeepSpeed "
        "reduce bucket (ZeRO-1/2) + gathered parameters (ZeRO-3: prefetch bucket + one layer; FSDP2: two layers) + "
        "one dequantized 4-bit weight: estimates"),
        (f"{gpus} GPU(s) on {nodes} node(s): per-rank bytes do not depend on the node count; recommended = the first "
        f"mode that fits in the order {', '.join(MODE_LABELS[m] for m in modes_in_order(cfg))} (fewest bytes moved "
        f"between ranks;"
        f" with several GPUs the single-process mode is shown for reference, not recommended)"),
    ]


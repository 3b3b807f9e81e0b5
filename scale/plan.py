"""``scale-plan``: which launch mode fits, before the job is launched. Predicted bytes per rank, from configs only.

    scale-plan --config configs/train/default.yaml --gpus 8 --gpu-mem 80
    scale-plan --config configs/train/default.yaml model.name_or_path=configs/models/llama-3.1-70b.json \\
        model.dtype=bfloat16 train.mixed_precision=bf16 model.bnb_4bit_compute_dtype=bfloat16 \\
        model.bnb_4bit_quant_storage=bfloat16 --gpus 16 --nodes 2
    scale-plan --gpus 2 --gpu-mem 24 --model-config configs/models/llama-3.1-8b.json --json
    scale-plan --resume runs/x/checkpoints/step_000400 --gpus 4 --gpu-mem 24   # continue that run on 4 GPUs

It reads the training config (the same YAML and dotted overrides as ``scale-train``) and the model's
``config.json`` only: no weights are loaded, so it answers for a 70B model on a laptop and for node counts that
do not exist here. For every launch mode (single, DDP, ZeRO-1/2/3, ZeRO-3 + CPU offload, FSDP2) it prints the
bytes one rank holds, by kind, and the total against ``--gpu-mem`` (GiB; a mode fits when it leaves
:data:`HEADROOM` of it free); it recommends the cheapest mode (fewest bytes moved between ranks per step) that
fits, a data-parallel one when there are several GPUs.

How each number is obtained:

- **Parameters** and **saved activations** are counted by :mod:`scale.planner.census` (meta-device model, fake-tensor
  forward with saved-tensor hooks).
- **Where each launch mode keeps them** is :mod:`scale.planner.layouts` (DeepSpeed, DDP and FSDP2 as their code does).
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
``--resume CKPT`` plans the run that wrote a checkpoint (its config, plus any overrides) on ``--gpus``: it prints the
``train.gradient_accumulation_steps`` that keeps the checkpoint's global batch there (the value ``scale-train``
computes itself when the config is the checkpoint's, :func:`scale.training.state.resume_accumulation`), or why none does.

No ``accelerate`` or ``torch.distributed`` import (``tests/test_layering.py``): planning never starts a process
group.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from scale.config.help import help_text
from scale.config.load import load_config
from scale.config.schema import Config, ModelConfig
from scale.config.validation import ConfigError
from scale.data.tokenize import build_splits
from scale.modeling.build import load_tokenizer
from scale.modeling.moe import active_counts, moe_layout
from scale.modeling.moe import model_shape as moe_model_shape
from scale.objectives.preference import REFERENCE_ADAPTER
from scale.planner.census import (GIB, Activations, PlanError, build_meta_model, census, count_activations,
                                  count_reference_peak, load_model_config, nbytes)
from scale.planner.layouts import (MODE_LABELS, MODES, OVERHEAD_FIXED_BYTES, OVERHEAD_FRACTION, SP_MODES, Rank,
                                   predict_mode)
from scale.training.state import divisors, read_state, resume_accumulation, saved_global_batch
from scale.utils.assets import resolve_data
from scale.utils.flops import flops_per_token, model_shape, reference_flops_per_token
from scale.utils.logs import ignore_known_warnings

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
    experts: str = ""  # a mixture-of-experts model: total vs active parameters and FLOPs per token (:func:`moe_text`)
    preference: dict[str, Any] = field(default_factory=dict)  # pairs: :func:`plan_pairs`; empty for other jobs

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        for r, d in zip(self.ranks, out["ranks"]):
            d.update(model_states=r.model_states, allocated=r.allocated, total=r.total)
        return out


def make_plan(cfg: Config, gpus: int, gpu_mem_gib: float = 80.0, nodes: int = 1, model_config: str | None = None,
              root: Path | None = None, padded: bool = True, single_only: bool = False) -> Plan:
    """Predict every launch mode's bytes per rank for ``cfg`` on ``gpus`` devices over ``nodes`` nodes.

    ``padded=False`` counts activations for rows that all fill ``data.max_length`` (no attention mask), see
    :func:`count_activations`; the harness pads each batch to its longest row, so True is the usual case.
    ``single_only=True`` plans the single-device mode alone (``ranks`` holds it only, no advice): the same
    :class:`Rank` as the full plan's first, at half the fake forwards (DeepSpeed's all-cast regime is not counted);
    what :func:`largest_micro_batch` probes with.

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
    if cfg.train.micro_batch_size == "auto":
        raise PlanError("train.micro_batch_size=auto: plan a number (scale.planner.autobatch resolves auto at start-up; "
                        "scale-plan resolves it against --gpu-mem)")
    hf_config = load_model_config(cfg.model, model_config)
    counts: dict[str, int] = {}
    tail, tail_note = data_tail(cfg, counts)
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
    preference = plan_pairs(user_cfg, cfg, models[on], params, acts, cast, counts) if cfg.loss.trains_pairs() else {}
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
    experts = moe_text(models[on], params, T, N)
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
        recommended=recommended, advice=advice, experts=experts, preference=preference,
        assumptions=[tail_note, *assumptions(replace(user_cfg, train=cfg.train), gpus, nodes, padded),
                     loss_note(cfg, a_on)])


def largest_micro_batch(cfg: Config, gpu_mem_gib: float, fraction: float = 1 - HEADROOM,
                        model_config: str | None = None, upper: int = 4096) -> tuple[int, Rank | None]:
    """The largest ``train.micro_batch_size`` whose single-device plan fits ``fraction`` of one device's memory.

    The plan's total (model states, saved activations, logits, transient bytes and the assumed framework overhead:
    :func:`make_plan`'s ``single`` row) is affine in the micro-batch at a fixed row length (everything but the model
    states scales with the rows), so two plans (1 and 16 rows) give the candidate ``b = (limit - total(0)) / slope``;
    plans at ``b`` and ``b + 1`` confirm it, and a bisection below ``b`` (or a doubling above it) takes over when the
    total is not affine (a loss chunk size that changes with the rows): 4 plans when it is, each a fake-tensor forward.

    Args:
        cfg: the training config; every key but ``train.micro_batch_size`` is planned as given.
        gpu_mem_gib: memory of the device (GiB).
        fraction: the share of it the plan may fill (0 < fraction <= 1).
        model_config: a ``config.json`` to plan instead of ``model.name_or_path``'s.
        upper: the largest micro-batch returned.

    Returns:
        ``(micro_batch_size, its single-device Rank)``; ``(0, None)`` when even one row does not fit.

    Raises:
        PlanError: as :func:`make_plan`, or ``fraction`` outside ``(0, 1]``.
    """
    if not 0 < fraction <= 1:
        raise PlanError(f"memory fraction {fraction}: must be in (0, 1]")
    limit = fraction * gpu_mem_gib * GIB
    plans: dict[int, Rank] = {}

    def total(b: int) -> Rank:
        if b not in plans:
            plans[b] = make_plan(replace(cfg, train=replace(cfg.train, micro_batch_size=b)), 1, gpu_mem_gib,
                                 model_config=model_config, single_only=True).ranks[0]
        return plans[b]

    def fits(b: int) -> bool:
        return not total(b).refused and total(b).total <= limit

    if not fits(1):
        return 0, None
    slope = max((total(16).total - total(1).total) / 15, 1.0)
    guess = int(min(max((limit - total(1).total) / slope + 1, 1), upper))
    lo, hi = (guess, guess + 1) if fits(guess) else (1, guess)   # lo fits; hi does not, once checked
    while lo < upper and hi <= upper and fits(hi):                # past the guess: double until a size does not fit
        lo, hi = hi, min(2 * hi, upper + 1)
    if lo >= upper or hi > upper:
        return (upper, total(upper)) if fits(upper) else _bisect(lo, upper, fits, total)
    return _bisect(lo, hi, fits, total)


def auto_micro_batch(cfg: Config, data_parallel_size: int, gpu_mem_gib: float, model_config: str | None = None,
                     upper: int = 4096) -> tuple[int, int, Rank | None]:
    """``train.micro_batch_size: auto`` as the run resolves it: the largest micro-batch whose single-device plan fits
    ``train.auto_memory_fraction`` of ``gpu_mem_gib`` (:func:`largest_micro_batch`, at most ``upper``); with
    ``train.auto_global_batch_size`` ``G``, the largest that also divides ``G / data_parallel_size``, and the
    accumulation that makes up the rest. Shared by ``scale-train`` (:mod:`scale.planner.autobatch`) and ``scale-plan``.

    Returns:
        ``(micro_batch_size, gradient_accumulation_steps, its single-device Rank)``; ``(0, steps as set, None)`` when
        not even one row fits.

    Raises:
        PlanError: ``G`` not divisible by ``data_parallel_size``; as :func:`make_plan`.
    """
    t = cfg.train
    G = t.auto_global_batch_size
    if G is not None and G % data_parallel_size:
        raise PlanError(f"train.auto_global_batch_size={G} is not divisible by the {data_parallel_size} "
                        f"data-parallel ranks: use a multiple of {data_parallel_size}")
    per_rank = G // data_parallel_size if G is not None else upper
    plain = replace(cfg, train=replace(t, auto_global_batch_size=None))  # a number with it set is refused
    b, rank = largest_micro_batch(plain, gpu_mem_gib, t.auto_memory_fraction, model_config, upper=min(per_rank, upper))
    if b == 0 or rank is None or G is None:
        return b, t.gradient_accumulation_steps, rank
    fit, b = b, max(d for d in range(1, b + 1) if per_rank % d == 0)
    if b != fit:
        rank = make_plan(replace(plain, train=replace(plain.train, micro_batch_size=b)), 1, gpu_mem_gib,
                         model_config=model_config, single_only=True).ranks[0]
    return b, per_rank // b, rank


def _bisect(lo: int, hi: int, fits: Any, total: Any) -> tuple[int, Rank]:
    """The largest size in ``[lo, hi)`` that fits, given that ``lo`` fits and ``hi`` does not."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo, total(lo)


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
            return (f"set {key}: then {MODE_LABELS[other.recommended]} fits ({_gib(total)} GiB per rank; ZeRO-3 and "
                    f"FSDP2 shard 4-bit weights only stored in the compute dtype)")
        first.append(f"set {key} (ZeRO-3 and FSDP2 shard 4-bit weights only stored in the compute dtype)")
    rest = ["lower train.micro_batch_size or data.max_length"]
    if not m.gradient_checkpointing:
        rest.append("turn on model.gradient_checkpointing")
    if not m.quantize_4bit:
        rest.append("use model.quantize_4bit")
    return ", ".join(first + rest) + ", or add GPUs"


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
    peak step is the one holding it. When the data cannot be read, ``loss.threshold`` (``all``:
    ``data.max_length - 1``) with a note saying so. ``counts``, when given, receives the examples of each split
    (``train``, ``eval``; a preference pair is two).
    """
    try:
        tok = load_tokenizer(cfg.model)
        splits = build_splits(cfg.data, cfg.loss, tok, resolve_data(cfg.data.path), cfg.train.seed)
    except Exception as e:  # noqa: BLE001 - a plan without the data still answers, and says so
        n = cfg.data.max_length - 1 if cfg.loss.threshold == "all" else cfg.loss.threshold  # all: the whole row
        return n, (f"tail: loss.threshold={cfg.loss.threshold}: {n} positions per row (the data could not be read "
                   f"for its tail lengths: {type(e).__name__}: {str(e)[:160]})")
    if counts is not None:  # examples per split (a preference pair is two)
        counts.update(train=len(splits.train), eval=len(splits.eval))
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


def pair_rows(cfg: Config) -> Config:
    """A preference job as the planner counts it: a micro-batch of ``P`` pairs (``train.micro_batch_size``) is
    ``2P`` rows of prompt + completion (:class:`scale.data.tasks.preference.PairCollator`: rows ``2p``, ``2p + 1``),
    and the preference losses run unchunked (``loss.chunk_size`` 0: :func:`scale.objectives.preference.side_logps`
    over the ``[2P, N, V]`` tail logits)."""
    return replace(cfg, train=replace(cfg.train, micro_batch_size=2 * cfg.train.micro_batch_size),
                   loss=replace(cfg.loss, chunk_size=0))


def plan_pairs(user_cfg: Config, cfg: Config, model: torch.nn.Module, params: list[Any],
               acts: dict[bool, Activations], cast: torch.dtype | None, counts: dict[str, int]) -> dict[str, Any]:
    """What a preference job adds to the plan, and the in-step reference's bytes set on ``acts`` (``reference``).

    - **Two sides per pair**: ``cfg`` is :func:`pair_rows`'s (``2P`` rows); the activations, logits and loss
      backward are counted for them.
    - **The reference** (``dpo``): ``loss.reference: adapter`` runs one more forward of the ``2P`` rows per
      micro-batch under ``no_grad`` after the policy's, while the policy's saved activations are alive: its peak
      (:func:`scale.planner.census.count_reference_peak`: tail logits, logsumexp's buffer, one layer's intermediates)
      is a transient of the step (``Activations.reference``, :func:`scale.planner.layouts.predict_mode` takes the larger
      of it and the loss backward). ``precomputed``: nothing in the step; one pass before training over every
      train and eval pair, ``2 x train.eval_micro_batch_size`` rows at a time, with no gradients or optimizer
      state yet.
    - **A starting adapter** (``model.adapter``) under the in-step reference: its frozen copy, the peft adapter
      ``reference`` (:func:`scale.objectives.preference.add_reference_adapter`), is appended to ``params`` as frozen
      parameters of the LoRA matrices' shapes and dtypes, so every launch mode holds (or shards) it as weights.
    - **FLOPs per pair**: the policy's training FLOPs of both sides (``2 T`` positions x
      :func:`scale.utils.flops.flops_per_token`) and the reference's forward
      (:func:`scale.utils.flops.reference_flops_per_token`) in the
      step or once in the pre-pass.

    Args:
        user_cfg: the config as given (``train.micro_batch_size`` in pairs).
        cfg: the planned config (:func:`pair_rows` of :func:`with_tail`'s).
        model: the meta-built model (:func:`scale.planner.census.build_meta_model`).
        params: its :func:`scale.planner.census.census`; the reference adapter's copies are appended (see above).
        acts: the activations by precision regime (as :func:`scale.planner.layouts.predict_mode` reads them); their
            ``reference`` is set.
        cast: the DeepSpeed regime's parameter dtype, or None.
        counts: examples per split (:func:`data_tail`), possibly empty.

    Returns:
        JSON-ready numbers (bytes, FLOPs) and ``text``, the plan's line in words.
    """
    loss = cfg.loss
    P, rows, T, N = user_cfg.train.micro_batch_size, cfg.train.micro_batch_size, cfg.data.max_length, loss.threshold
    reference = loss.reference if loss.objective == "dpo" else "none"
    in_step = reference == "adapter"
    peak = {regime: count_reference_peak(cfg, model, params, cast if regime else None) for regime in (False, True)
            } if in_step else {False: 0, True: 0}
    for regime, a in acts.items():
        a.reference = peak[regime]
    if in_step and cfg.model.adapter is not None:  # the starting adapter's frozen copy: more (frozen) parameters
        params.extend(replace(p, name=p.name.replace(".default.", f".{REFERENCE_ADAPTER}."), trainable=False)
                      for p in list(params) if p.trainable)
    eval_rows = 2 * cfg.train.eval_micro_batch_size
    prepass = (count_reference_peak(cfg, model, params, None, rows=eval_rows) if reference == "precomputed" else 0)
    trainable = sum(p.numel for p in params if p.trainable)
    shape, f = model_shape(model), N / T
    policy = 2 * T * flops_per_token(shape, T, lora_params=trainable, logits_fraction=f)
    forward = 2 * T * reference_flops_per_token(shape, T, f, trainable if cfg.model.adapter else 0)
    train_pairs, eval_pairs = counts.get("train", 0) // 2, counts.get("eval", 0) // 2
    out = {"objective": loss.objective, "pairs_per_micro_batch": P, "rows_per_micro_batch": rows,
           "reference": reference, "reference_step_bytes": peak[False], "reference_pass_bytes": prepass,
           "reference_pass_rows": eval_rows if prepass else 0, "train_pairs": train_pairs, "eval_pairs": eval_pairs,
           "policy_flops_per_pair": policy, "reference_flops_per_pair": forward if reference != "none" else 0.0,
           "step_flops_per_pair": policy + (forward if in_step else 0.0),
           "reference_pass_flops": forward * (train_pairs + eval_pairs) if reference == "precomputed" else 0.0}
    ref_text = {"adapter": (f"loss.reference=adapter: one more forward of the {rows} rows per micro-batch under "
                            f"no_grad, {peak[False] / 2**20:.1f} MiB at its peak on top of the policy's saved "
                            f"activations (in 'transient'), {forward:.3g} FLOPs per pair"),
                "precomputed": (f"loss.reference=precomputed: nothing in the step; one pass before training over "
                                f"{train_pairs + eval_pairs} pairs ({eval_rows} rows at a time, "
                                f"{prepass / 2**20:.1f} MiB at its peak on top of the weights), "
                                f"{out['reference_pass_flops']:.3g} FLOPs once"),
                "none": f"loss.objective={loss.objective}: reference-free"}[reference]
    out["text"] = (f"preference pairs ({loss.objective}): a micro-batch of {P} pairs is {rows} rows (chosen and "
                   f"rejected each prompt + completion); {ref_text}; training FLOPs per pair "
                   f"{out['step_flops_per_pair']:.3g} (policy {policy:.3g} over 2 x {T} positions)")
    return out


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
        + f"; LoRA r={cfg.lora.r} on {cfg.lora.target_modules} in fp32 (peft); optimizer {cfg.optim.name}"
        + f"; mixed precision {t.mixed_precision}",
        (f"framework overhead = {OVERHEAD_FIXED_BYTES / GIB:.0f} GiB per process (CUDA context, cuBLAS/NCCL "
        f"workspaces) + {OVERHEAD_FRACTION:.0%} of the counted bytes (allocator fragmentation): an assumption; a mode "
        f"fits when its total leaves {HEADROOM:.0%} of --gpu-mem free ('tight': within the memory, not the margin)"),
        ("transient = max(loss backward: 3 x [B x N, V] fp32, one recomputed layer under checkpointing) + DeepSpeed "
        "reduce bucket (ZeRO-1/2) + gathered parameters (ZeRO-3: prefetch bucket + one layer; FSDP2: two layers) + "
        "one dequantized 4-bit weight: estimates"),
        (f"{gpus} GPU(s) on {nodes} node(s): per-rank bytes do not depend on the node count; recommended = the first "
        f"mode that fits in the order {', '.join(MODE_LABELS[m] for m in modes_in_order(cfg))} (fewest bytes moved "
        f"between ranks;"
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


def moe_text(model: torch.nn.Module, params: list[Any], max_length: int, threshold: int) -> str:
    """The plan's line for a mixture-of-experts model (``""`` for a dense one): total and active parameters (a token
    runs through ``k`` of the ``E`` routed experts, :func:`scale.modeling.moe.active_counts`), the training FLOPs per token
    from the active ones (:func:`scale.modeling.moe.model_shape`, the ``train/mfu`` count) against every expert running, and
    the expert stack one MoE layer holds in its training dtype: LoRA on fused experts (peft's ``ParamWrapper``)
    computes ``W + B A`` for the whole stack in each forward, which backward keeps (counted in the saved
    activations; checkpointing keeps one layer's)."""
    layout = moe_layout(model)
    if layout is None:
        return ""
    counts = active_counts(model, layout)
    trainable = sum(p.numel for p in params if p.trainable)
    shape = moe_model_shape(model)
    fraction = threshold / max_length
    active = flops_per_token(shape, max_length, lora_params=trainable, logits_fraction=fraction)
    every = flops_per_token(replace(shape, layers=shape.layers + counts.experts - counts.experts * layout.top_k
                                    // layout.num_experts, inactive_lora=0), max_length, lora_params=trainable,
                            logits_fraction=fraction)
    by_name = {p.name.removeprefix("base_model.model.").replace(".base_layer", ""): p for p in params}
    stack = max((sum(by_name[n].numel * nbytes(by_name[n].dtype) for n in layout.expert_params
                     if n.startswith(f"{e}.") and n in by_name) for e in layout.experts), default=0)
    return (f"mixture of experts: {layout.num_experts} routed experts, top-{layout.top_k}, in {len(layout.experts)} "
            f"layers: {counts.total:,} parameters, {counts.active:,} active per token "
            f"({counts.active / counts.total:.1%}); training FLOPs per token {active:.3g} from the active ones (train/mfu counts these; {every:.3g} if "
            f"every expert ran); one layer's expert stack {_gib(stack)} GiB, computed as W + B A in each forward "
            f"(LoRA on fused experts) and kept for backward")


def format_plan(plan: Plan) -> str:
    """The plan as a text table (GiB per rank), fits, recommendation and assumptions."""
    a = plan.activations
    head = [
        (f"scale-plan: {plan.model} ({plan.model_type}), {plan.parameters:,} parameters, "
        f"{plan.trainable_parameters:,} trainable; {plan.gpus} GPU(s) x {plan.gpu_mem_gib:g} GiB on "
        f"{plan.nodes} node(s); micro-batch {plan.micro_batch_size} x {plan.max_length} tokens, checkpointing "
        f"{plan.checkpointing if isinstance(plan.checkpointing, str) else 'on' if plan.checkpointing else 'off'}"),
        (f"saved activations per micro-batch: checkpointing off {_gib(a['checkpointing_off'])} GiB, on "
        f"{_gib(a['checkpointing_on'])} GiB; fp32 log-probabilities the loss keeps: tail [B, N, V] "
        f"{plan.logits_tail_bytes / 2**20:.2f} MiB vs full [B, T, V] {_gib(plan.logits_full_bytes)} GiB"),
        *([plan.experts] if plan.experts else []),
        *([plan.preference["text"]] if plan.preference else []),
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
           else f"recommended: none fits; {plan.advice}")
    notes = [f"  {MODE_LABELS[r.mode]}: {n}" for r in plan.ranks for n in r.notes]
    notes += [f"  {MODE_LABELS[r.mode]} refused: {r.refused}" for r in plan.ranks if r.refused]
    return "\n".join([*([plan.resume, ""] if plan.resume else []), *head, *lines, "", rec, "", "notes:", *notes, "",
                      "assumptions:", *(f"  - {x}" for x in plan.assumptions)])


def resume_config(checkpoint: str | Path, overrides: list[str], gpus: int) -> tuple[Config, str]:
    """The config of the run that wrote ``checkpoint`` (plus ``overrides``) as it resumes on ``gpus`` processes:
    ``train.gradient_accumulation_steps`` set to keep its global batch; and that in one line. When the checkpoint's
    micro-batch does not divide the rows a rank then trains per step (and the overrides set neither), the largest
    micro-batch that does is planned, and the line names the two keys scale-train needs.

    Raises:
        PlanError: ``checkpoint`` holds no readable ``trainer_state.json``.
        ConfigError: the global batch cannot be kept on ``gpus`` (the message lists the valid choices).
    """
    import tempfile

    import yaml

    try:
        state = read_state(checkpoint)
    except (OSError, ValueError, TypeError) as e:
        raise PlanError(f"--resume {checkpoint}: not a checkpoint ({type(e).__name__}: {str(e)[:160]}); give a "
                        f"<output_dir>/checkpoints/step_XXXXXX directory") from e
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "config.yaml"
        path.write_text(yaml.safe_dump(state.config), encoding="utf-8")
        cfg = load_config(path, overrides)
    t, G = state.config.get("train", {}), saved_global_batch(state)
    dp = cfg.train.data_parallel_size(gpus)
    saved = (t.get("micro_batch_size", 0), t.get("gradient_accumulation_steps", 0))
    how = "scale-train sets it when the config is the checkpoint's"
    try:
        ga = resume_accumulation(G, *saved, cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps, dp,
                                 f"checkpoint {checkpoint}")
    except ConfigError:
        # The checkpoint's micro-batch does not divide the rows each rank now trains per step: plan the largest one
        # that does (the split the user would pick), unless the overrides chose a split themselves.
        if G % dp or (cfg.train.micro_batch_size, cfg.train.gradient_accumulation_steps) != saved:
            raise
        per_rank = G // dp
        cfg.train.micro_batch_size = max(m for m in divisors(per_rank) if m <= max(1, cfg.train.micro_batch_size))
        ga = per_rank // cfg.train.micro_batch_size
        how = (f"the checkpoint's micro_batch_size={saved[0]} does not divide the {per_rank} rows a rank trains per "
               f"step: give train.micro_batch_size={cfg.train.micro_batch_size} "
               f"train.gradient_accumulation_steps={ga} to scale-train")
    cfg.train.gradient_accumulation_steps = ga
    wrote = f"{state.mode or 'an earlier version'} on {state.world_size} process(es)"
    return cfg, (f"resume {checkpoint} (step {state.step}, written by {wrote}) on {gpus} GPU(s): global_batch_size "
                 f"{G} = micro_batch_size {cfg.train.micro_batch_size} x train.gradient_accumulation_steps={ga} x {dp} "
                 f"data-parallel rank(s); {how}")


def main(argv: list[str] | None = None) -> int:
    """``scale-plan [--config PATH] [key=value ...] --gpus N [--gpu-mem GiB] [--nodes K] [--full-rows] [--json]``."""
    parser = argparse.ArgumentParser(prog="scale-plan", description=help_text(__doc__),
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
    parser.add_argument("--resume", default=None, metavar="CKPT",
                        help="a checkpoint directory: plan its run (its config, + overrides) on --gpus, with the "
                             "gradient_accumulation_steps that keeps its global batch")
    args = parser.parse_intermixed_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    try:
        note = None
        if args.resume is not None:
            cfg, note = resume_config(args.resume, args.overrides, args.gpus)
        else:
            cfg = load_config(args.config, args.overrides)
        if cfg.train.micro_batch_size == "auto":
            dp = cfg.train.data_parallel_size(args.gpus)
            b, ga, _ = auto_micro_batch(cfg, dp, args.gpu_mem, args.model_config)
            if b == 0:
                raise PlanError(f"train.micro_batch_size=auto: not even one row fits {cfg.train.auto_memory_fraction:g}"
                                f" of {args.gpu_mem:g} GiB")
            kept = cfg.train.auto_global_batch_size
            cfg = replace(cfg, train=replace(cfg.train, micro_batch_size=b, gradient_accumulation_steps=ga,
                                             auto_global_batch_size=None))
            note = "\n".join(filter(None, [note, (
                f"train.micro_batch_size=auto: {b}, the largest whose single-GPU plan fits train.auto_memory_fraction "
                f"{cfg.train.auto_memory_fraction:g} of --gpu-mem {args.gpu_mem:g} GiB"
                + (f" and divides train.auto_global_batch_size {kept} / {dp} data-parallel ranks; "
                   f"gradient_accumulation_steps {ga}" if kept is not None else ""))]))
        plan = make_plan(cfg, args.gpus, args.gpu_mem, args.nodes, args.model_config, padded=not args.full_rows)
        plan.resume = note
    except (ConfigError, PlanError, FileNotFoundError) as e:
        sys.stderr.write(f"scale-plan: error: {type(e).__name__}: {e}\n")
        return 2
    sys.stdout.write((json.dumps(plan.to_dict(), indent=2) if args.json else format_plan(plan)) + "\n")
    return 0


def cli() -> None:
    """Console entry point. The planner counts 4-bit weights itself (:func:`scale.planner.census.nf4_bytes`) on meta
    tensors, so bitsandbytes, which peft and transformers import whenever it is installed (~3 s of CPU: it wraps its
    kernels in ``torch.compile``), is kept out of the process as in :func:`scale.cli.start_fast`; peft's call of
    transformers' deprecated ``is_gradient_checkpointing`` is not reported (:func:`scale.utils.logs.ignore_known_warnings`,
    as every command drops it)."""
    sys.modules.setdefault("bitsandbytes", None)
    ignore_known_warnings()
    sys.exit(main())


if __name__ == "__main__":
    cli()
